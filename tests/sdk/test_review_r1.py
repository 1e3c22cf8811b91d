"""Review R1 of the SDK restructure (issue 25 item 2, issue 27 'the SDK's first call'):
regressions found by the review, each against real servers."""

from __future__ import annotations

import pytest

import kvdock.sdk as kvd
from helpers import MODEL, make_kv, make_tokens
from kvdock.errors import LimitExceededError
from kvdock.protocol import ErrorCode
from kvdock.protocol import messages as m


def test_another_kvdock_servers_http_url_of_the_same_chunk_size_is_refused(make_server) -> None:
    """connect checked only the chunk size of the http_url's /config: the HTTP API of another
    server with the same settings (two servers on one box, both with the default chunk size)
    was accepted and kept as ctx.http_url, so /status read from it described the wrong server."""
    a, b = make_server(), make_server()
    with pytest.raises(kvd.ServerUnavailableError, match=rf"^http_url '{b.http_url}' is another server's HTTP API"):
        kvd.connect(a.url, b.http_url, MODEL, timeout=10)
    assert a.get("/status")["clients"] == 0  # the context it registered was closed again
    with kvd.connect(a.url, a.http_url, MODEL, timeout=10) as ctx:  # its own is still fine
        assert ctx.http_url == a.http_url


def test_a_request_over_the_limit_is_the_limits_exception_whichever_side_refuses_it(make_server) -> None:
    """Wire codes are one-to-one with exceptions (LIMIT <-> LimitExceededError), but the SDK's own
    checks of the same limits (max_request_tokens, the salt length) raised a plain
    InvalidInputError: ``except LimitExceededError`` caught the server's refusal only."""
    srv = make_server("--max-request-tokens", "64")
    with kvd.connect(srv.url, None, MODEL, timeout=10) as ctx:
        long = make_tokens(128)
        for call in (
            lambda: kvd.lookup(ctx, long),
            lambda: kvd.retrieve(ctx, long),
            lambda: kvd.store(ctx, make_kv(128), long),
        ):
            with pytest.raises(LimitExceededError, match="over the server's limit of 64 tokens") as e:
                call()
            assert e.value.code == ErrorCode.LIMIT
        with pytest.raises(LimitExceededError) as server_side:  # the server's own refusal: the same class
            ctx.ask(m.Lookup(ctx.client_id, b"\0" * 4 * 128, ""))
        assert server_side.value.code == ErrorCode.LIMIT
        salt = "s" * 300
        with pytest.raises(LimitExceededError, match="cache_salt has 300 characters") as e:
            kvd.lookup(ctx, make_tokens(32), cache_salt=salt)
        assert e.value.code == ErrorCode.LIMIT
        with pytest.raises(LimitExceededError) as server_side:
            ctx.ask(m.Lookup(ctx.client_id, b"\0" * 4 * 32, salt))
        assert server_side.value.code == ErrorCode.LIMIT


def test_a_retry_of_the_old_local_socket_never_undoes_a_new_registrations_one(ctx, monkeypatch) -> None:
    """After a server restart, one thread's retry of the old (dead) local socket (Connection._current,
    every LOCAL_RETRY_S) and another thread's re-registration naming the new one (use_local) ran at
    once: the retry wrote the old URL back over the new one, the new channel was dropped as
    'superseded', and the context stayed on zmq with no watch (no fast reads) for good, retrying the
    dead socket every 5 s."""
    import threading

    from kvdock.sdk import _connection

    conn = ctx._conn
    new_url, old_url = conn._local_url, "unix:///nonexistent/kvdock-r1/control.sock"
    assert conn.channel == "local" and new_url.startswith("unix://")
    # the state a restart leaves: the channel broke, its socket is gone, a retry is due
    conn._local.close()
    conn._local_url, conn._retry_at = old_url, 0.0
    rewatched: list[bool] = []
    conn.on_local = lambda: rewatched.append(True)
    creating, retried = threading.Event(), threading.Event()
    real_client, real_use = _connection.ControlClient, _connection.Connection.use_local

    def client(url: str, timeout: float, *args: object) -> object:
        if url == new_url:  # the registration's new channel: the retry runs meanwhile
            creating.set()
            assert retried.wait(10)
        return real_client(url, timeout, *args)  # type: ignore[arg-type]

    registering = threading.Thread(target=real_use, args=(conn, new_url))

    def use_local(url: str, **kw: bool) -> None:  # the retry, having read the old URL
        if url == old_url and not registering.is_alive():
            registering.start()  # the registration names the new socket now
            assert creating.wait(10)
        real_use(conn, url, **kw)

    monkeypatch.setattr(_connection, "ControlClient", client)
    monkeypatch.setattr(conn, "use_local", use_local)
    assert conn._current() is conn._client  # the old socket is gone: zmq for this request
    retried.set()
    registering.join(10)
    assert conn._local_url == new_url and conn.channel == "local"
    assert rewatched == [True]  # the context's watch followed the new channel


def test_an_abstract_ipc_endpoint_is_probed_not_refused() -> None:
    """connect's probe (issue 27: fail at once when nothing listens) looked for a socket file
    named ``@NAME`` for zmq's abstract-namespace ``ipc://@NAME``, so it refused an endpoint zmq
    reaches. Here one that takes the connection but never answers: the timeout, as for tcp."""
    import os
    import socket

    name = f"kvdock-r1-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as silent:
        silent.bind("\0" + name)
        silent.listen(8)
        with pytest.raises(kvd.ServerUnavailableError, match=rf"ipc://@{name}.*no reply"):
            kvd.connect(f"ipc://@{name}", None, MODEL, timeout=1.0)
    with pytest.raises(kvd.ServerUnavailableError, match=rf"^nothing listens at ipc://@{name}"):
        kvd.connect(f"ipc://@{name}", None, MODEL, timeout=1.0)


def _outbound_address() -> str:
    """This host's address on its first non-loopback interface (a UDP connect sends nothing)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.1", 9))  # TEST-NET-1: only picks the route's source address
        return str(s.getsockname()[0])


def test_the_tenant_token_is_never_sent_to_a_non_loopback_http_url() -> None:
    """connect's check of ``http_url`` sent the tenant token as a Bearer header in clear text to
    whatever host was given; it is sent to loopback only (elsewhere the check only sees that the
    API answers)."""
    import http.server
    import threading

    from kvdock.sdk import _http

    seen: list[str | None] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append(self.headers.get("Authorization"))
            self.send_response(401)
            self.end_headers()
            self.wfile.write(b"a token is needed")

        def log_message(self, *args: object) -> None:
            pass

    host = _outbound_address()
    assert not host.startswith("127."), f"no non-loopback interface to test with: {host}"
    srv = http.server.ThreadingHTTPServer(("0.0.0.0", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        port = srv.server_address[1]
        _http.check(f"http://{host}:{port}", 512, 5.0, token="secret-tenant-token")
        _http.check(f"http://127.0.0.1:{port}", 512, 5.0, token="secret-tenant-token")
    finally:
        srv.shutdown()
        srv.server_close()
    assert seen == [None, "Bearer secret-tenant-token"]

"""The SDK's first call (issue 27): ``connect`` fails fast and clearly when nothing listens, and
``http_url`` is either left out (None) or checked, never silently ignored."""

from __future__ import annotations

import http.server
import json
import threading
import time
from collections.abc import Iterator

import pytest

import kvdock.sdk as kvd
from helpers import GEOMETRY, MODEL, free_port

FAST_S = 10.0  # "at once": far below the 60 s default timeout, generous for a loaded 2-core box


def test_nothing_listening_fails_at_once_naming_the_url() -> None:
    """It waited the whole timeout (60 s by default) before saying 'no reply'."""
    dead = f"tcp://127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(kvd.ServerUnavailableError, match=rf"^nothing listens at {dead} \(connection refused\)"):
        kvd.connect(dead, None, MODEL)  # the default timeout: 60 s
    assert time.monotonic() - started < FAST_S
    started = time.monotonic()
    with pytest.raises(kvd.ServerUnavailableError, match=rf"^nothing listens at {dead}"):
        kvd.register_model(dead, None, "m", num_layers=1, num_kv_heads=1, head_dim=4, dtype="float32")
    with pytest.raises(kvd.ServerUnavailableError, match=rf"^nothing listens at {dead}"):
        kvd.admin.describe_server(dead)
    assert time.monotonic() - started < 2 * FAST_S


def test_a_missing_ipc_socket_fails_at_once(tmp_path) -> None:
    url = f"ipc://{tmp_path}/nope.sock"
    started = time.monotonic()
    with pytest.raises(kvd.ServerUnavailableError, match=rf"^cannot reach {url}: no socket file"):
        kvd.connect(url, None, MODEL)
    assert time.monotonic() - started < FAST_S


def test_http_url_may_be_left_out(server) -> None:
    with kvd.connect(server.url, None, MODEL, timeout=10) as ctx:
        assert ctx.http_url is None and kvd.lookup(ctx, list(range(32))) == 0
    assert kvd.register_model(server.url, None, MODEL, dtype="bfloat16", **GEOMETRY).created is False


def test_a_dead_http_url_is_refused_at_once_naming_it(server) -> None:
    """It was accepted and never used: connect succeeded with http_url pointing at a dead port."""
    bad = f"http://127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(kvd.ServerUnavailableError, match=rf"^http_url '{bad}' is unusable \(the server's HTTP API"):
        kvd.connect(server.url, bad, MODEL)
    with pytest.raises(kvd.ServerUnavailableError, match=rf"^http_url '{bad}' is unusable"):
        kvd.register_model(server.url, bad, MODEL, dtype="bfloat16", **GEOMETRY)
    assert time.monotonic() - started < 2 * FAST_S
    assert server.get("/status")["clients"] == 0  # the context it registered was closed again


@pytest.fixture
def other_http() -> Iterator[str]:
    """A real HTTP server that answers /config as a kvdock server of chunk size 99 would."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps({"chunk_size": 99, "protocol_version": 1}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


def test_another_servers_http_url_is_refused(server, other_http: str) -> None:
    with pytest.raises(
        kvd.ServerUnavailableError,
        match=rf"^http_url '{other_http}' is another server's HTTP API .*chunk size 99, not the 16 of the server",
    ):
        kvd.connect(server.url, other_http, MODEL, timeout=10)


def test_an_http_url_that_is_not_kvdocks_is_refused(server) -> None:
    """Something that answers HTTP but has no kvdock /config there (here a 404)."""
    with pytest.raises(kvd.ServerUnavailableError, match=r"is unusable .*answered 404"):
        kvd.connect(server.url, server.http_url + "/nope", MODEL, timeout=10)


def test_the_right_http_url_is_kept(server) -> None:
    with kvd.connect(server.url, server.http_url, MODEL, timeout=10) as ctx:
        assert ctx.http_url == server.http_url
        assert kvd.server_status(ctx.http_url)["health"] == "ok"

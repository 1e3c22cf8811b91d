"""Which channel an SDK context talks over, and what happens when the local one breaks.

A shared-memory client sends its control messages over the server's local UNIX socket; zmq is
the fallback. Real servers throughout: a restart, a kill while a call waits, a local connection
cut under the client, threads sharing one context."""

from __future__ import annotations

import signal
import threading
import time

import pytest
import torch

import kvdock.sdk as kvd
from helpers import ALWAYS_PROCESS, CHUNK, MODEL, make_kv, make_tokens, start_inprocess, start_server
from kvdock.sdk import _connection as connmod

# servers a test starts itself: in this process, as make_server's
start_any = start_server if ALWAYS_PROCESS else start_inprocess


def test_a_shared_memory_client_talks_over_the_local_socket(make_server) -> None:
    srv = make_server()
    kv, tokens = make_kv(3 * CHUNK, seed=1), make_tokens(3 * CHUNK, start=100)
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as c:
        assert c.transport == "shm" and c._conn.channel == "local"
        assert kvd.store(c, kv, tokens)
        assert kvd.lookup(c, tokens) == 3 * CHUNK
        out = kvd.retrieve(c, tokens)
        assert out is not None and torch.equal(out, kv)
        assert kvd.check_server_integrity(c) == []
    assert "unix://" in srv.log()  # the start-up line names the socket


@pytest.mark.parametrize("flag", ["--no-local-socket", "--no-shm"])
def test_without_the_local_socket_everything_goes_over_zmq(make_server, flag: str) -> None:
    srv = make_server(flag)
    kv, tokens = make_kv(2 * CHUNK, seed=2), make_tokens(2 * CHUNK, start=200)
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as c:
        assert c._conn.channel == "zmq"
        assert c.transport == ("inline" if flag == "--no-shm" else "shm")
        assert kvd.store(c, kv, tokens)
        out = kvd.retrieve(c, tokens)
        assert out is not None and torch.equal(out, kv)
    assert "unix://" not in srv.log()


def test_the_same_bytes_whichever_channel_stored_them(make_server) -> None:
    srv = make_server()
    kv, tokens = make_kv(2 * CHUNK, seed=3), make_tokens(2 * CHUNK, start=300)
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as local:
        assert local._conn.channel == "local"
        local._conn.use_local("")  # this one stays on zmq
        assert local._conn.channel == "zmq"
        assert kvd.store(local, kv, tokens)
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as c:
        assert c._conn.channel == "local"
        out = kvd.retrieve(c, tokens)
        assert out is not None and torch.equal(out, kv)


def test_a_local_connection_cut_under_the_client_falls_back_to_zmq_then_comes_back(
    make_server, monkeypatch: pytest.MonkeyPatch
) -> None:
    srv = make_server()
    kv, tokens = make_kv(2 * CHUNK, seed=4), make_tokens(2 * CHUNK, start=400)
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as c:
        assert kvd.store(c, kv, tokens)
        first = c._conn._local
        c._conn._local._chan._sock.shutdown(2)  # type: ignore[union-attr]  # what a dropped connection looks like
        c._conn._retry_at = time.monotonic() + 600  # not due yet (whatever the test's pace)
        out = kvd.retrieve(c, tokens)  # the request could not leave: it went over zmq instead
        assert out is not None and torch.equal(out, kv)
        assert c._conn.channel == "zmq"
        assert kvd.lookup(c, tokens) == 2 * CHUNK  # not retried before LOCAL_RETRY_S
        assert c._conn.channel == "zmq"
        monkeypatch.setattr(connmod, "LOCAL_RETRY_S", 600.0)
        c._conn._retry_at = 0.0  # due now
        assert kvd.lookup(c, tokens) == 2 * CHUNK  # the local socket is tried again, and works
        assert c._conn.channel == "local" and c._conn._local is not first
        assert kvd.check_server_integrity(c) == []


def test_registering_again_at_the_same_server_keeps_the_working_local_client(make_server) -> None:
    srv = make_server()
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as c:
        local = c._conn._local
        c._reconnect()  # what a client_ttl expiry makes a request do: the same server, the same socket
        assert c._conn._local is local and not local.closed  # type: ignore[union-attr]
        assert kvd.lookup(c, make_tokens(CHUNK)) == 0


def test_after_a_restart_the_client_registers_again_and_takes_the_new_local_socket(make_server, tmp_path) -> None:
    srv = make_server()
    kv, tokens = make_kv(CHUNK, seed=5), make_tokens(CHUNK, start=500)
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as c:
        first = c._conn._local.url  # type: ignore[union-attr]
        assert kvd.store(c, kv, tokens)
        srv.stop()
        # (in this process like make_server's: a restart needs no process boundary)
        again = start_any(tmp_path, chunk_size=CHUNK, port=srv.port, http_port=srv.http_port)
        try:
            kvd.register_model(again.url, again.http_url, MODEL, dtype="bfloat16", timeout=10, **_geometry())
            assert kvd.store(c, kv, tokens)  # the dead socket's EPIPE sent it over zmq: registered again
            assert c._conn.channel == "local" and c._conn._local.url != first  # type: ignore[union-attr]
            out = kvd.retrieve(c, tokens)
            assert out is not None and torch.equal(out, kv)
        finally:
            assert again.stop() == 0


def test_a_server_killed_while_a_call_waits_fails_it_at_once_not_at_the_timeout(make_server) -> None:
    srv = make_server()
    tokens = make_tokens(CHUNK, start=600)
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=60) as c:
        c.fast_reads = False  # lookups are requests here
        assert kvd.lookup(c, tokens) == 0
        srv.proc.send_signal(signal.SIGSTOP)  # the request is sent, its reply never comes
        errors: list[BaseException] = []

        def ask() -> None:
            try:
                kvd.lookup(c, tokens)
            except BaseException as e:
                errors.append(e)

        t = threading.Thread(target=ask)
        t.start()
        time.sleep(0.3)
        killed = time.monotonic()
        srv.proc.kill()
        srv.proc.wait()
        t.join(20)
        assert not t.is_alive()
        assert time.monotonic() - killed < 10  # the timeout is 60 s
        assert len(errors) == 1 and type(errors[0]) is kvd.ServerUnavailableError
        assert "closed" in str(errors[0])


def test_threads_sharing_a_context_over_the_local_socket_each_get_their_own_replies(make_server) -> None:
    srv = make_server()
    prompts = [
        (make_kv(CHUNK * (1 + i % 3), seed=10 + i), make_tokens(CHUNK * (1 + i % 3), start=1000 * (i + 1)))
        for i in range(8)
    ]
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as c:
        for kv, tokens in prompts:
            assert kvd.store(c, kv, tokens)
        bad: list[str] = []

        def work(i: int) -> None:
            kv, tokens = prompts[i]
            for _ in range(40):
                if kvd.lookup(c, tokens) != len(tokens):
                    bad.append(f"lookup {i}")
                out = kvd.retrieve(c, tokens)
                if out is None or not torch.equal(out, kv):
                    bad.append(f"retrieve {i}")

        threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert bad == [] and c._conn.channel == "local"
        assert kvd.check_server_integrity(c) == []


def _geometry() -> dict[str, int]:
    from helpers import GEOMETRY

    return dict(GEOMETRY)


def test_threads_that_retry_the_local_socket_at_once_all_get_their_replies(make_server) -> None:
    """Regression: two threads retrying the broken local channel together each made a client,
    and the second closed the first while a call waited on it (a spurious ServerUnavailableError)."""
    srv = make_server()
    tokens = make_tokens(CHUNK, start=700)
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as c:
        assert kvd.store(c, make_kv(CHUNK, seed=7), tokens)
        for _ in range(5):
            c._conn._local._chan._sock.shutdown(2)  # type: ignore[union-attr]
            c._conn._retry_at = 0.0  # due: every thread below may try it
            errors: list[BaseException] = []
            barrier = threading.Barrier(8)

            def ask(barrier: threading.Barrier = barrier, errors: list[BaseException] = errors) -> None:
                barrier.wait()
                try:
                    for _ in range(5):
                        assert kvd.lookup(c, tokens) == CHUNK
                except BaseException as e:
                    errors.append(e)

            threads = [threading.Thread(target=ask) for _ in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert errors == [] and c._conn.channel == "local"


def test_session_ids_are_random_version_4_uuids() -> None:
    """A session id is a ``uuid.uuid4().hex`` (version 4, RFC 4122 variant); never the same twice."""
    import uuid

    ids = [kvd.KVCacheContext.new_session_id() for _ in range(2000)]
    assert len(set(ids)) == len(ids)
    for sid in ids:
        u = uuid.UUID(hex=sid)
        assert u.hex == sid and u.version == 4 and u.variant == uuid.RFC_4122
    assert {sid[12] for sid in ids} == {"4"} and {sid[16] for sid in ids} == set("89ab")
    assert len({sid[13] for sid in ids}) == 16 and len({sid[17] for sid in ids}) == 16  # (the rest is random)

"""The in-process server harness (kvdock.inprocess) and the fault switchboard (kvdock.faults): a
real server on a thread of the test process serves both transports byte-exactly, stops leaving
no thread, descriptor, segment or socket behind, takes faults without touching the environment,
and refuses what needs a process."""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

import kvdock.sdk as kvd
from helpers import CHUNK, GEOMETRY, MODEL, make_kv, make_tokens, start_inprocess
from kvdock import faults
from kvdock.inprocess import InProcessServer, config_from_args
from kvdock.shm.segment import PREFIX, SHM_DIR


def _segments() -> set[str]:
    return {p.name for p in SHM_DIR.iterdir() if p.name.startswith(PREFIX)}


def _threads() -> set[threading.Thread]:
    # pyzmq's garbage collector thread lives as long as the process once any zero-copy send made it
    return {t for t in threading.enumerate() if type(t).__name__ != "GarbageCollectorThread"}


def _fds() -> dict[str, str]:
    found = {}
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # (listdir's own)
            found[fd] = os.readlink(f"/proc/self/fd/{fd}")
    return found


def _round_trip(tmp_path: Path, transport: str) -> InProcessServer:
    """A server that stored and retrieved 4 chunks byte-exactly (stopped by the caller)."""
    srv = start_inprocess(tmp_path, *(["--no-shm"] if transport == "inline" else []))
    assert srv.alive and srv.url == f"tcp://127.0.0.1:{srv.port}"
    kvd.register_model(srv.url, srv.http_url, MODEL, dtype="bfloat16", **GEOMETRY, timeout=10)
    kv, tokens = make_kv(4 * CHUNK, seed=3), make_tokens(4 * CHUNK)
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as c:
        assert c.transport == transport
        assert kvd.store(c, kv, tokens) is True
        out = kvd.retrieve(c, tokens)
        assert out is not None and torch.equal(out.view(torch.uint8), kv.view(torch.uint8))
    assert srv.get("/status")["sessions"] == 0
    assert srv.metric("kvdock_stores_total") == 1
    return srv


@pytest.mark.parametrize("transport", ["shm", "inline"])
def test_a_round_trip_then_a_clean_stop_leaves_nothing(tmp_path: Path, transport: str) -> None:
    # first, what this process makes once and keeps: pyzmq's zero-copy garbage collector (a
    # thread and a context), the copy threads
    assert _round_trip(tmp_path, transport).stop() == 0
    threads, segments, fds = _threads(), _segments(), _fds()
    srv = _round_trip(tmp_path, transport)
    assert srv.state is not None
    ours = {srv.state.pool.main.name} - {""}  # the pool, in /dev/shm like a process's (none with --no-shm)
    assert len(ours) == (transport == "shm") and ours <= _segments() - segments
    assert srv.stop() == 0 and not srv.alive and srv.error is None
    assert srv.stop() == 0  # harmless twice
    assert "kvdock serving: zmq tcp://127.0.0.1:" in srv.log() and "shutting down" in srv.log()
    assert not ours & _segments()
    assert _threads() == threads, _threads() - threads
    # zmq closes its sockets a moment after term() returns; mappings go with the last view of them
    deadline = time.monotonic() + 10
    while gc.collect() >= 0 and (left := {fd: what for fd, what in _fds().items() if fds.get(fd) != what}):
        assert time.monotonic() < deadline, f"descriptors left open: {left}"
        time.sleep(0.05)


def test_faults_are_injected_into_one_server_and_not_the_environment(tmp_path: Path) -> None:
    assert faults.COPY_DELAY_ENV not in os.environ
    slow = start_inprocess(tmp_path, "--no-shm", env={faults.COPY_DELAY_ENV: "0.25", faults.RETRIEVE_MISS_ENV: "1"})
    plain = start_inprocess(tmp_path, "--no-shm")
    try:
        assert slow.state is not None and plain.state is not None
        assert (slow.state.fault_copy_delay_s, slow.state.fault_retrieve_miss) == (0.25, True)
        assert (plain.state.fault_copy_delay_s, plain.state.fault_retrieve_miss) == (0.0, False)
        assert faults.current() == faults.NONE  # this thread's faults: the (empty) environment's
        kvd.register_model(slow.url, slow.http_url, MODEL, dtype="bfloat16", **GEOMETRY, timeout=10)
        kv, tokens = make_kv(2 * CHUNK), make_tokens(2 * CHUNK)
        with kvd.connect(slow.url, slow.http_url, MODEL, timeout=10) as c:
            t0 = time.monotonic()
            assert kvd.store(c, kv, tokens) is True
            assert time.monotonic() - t0 >= 0.25  # the copy waited
            assert kvd.retrieve(c, tokens) is None  # and every retrieve misses
    finally:
        assert slow.stop() == 0 and plain.stop() == 0


def test_faults_from_the_environment_and_injected() -> None:
    env = {
        faults.COPY_DELAY_ENV: "1.5",
        faults.RETRIEVE_MISS_ENV: "1",
        faults.L2_WRITE_DELAY_ENV: "0.05",
        faults.FAIL_LOADS_ENV: "a@1,b@0,junk",
    }
    got = faults.Faults.from_env(env)
    assert got == faults.Faults(1.5, True, 0.05, frozenset({("a", "1"), ("b", "0")}))
    assert faults.Faults.from_env({faults.RETRIEVE_MISS_ENV: "0", faults.COPY_DELAY_ENV: ""}) == faults.NONE
    with pytest.raises(ValueError, match="KVDOCK_FAULT_COPY_DELAY"):
        faults.Faults.from_env({"KVDOCK_FAULT_COPY_DELAY": "1"}, strict=True)  # a typo tests nothing
    with faults.injected(got):
        assert faults.current() is got
        seen: list[faults.Faults] = []
        t = threading.Thread(target=lambda: seen.append(faults.current()))
        t.start()
        t.join()
        assert seen == [faults.NONE]  # another thread's context: not injected there
    assert faults.current() == faults.NONE


def test_what_needs_a_process_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="KVDOCK_FAST_READS"):
        start_inprocess(tmp_path, env={"KVDOCK_FAST_READS": "0"})
    with start_inprocess(tmp_path) as srv:
        with pytest.raises(ValueError, match="SIGKILL"):
            srv.stop(signal.SIGKILL)
        assert srv.alive
    assert not srv.alive and srv.returncode == 0


def test_a_server_that_cannot_start_says_why(tmp_path: Path) -> None:
    with InProcessServer.start("--no-disk", chunk_size=CHUNK) as first:
        with pytest.raises(RuntimeError, match="cannot listen on") as e:
            InProcessServer.start("--no-disk", chunk_size=CHUNK, port=first.port, log_path=tmp_path / "b.log")
        assert "did not come up" in str(e.value)


def test_config_from_args_is_the_cli_s() -> None:
    cfg = config_from_args(["--port", "7000", "--no-shm", "--l1-size", "1MiB", "--session-ttl", "2"])
    assert (cfg.port, cfg.no_shm, cfg.l1_size, cfg.session_ttl, cfg.no_disk) == (7000, True, 1 << 20, 2.0, False)
    with pytest.raises(RuntimeError, match="l3_coherence_ms must be positive"):  # a 0 given is a 0
        InProcessServer.start("--redis-url", "redis://127.0.0.1:1/0", "--l3-coherence-ms", "0")


def test_a_picked_port_taken_meanwhile_is_picked_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression (a port race at -n 4: "cannot listen on tcp://127.0.0.1:53129: Address already
    in use"): the retry of tests' start_inprocess compared the message case-sensitively and never
    retried. The first port it picks here is held by a real listening socket."""
    import socket

    import kvdock.testing as testing

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    picks = iter([taken.getsockname()[1]])
    real = testing.free_ports  # (InProcessServer.start picks through it: server_ports)
    monkeypatch.setattr(testing, "free_ports", lambda n, avoid=(): [next(picks, None) or p for p in real(n, avoid)])
    try:
        srv = start_inprocess(tmp_path)
        try:
            assert srv.port != taken.getsockname()[1]
            kvd.register_model(srv.url, srv.http_url, MODEL, dtype="bfloat16", **GEOMETRY, timeout=10)
            with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as ctx:
                kv, tokens = make_kv(2 * CHUNK), make_tokens(2 * CHUNK)
                assert kvd.store(ctx, kv, tokens) is True
                assert torch.equal(kvd.retrieve(ctx, tokens), kv)
        finally:
            assert srv.stop() == 0
    finally:
        taken.close()

"""kvdock.testing's server launcher: what it takes for a server that is up."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import pytest

from kvdock.testing import launch_server

ZMTP_GREETING = b"\xff\x00\x00\x00\x00\x00\x00\x00\x01\x7f\n"  # what a ZMQ socket says first (and a newline)


def test_a_foreign_socket_on_the_http_port_is_not_a_server_that_is_up(tmp_path: Path) -> None:
    """CI: a server that could not bind its control port was polled on its HTTP port, where
    another test's server had bound a ZMQ socket: wait_ready raised http.client's BadStatusLine
    (the ZMTP greeting) instead of the server's own exit and log."""
    foreign = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def answer_garbage() -> None:
        foreign.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = foreign.accept()
            except TimeoutError:
                continue
            with conn:
                conn.sendall(ZMTP_GREETING)

    thread = threading.Thread(target=answer_garbage, daemon=True)
    thread.start()
    try:
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port, http_port = taken.getsockname()[1], foreign.getsockname()[1]
            srv = launch_server(port=port, http_port=http_port, log_path=tmp_path / "log")
            try:
                with pytest.raises(RuntimeError, match=r"exited with 2:[\s\S]*Address already in use"):
                    srv.wait_ready(60)
            finally:
                srv.stop()
    finally:
        stop.set()
        thread.join()
        foreign.close()


def test_a_redis_whose_port_another_redis_took_starts_on_another_port_and_is_its_own() -> None:
    """CI flake (test_control_client's L3 write-down timed out): free_port gave two tests' Redis
    the same port, ours could not bind and exited, the other answered its PING, and the test used
    (and saw paused) another test's Redis. A first start now checks that the server answering is
    its own process and takes another port if not; a restart keeps its port and says so."""
    from helpers import RedisProc
    from kvdock.testing import free_port

    other = RedisProc(free_port()).start()
    try:
        ours = RedisProc(other.port)
        ours.start()
        try:
            assert ours.port != other.port and ours.proc is not None and ours.proc.poll() is None
            import redis

            c = redis.Redis(port=ours.port)
            assert int(c.info("server")["process_id"]) == ours.proc.pid
            c.close()
            ours.stop()
            ours.port = other.port  # (a restart on a port another server holds now)
            with pytest.raises(AssertionError, match=f"port {other.port} is another process's"):
                ours.start()
        finally:
            ours.stop()
    finally:
        other.stop()


def test_free_ports_are_distinct_and_free() -> None:
    """CI flake (test_adversarial_r10_stage): ``free_port(), free_port()`` returned one port
    twice (the kernel hands a just-closed port out again) and the in-process server refused
    "port 44389, http_port 44389 ... must differ". free_ports holds every socket open until all
    are picked."""
    import socket

    from kvdock.testing import free_ports

    for _ in range(200):
        a, b = free_ports(2)
        assert a != b
    many = free_ports(50)
    assert len(set(many)) == 50
    for port in many:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # still free: nothing kept it


def test_free_ports_avoid_the_ports_named_in_cli_flags() -> None:
    """A test that picks a --kv-events-port and then starts a server: the server's own two ports
    must not be that one (it was closed, so the kernel may hand it out again)."""
    from kvdock.testing import free_port, free_ports

    for _ in range(100):
        events = free_port()
        picked = free_ports(2, avoid=("--kv-events-port", str(events), "--l1-size", "8MiB"))
        assert events not in picked and len(set(picked)) == 2
    everything_but_one = free_ports(20)
    assert not set(free_ports(5, avoid=everything_but_one)) & set(everything_but_one)


def test_a_server_given_one_port_picks_another_for_the_other(tmp_path, monkeypatch) -> None:
    """Review of f348a6d: a restart that names only ``port`` could get ``http_port == port``
    (the port the caller gives is not listening yet, so the kernel may hand it out again). The
    picker is told to avoid it (free_ports' own test shows it then never returns it)."""
    import kvdock.testing as testing
    from kvdock.inprocess import InProcessServer
    from kvdock.testing import free_port, free_ports

    avoided: list[set[str]] = []

    def picker(n, avoid=()):  # type: ignore[no-untyped-def]
        avoided.append({str(v) for v in avoid})
        return free_ports(n, avoid)

    monkeypatch.setattr(testing, "free_ports", picker)  # (server_ports picks through it)
    port = free_port()
    srv = InProcessServer.start("--no-disk", l1_size="8MiB", port=port, log_path=tmp_path / f"{port}.log")
    try:
        assert srv.port == port and srv.http_port != port
        assert avoided and str(port) in avoided[-1]
    finally:
        assert srv.stop() == 0

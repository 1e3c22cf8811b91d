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

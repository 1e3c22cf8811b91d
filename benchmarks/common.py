"""Shared pieces of the benchmark scripts: real ``kvdock serve`` subprocesses and timing helpers."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    name: str
    proc: subprocess.Popen[bytes]
    port: int
    http_port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def stop(self, timeout: float = 15.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def spawn(name: str, logdir: Path, l1_size: str, chunk_size: int, extra: list[str]) -> Server:
    port, http_port = free_port(), free_port()
    log_path = logdir / f"server-{name}.log"
    args = [
        sys.executable,
        "-m",
        "kvdock.cli.main",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--http-port",
        str(http_port),
        "--l1-size",
        l1_size,
        "--chunk-size",
        str(chunk_size),
        "--log-level",
        "WARNING",
        *extra,
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVDOCK_")}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
    return Server(name, proc, port, http_port, log_path)


def wait_up(srv: Server, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if srv.proc.poll() is not None:
            raise RuntimeError(f"{srv.name} server exited with {srv.proc.returncode}:\n{srv.log()}")
        try:
            urllib.request.urlopen(srv.http_url + "/healthz", timeout=1).read()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{srv.name} server did not come up within {timeout:.0f}s:\n{srv.log()}")


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    r = fn()
    return time.perf_counter() - t0, r


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9

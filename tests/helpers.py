"""Test helpers: start a real ``kvdock serve`` subprocess on free ports and wait until it answers."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import torch

MODEL = "tiny"
GEOMETRY = {"num_layers": 3, "num_kv_heads": 2, "head_dim": 8}
CHUNK = 16  # chunk_size of test servers


def make_kv(tokens: int, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> torch.Tensor:
    """Deterministic random KV_2LTD for the test model."""
    g = torch.Generator().manual_seed(seed)
    d = GEOMETRY["num_kv_heads"] * GEOMETRY["head_dim"]
    return torch.randn(2, GEOMETRY["num_layers"], tokens, d, generator=g).to(dtype)


def make_tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class ServerProc:
    proc: subprocess.Popen[bytes]
    port: int
    http_port: int
    log_path: Path
    args: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def get(self, path: str) -> dict:
        with urllib.request.urlopen(self.http_url + path, timeout=5) as r:
            return json.loads(r.read())

    def text(self, path: str) -> str:
        with urllib.request.urlopen(self.http_url + path, timeout=5) as r:
            return r.read().decode()

    def log(self) -> str:
        return self.log_path.read_text()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_server(tmp_path: Path, *extra: str, l1_size: str = "64MiB", chunk_size: int = 16) -> ServerProc:
    """Start ``kvdock serve`` with a small pool and small chunks; raises if it does not come up."""
    port, http_port = free_port(), free_port()
    log_path = tmp_path / f"server-{port}.log"
    args = [
        sys.executable,
        "-m",
        "kvdock.cli.main",
        "serve",
        "--port",
        str(port),
        "--http-port",
        str(http_port),
        "--l1-size",
        l1_size,
        "--chunk-size",
        str(chunk_size),
        # no L2 unless a test asks for one: the default directory is shared by the whole machine
        *([] if any(a.startswith(("--disk", "--no-disk")) for a in extra) else ["--no-disk"]),
        *extra,
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVDOCK_")}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
    srv = ServerProc(proc, port, http_port, log_path, args)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{srv.log()}")
        try:
            urllib.request.urlopen(srv.http_url + "/healthz", timeout=1).read()
            return srv
        except OSError:
            time.sleep(0.05)
    srv.stop()
    raise RuntimeError(f"server did not come up:\n{srv.log()}")


@dataclass
class RedisProc:
    port: int
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisProc:
        """Start redis-server (no persistence) on ``port`` and wait until it answers PING."""
        import redis

        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        deadline = time.monotonic() + 20
        while True:
            try:
                client.ping()
                client.close()
                return self
            except redis.RedisError:
                assert self.proc.poll() is None and time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

"""Test helpers: start a real ``kvdock serve`` subprocess on free ports and wait until it answers."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvdock.testing import ServerProcess, free_port
from kvdock.testing import start_server as start

__all__ = [
    "CHUNK",
    "GEOMETRY",
    "MODEL",
    "RedisProc",
    "ServerProc",
    "free_port",
    "make_kv",
    "make_tokens",
    "start_server",
]

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


ServerProc = ServerProcess


def start_server(
    tmp_path: Path,
    *extra: str,
    l1_size: str = "64MiB",
    chunk_size: int = 16,
    env: dict[str, str] | None = None,
    port: int = 0,
    http_port: int = 0,
) -> ServerProcess:
    """Start ``kvdock serve`` with a small pool and small chunks; raises if it does not come up.
    No L2 unless the test asks for one: the default directory is shared by the whole machine."""
    disk = [] if any(a.startswith(("--disk", "--no-disk")) for a in extra) else ["--no-disk"]
    log_path = tmp_path / f"server-{time.monotonic_ns()}.log"
    return start(
        *disk,
        *extra,
        l1_size=l1_size,
        chunk_size=chunk_size,
        log_path=log_path,
        timeout=30,
        env=env,
        port=port,
        http_port=http_port,
    )


@contextmanager
def serving(
    tmp_path: Path, transport: str, *extra: str, models: tuple[tuple[str, str], ...] = ((MODEL, "bfloat16"),)
) -> Iterator[ServerProcess]:
    """A server (``start_server``) whose clients get ``transport`` ("shm" or "inline"), with
    ``models`` (name, dtype) registered in GEOMETRY; stopped at exit, which must be clean."""
    import kvdock.sdk as kvd

    srv = start_server(tmp_path, *extra, *(["--no-shm"] if transport == "inline" else []))
    try:
        for name, dtype in models:
            kvd.register_model(srv.url, srv.http_url, name, dtype=dtype, **GEOMETRY, timeout=10)
        yield srv
    finally:
        assert srv.stop() == 0, srv.log()


@dataclass
class RedisProc:
    port: int
    proc: subprocess.Popen[bytes] | None = None
    password: str = ""
    extra: tuple[str, ...] = ()  # more redis-server flags

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> RedisProc:
        """Start redis-server (no persistence) on ``port`` and wait until it answers PING."""
        import redis

        auth = ["--requirepass", self.password] if self.password else []
        self.proc = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                *auth,
                *self.extra,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2, password=self.password or None)
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


def wait_for(cond: Callable[[], object], what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def tier(srv: ServerProcess, name: str) -> dict[str, Any]:
    """A lower tier's entry of the server's /status."""
    doc: dict[str, Any] = srv.get("/status")["tiers"][name]
    return doc


def wait_written(srv: ServerProcess, name: str, n: int) -> None:
    """Until tier ``name`` counts ``n`` writes and nothing is left to write down."""
    wait_for(
        lambda: tier(srv, name)["writes"] >= n and srv.get("/status")["tiers"]["writeback_backlog_bytes"] == 0,
        f"{n} writes to {name}",
    )


def cluster_ports(n: int) -> list[int]:
    """``n`` loopback ports that are free, each with its cluster bus port (+10000) free too."""
    import random
    import socket

    found: list[int] = []
    while len(found) < n:
        port = random.randrange(20000, 30000)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10000))
        except OSError:
            continue
        if port not in found:
            found.append(port)
    return found


@dataclass
class RedisClusterProc:
    """A real Redis Cluster on loopback: ``masters`` masters with one replica each (Debian's
    redis-server in cluster mode, a short cluster-node-timeout so failovers take about a second),
    made with ``redis-cli --cluster create``. Nodes can be killed and started again by index."""

    ports: list[int]
    workdir: Path
    masters: int = 3
    node_timeout_ms: int = 1000
    procs: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports[:2]) + "/"

    def start_node(self, port: int) -> None:
        self.procs[port] = subprocess.Popen(
            [
                "redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--cluster-enabled", "yes", "--cluster-config-file", str(self.workdir / f"nodes-{port}.conf"),
                "--cluster-node-timeout", str(self.node_timeout_ms), "--dir", str(self.workdir),
                # replicas attach at once, and show in CLUSTER SLOTS once their offset moves, which
                # the master's pings to them do (every 10 s by default)
                "--repl-diskless-sync-delay", "0", "--repl-ping-replica-period", "1",
            ],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip

    def start(self) -> RedisClusterProc:
        import redis

        for port in self.ports:
            self.start_node(port)
        for port in self.ports:
            self._wait(lambda p=port: redis.Redis(port=p, socket_timeout=1).ping(), f"node {port} to start")
        subprocess.run(
            ["redis-cli", "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports),
             "--cluster-replicas", str(len(self.ports) // self.masters - 1), "--cluster-yes"],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip
        self.wait_ok()
        return self

    def info(self, port: int) -> dict[str, str]:
        import redis

        text = redis.Redis(port=port, socket_timeout=1).execute_command("CLUSTER", "INFO").decode()
        return dict(line.split(":", 1) for line in text.split() if ":" in line)

    def roles(self) -> dict[int, str]:
        """Each live node's role ("master" or "slave"), as it says itself."""
        import redis

        out = {}
        for port, proc in self.procs.items():
            if proc.poll() is None:
                role = redis.Redis(port=port, socket_timeout=1).execute_command("ROLE")[0]
                out[port] = role.decode() if isinstance(role, bytes) else str(role)
        return out

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Until every live node reports ``cluster_state:ok`` and 3 masters are live."""

        def ok() -> bool:
            import redis

            live = [p for p, proc in self.procs.items() if proc.poll() is None]
            if not all(self.info(p).get("cluster_state") == "ok" for p in live):
                return False
            if sum(r == "master" for r in self.roles().values()) != self.masters:
                return False
            # every slot range names its replica once the replicas have attached (a client made
            # before that would not know them)
            slots = redis.Redis(port=live[0], socket_timeout=1).execute_command("CLUSTER", "SLOTS")
            replicas = len(live) // self.masters - 1
            return all(len(r) - 3 >= replicas for r in slots)

        self._wait(ok, "the cluster to be ok", timeout)

    def kill(self, port: int) -> None:
        proc = self.procs[port]
        proc.kill()
        proc.wait()

    def stop(self) -> None:
        for port in list(self.procs):
            if self.procs[port].poll() is None:
                self.kill(port)

    @staticmethod
    def _wait(cond: Callable[[], object], what: str, timeout: float = 20.0) -> None:
        import redis

        deadline = time.monotonic() + timeout
        while True:
            try:
                if cond():
                    return
            except (redis.RedisError, OSError):
                pass
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.05)

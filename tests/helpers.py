"""Test helpers: start a real server, in this process (``kvdock.inprocess``: a thread with its own
event loop, real sockets and shared memory) or as a ``kvdock serve`` subprocess on free ports (for
what needs a process boundary), and wait until it answers."""

from __future__ import annotations

import functools
import os
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvdock.inprocess import InProcessServer
from kvdock.testing import ServerProcess, free_port, free_ports, server_binary
from kvdock.testing import start_server as start
from zygote import SERVER
from zygote import Popen as ZygotePopen

__all__ = [
    "CHUNK",
    "GEOMETRY",
    "L1_SIZE",
    "MODEL",
    "NOTHING_ELSE",
    "AnyServer",
    "InProcessServer",
    "RedisProc",
    "ServerProc",
    "free_port",
    "free_ports",
    "make_kv",
    "make_tokens",
    "needs_process",
    "running",
    "start_inprocess",
    "start_server",
]

MODEL = "tiny"
GEOMETRY = {"num_layers": 3, "num_kv_heads": 2, "head_dim": 8}
CHUNK = 16  # chunk_size of test servers
# the pool of a test server unless the test asks for another: ~2,700 chunks of MODEL, more than a
# test that does not mean to fill it stores. Small on purpose: the kernel zeroes and maps every
# page of a pool at start and every client maps it: ~60 ms of system time per server at 64 MiB
L1_SIZE = "8MiB"


# the outcomes of a store (StoreResult, as the CLI prints it) besides stored, deduped and pool full
NOTHING_ELSE = {"in_flight_chunks": 0, "diverged_chunks": 0, "superseded_chunks": 0}


def make_kv(tokens: int, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> torch.Tensor:
    """Deterministic random KV_2LTD for the test model."""
    g = torch.Generator().manual_seed(seed)
    d = GEOMETRY["num_kv_heads"] * GEOMETRY["head_dim"]
    return torch.randn(2, GEOMETRY["num_layers"], tokens, d, generator=g).to(dtype)


def make_tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


ServerProc = ServerProcess
AnyServer = ServerProcess | InProcessServer  # what make_server / server give (same surface)
# every server a process (make_server, serving): to compare, or to rule the harness out
ALWAYS_PROCESS = os.environ.get("KVDOCK_TEST_SUBPROCESS") == "1"


def needs_process(env: dict[str, str] | None) -> bool:
    """Whether a server started with ``env`` needs a process of its own: anything but the fault
    variables (kvdock.faults, which an in-process server takes directly), or KVDOCK_TEST_SUBPROCESS=1."""
    return ALWAYS_PROCESS or any(not k.startswith("KVDOCK_FAULT_") for k in env or {})


def running(srv: AnyServer) -> bool:
    return srv.proc.poll() is None if isinstance(srv, ServerProcess) else srv.alive


def _disk_flags(extra: tuple[str, ...]) -> list[str]:
    return [] if any(a.startswith(("--disk", "--no-disk")) for a in extra) else ["--no-disk"]


def start_server(
    tmp_path: Path,
    *extra: str,
    l1_size: str = L1_SIZE,
    chunk_size: int = 16,
    env: dict[str, str] | None = None,
    port: int = 0,
    http_port: int = 0,
) -> ServerProcess:
    """Start ``kvdock serve`` with a small pool and small chunks; raises if it does not come up.
    No L2 unless the test asks for one: the default directory is shared by the whole machine.
    The process is forked from a python that imported the server already (tests/zygote.py)."""
    log_path = tmp_path / f"server-{time.monotonic_ns()}.log"
    return start(
        *_disk_flags(extra),
        *extra,
        l1_size=l1_size,
        chunk_size=chunk_size,
        log_path=log_path,
        timeout=30,
        env=env,
        port=port,
        http_port=http_port,
        popen=functools.partial(ZygotePopen, preload=SERVER),
    )


def start_inprocess(
    tmp_path: Path,
    *extra: str,
    l1_size: str = L1_SIZE,
    chunk_size: int = 16,
    env: dict[str, str] | None = None,
    port: int = 0,
    http_port: int = 0,
) -> InProcessServer:
    """``start_server``'s server (same arguments and defaults) in this process; ``env`` may name
    fault variables only (needs_process). Ports it picked itself (free_port) that something else
    took meanwhile (an ephemeral port of another test's connection: EADDRINUSE) are picked again,
    twice at most."""
    for attempt in range(3):
        log_path = tmp_path / f"server-{time.monotonic_ns()}.log"
        try:
            return InProcessServer.start(
                *_disk_flags(extra),
                *extra,
                l1_size=l1_size,
                chunk_size=chunk_size,
                log_path=log_path,
                timeout=30,
                env=env,
                port=port,
                http_port=http_port,
            )
        except RuntimeError as e:
            if port or http_port or attempt == 2 or "address already in use" not in str(e).lower():
                raise
    raise AssertionError("unreachable")


@contextmanager
def serving(
    tmp_path: Path, transport: str, *extra: str, models: tuple[tuple[str, str], ...] = ((MODEL, "bfloat16"),)
) -> Iterator[AnyServer]:
    """A server (``start_server``) whose clients get ``transport`` ("shm" or "inline"), with
    ``models`` (name, dtype) registered in GEOMETRY; stopped at exit, which must be clean. In
    this process unless KVDOCK_TEST_SUBPROCESS=1."""
    import kvdock.sdk as kvd

    start_any = start_server if ALWAYS_PROCESS else start_inprocess
    srv = start_any(tmp_path, *extra, *(["--no-shm"] if transport == "inline" else []))
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
    server: str = "redis"  # or "valkey": kvdock.testing.server_binary
    started: bool = False  # once started, the port is in its URL: a restart keeps it

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> RedisProc:
        """Start redis-server (valkey-server for ``server="valkey"``; no persistence) on ``port``
        and wait until it answers PING. The server that answers must be this one: a port that
        another test's server took meanwhile (free_port picked it for both) made ours exit while
        the other answered, and the test then used (and saw paused) another test's Redis. A first
        start then takes another free port; a restart keeps its port (its URL is in use)."""
        for attempt in range(3):
            if self._launch():
                self.started = True
                return self
            assert not self.started and attempt < 2, f"{self.server}: port {self.port} is another process's"
            self.port = free_port()
        raise AssertionError("unreachable")

    def _launch(self) -> bool:
        """Start the server on ``port``; False if it exited while another process answers there."""
        import redis

        auth = ["--requirepass", self.password] if self.password else []
        self.proc = subprocess.Popen(
            [
                server_binary(self.server),
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
        try:
            while True:
                try:
                    pid = int(client.info("server")["process_id"])
                except redis.RedisError:
                    if self.proc.poll() is not None:
                        return False  # (it could not bind: the port is taken)
                    assert time.monotonic() < deadline, f"{self.server} did not start"
                    time.sleep(0.05)
                    continue
                if pid == self.proc.pid:
                    return True
                self.proc.kill()  # (another's server answers: ours cannot have bound the port)
                self.proc.wait()
                return False
        finally:
            client.close()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def run_for(threads: list[threading.Thread], stop: threading.Event, seconds: float, join_s: float = 60) -> None:
    """Start ``threads``, let them run ``seconds`` (a soak's length, not a wait for something),
    set ``stop`` and join them, each within ``join_s``; AssertionError for one still running."""
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join(join_s)
    assert not any(t.is_alive() for t in threads), "a thread did not stop"


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


def open_sessions(srv: ServerProcess) -> int:
    """The sessions the server holds now (/status)."""
    return int(srv.get("/status")["sessions"])


def wait_sessions(srv: ServerProcess, want: int, timeout: float = 10) -> None:
    """Until the server holds ``want`` sessions: a CommitRetrieve needs no answer, so /status
    (HTTP) may see it a moment after the call that sent it returned."""
    deadline = time.monotonic() + timeout
    while open_sessions(srv) != want:
        assert time.monotonic() < deadline, f"sessions {open_sessions(srv)}, want {want}"
        time.sleep(0.02)


def assert_fast_reads_refused(srv: ServerProcess, client_id: str) -> None:
    """Send a FastReads report as ``client_id`` (reports are never answered) and wait until the
    server refused it (its bad_request count moves), counting nothing."""
    from kvdock.protocol import messages as m
    from kvdock.transport.client import ControlClient

    before = srv.metric("kvdock_lookups_total", 0.0)
    refused = srv.metric('kvdock_errors_total{code="bad_request"}', 0)
    client = ControlClient(srv.url, 10)
    try:
        client.send_nowait(m.FastReads(client_id, 1000, 0, 10, 10, entries=[0], offsets=[0], gens=[0]))
        deadline = time.monotonic() + 10
        while srv.metric('kvdock_errors_total{code="bad_request"}', 0) == refused:
            assert time.monotonic() < deadline, "the report was not refused"
            time.sleep(0.05)
    finally:
        client.close()
    assert srv.metric("kvdock_lookups_total", 0.0) == before


class SlowLink:
    """An in-process server's L3 write-downs wait (their fence read, nothing sent yet: as bytes on
    a slow link would) until :meth:`release`; ``waiting`` is set once one waits."""

    def __init__(self, srv: Any) -> None:
        self.tier = next(lane.tier for lane in srv.state.manager.lanes if lane.name == "l3")
        self.real = self.tier.write_from
        self.go, self.waiting = threading.Event(), threading.Event()

        def slow(*args: Any, **kw: Any) -> Any:
            self.waiting.set()
            self.go.wait(60)
            return self.real(*args, **kw)

        self.tier.write_from = slow

    def release(self) -> None:
        self.go.set()
        self.tier.write_from = self.real


def miss_or(got: torch.Tensor | None, want: torch.Tensor, replaced: torch.Tensor, who: str) -> None:
    """``got`` (a retrieve: a leading run of chunks, or None) is None or a prefix of ``want``;
    AssertionError naming ``replaced`` (a version an acknowledged overwrite replaced) if it is a
    prefix of that, or other bytes."""
    if got is None:
        return
    n = got.shape[2]
    assert n % CHUNK == 0 and n > 0, f"{who} retrieved {n} tokens"
    if torch.equal(got, want[:, :, :n]):
        return
    assert not torch.equal(got, replaced[:, :, :n]), (
        f"{who} serves {n // CHUNK} chunk(s) of the version an acknowledged overwrite replaced"
    )
    raise AssertionError(f"{who} serves bytes of no store")


def l3_coherence(srv: Any) -> dict[str, Any]:
    """A server's /status of its fleet coherence (its L3 tier's ``coherence``)."""
    return dict(srv.get("/status")["tiers"]["l3"]["coherence"])


def backlog(srv: Any) -> int:
    """A server's write-downs not done yet, in bytes (/status ``writeback_backlog_bytes``)."""
    return int(srv.get("/status")["tiers"]["writeback_backlog_bytes"])


def vouching(make_server: Callable[..., Any], url: str, *flags: str) -> Any:
    """A server on the L3 at ``url`` (no L2), once it vouches (its first poll is applied)."""
    srv = make_server("--redis-url", url, "--no-disk", *flags)
    wait_for(lambda: l3_coherence(srv)["vouched"], "the server to vouch", 30)
    return srv

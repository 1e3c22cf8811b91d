"""Start a server: pool, storage, control plane and HTTP on one asyncio loop; stop cleanly on
SIGINT/SIGTERM (the shared-memory segment is unlinked)."""

from __future__ import annotations

import asyncio
import inspect
import logging
import signal
from pathlib import Path
from typing import Any

from aiohttp import web

from kvdock.config import (
    L1_AUTO_FRACTION,
    ServerConfig,
    auto_disk_size,
    auto_l1_size,
    default_disk_dir,
    format_size,
)
from kvdock.errors import ConfigError, ProtocolError
from kvdock.protocol import ErrorCode, decode_request, encode
from kvdock.protocol.messages import Error
from kvdock.server.dispatch import handle
from kvdock.server.handlers import HeldPayload, ServerState
from kvdock.server.http import make_app
from kvdock.server.metrics import Metrics
from kvdock.server.registry import Registry
from kvdock.shm import HEADER_SIZE, PoolSegment, SlotAllocator, cleanup_stale
from kvdock.storage import L1Store, StorageManager
from kvdock.storage.disk import DiskInUseError, DiskStore
from kvdock.storage.redis import RedisStore
from kvdock.storage.tiers import Tiers
from kvdock.transport.server import ControlServer, Incoming

log = logging.getLogger("kvdock.server")


def build_state(config: ServerConfig) -> ServerState:
    """Create the pool (shared or private) and the storage stack for ``config``."""
    stale = cleanup_stale()
    if stale:
        log.info("removed %d stale shared-memory segment(s) of dead servers: %s", len(stale), ", ".join(stale))
    size = config.l1_size or auto_l1_size()
    if not config.l1_size:
        log.info(
            "L1 size: %s (auto: %d%% of available memory; set --l1-size to choose)",
            format_size(size),
            L1_AUTO_FRACTION * 100,
        )
    segment = PoolSegment.anonymous(size) if config.no_shm else PoolSegment.create(size)
    try:
        metrics = Metrics()
        l1 = L1Store(SlotAllocator(HEADER_SIZE, size), on_evict=lambda obj: metrics.evictions.inc(), memory=segment.buf)
        manager = StorageManager(l1, config.session_ttl)
        disk = _open_disk(config)
        registry = Registry(config.chunk_size, disk.root / "models.msgpack" if disk is not None else None)
        tiers = Tiers(manager, registry.layout_of, disk, _open_redis(config))
    except BaseException:
        segment.unlink()
        segment.close()
        raise
    metrics.l1_capacity.set(size)
    state = ServerState(config.chunk_size, segment, not config.no_shm, manager, registry, tiers, metrics)
    metrics.watch_tiers(tiers)
    return state


def _open_disk(config: ServerConfig) -> DiskStore | None:
    if config.no_disk:
        return None
    root = Path(config.disk_dir) if config.disk_dir else default_disk_dir()
    size = config.disk_size or auto_disk_size(root)
    try:
        disk = DiskStore(root, size)
    except DiskInUseError as e:
        raise ConfigError(f"{e}; give another --disk-dir, or --no-disk") from None
    report = disk.scan()
    log.info(
        "L2 disk %s: %s budget, %d object(s) found (%s used), %d torn file(s) and %d temp file(s) removed",
        root,
        format_size(size),
        report.loaded,
        format_size(disk.used_bytes),
        report.torn,
        report.temp_files,
    )
    return disk


def _open_redis(config: ServerConfig) -> RedisStore | None:
    if not config.redis_url:
        return None
    store = RedisStore(config.redis_url)
    if store.probe():
        log.info("L3 redis %s: connected", store.display_url)
    return store


async def _serve_control(state: ServerState, control: ControlServer) -> None:
    waiting: set[asyncio.Task[None]] = set()  # replies that wait for a lower tier
    while True:
        msg: Incoming = await control.recv()
        try:
            await _serve_one(state, control, msg, waiting)
        except Exception:  # e.g. a reply that cannot be sent: log it, keep serving everyone else
            log.exception("control plane")


async def _serve_one(
    state: ServerState, control: ControlServer, msg: Incoming, waiting: set[asyncio.Task[None]]
) -> None:
    try:
        if msg.header is None:
            raise ProtocolError("expected frames [seq, header, *payload]")
        req = decode_request(msg.header)
    except ProtocolError as e:
        state.metrics.errors.labels(ErrorCode.MALFORMED.value).inc()
        await control.send(msg.identity, msg.seq, encode(Error(ErrorCode.MALFORMED.value, str(e))))
        return
    try:
        out = handle(state, req, msg.payload)
    except Exception as e:  # a bug must not take the server down for everyone else
        out = _internal_error(state, req, e)
    if inspect.isawaitable(out):
        task = asyncio.create_task(_reply_later(state, control, msg, req, out, waiting))
        waiting.add(task)
        task.add_done_callback(waiting.discard)
        return
    reply, payload = out
    await _send(control, msg, reply, payload, waiting)


async def _send(
    control: ControlServer, msg: Incoming, reply: Any, payload: Any, waiting: set[asyncio.Task[None]]
) -> None:
    """Send a reply; held slot views are released when zmq is done with them (in a task, so the
    loop serves others meanwhile)."""
    if not isinstance(payload, HeldPayload):
        await control.send(msg.identity, msg.seq, encode(reply), payload)
        return

    async def send_then_release() -> None:
        try:
            await control.send_tracked(msg.identity, msg.seq, encode(reply), payload)
        finally:
            payload.release()

    task = asyncio.create_task(send_then_release())
    waiting.add(task)
    task.add_done_callback(waiting.discard)


async def _reply_later(
    state: ServerState,
    control: ControlServer,
    msg: Incoming,
    req: object,
    pending: Any,
    waiting: set[asyncio.Task[None]],
) -> None:
    try:
        reply, payload = await pending
    except Exception as e:
        reply, payload = _internal_error(state, req, e)
    try:
        await _send(control, msg, reply, payload, waiting)
    except Exception:
        log.exception("sending a deferred reply")


def _internal_error(state: ServerState, req: object, e: Exception) -> tuple[Error, list[Any]]:
    log.exception("internal error handling %s", type(req).__name__)
    state.metrics.errors.labels(ErrorCode.INTERNAL.value).inc()
    return Error(ErrorCode.INTERNAL.value, f"{type(e).__name__}: {e}"), []


async def _reap(state: ServerState, ttl: float) -> None:
    while True:
        await asyncio.sleep(min(1.0, ttl / 4))
        try:
            await state.tiers.probe()
            n = state.manager.expire()
        except Exception:  # keep reaping: a dead reaper would leave every lease open forever
            log.exception("lease reaper")
            continue
        if n:
            state.metrics.expired_sessions.inc(n)
            log.warning("%d session(s) lease expired; their pins and reservations were released", n)


async def serve(config: ServerConfig, ready: asyncio.Event | None = None) -> None:
    """Run until SIGINT/SIGTERM. The shared-memory segment is unlinked on every way out, start-up
    failures (port in use) included."""
    state = build_state(config)
    try:
        await _run(state, config, ready)
    finally:
        state.tiers.close()  # finishes queued write-downs first
        state.segment.unlink()
        state.segment.close()


async def _run(state: ServerState, config: ServerConfig, ready: asyncio.Event | None) -> None:
    control = ControlServer(config.zmq_url)
    runner = web.AppRunner(make_app(state, config), access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, config.host, config.http_port).start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        log.info(
            "kvdock serving: zmq %s, http http://%s:%d, chunk_size %d, L1 %s (%s%s)",
            config.zmq_url,
            config.host,
            config.http_port,
            config.chunk_size,
            format_size(state.manager.l1.allocator.capacity),
            "shared memory " if state.shm_enabled else "private memory, inline transport only",
            state.segment.name,
        )
        tasks = [
            asyncio.create_task(_serve_control(state, control)),
            asyncio.create_task(_reap(state, config.session_ttl)),
        ]
        if ready is not None:
            ready.set()
        await stop.wait()
        log.info("shutting down")
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        await runner.cleanup()
        control.close()

"""Start a server: pool, storage, control plane and HTTP on one asyncio loop; stop cleanly on
SIGINT/SIGTERM (the shared-memory segment is unlinked)."""

from __future__ import annotations

import asyncio
import logging
import signal

from aiohttp import web

from kvdock.config import L1_AUTO_FRACTION, ServerConfig, auto_l1_size, format_size
from kvdock.errors import ProtocolError
from kvdock.protocol import decode_request, encode
from kvdock.protocol.messages import Error
from kvdock.server.handlers import ServerState, handle
from kvdock.server.http import make_app
from kvdock.server.registry import Registry
from kvdock.shm import HEADER_SIZE, PoolSegment, SlotAllocator, cleanup_stale
from kvdock.storage import L1Store, StorageManager
from kvdock.transport.server import ControlServer, Incoming

log = logging.getLogger("kvdock.server")


def build_state(config: ServerConfig) -> ServerState:
    """Create the pool (shared or private) and the storage stack for ``config``."""
    from kvdock.server.metrics import Metrics

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
    metrics = Metrics()
    l1 = L1Store(SlotAllocator(HEADER_SIZE, size), on_evict=lambda obj: metrics.evictions.inc())
    manager = StorageManager(l1, config.session_ttl)
    metrics.l1_capacity.set(size)
    return ServerState(config.chunk_size, segment, not config.no_shm, manager, Registry(config.chunk_size), metrics)


async def _serve_control(state: ServerState, control: ControlServer) -> None:
    while True:
        msg: Incoming = await control.recv()
        try:
            if msg.header is None:
                raise ProtocolError("expected frames [seq, header, *payload]")
            req = decode_request(msg.header)
        except ProtocolError as e:
            state.metrics.errors.labels("malformed").inc()
            await control.send(msg.identity, msg.seq, encode(Error("malformed", str(e))))
            continue
        try:
            reply, payload = handle(state, req, msg.payload)
        except Exception as e:  # a bug must not take the server down for everyone else
            log.exception("internal error handling %s", type(req).__name__)
            state.metrics.errors.labels("internal").inc()
            reply, payload = Error("internal", f"{type(e).__name__}: {e}"), []
        await control.send(msg.identity, msg.seq, encode(reply), payload)


async def _reap(state: ServerState, ttl: float) -> None:
    while True:
        await asyncio.sleep(min(1.0, ttl / 4))
        n = state.manager.expire()
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

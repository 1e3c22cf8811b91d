"""Start a server: the state (:mod:`kvdock.server.build`), then the control plane, the pool door
and HTTP on one asyncio loop; stop cleanly on SIGINT/SIGTERM: stop taking requests, write down every
acknowledged chunk still queued for L2/L3 (no time limit; a second signal drops the rest, counted:
:mod:`kvdock.storage.drain`), then unlink the shared-memory segment."""

from __future__ import annotations

import asyncio
import functools
import logging
import signal
import time
from collections.abc import Awaitable, Coroutine
from typing import Any

import zmq
from aiohttp import web

from kvdock import memcpy
from kvdock.config import ServerConfig
from kvdock.errors import ConfigError, ProtocolError
from kvdock.keys import TOKEN_DTYPE
from kvdock.protocol import ErrorCode, decode_request, encode
from kvdock.protocol.limits import max_frame_bytes, max_local_message_bytes
from kvdock.protocol.messages import UNANSWERED, Error, PrepareRetrieve, PrepareRetrieveMany
from kvdock.server.build import build_state, follow_fleet, server_curve
from kvdock.server.dispatch import handle
from kvdock.server.events import FLUSH_S, advertised_url
from kvdock.server.http import make_app, request_logger
from kvdock.server.pools import open_door, open_pool
from kvdock.server.resources import keep_freed_memory, raise_fd_limit
from kvdock.server.state import Outcome, Reply, ServerState
from kvdock.server.tenants import load_tenants
from kvdock.sizes import format_size
from kvdock.transport.curve import ServerCurve
from kvdock.transport.server import ControlServer, Incoming

log = logging.getLogger("kvdock.server")


def _serve_one(state: ServerState, control: ControlServer, msg: Incoming, waiting: set[asyncio.Task[None]]) -> None:
    """Handle one request, from the control server's reader callback: reply at once, or in a
    task (``waiting``) when the handler waits for a lower tier or the reply's frames must be
    tracked until sent. Its latency is observed when the reply is handed to the transport."""
    started = time.perf_counter()
    try:
        if msg.header is None:
            raise ProtocolError("expected frames [seq, header, *payload]")
        req = decode_request(msg.header)
    except ProtocolError as e:
        state.metrics.errors.labels(ErrorCode.MALFORMED.value).inc()
        control.send(msg, encode(Error(ErrorCode.MALFORMED.value, str(e))))
        return
    out: Outcome
    unsent = state.unsent.get(msg.peer, 0)
    reserved = 0
    retrieving = isinstance(req, (PrepareRetrieve, PrepareRetrieveMany))
    if retrieving and unsent > state.max_unsent_bytes:
        out = Reply(Error(ErrorCode.BUSY.value, f"{unsent} bytes of earlier replies are still unread; read them first"))
    elif retrieving and state.unsent_bytes > state.max_total_unsent_bytes:
        out = Reply(Error(ErrorCode.BUSY.value, "the server's inline replies to all clients are not read yet; retry"))
    else:
        # an inline retrieve's reply counts against its client's cap from now on, so retrieves
        # sent back to back cannot all pass the check before any reply exists
        reserved = _reply_bound(state, req)
        _count_unsent(state, msg.peer, reserved)
        try:
            out = handle(state, req, msg.payload, msg.key)
        except Exception as e:  # a bug must not take the server down for everyone else
            out = _internal_error(state, req, e)
    if isinstance(out, Reply):
        state.metrics.observe_request(state.registry, req, started)
        if not isinstance(req, UNANSWERED):  # (one no reply answers: handled, nothing goes out)
            _send(state, control, msg, out, waiting, reserved)
        return
    _spawn(waiting, _reply_later(state, control, msg, req, out, waiting, reserved, started))


def _spawn(waiting: set[asyncio.Task[None]], coro: Coroutine[Any, Any, None]) -> None:
    task = asyncio.create_task(coro)
    waiting.add(task)
    task.add_done_callback(waiting.discard)


def _reply_bound(state: ServerState, req: object) -> int:
    """The most payload bytes the reply to ``req`` can carry (inline retrieves only)."""
    if not isinstance(req, (PrepareRetrieve, PrepareRetrieveMany)):
        return 0
    client = state.registry.clients.get(req.client_id)
    if client is None or client.transport != "inline":
        return 0
    prompts = req.tokens if isinstance(req, PrepareRetrieveMany) else [req.tokens]
    return sum(len(t) // TOKEN_DTYPE.itemsize // state.chunk_size for t in prompts) * client.model.slot_nbytes


def _count_unsent(state: ServerState, peer: tuple[int, bytes], n: int) -> None:
    left = state.unsent.pop(peer, 0) + n
    if left:
        state.unsent[peer] = left


def _send(
    state: ServerState,
    control: ControlServer,
    msg: Incoming,
    reply: Reply,
    waiting: set[asyncio.Task[None]],
    reserved: int = 0,
) -> None:
    """Send a reply. Payload frames (private buffers) are counted as unsent for their client until
    zmq has written them to the peer, in a task, so the loop serves others meanwhile; the
    ``reserved`` count taken when the request arrived is released then too."""
    header = encode(reply.message)
    if not reply.frames:
        _count_unsent(state, msg.peer, -reserved)
        control.send(msg, header)
        return
    size = max(reserved, sum(len(f) for f in reply.frames))
    _count_unsent(state, msg.peer, size - reserved)

    async def send_and_count() -> None:
        try:
            await control.send_tracked(msg, header, reply.frames)
        finally:
            _count_unsent(state, msg.peer, -size)
        if reply.pooled:  # zmq is done with them (not on an error above: then they are dropped)
            for frame in reply.frames:
                state.reply_buffers.give(frame)

    _spawn(waiting, send_and_count())


async def _reply_later(
    state: ServerState,
    control: ControlServer,
    msg: Incoming,
    req: object,
    pending: Awaitable[Reply],
    waiting: set[asyncio.Task[None]],
    reserved: int,
    started: float,
) -> None:
    try:
        reply = await pending
    except Exception as e:
        reply = _internal_error(state, req, e)
    state.metrics.observe_request(state.registry, req, started)
    try:
        _send(state, control, msg, reply, waiting, reserved)
    except Exception:
        log.exception("sending a deferred reply")


def _internal_error(state: ServerState, req: object, e: Exception) -> Reply:
    log.exception("internal error handling %s", type(req).__name__)
    state.metrics.errors.labels(ErrorCode.INTERNAL.value).inc()
    return Reply(Error(ErrorCode.INTERNAL.value, f"{type(e).__name__}: {e}"))


async def _reap(state: ServerState, ttl: float) -> None:
    """Expire sessions and clients whose leases ran out (clients: their sessions end too)."""
    while True:
        await asyncio.sleep(min(1.0, ttl / 4, state.registry.client_ttl / 4))
        try:
            n = state.manager.sessions.expire()
            gone = state.registry.expire(state.manager.sessions.end_client)
            freed = state.manager.sessions.reap_quarantine()
            if freed:
                log.info("%d quarantined slot(s) of dead client processes freed", freed)
        except Exception:  # keep reaping: a dead reaper would leave every lease open forever
            log.exception("lease reaper")
        else:
            if n:
                state.metrics.expired_sessions.inc(n)
                log.warning("%d session(s) lease expired; their pins and reservations were released", n)
            if gone:
                state.metrics.expired_clients.inc(gone)
                log.info("%d client(s) silent for %g s were forgotten", gone, state.registry.client_ttl)


async def _probe(state: ServerState) -> None:
    """Reconnect down tiers, on their reader threads, apart from the lease reaper (a hung Redis
    must never delay lease expiry)."""
    while True:
        await asyncio.sleep(0.5)
        for lane in state.manager.lanes:
            if not lane.tier.up() and lane.tier.probe_due():
                await lane.on_reader(lane.tier.probe, default=None, when_down=True)


async def _publish_events(state: ServerState, server: str) -> None:
    """Publish pending KV events every FLUSH_S (only runs when they are on)."""
    assert state.events is not None
    while True:
        await asyncio.sleep(FLUSH_S)
        try:
            state.events.flush(server)
        except Exception:  # keep publishing
            log.exception("KV events")


async def serve(config: ServerConfig, ready: asyncio.Event | None = None) -> None:
    """Run until SIGINT/SIGTERM. The shared-memory segment is unlinked on every way out, start-up
    failures (port in use) included."""
    try:
        memcpy.default_threads()  # a bad KVDOCK_COPY_THREADS fails here, not at the first copy
    except ValueError as e:
        raise ConfigError(str(e)) from None
    raise_fd_limit()
    keep_freed_memory()
    tenants = load_tenants(config.tenants) if config.tenants else None
    curve = server_curve(config, tenants)
    state = build_state(config, curve, tenants)
    stop, abort = asyncio.Event(), asyncio.Event()  # the first signal, and a second one
    try:
        await _run(state, config, ready, curve, stop, abort)
        await state.manager.drain(abort)  # every acknowledged write-down, unless a second signal came
    finally:
        state.manager.close()
        state.copier.shutdown(wait=True)
        if state.events is not None:
            state.events.close()
        state.pool.close()


def _on_signal(sig: signal.Signals, stop: asyncio.Event, abort: asyncio.Event) -> None:
    """The first SIGINT/SIGTERM stops the server (then drains its write-downs); a second one
    aborts the drain."""
    if not stop.is_set():
        stop.set()
    elif not abort.is_set():
        log.warning("%s again: dropping the write-downs not done yet", sig.name)
        abort.set()


async def _run(
    state: ServerState,
    config: ServerConfig,
    ready: asyncio.Event | None,
    curve: ServerCurve | None,
    stop: asyncio.Event,
    abort: asyncio.Event,
) -> None:
    # no frame of a valid request is larger than a chunk (which fits in the pool) or the token ids
    # of the largest request: refuse bigger ones before zmq buffers them
    max_frame = max_frame_bytes(config.max_request_tokens, state.manager.l1.allocator.capacity)
    try:
        # local clients share memory: their messages carry token ids, never chunk bytes (and a
        # batch's per-prompt salts and session ids)
        local_max = max_local_message_bytes(config.max_request_tokens)
        if not state.pool.mappable or config.no_local_socket:
            local_max = 0
        control = ControlServer(config.zmq_url, max_frame, local_max, curve)
    except zmq.ZMQError as e:
        raise ConfigError(f"cannot listen on {config.zmq_url}: {e}") from None
    state.local_url = control.local_url
    try:
        door = state.door = open_door(state.pool)
    except BaseException:
        control.close()
        raise
    runner = web.AppRunner(make_app(state, config), access_log=None, logger=request_logger())
    await runner.setup()
    try:
        await web.TCPSite(runner, config.http_bind_host, config.http_port).start()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, _on_signal, sig, stop, abort)
        log.info(
            "kvdock serving: zmq %s%s%s, http http://%s:%d, chunk_size %d, L1 %s (%s%s)",
            config.zmq_url,
            (f" (CURVE, {len(curve.authorized)} client key(s))" if curve is not None else "")
            + (f", {len(state.tenants)} tenant(s)" if state.tenants is not None else ""),
            f" and {control.local_url}" if control.local_url else "",
            config.http_bind_host,
            config.http_port,
            config.chunk_size,
            format_size(state.manager.l1.allocator.capacity),
            "shared memory" if state.pool.mappable else "private memory, inline transport only",
            "".join(
                f", {x}"
                for x in (state.pool.main.name, f"{len(state.pool.own)} tenant pool(s)" * bool(state.pool.own))
                if x
            ),
        )
        waiting: set[asyncio.Task[None]] = set()  # replies that wait for a lower tier or to be sent
        control.start(lambda msg: _serve_one(state, control, msg, waiting))
        if door is not None:
            door.start(loop, functools.partial(open_pool, state.pool, state.tickets))
        if state.events is not None and state.events.publisher is not None:
            state.events.publisher.start()
        tasks = [
            asyncio.create_task(_reap(state, config.session_ttl)),
            asyncio.create_task(_probe(state)),
            asyncio.create_task(follow_fleet(state)),  # an L3's invalidations (nothing without one)
        ]
        if config.kv_events_url:
            tasks.append(asyncio.create_task(_publish_events(state, advertised_url(config))))
            log.info("KV events: %s", config.kv_events_url)
        if ready is not None:
            ready.set()
        await stop.wait()
        log.info("shutting down")
        control.stop()  # no request is taken from here on
        for t in [*tasks, *waiting]:
            t.cancel()
        await asyncio.gather(*tasks, *waiting, return_exceptions=True)
    finally:
        await runner.cleanup()
        control.close()
        if door is not None:
            door.close()

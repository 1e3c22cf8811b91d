"""HTTP API: read-only discovery and operations, plus token-guarded admin actions.

GET  /config   chunk size, protocol, transports, the L1 pool's shared-memory name and size
GET  /status   health, uptime, sessions, clients, pool usage, registered models (cache_context_meta)
GET  /healthz  200 "ok"
GET  /metrics  Prometheus text
POST /admin/clear   drop every object from L1 and L2, or one of them with ?tier=l1 / ?tier=l2
                    (``Authorization: Bearer <token>`` if admin_token is set); the shared L3 is
                    left alone

With tenants (``--tenants``), /config and /status need ``Authorization: Bearer <token>``: the
admin token sees everything, a tenant's token sees the server's settings and only its own models
(no pool name: tenants do not map the shared pool, and no counts of other tenants' objects);
without a token only /healthz and /metrics answer. Admin actions then need the admin token, and
are refused outright if the server has none.

A request aiohttp cannot parse (a line too long, bad headers) gets its 4xx and one short log
line, not a traceback (see :func:`request_logger`).
"""

from __future__ import annotations

import dataclasses
import hmac
import logging
import time
from typing import Any

import msgspec
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from kvdock import __version__
from kvdock.config import ServerConfig
from kvdock.layout import FORMAT_AXES, concrete_shape
from kvdock.protocol.messages import PROTOCOL_VERSION, ModelLayout
from kvdock.server.handlers import refresh_gauges
from kvdock.server.state import ServerState
from kvdock.server.tenants import Tenant
from kvdock.shm.slots import Partitions

STATE: web.AppKey[ServerState] = web.AppKey("state", ServerState)
CONFIG: web.AppKey[ServerConfig] = web.AppKey("config", ServerConfig)
STARTED: web.AppKey[float] = web.AppKey("started", float)


def config_doc(state: ServerState, config: ServerConfig) -> dict[str, Any]:
    return {
        "server_version": __version__,
        "protocol_version": PROTOCOL_VERSION,
        "chunk_size": state.chunk_size,
        "zmq_url": config.zmq_url,
        "session_ttl": config.session_ttl,
        "client_ttl": config.client_ttl,
        "max_request_tokens": config.max_request_tokens,
        "kv_events_url": config.kv_events_url or None,
        "transports": ["shm", "inline"] if state.pool.mappable else ["inline"],
        "l1": {
            "shm_enabled": state.pool.mappable,
            "shm_name": state.pool.main.name or None,
            "size_bytes": state.manager.l1.allocator.capacity,
        },
    }


def status_doc(state: ServerState, started: float) -> dict[str, Any]:
    alloc = state.manager.l1.allocator
    return {
        "health": "ok",
        "server_version": __version__,
        "uptime_s": round(time.monotonic() - started, 3),
        "sessions": state.manager.session_count,
        "clients": len(state.registry.clients),  # a count only: a client id is a capability
        "l1": {
            "capacity_bytes": alloc.capacity,
            "used_bytes": alloc.used_bytes,
            "free_bytes": alloc.free_bytes,
            "objects": len(state.manager.l1),
            "evictions": state.manager.l1.evictions,
            # the eviction policy, evictions by reason, write-down back-pressure (storage.writeback)
            "eviction": state.manager.l1.stats(),
            # slots of expired store sessions whose writer process may still write them
            "quarantined_bytes": state.manager.sessions.quarantined_bytes(),
            # inline reply bytes zmq has not written to their clients yet (capped per client)
            "unsent_reply_bytes": state.unsent_bytes,
        },
        "tiers": tiers_doc(state),
        "hit_rate": hit_rate_doc(state),
        "cache_context_meta": [
            {**model_meta(e.layout), "chunk_nbytes": e.slot_nbytes} for e in state.registry.models.values()
        ],
    }


def model_meta(lay: ModelLayout) -> dict[str, Any]:
    """One model's ``cache_context_meta`` entry, all derived from its one ModelLayout: the whole
    layout under ``layout`` (what kvdock's SDK reads, by ``msgspec.convert``), and the keys of the
    reference design (``world_size``, ``kv_cache_layout``), whose ``engine_kv_concrete_shape`` is
    the one-block shape of ``engine_kv_format``, so a client that decodes the geometry from it
    finds the registered one. An engine format the decoders do not know is shown as NHD (the
    stored chunk does not depend on it; ``layout.engine`` keeps the engine's own)."""
    geo = lay.geometry
    fmt = lay.engine.kv_cache_layout if lay.engine.kv_cache_layout in FORMAT_AXES else "NHD"
    return {
        "model_name": lay.model_name,
        "world_size": geo.world_size,
        "kv_cache_layout": {
            "num_layers": geo.num_layers,
            "dtype": geo.dtype,
            "tokens_per_block": lay.tokens_per_block,
            "engine_kv_format": fmt,
            "engine_kv_concrete_shape": concrete_shape(fmt, 1, lay.tokens_per_block, geo.num_kv_heads, geo.head_dim),
        },
        "layout": msgspec.to_builtins(lay),
    }


def hit_rate_doc(state: ServerState) -> dict[str, Any]:
    """Whole-chunk tokens asked for by lookups and retrieves, found, and the share found in each
    tier: a lower tier's are the chunks promoted from it into L1 (its ``hits``), L1's the rest."""
    hit = int(state.metrics.hit_tokens._value.get())
    asked = hit + int(state.metrics.miss_tokens._value.get())
    lower = {lane.name: lane.counters.hits * state.chunk_size for lane in state.manager.lanes}
    doc: dict[str, Any] = {"asked_tokens": asked, "hit_tokens": hit, "all": round(hit / asked, 4) if asked else 0.0}
    doc["l1"] = round(max(0, hit - sum(lower.values())) / asked, 4) if asked else 0.0
    doc.update({name: round(n / asked, 4) if asked else 0.0 for name, n in lower.items()})
    return doc


def tiers_doc(state: ServerState) -> dict[str, Any]:
    lanes = state.manager.lanes
    doc: dict[str, Any] = {
        lane.name: {
            **lane.tier.status(),
            **dataclasses.asdict(lane.counters),
            "backlog_bytes": lane.backlog_bytes,
            "writes_cancelled": lane.writes_cancelled,  # queued write-downs an overwrite made moot
        }
        for lane in lanes
    }
    doc["writeback_backlog_bytes"] = sum(lane.backlog_bytes for lane in lanes)
    return doc


def _bearer(request: web.Request) -> str:
    header = request.headers.get("Authorization", "")
    return header.removeprefix("Bearer ") if header.startswith("Bearer ") else ""


def _scope(request: web.Request) -> Tenant | None:
    """Whose view a read gets: None for everything (no tenants, or the admin token), else the
    tenant whose token came; 401 without one."""
    state = request.app[STATE]
    if state.tenants is None:
        return None
    token = _bearer(request)
    if token and state.registry.is_admin(token):
        return None
    tenant = state.tenants.by_token(token)
    if tenant is None:
        raise web.HTTPUnauthorized(
            text="this server has tenants: /config and /status need a tenant's token or the admin token "
            "(Authorization: Bearer <token>); /healthz and /metrics need none"
        )
    return tenant


async def _config(request: web.Request) -> web.Response:
    tenant = _scope(request)
    doc = config_doc(request.app[STATE], request.app[CONFIG])
    if tenant is not None:  # tenants do not map the shared pool
        doc["transports"] = ["inline"]
        doc["l1"] = {"shm_enabled": False, "shm_name": None, "size_bytes": doc["l1"]["size_bytes"]}
    return web.json_response(doc)


async def _status(request: web.Request) -> web.Response:
    tenant = _scope(request)
    state = request.app[STATE]
    doc = status_doc(state, request.app[STARTED])
    if tenant is not None:  # its models only, and no counts of what others hold
        visible = set(state.registry.visible(tenant))
        doc = {k: doc[k] for k in ("health", "server_version", "uptime_s")} | {
            "tenant": tenant.name,
            "usage": tenant_usage(state, tenant),
            "cache_context_meta": [e for e in doc["cache_context_meta"] if e["model_name"] in visible],
        }
    elif state.tenants is not None:
        doc["tenants"] = {t.name: tenant_usage(state, t) for t in state.tenants.all.values()}
    return web.json_response(doc)


def tenant_usage(state: ServerState, tenant: Tenant) -> dict[str, dict[str, int]]:
    """Per tier with quotas: the bytes ``tenant`` holds there and its quota (L1: its region of the
    pool; L3: what this server wrote for it)."""
    usage = {}
    pool = state.manager.l1.allocator
    if isinstance(pool, Partitions) and tenant.name in pool.regions:
        usage["l1"] = {"used_bytes": pool.regions[tenant.name].used_bytes, "quota_bytes": tenant.quota("l1")}
    for lane in state.manager.lanes:
        shares = getattr(lane.tier, "shares", None)
        if shares is not None and tenant.quota(lane.name):
            usage[lane.name] = {"used_bytes": shares.used.get(tenant.name, 0), "quota_bytes": tenant.quota(lane.name)}
    return usage


async def _healthz(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def _metrics(request: web.Request) -> web.Response:
    """Open to all (no token needed): the server-wide metrics; with tenants, the per-tenant series
    of every tenant for the admin token, of its own tenant for a tenant's token, none otherwise."""
    state = request.app[STATE]
    refresh_gauges(state)
    tenants: list[str] = []
    if state.tenants is not None:
        token = _bearer(request)
        if token and state.registry.is_admin(token):
            tenants = list(state.tenants.all)
        elif token and (tenant := state.tenants.by_token(token)) is not None:
            tenants = [tenant.name]
    return web.Response(body=state.metrics.render(tenants), content_type="text/plain", charset="utf-8")


def _authorize(request: web.Request) -> None:
    token = request.app[CONFIG].admin_token
    if not token:
        if request.app[STATE].tenants is not None:
            raise web.HTTPForbidden(text="admin actions on a server with tenants need its --admin-token (it has none)")
        return
    given = _bearer(request)
    if not given or not hmac.compare_digest(given.encode(), token.encode()):
        raise web.HTTPUnauthorized(text="admin token required (Authorization: Bearer <token>)")


async def _clear(request: web.Request) -> web.Response:
    _authorize(request)
    state = request.app[STATE]
    tier = request.query.get("tier", "all")
    if tier not in ("all", "l1", "l2"):
        raise web.HTTPBadRequest(text=f"tier must be all, l1 or l2, got {tier!r}")
    removed = await state.manager.clear(tier)
    return web.json_response({"removed": removed.get("l1", 0), "removed_l2": removed.get("l2", 0)})


class _RequestLogger(logging.Logger):
    """aiohttp's per-request logger (a child of ``aiohttp.server``, same handlers and level): a
    request that cannot be parsed, or whose client hung up, is logged as one short WARNING line
    instead of a traceback; any other error keeps its traceback."""

    def __init__(self, parent: logging.Logger) -> None:
        super().__init__(parent.name)
        self.parent = parent

    def exception(self, msg: object, *args: object, exc_info: Any = True, **kwargs: Any) -> None:
        if isinstance(exc_info, HttpProcessingError):
            text = str(msg) % args if args else str(msg)
            detail = " ".join(str(exc_info.message).split())
            if len(detail) > 120:
                detail = detail[:117] + "..."
            self.warning("%s: %d %s", text, exc_info.code, detail)
            return
        if isinstance(exc_info, ConnectionError):  # the client hung up mid-request: one line
            text = str(msg) % args if args else str(msg)
            self.warning("%s: the client went away (%s)", text, type(exc_info).__name__)
            return
        super().exception(msg, *args, exc_info=exc_info, **kwargs)


def request_logger() -> logging.Logger:
    """The ``logger`` to give aiohttp's AppRunner (see _RequestLogger)."""
    return _RequestLogger(logging.getLogger("aiohttp.server"))


def make_app(state: ServerState, config: ServerConfig) -> web.Application:
    app = web.Application()
    app[STATE] = state
    app[CONFIG] = config
    app[STARTED] = time.monotonic()
    tenants = state.tenants
    if tenants is not None:  # the per-tenant view of /status, at every scrape of /metrics too
        state.metrics.watch_tenants(lambda: {t.name: tenant_usage(state, t) for t in tenants.all.values()})
    app.router.add_get("/config", _config)
    app.router.add_get("/status", _status)
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/metrics", _metrics)
    app.router.add_post("/admin/clear", _clear)
    return app

"""Handlers of the registration and client ops, and the request helpers every handler uses.

Each handler takes the state, the decoded request and its payload frames, and returns a
:class:`~kvdock.server.state.Reply` (or an awaitable of one, for ops that wait). Raising
RequestError (or SessionError / RegistrationError) turns into an Error reply."""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Iterable

from kvdock import __version__
from kvdock import keys as keymod
from kvdock.errors import RequestError
from kvdock.protocol import messages as m
from kvdock.protocol.codes import ErrorCode
from kvdock.protocol.limits import MAX_RENEW, MAX_SALT_LEN
from kvdock.server import access, fleet
from kvdock.server.registry import ClientEntry, ModelEntry
from kvdock.server.state import Outcome, Payload, Reply, ServerState
from kvdock.server.tenants import Tenant
from kvdock.shm.processes import process_visible
from kvdock.shm.segment import PoolSegment


def client_of(state: ServerState, client_id: str) -> ClientEntry:
    """The client a request names, its lease renewed; UNKNOWN_CLIENT if it is not registered."""
    client = state.registry.touch(client_id)
    if client is None:
        raise access.unknown_client(client_id)
    return client


def check_request(state: ServerState, tokens: bytes, salt: str) -> None:
    """LIMIT past max_request_tokens or the salt limit, and an error for token bytes that are not
    whole uint32s: what must hold before any hashing."""
    cap = state.registry.max_request_tokens
    count = len(tokens) // keymod.TOKEN_DTYPE.itemsize
    if count > cap:
        raise RequestError(
            f"request of {count} tokens is over the server's limit of {cap} tokens "
            f"(max_request_tokens; raise it with --max-request-tokens)",
            ErrorCode.LIMIT,
        )
    if len(salt) > MAX_SALT_LEN:
        raise RequestError(f"cache_salt of {len(salt)} characters is over the limit of {MAX_SALT_LEN}", ErrorCode.LIMIT)
    try:
        keymod.tokens_from_bytes(tokens)  # a view: no copy
    except ValueError as e:
        raise RequestError(str(e)) from None


def keys_of(state: ServerState, client: ClientEntry, tokens: bytes, salt: str) -> list[keymod.ObjectKey]:
    """The chunk keys of a request's tokens, checked first (check_request)."""
    check_request(state, tokens, salt)
    return hashed_keys(state, client, tokens, salt)


def hashed_keys(state: ServerState, client: ClientEntry, tokens: bytes, salt: str) -> list[keymod.ObjectKey]:
    """The chunk keys of tokens that passed check_request already, in the client's shard: an
    object's key names the shard it holds, never the rank that wrote it."""
    return shard_keys(state, client, tokens, salt, [client.shard])[0]


def shard_keys(
    state: ServerState, client: ClientEntry, tokens: bytes, salt: str, shards: Iterable[int]
) -> list[list[keymod.ObjectKey]]:
    """:func:`hashed_keys` in each of ``shards`` (the tokens hashed once)."""
    hashes = keymod.chunk_hashes(keymod.tokens_from_bytes(tokens), state.chunk_size)
    model = client.model.layout.model_name
    return [[keymod.ObjectKey(model, s, salt, h) for h in hashes] for s in shards]


def ping(state: ServerState, req: m.Ping, payload: Payload) -> Reply:
    return Reply(m.Pong(m.PROTOCOL_VERSION, __version__))


def _check_version(version: int) -> None:
    if version != m.PROTOCOL_VERSION:
        raise RequestError(
            f"client speaks protocol {version}, server speaks {m.PROTOCOL_VERSION}", ErrorCode.PROTOCOL_VERSION
        )


def register_model(state: ServerState, req: m.RegisterModel, payload: Payload, key: bytes = b"") -> Outcome:
    """With tenants: the admin token, or a tenant that may use the model, may register it."""
    _check_version(req.protocol_version)
    authorized = False
    if state.tenants is not None and not state.registry.is_admin(req.admin_token):
        access.check_registrant(state, access.tenant_of(state, key, req.token), req.layout.model_name)
        authorized = True
    if not authorized:
        state.registry.authorize(req.admin_token)
    if fleet.l3_lane(state) is not None:  # the servers sharing the L3 agree on the model first
        return _registered(fleet.register_model(state, req.layout))
    entry, created = state.registry.register_model(req.layout, authorized=True)
    return Reply(m.ModelRegistered(created, entry.slot_nbytes))


async def _registered(pending: Awaitable[tuple[ModelEntry, bool]]) -> Reply:
    entry, created = await pending
    return Reply(m.ModelRegistered(created, entry.slot_nbytes))


def pool_for(state: ServerState, tenant: Tenant | None) -> PoolSegment | None:
    """The segment a client of ``tenant`` may map (None: the inline transport only): without
    tenants, the one pool; with them, the tenant's own pool when it has an L1 quota (the shared
    rest holds other tenants' objects: nobody maps it)."""
    return state.pool.segment_of(tenant.name if tenant is not None else None)


def describe(state: ServerState, req: m.Describe, payload: Payload, key: bytes = b"") -> Reply:
    _check_version(req.protocol_version)
    tenant = access.tenant_of(state, key, req.token)
    visible = state.registry.visible(tenant)
    entry = state.registry.models.get(req.model_name) if req.model_name in visible else None
    segment = pool_for(state, tenant)
    ticket = ""
    # a ticket is for the process named, one this server sees (shared memory is only for those:
    # storage.sessions); the door checks who knocks
    if (
        segment is not None
        and state.door is not None
        and tenant is not None
        and process_visible(req.pid, req.pid_start)
    ):
        ticket = state.tickets.issue(tenant.name, req.pid, req.pid_start)
    return Reply(
        m.Described(
            state.chunk_size,
            state.registry.max_request_tokens,
            state.manager.sessions.ttl,
            segment.name if segment is not None else "",
            entry.layout if entry is not None else None,
            sorted(visible),
            state.door.url if ticket and state.door is not None else "",
            ticket,
        )
    )


def register_client(state: ServerState, req: m.RegisterClient, payload: Payload, key: bytes = b"") -> Reply:
    _check_version(req.protocol_version)
    tenant = access.tenant_of(state, key, req.token)
    segment = pool_for(state, tenant)
    # Shared memory only for a process this server can see (same PID namespace): a client that
    # writes slots itself must be one whose death the server can detect (see storage.sessions).
    use_shm = (
        segment is not None
        and bool(req.shm_proof)
        and secrets.compare_digest(req.shm_proof.encode(), segment.nonce.encode())
        and process_visible(req.pid, req.pid_start)
    )
    client = state.registry.register_client(
        req.instance_id, req.model_name, req.kv_rank, "shm" if use_shm else "inline", key=key, tenant=tenant
    )
    client.pid, client.pid_start = req.pid, req.pid_start
    local = state.local_url if use_shm else ""
    return Reply(
        m.ClientRegistered(
            client.client_id, client.transport, state.chunk_size, client.model.slot_nbytes, local, client.model.geometry
        )
    )


def count_hits(state: ServerState, hit_chunks: int, asked_chunks: int) -> None:
    state.metrics.hit_tokens.inc(hit_chunks * state.chunk_size)
    state.metrics.miss_tokens.inc((asked_chunks - hit_chunks) * state.chunk_size)


def close_client(state: ServerState, req: m.CloseClient, payload: Payload) -> Reply:
    client = client_of(state, req.client_id)
    state.manager.sessions.end_client(client.client_id, quarantine=not req.idle)
    del state.registry.clients[client.client_id]
    return Reply(m.Done())


def check_integrity(state: ServerState, req: m.CheckIntegrity, payload: Payload) -> Reply:
    if state.tenants is not None and not state.registry.is_admin(req.admin_token):
        raise RequestError("checking a server with tenants needs its admin token", ErrorCode.UNAUTHORIZED)
    try:
        state.manager.check_integrity()
        state.pool.check_integrity()
        state.tickets.check_integrity()
        if state.door is not None:
            state.door.check_integrity()
    except AssertionError as e:
        return Reply(m.IntegrityReport(False, [str(e) or "assertion failed"]))
    return Reply(m.IntegrityReport(True, []))


def refresh_gauges(state: ServerState) -> None:
    alloc = state.manager.l1.allocator
    state.metrics.l1_used.set(alloc.used_bytes)
    state.metrics.l1_capacity.set(alloc.capacity)
    state.metrics.l1_objects.set(len(state.manager.l1))
    state.metrics.sessions.set(state.manager.session_count)


def renew_sessions(state: ServerState, req: m.RenewSessions, payload: Payload) -> Reply:
    client = client_of(state, req.client_id)
    if len(req.session_ids) > MAX_RENEW:
        count = len(req.session_ids)
        raise RequestError(f"at most {MAX_RENEW} sessions per RenewSessions, got {count}", ErrorCode.LIMIT)
    sessions = state.manager.sessions
    gone = []
    for sid in req.session_ids:
        if sessions.has(client.client_id, sid):
            sessions.get(client.client_id, sid)  # renews its lease
        else:
            gone.append(sid)
    return Reply(m.Renewed(gone))

"""Handlers of the registration and store ops, and the server state they share. Each takes the
state, the decoded request and its payload frames, and returns the reply and its payload frames.
Raising RequestError (or SessionError / RegistrationError) turns into an Error reply."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvdock import __version__
from kvdock import keys as keymod
from kvdock.errors import RequestError
from kvdock.protocol import messages as m
from kvdock.protocol.codes import ErrorCode
from kvdock.server.metrics import Metrics
from kvdock.server.registry import ClientEntry, Registry
from kvdock.shm import PoolSegment
from kvdock.storage import StorageManager
from kvdock.storage.tiers import Tiers

Payload = list[memoryview]


@dataclass
class ServerState:
    chunk_size: int
    segment: PoolSegment
    shm_enabled: bool
    manager: StorageManager
    registry: Registry
    tiers: Tiers
    metrics: Metrics = field(default_factory=Metrics)


Result = tuple[Any, list[Any]]


class HeldPayload(list[memoryview]):
    """Payload frames that are views of slots: the sender must call ``release`` once zmq is done
    with them (the slots are pinned until then, whatever happens to the session)."""

    def __init__(self, views: list[memoryview], release: Callable[[], None]) -> None:
        super().__init__(views)
        self.release = release


def client_of(state: ServerState, client_id: str) -> ClientEntry:
    client = state.registry.clients.get(client_id)
    if client is None:
        msg = f"client {client_id!r} is not registered (call RegisterClient first)"
        raise RequestError(msg, ErrorCode.UNKNOWN_CLIENT)
    return client


def keys_of(state: ServerState, client: ClientEntry, tokens: bytes, salt: str) -> list[keymod.ObjectKey]:
    try:
        arr = keymod.tokens_from_bytes(tokens)
    except ValueError as e:
        raise RequestError(str(e)) from None
    model = client.model.layout.model_name
    return [keymod.ObjectKey(model, client.kv_rank, salt, h) for h in keymod.chunk_hashes(arr, state.chunk_size)]


def ping(state: ServerState, req: m.Ping, payload: Payload) -> Result:
    return m.Pong(m.PROTOCOL_VERSION, __version__), []


def _check_version(version: int) -> None:
    if version != m.PROTOCOL_VERSION:
        raise RequestError(
            f"client speaks protocol {version}, server speaks {m.PROTOCOL_VERSION}", ErrorCode.PROTOCOL_VERSION
        )


def register_model(state: ServerState, req: m.RegisterModel, payload: Payload) -> Result:
    _check_version(req.protocol_version)
    entry, created = state.registry.register_model(req.layout)
    return m.ModelRegistered(created, entry.slot_nbytes), []


def register_client(state: ServerState, req: m.RegisterClient, payload: Payload) -> Result:
    _check_version(req.protocol_version)
    use_shm = state.shm_enabled and req.shm_proof == state.segment.nonce
    client = state.registry.register_client(
        req.instance_id, req.model_name, req.kv_rank, "shm" if use_shm else "inline"
    )
    return m.ClientRegistered(client.client_id, client.transport, state.chunk_size, client.model.slot_nbytes), []


def count_hits(state: ServerState, hit_chunks: int, asked_chunks: int) -> None:
    state.metrics.hit_tokens.inc(hit_chunks * state.chunk_size)
    state.metrics.miss_tokens.inc((asked_chunks - hit_chunks) * state.chunk_size)


def prepare_store(state: ServerState, req: m.PrepareStore, payload: Payload) -> Result:
    client = client_of(state, req.client_id)
    keys = keys_of(state, client, req.tokens, req.cache_salt)
    plan = state.manager.prepare_store(client.client_id, req.session_id, keys, client.model.slot_nbytes, req.overwrite)
    state.metrics.deduped_chunks.inc(plan.deduped)
    state.metrics.pool_full_chunks.inc(plan.pool_full)
    slots = [m.SlotRef(i, obj.offset) for i, obj in plan.slots]
    return m.StorePrepared(slots, plan.deduped, plan.pool_full), []


def commit_store(state: ServerState, req: m.CommitStore, payload: Payload) -> Result:
    client = client_of(state, req.client_id)
    if client.transport == "inline":
        _write_inline(state, client, req, payload)
    elif payload:
        raise RequestError("shared-memory clients send no payload frames")
    n = state.manager.commit_store(client.client_id, req.session_id, req.chunks)
    state.metrics.stores.inc()
    state.metrics.stored_chunks.inc(n)
    state.metrics.stored_bytes.inc(n * client.model.slot_nbytes)
    return m.StoreCommitted(n), []


def _write_inline(state: ServerState, client: ClientEntry, req: m.CommitStore, payload: Payload) -> None:
    objs = state.manager.reservations(client.client_id, req.session_id, req.chunks)
    nbytes = client.model.slot_nbytes
    bad = len(payload) != len(objs) or any(len(p) != nbytes for p in payload)
    if bad:
        state.manager.end_session(client.client_id, req.session_id)  # abort: nothing half-written stays
        sizes = sorted({len(p) for p in payload})
        raise RequestError(
            f"expected {len(objs)} frames of {nbytes} bytes, got {len(payload)} of sizes {sizes}", ErrorCode.BAD_PAYLOAD
        )
    buf = state.segment.buf
    for obj, frame in zip(objs, payload, strict=False):
        buf[obj.offset : obj.offset + nbytes] = frame


def end_session(state: ServerState, req: m.EndSession, payload: Payload) -> Result:
    state.manager.end_session(client_of(state, req.client_id).client_id, req.session_id)
    return m.Done(), []


def close_client(state: ServerState, req: m.CloseClient, payload: Payload) -> Result:
    client = client_of(state, req.client_id)
    state.manager.end_client(client.client_id)
    del state.registry.clients[client.client_id]
    return m.Done(), []


def check_integrity(state: ServerState, req: m.CheckIntegrity, payload: Payload) -> Result:
    try:
        state.tiers.check_integrity()
    except AssertionError as e:
        return m.IntegrityReport(False, [str(e) or "assertion failed"]), []
    return m.IntegrityReport(True, []), []


def refresh_gauges(state: ServerState) -> None:
    alloc = state.manager.l1.allocator
    state.metrics.l1_used.set(alloc.used_bytes)
    state.metrics.l1_capacity.set(alloc.capacity)
    state.metrics.l1_objects.set(len(state.manager.l1))
    state.metrics.sessions.set(state.manager.session_count)

"""Handlers of the store ops: PrepareStore, CommitStore, EndSession.

Shared-memory clients write their reserved slots themselves between the two; inline clients send
the bytes with CommitStore, and a copier thread writes them into the slots (off the event loop,
while the session is busy so its lease cannot run out under the copy). An overwrite's commit
waits for the lower tiers to delete the older versions (see :mod:`kvdock.storage.manager`)."""

from __future__ import annotations

import numpy as np

from kvdock.errors import RequestError, SessionError
from kvdock.keys import ObjectKey
from kvdock.memcpy import Copier
from kvdock.protocol import messages as m
from kvdock.protocol.codes import ErrorCode
from kvdock.server.handlers import client_of, keys_of
from kvdock.server.registry import ClientEntry
from kvdock.server.state import Outcome, Payload, Reply, ServerState
from kvdock.storage import L1Object, Writer
from kvdock.storage.tier import Head


def prepare_store(state: ServerState, req: m.PrepareStore, payload: Payload) -> Outcome:
    client = client_of(state, req.client_id)
    keys = keys_of(state, client, req.tokens, req.cache_salt)
    shards = client.model.geometry.shards
    if req.overwrite and shards > 1:  # (a whole-model client's requests go to server.shards)
        raise RequestError(
            f"an overwrite of one rank's shard of {client.model.layout.model_name!r}, stored in {shards} shards, "
            "would leave the other shards' older version beside it (a chunk of two versions): overwrite the whole "
            "model (a context connected without kv_rank)"
        )
    mgr = state.manager
    if not req.overwrite and mgr.has_unindexed_tier and mgr.lookup_l1(keys) < len(keys):
        return _prepare_after_heads(state, client, req, keys)  # dedup against L3 too
    return _prepare(state, client, req, keys, None)


async def _prepare_after_heads(
    state: ServerState, client: ClientEntry, req: m.PrepareStore, keys: list[ObjectKey]
) -> Reply:
    start = state.manager.lookup_l1(keys)
    below = await state.manager.unindexed_heads(keys[start:])
    return _prepare(state, client, req, keys, below)


def _prepare(
    state: ServerState,
    client: ClientEntry,
    req: m.PrepareStore,
    keys: list[ObjectKey],
    below: dict[ObjectKey, Head] | None,
) -> Reply:
    writer = Writer(client.pid, client.pid_start) if client.transport == "shm" else None
    plan = state.manager.prepare_store(
        client.client_id, req.session_id, keys, client.model.slot_nbytes, req.overwrite, writer, below
    )
    state.metrics.deduped_chunks.inc(plan.deduped)
    state.metrics.pool_full_chunks.inc(plan.pool_full)
    alloc = state.manager.l1.allocator
    slots = [m.SlotRef(i, obj.offset, alloc.generation(obj.offset)) for i, obj in plan.slots]
    return Reply(m.StorePrepared(slots, plan.deduped, plan.pool_full, plan.in_flight))


def commit_store(state: ServerState, req: m.CommitStore, payload: Payload) -> Outcome:
    client = client_of(state, req.client_id)
    objs = state.manager.reservations(client.client_id, req.session_id, req.chunks)
    if client.transport == "shm" and payload:
        raise RequestError("shared-memory clients send no payload frames")
    if client.transport == "inline":
        _check_frames(state, client, req, objs, payload)
    session = state.manager.sessions.get(client.client_id, req.session_id)
    if session.committing:  # a second CommitStore would copy into slots the first may free
        raise SessionError(f"session {req.session_id!r} is already being committed")
    session.committing = True
    if client.transport == "inline" or session.deletes:
        return _commit_later(state, client, req, objs, payload)
    return _commit(state, client, req, True)


def _check_frames(
    state: ServerState, client: ClientEntry, req: m.CommitStore, objs: list[L1Object], payload: Payload
) -> None:
    nbytes = client.model.slot_nbytes
    if len(payload) != len(objs) or any(len(p) != nbytes for p in payload):
        state.manager.end_session(client.client_id, req.session_id)  # abort: nothing half-written stays
        sizes = sorted({len(p) for p in payload})
        raise RequestError(
            f"expected {len(objs)} frames of {nbytes} bytes, got {len(payload)} of sizes {sizes}", ErrorCode.BAD_PAYLOAD
        )


async def _commit_later(
    state: ServerState, client: ClientEntry, req: m.CommitStore, objs: list[L1Object], payload: Payload
) -> Reply:
    mgr = state.manager
    if payload:
        session = mgr.sessions.get(client.client_id, req.session_id)
        mgr.hold(session)
        try:
            views = [mgr.l1.view(o) for o in objs]
            await state.copy(copy_frames, views, payload)
        finally:
            mgr.unhold(session)
    ok = await mgr.wait_deletes(client.client_id, req.session_id)
    return _commit(state, client, req, ok)


def copy_frames(views: list[memoryview], frames: Payload) -> None:
    copier = Copier()
    for view, frame in zip(views, frames, strict=True):
        copier.add(np.frombuffer(view, np.uint8), np.frombuffer(frame, np.uint8))
    copier.run()  # without the GIL


def _commit(state: ServerState, client: ClientEntry, req: m.CommitStore, deletes_ok: bool) -> Reply:
    n = state.manager.commit_store(client.client_id, req.session_id, req.chunks, deletes_ok)
    state.metrics.stores.inc()
    state.metrics.stored_chunks.inc(n)
    state.metrics.stored_bytes.inc(n * client.model.slot_nbytes)
    return Reply(m.StoreCommitted(n))


def end_session(state: ServerState, req: m.EndSession, payload: Payload) -> Reply:
    # Before client_of: a client forgotten meanwhile still ends its copy here, which is what
    # releases slots quarantined for it (of every shard of a whole-model client's request too).
    state.manager.end_session(req.client_id, req.session_id)
    state.manager.sessions.release_quarantined_group(req.client_id, req.session_id)
    client_of(state, req.client_id)
    return Reply(m.Done())

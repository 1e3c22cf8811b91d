"""Handlers of the store ops: PrepareStore, CommitStore, EndSession, for a request over any number
of shards (:mod:`kvdock.server.shards`; one shard is the common case).

Shared-memory clients write their reserved slots themselves between the two; inline clients send
the bytes with CommitStore, and a copier thread writes them into the slots (off the event loop,
while the sessions are busy so their leases cannot run out under the copy). An overwrite's commit
waits for the lower tiers to delete the older versions (see :mod:`kvdock.storage.manager`).

A request of several shards has a session per shard (even one that reserved nothing: its
deletions of older versions are still waited for) and commits all of them in one step, or none:
any refusal of its CommitStore ends every shard's session. A request of one shard keeps its
session when its CommitStore is refused for the chunks it names (the client may send a correct
one), but not for its payload."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvdock.errors import RequestError, SessionError
from kvdock.keys import ObjectKey
from kvdock.memcpy import Copier
from kvdock.protocol import messages as m
from kvdock.protocol.codes import ErrorCode
from kvdock.server.handlers import client_of
from kvdock.server.registry import ClientEntry
from kvdock.server.shards import Interleave, check_free, end_all, request_keys, session_ids, shards_of
from kvdock.server.state import Outcome, Payload, Reply, ServerState
from kvdock.storage import L1Object, Writer, writeback
from kvdock.storage.plans import write_limit
from kvdock.storage.tier import Head


def prepare_store(state: ServerState, req: m.PrepareStore, payload: Payload) -> Outcome:
    client = client_of(state, req.client_id)
    keysets = request_keys(state, client, req.tokens, req.cache_salt, req.session_id)
    shards = client.model.geometry.shards
    if req.overwrite and len(keysets) < shards:
        raise RequestError(
            f"an overwrite of one rank's shard of {client.model.layout.model_name!r}, stored in {shards} shards, "
            "would leave the other shards' older version beside it (a chunk of two versions): overwrite the whole "
            "model (a context connected without kv_rank)"
        )
    if req.over is not None and len(req.over) != len(keysets):
        raise RequestError(f"a store of {len(keysets)} shard(s) names {len(req.over)} over versions (one per shard)")
    mgr = state.manager
    check_free(state, client, session_ids(req.session_id, len(keysets)))
    if req.overwrite and any(mgr.contended(keys) for keys in keysets):
        # another client writes some shard's chunks: overwriting the others would leave a chunk
        # whose shards are of two versions (so the whole prefix of every shard is in flight)
        return Reply(m.StorePrepared([], 0, 0, len(keysets[0]) * len(keysets)))
    heads = not req.overwrite and mgr.has_unindexed_tier and any(mgr.lookup_l1(k) < len(k) for k in keysets)
    if heads or writeback.needs_wait(mgr, keysets, client.model.slot_nbytes, req.overwrite):
        return _prepare_later(state, client, req, keysets, heads)  # heads: dedup against L3 too
    return _prepare(state, client, req, keysets, [None] * len(keysets))


async def _prepare_later(
    state: ServerState, client: ClientEntry, req: m.PrepareStore, keysets: list[list[ObjectKey]], heads: bool
) -> Reply:
    """PrepareStore past what takes a while: first, with ``heads``, the unindexed tier's heads of
    the chunks L1 lacks (a plain store dedups against L3 too); then, if the store needs dirty
    objects' room, a bounded wait for write-downs to free clean room (storage.writeback:
    back-pressure). After each, the request's session ids are checked free again (the client may
    have opened one meanwhile)."""
    mgr = state.manager
    sids = session_ids(req.session_id, len(keysets))
    below: list[dict[ObjectKey, Head] | None] = [None] * len(keysets)
    pending: set[ObjectKey] = set()
    if heads:
        lacking = [keys[mgr.lookup_l1(keys) :] for keys in keysets]
        found = [await mgr.unindexed_heads(keys) for keys in lacking]
        below = list(found)
        if mgr.coherence is not None:  # (an overwrite elsewhere not in L3 yet: storage.redis.floored)
            for keys, held in zip(lacking, found, strict=True):
                absent = [k for k in keys if k not in held]
                pending |= await mgr.chains.pending_overwrites(absent, client.model.geometry.shards)
        check_free(state, client, sids)
    if writeback.needs_wait(mgr, keysets, client.model.slot_nbytes, req.overwrite):
        await writeback.wait_for_room(mgr, keysets, client.model.slot_nbytes, req.overwrite)
        check_free(state, client, sids)
    return _prepare(state, client, req, keysets, below, pending)


def _prepare(
    state: ServerState,
    client: ClientEntry,
    req: m.PrepareStore,
    keysets: list[list[ObjectKey]],
    below: Sequence[dict[ObjectKey, Head] | None],
    pending: set[ObjectKey] | None = None,
) -> Reply:
    """Every shard's PrepareStore, in this one step. Of several shards, every shard gets a session
    (one with no slots still holds its deletions of older versions, which the commit waits for),
    ended at once when no shard reserved anything (the client then does not commit)."""
    mgr = state.manager
    writer = Writer(client.pid, client.pid_start) if client.transport == "shm" else None
    shards = len(keysets)
    sids = session_ids(req.session_id, shards)
    # a plain store extends a run holding an edit only with KV computed over it (storage.plans)
    runs = [] if req.overwrite else [mgr.chains.store_run(k, h) for k, h in zip(keysets, below, strict=True)]
    limit = write_limit(runs, req.over, req.edited) if runs else None
    with mgr.l1.dirty_eviction():  # past any wait for write-downs (storage.writeback)
        # every shard at once: one deletion (one invalidation) of all their older versions; on an
        # error, no shard's session stays open
        plans = mgr.prepare_stores(
            client.client_id,
            list(zip(sids, keysets, below, strict=True)),
            client.model.slot_nbytes,
            req.overwrite,
            writer,
            shards > 1,
            limit,
            req.edited,
            pending,
        )
    if shards > 1 and not any(p.slots for p in plans):
        end_all(state, client, sids)
    gens = mgr.l1.allocator.generations
    refs = []
    for p in plans:
        offsets = [obj.offset for _, obj in p.slots]
        refs.append([m.SlotRef(i, off, gen) for (i, _), off, gen in zip(p.slots, offsets, gens(offsets), strict=True)])
    slots = Interleave(shards).merge(refs)
    deduped, pool_full = sum(p.deduped for p in plans), sum(p.pool_full for p in plans)
    state.metrics.deduped_chunks.inc(deduped)
    state.metrics.pool_full_chunks.inc(pool_full)
    in_flight, diverged = sum(p.in_flight for p in plans), sum(p.diverged for p in plans)
    return Reply(m.StorePrepared(slots, deduped, pool_full, in_flight, diverged))


def commit_store(state: ServerState, req: m.CommitStore, payload: Payload) -> Outcome:
    client = client_of(state, req.client_id)
    mgr = state.manager
    shards = len(shards_of(client))
    sids = session_ids(req.session_id, shards)
    if shards > 1:
        _check_group(state, client, sids, req.chunks)
    interleave = Interleave(shards)
    chunks = interleave.chunks(req.chunks)
    try:
        objs = [mgr.reservations(client.client_id, sid, c) for sid, c in zip(sids, chunks, strict=True)]
        if client.transport == "shm" and payload:
            raise RequestError("shared-memory clients send no payload frames")
        frames: list[list[memoryview]] = [[] for _ in sids]
        if client.transport == "inline":
            _check_frames(state, client, sids, req.chunks, payload)
            frames = interleave.route(req.chunks, payload)
        # a second CommitStore would copy into slots the first may free
        sessions = mgr.sessions.begin_commit(client.client_id, sids)
    except BaseException:
        _abort(state, client, sids)
        raise
    work = list(zip(sids, chunks, strict=True))
    if client.transport == "inline" or any(session.deletes for session in sessions):
        return _commit_later(state, client, work, [o for run in objs for o in run], [f for fs in frames for f in fs])
    return _commit(state, client, work, True)


def _abort(state: ServerState, client: ClientEntry, sids: list[str]) -> None:
    """After a refused (or finished) commit of several shards, end every shard's session: nothing
    half-written stays, and no shard commits without the others. One shard's session stays open
    (its client may send a correct CommitStore; a finished commit ended it already)."""
    if len(sids) > 1:
        end_all(state, client, sids)


def _check_group(state: ServerState, client: ClientEntry, sids: list[str], chunks: list[int]) -> None:
    """SessionError, every shard's session ended, unless all of a request's shard sessions are
    open (a commit of some shards only could leave a chunk of two versions) and its slots are
    distinct and in range."""
    sessions = state.manager.sessions
    if not all(sessions.has(client.client_id, sid) for sid in sids):
        expired = sum(sessions.release_quarantine(client.client_id, sid) for sid in sids)
        end_all(state, client, sids)
        if expired:
            raise SessionError(f"session {sids[0]!r}: its lease ran out before the commit; nothing was stored")
        raise SessionError(f"no open session {sids[0]!r} for every shard (never opened, ended, or its lease ran out)")
    if len(set(chunks)) != len(chunks) or any(c < 0 or c >= 2**62 for c in chunks):
        end_all(state, client, sids)
        raise SessionError(f"chunks {chunks[:8]} repeat or are out of range")


def _check_frames(
    state: ServerState, client: ClientEntry, sids: list[str], chunks: list[int], payload: Payload
) -> None:
    nbytes = client.model.slot_nbytes
    if len(payload) != len(chunks) or any(len(p) != nbytes for p in payload):
        end_all(state, client, sids)  # abort: nothing half-written stays
        sizes = sorted({len(p) for p in payload})
        raise RequestError(
            f"expected {len(chunks)} frames of {nbytes} bytes, got {len(payload)} of sizes {sizes}",
            ErrorCode.BAD_PAYLOAD,
        )


async def _commit_later(
    state: ServerState,
    client: ClientEntry,
    work: list[tuple[str, list[int]]],
    objs: list[L1Object],
    frames: list[memoryview],
) -> Reply:
    """The inline copies and every shard's deletions, with every shard's session held (none can
    expire while another's deletions are awaited: a commit of some shards only would leave two
    versions), then :func:`_commit`."""
    mgr = state.manager
    sids = [sid for sid, _ in work]
    sessions = [mgr.sessions.get(client.client_id, sid) for sid in sids]
    ok = True
    for session in sessions:
        mgr.sessions.hold(session)
    try:
        if frames:
            await state.copy(copy_frames, [mgr.l1.view(o) for o in objs], frames)
        for sid in sids:
            ok = await mgr.wait_deletes(client.client_id, sid) and ok
    except BaseException:
        _abort(state, client, sids)
        raise
    finally:
        for session in sessions:
            mgr.sessions.unhold(session)
    return _commit(state, client, work, ok)


def copy_frames(views: list[memoryview], frames: Payload) -> None:
    copier = Copier()
    for view, frame in zip(views, frames, strict=True):
        copier.add(np.frombuffer(view, np.uint8), np.frombuffer(frame, np.uint8))
    copier.run()  # without the GIL


def _commit(state: ServerState, client: ClientEntry, work: list[tuple[str, list[int]]], deletes_ok: bool) -> Reply:
    """Commit every shard's session in this one step, or none: every session must still be open
    (one ended meanwhile, by the client or its lease, refuses them all), and when a lower tier
    could not delete an older version the first refusal ends them all."""
    mgr = state.manager
    try:
        if deletes_ok and len(work) > 1:
            for sid, indexes in work:
                mgr.reservations(client.client_id, sid, indexes)  # SessionError for one gone
        n = mgr.commit_stores(client.client_id, work, deletes_ok)  # chunk-major across shards
    finally:
        _abort(state, client, [sid for sid, _ in work])
    state.metrics.stores.inc()
    state.metrics.stored_chunks.inc(n)
    state.metrics.stored_bytes.inc(n * client.model.slot_nbytes)
    return Reply(m.StoreCommitted(n))


def end_session(state: ServerState, req: m.EndSession, payload: Payload) -> Reply:
    # Before client_of: a client forgotten meanwhile still ends its copy here, which is what
    # releases slots quarantined for it (of every shard of a whole-model client's request too).
    client = state.registry.clients.get(req.client_id)
    for sid in session_ids(req.session_id, len(shards_of(client)) if client is not None else 1):
        state.manager.end_session(req.client_id, sid)
    state.manager.sessions.release_quarantined_group(req.client_id, req.session_id)
    client_of(state, req.client_id)
    return Reply(m.Done())

"""Requests of an all-rank client of a model stored in several shards (tensor parallelism).

Each rank of a tensor-parallel engine stores the KV heads it holds as the objects of its shard,
keyed ``(model, shard, salt, chunk)`` (:meth:`kvdock.layout.KVGeometry.shard_of`); a client
registered with ``kv_rank = ALL_RANKS`` (the SDK's whole-model view) sends each request once, and
the server runs it once per shard. The model's chunk ``i`` is cached when every shard holds it.
Slots are listed chunk-major: ``SlotRef.index = chunk * shards + shard``. Shard ``s``'s session
of a request with session id ``sid`` is ``sid`` for shard 0 and ``sid`` + ``"/s"`` for the others.

What keeps a reader from ever assembling two versions of a chunk (an overwrite replaces every
shard, and a reader must see all of them old or all new):

* a store prepares every shard in one step of the event loop and commits every shard in one step,
  after every shard's deletions of older versions are done (an overwrite refused for one shard,
  a lower tier that could not delete, is refused for all);
* an overwrite reserves nothing while another client writes any shard's chunks;
* a retrieve hands out the chunks whose objects every shard holds, each still current (not
  replaced since pinned) in the step that answers (:func:`retrieval.retrieve_later`, ``common``).

Ops that name one session per request and carry per-shard state the client would have to tell
apart (prefetch status, batches, inspection, view renewals) are refused for such clients: they
connect per rank (``kv_rank=r``) for those.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from kvdock.errors import RequestError, SessionError
from kvdock.keys import ObjectKey
from kvdock.protocol import messages as m
from kvdock.protocol.codes import ErrorCode
from kvdock.server import retrieval
from kvdock.server import storing as st
from kvdock.server.handlers import check_request, client_of, shard_keys
from kvdock.server.registry import ClientEntry
from kvdock.server.state import Outcome, Payload, Reply, ServerState
from kvdock.storage import L1Object, StorePlan, Writer
from kvdock.storage.tier import Head


def session_ids(session_id: str, shards: int) -> list[str]:
    """The sessions of one request's shards."""
    return [session_id] + [f"{session_id}/{s}" for s in range(1, shards)]


def _keysets(
    state: ServerState, client: ClientEntry, tokens: bytes, salt: str, session_id: str = ""
) -> list[list[ObjectKey]]:
    check_request(state, tokens, salt)
    if "/" in session_id:  # ("/" names the shards of a request's session)
        raise RequestError(f"a whole-model client's session ids must not contain '/': {session_id[:64]!r}")
    return shard_keys(state, client, tokens, salt, range(client.model.geometry.shards))


def lookup(state: ServerState, req: m.Lookup, payload: Payload) -> Outcome:
    client = client_of(state, req.client_id)
    if req.prefetch:
        raise RequestError(_refusal("a prefetching Lookup"))
    keysets = _keysets(state, client, req.tokens, req.cache_salt)
    state.metrics.lookups.inc()
    in_l1 = [state.manager.l1_hit(keys) for keys in keysets]
    return retrieval.count_all(state, in_l1, keysets, lambda runs: retrieval.lookup_result(state, runs), common=True)


def prepare_retrieve(state: ServerState, req: m.PrepareRetrieve, payload: Payload) -> Outcome:
    client = client_of(state, req.client_id)
    keysets = _keysets(state, client, req.tokens, req.cache_salt, req.session_id)
    cut = retrieval.cut_of(client, _stage_part(client, req.part))
    if state.fault_retrieve_miss:
        return Reply(m.RetrievePrepared([]))
    sids = session_ids(req.session_id, len(keysets))
    _check_free(state, client, sids)
    retrieval.check_tips(req.tips, len(keysets))
    sessions = retrieval.open_retrieves(state, client, sids, keysets)
    asked = [len(k) for k in keysets]
    pending = retrieval.retrieve_later(state, client, sessions, asked, req.wait_s, cut, common=True, tips=req.tips)
    return _interleaved(pending)


def _stage_part(client: ClientEntry, part: m.ReadPart | None) -> m.ReadPart | None:
    """``part`` (of the whole model's layers) as the part of each shard: the same layers, unless
    the model's pipeline stages split them, where only every layer (from a chunk on) is a part
    every shard has."""
    geo = client.model.geometry
    if part is None or geo.pp_size == 1:
        return part
    if (part.layer_start, part.layer_stop, part.layer_step) != (0, geo.num_layers * geo.pp_size, 1):
        raise RequestError(_refusal("a read of some layers of a model in pipeline stages"))
    return m.ReadPart(0, geo.num_layers, 1, part.first_chunk)


async def _interleaved(pending: Awaitable[retrieval.Prepared]) -> Reply:
    p = await pending
    shards = len(p.slots)
    slots = [
        m.SlotRef(i * shards + s, ref.offset, ref.gen)
        for i, row in enumerate(zip(*p.slots, strict=True))
        for s, ref in enumerate(row)
    ]
    return Reply(m.RetrievePrepared(slots), p.frames, pooled=True)


def commit_retrieve(state: ServerState, req: m.CommitRetrieve, payload: Payload) -> Reply:
    client = client_of(state, req.client_id)
    mgr, n, found = state.manager, 0, False
    for sid in session_ids(req.session_id, client.model.geometry.shards):
        if mgr.sessions.has(client.client_id, sid):
            n += mgr.commit_retrieve(client.client_id, sid)
            found = True
    if not found:  # the error of an unknown session, as for any client
        mgr.sessions.get(client.client_id, req.session_id)
    retrieval.count_retrieved(state, n * client.model.slot_nbytes)
    return Reply(m.Done())


def end_session(state: ServerState, req: m.EndSession, payload: Payload) -> Reply:
    client = state.registry.clients.get(req.client_id)
    shards = client.model.geometry.shards if client is not None else 1
    for sid in session_ids(req.session_id, shards):  # before client_of: see storing.end_session
        state.manager.end_session(req.client_id, sid)
    client_of(state, req.client_id)
    return Reply(m.Done())


# --- store ---------------------------------------------------------------------------------------


def prepare_store(state: ServerState, req: m.PrepareStore, payload: Payload) -> Outcome:
    client = client_of(state, req.client_id)
    keysets = _keysets(state, client, req.tokens, req.cache_salt, req.session_id)
    mgr = state.manager
    _check_free(state, client, session_ids(req.session_id, len(keysets)))
    if req.overwrite and any(mgr.contended(keys) for keys in keysets):
        # another client writes some shard's chunks: overwriting the others would leave a chunk
        # whose shards are of two versions
        return Reply(m.StorePrepared([], 0, 0, len(keysets[0]) * len(keysets)))
    if not req.overwrite and mgr.has_unindexed_tier and any(mgr.lookup_l1(k) < len(k) for k in keysets):
        return _prepare_after_heads(state, client, req, keysets)
    return _prepare(state, client, req, keysets, [None] * len(keysets))


async def _prepare_after_heads(
    state: ServerState, client: ClientEntry, req: m.PrepareStore, keysets: list[list[ObjectKey]]
) -> Reply:
    mgr = state.manager
    below = [await mgr.unindexed_heads(keys[mgr.lookup_l1(keys) :]) for keys in keysets]
    _check_free(state, client, session_ids(req.session_id, len(keysets)))  # (the heads took a while)
    return _prepare(state, client, req, keysets, below)


def _prepare(
    state: ServerState,
    client: ClientEntry,
    req: m.PrepareStore,
    keysets: list[list[ObjectKey]],
    below: Sequence[dict[ObjectKey, Head] | None],
) -> Reply:
    """Every shard's PrepareStore, in this one step. Every shard gets a session (one with no slots
    still holds its deletions of older versions, which the commit waits for), ended at once
    when no shard reserved anything (the client then does not commit)."""
    mgr = state.manager
    writer = Writer(client.pid, client.pid_start) if client.transport == "shm" else None
    shards = len(keysets)
    plans: list[StorePlan] = []
    sids = session_ids(req.session_id, shards)
    try:
        for sid, keys, heads in zip(sids, keysets, below, strict=True):
            plan = mgr.prepare_store(
                client.client_id, sid, keys, client.model.slot_nbytes, req.overwrite, writer, heads, open_empty=True
            )
            plans.append(plan)
    except BaseException:
        for sid in sids[: len(plans)]:
            mgr.end_session(client.client_id, sid)
        raise
    if not any(p.slots for p in plans):
        _end_all(state, client, sids)
    alloc = mgr.l1.allocator
    slots = sorted(
        (
            m.SlotRef(i * shards + s, obj.offset, alloc.generation(obj.offset))
            for s, p in enumerate(plans)
            for i, obj in p.slots
        ),
        key=lambda ref: ref.index,
    )
    deduped, pool_full = sum(p.deduped for p in plans), sum(p.pool_full for p in plans)
    state.metrics.deduped_chunks.inc(deduped)
    state.metrics.pool_full_chunks.inc(pool_full)
    return Reply(m.StorePrepared(slots, deduped, pool_full, sum(p.in_flight for p in plans)))


def commit_store(state: ServerState, req: m.CommitStore, payload: Payload) -> Outcome:
    client = client_of(state, req.client_id)
    mgr = state.manager
    shards = client.model.geometry.shards
    sids = session_ids(req.session_id, shards)
    _check_group(state, client, sids)
    if len(set(req.chunks)) != len(req.chunks) or any(c < 0 or c >= 2**62 for c in req.chunks):
        _end_all(state, client, sids)
        raise SessionError(f"chunks {req.chunks[:8]} repeat or are out of range")
    if client.transport == "shm" and payload:
        _end_all(state, client, sids)
        raise RequestError("shared-memory clients send no payload frames")
    per_shard: dict[int, list[int]] = {s: [] for s in range(shards)}
    frames: dict[int, list[Any]] = {s: [] for s in range(shards)}
    for at, c in enumerate(req.chunks):
        per_shard[c % shards].append(c // shards)
        if client.transport == "inline" and at < len(payload):
            frames[c % shards].append(payload[at])
    objs: dict[int, list[L1Object]] = {}
    try:
        for s in range(shards):
            objs[s] = mgr.reservations(client.client_id, sids[s], per_shard[s])
        nbytes = client.model.slot_nbytes
        if client.transport == "inline" and (len(payload) != len(req.chunks) or any(len(p) != nbytes for p in payload)):
            sizes = sorted({len(p) for p in payload})
            raise RequestError(
                f"expected {len(req.chunks)} frames of {client.model.slot_nbytes} bytes, got {len(payload)} of "
                f"sizes {sizes}",
                ErrorCode.BAD_PAYLOAD,
            )
        sessions = [mgr.sessions.get(client.client_id, sid) for sid in sids]
        if any(session.committing for session in sessions):
            raise SessionError(f"session {req.session_id!r} is already being committed")
    except BaseException:
        _end_all(state, client, sids)  # abort: nothing half-written stays
        raise
    for session in sessions:
        session.committing = True
    everyone = list(range(shards))
    if client.transport == "inline" or any(session.deletes for session in sessions):
        return _commit_later(state, client, req, everyone, sids, per_shard, objs, frames)
    return _commit(state, client, [(sids[s], per_shard[s]) for s in everyone], True)


def _check_group(state: ServerState, client: ClientEntry, sids: list[str]) -> None:
    """SessionError, every shard's session ended, unless all of a request's shard sessions are
    open: a commit of some shards only could leave a chunk of two versions."""
    sessions = state.manager.sessions
    if all(sessions.has(client.client_id, sid) for sid in sids):
        return
    expired = sum(sessions.release_quarantine(client.client_id, sid) for sid in sids)
    _end_all(state, client, sids)
    if expired:
        raise SessionError(f"session {sids[0]!r}: its lease ran out before the commit; nothing was stored")
    raise SessionError(f"no open session {sids[0]!r} for every shard (never opened, ended, or its lease ran out)")


async def _commit_later(
    state: ServerState,
    client: ClientEntry,
    req: m.CommitStore,
    open_: list[int],
    sids: list[str],
    per_shard: dict[int, list[int]],
    objs: dict[int, list[L1Object]],
    frames: dict[int, list[Any]],
) -> Reply:
    """The inline copies and every shard's deletions, with every shard's session held (none can
    expire while another's deletions are awaited: a commit of some shards only would leave two
    versions), then :func:`_commit`."""
    mgr = state.manager
    sessions = [mgr.sessions.get(client.client_id, sids[s]) for s in open_]
    ok = True
    for session in sessions:
        mgr.hold(session)
    try:
        if client.transport == "inline":
            views = [mgr.l1.view(o) for s in open_ for o in objs[s]]
            await state.copy(st.copy_frames, views, [f for s in open_ for f in frames[s]])
        for s in open_:
            ok = await mgr.wait_deletes(client.client_id, sids[s]) and ok
    except BaseException:
        _end_all(state, client, [sids[s] for s in open_])
        raise
    finally:
        for session in sessions:
            mgr.unhold(session)
    return _commit(state, client, [(sids[s], per_shard[s]) for s in open_], ok)


def _commit(state: ServerState, client: ClientEntry, work: list[tuple[str, list[int]]], deletes_ok: bool) -> Reply:
    """Commit every shard's session in this one step, or none: every session must still be open
    (one ended meanwhile, by the client or its lease, refuses them all), and when a lower tier
    could not delete an older version the first refusal ends them all."""
    mgr, n = state.manager, 0
    try:
        if deletes_ok:
            for sid, indexes in work:
                mgr.reservations(client.client_id, sid, indexes)  # SessionError for one gone
        for sid, indexes in work:
            n += mgr.commit_store(client.client_id, sid, indexes, deletes_ok)
    finally:
        _end_all(state, client, [sid for sid, _ in work])
    state.metrics.stores.inc()
    state.metrics.stored_chunks.inc(n)
    state.metrics.stored_bytes.inc(n * client.model.slot_nbytes)
    return Reply(m.StoreCommitted(n))


def _end_all(state: ServerState, client: ClientEntry, sids: list[str]) -> None:
    for sid in sids:
        state.manager.end_session(client.client_id, sid)


def _check_free(state: ServerState, client: ClientEntry, sids: list[str]) -> None:
    """SessionError when one of a request's shard sessions is in use (a client reusing ids)."""
    taken = [sid for sid in sids if state.manager.sessions.in_use(client.client_id, sid)]
    if taken:
        raise SessionError(f"session {taken[0]!r} is already open")


# --- refused -------------------------------------------------------------------------------------


def _refusal(what: str) -> str:
    return (
        f"{what} is not supported for a client of every rank of a model stored in several shards "
        "(tensor parallelism); connect with kv_rank=r for per-shard access"
    )


def refused(op: str) -> Callable[[ServerState, Any, Payload], Outcome]:
    def handler(state: ServerState, req: Any, payload: Payload) -> Outcome:
        client_of(state, req.client_id)
        raise RequestError(_refusal(op))

    return handler

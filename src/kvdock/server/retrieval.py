"""Handlers of the retrieve ops: PrepareRetrieve and CommitRetrieve, for a request over any number
of shards (:mod:`kvdock.server.shards`; one shard is the common case), and the retrieve parts
the batch ops share (:mod:`kvdock.server.batch`).

A retrieve session pins the leading run of the prefix that L1 holds; when the tiers hold more, a
prefetch job loads it into L1 (pinning each chunk for the session) and the reply waits for it,
on the server, so a client needs a single round trip. A Lookup with ``prefetch``
(:mod:`kvdock.server.lookups`) starts the same session early; PrepareRetrieve then reuses it.
Of several shards, each shard has its own session and the reply hands out, for every shard, the
chunks every shard holds, current in the step that replies (:func:`retrieve_later`).

Shared-memory clients copy the pinned slots themselves and release them with CommitRetrieve; each
slot comes with its generation, which the client checks after its copy. For inline clients a
copier thread copies the slots into a private buffer (the session holds the pins meanwhile), the
session ends at once, and the reply's frames are that buffer: a client that never reads its
socket holds no pool memory, only the unsent bytes, which are capped per client.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import dataclass

import numpy as np

from kvdock.errors import RequestError
from kvdock.keys import ObjectKey
from kvdock.memcpy import Copier
from kvdock.protocol import messages as m
from kvdock.protocol.codes import ErrorCode
from kvdock.server.handlers import client_of, count_hits
from kvdock.server.lookups import wait_prefetched
from kvdock.server.registry import ClientEntry
from kvdock.server.shards import Interleave, check_free, request_keys, session_ids, shards_of, stage_part
from kvdock.server.state import Outcome, Payload, Reply, ServerState
from kvdock.storage import L1Object, Session
from kvdock.storage.manager import PrefetchJob


@dataclass(frozen=True)
class Cut:
    """How a :class:`~kvdock.protocol.messages.ReadPart` cuts a slot: its bytes are ``planes *
    layers`` rows of ``row`` bytes (one per plane and layer); the part is rows ``[:, picked]`` of
    the chunks from ``first`` on."""

    planes: int
    layers: int
    row: int
    picked: slice
    first: int

    @property
    def nbytes(self) -> int:
        """Bytes of one chunk's part."""
        return self.planes * len(range(self.layers)[self.picked]) * self.row


def cut_of(client: ClientEntry, part: m.ReadPart | None) -> Cut:
    """The cut of ``client``'s slots that ``part`` asks for (whole chunks when None);
    RequestError for a part outside the model's layers."""
    geo = client.model.layout.geometry
    n = geo.num_layers
    row = client.model.slot_nbytes // (geo.planes * n)
    if part is None:
        return Cut(geo.planes, n, row, slice(0, n), 0)
    if not (0 <= part.layer_start < part.layer_stop <= n and part.layer_step >= 1 and part.first_chunk >= 0):
        raise RequestError(f"read part {part} is not within the model's {n} layers (or its first chunk is negative)")
    return Cut(geo.planes, n, row, slice(part.layer_start, part.layer_stop, part.layer_step), part.first_chunk)


def prepare_retrieve(state: ServerState, req: m.PrepareRetrieve, payload: Payload) -> Outcome:
    client = client_of(state, req.client_id)
    keysets = request_keys(state, client, req.tokens, req.cache_salt, req.session_id)
    cut = cut_of(client, stage_part(client, req.part))
    check_tips(req.tips, len(keysets))
    if state.fault_retrieve_miss:
        return Reply(m.RetrievePrepared([]))
    mgr = state.manager
    sids = session_ids(req.session_id, len(keysets))
    if len(sids) == 1 and mgr.sessions.has(client.client_id, sids[0]):  # opened by a prefetching Lookup
        sessions = [mgr.sessions.get(client.client_id, sids[0])]
        if sessions[0].keys != keysets[0]:
            raise RequestError(f"session {req.session_id!r} was opened for other tokens or cache_salt")
    else:
        check_free(state, client, sids)
        sessions = open_retrieves(state, client, sids, keysets)
    asked = [len(k) for k in keysets]
    if len(sessions) > 1 or loading(sessions) or client.transport == "inline":
        pending = retrieve_later(state, client, sessions, asked, req.wait_s, cut, len(sessions) > 1, req.tips)
        return _interleaved(pending)
    return Reply(m.RetrievePrepared(shm_slots(state, client, sessions[0], asked[0], req.tips)))


def check_tips(tips: list[int] | None, shards: int) -> None:
    if tips is not None and len(tips) != shards:
        raise RequestError(f"a retrieve of {shards} shard(s) names {len(tips)} tip versions (one per shard)")


def vouched(runs: list[list[L1Object]], asked: list[int], tips: list[int] | None) -> list[list[L1Object]]:
    """``runs`` when no tips were asked for, or when each run is every chunk asked for and ends
    with its tip (the version a lookup saw); else no run at all (a miss)."""
    if tips is None or all(
        n and len(run) == n and run[-1].version == tip for run, n, tip in zip(runs, asked, tips, strict=True)
    ):
        return runs
    return [[] for _ in runs]


async def _interleaved(pending: Awaitable[Prepared]) -> Reply:
    p = await pending
    return Reply(m.RetrievePrepared(Interleave(len(p.slots)).merge(p.slots)), p.frames, pooled=True)


def open_retrieves(
    state: ServerState, client: ClientEntry, session_ids: list[str], keysets: list[list[ObjectKey]]
) -> list[Session]:
    """One retrieve session per key list, each prefetching what lower tiers hold; all or none
    (those opened are ended if one cannot be)."""
    mgr = state.manager
    sessions: list[Session] = []
    try:
        for sid, keys in zip(session_ids, keysets, strict=True):
            sessions.append(mgr.open_retrieve(client.client_id, sid, keys))
            mgr.start_prefetch(sessions[-1])
    except BaseException:
        for s in sessions:
            mgr.end_session(client.client_id, s.session_id)
        raise
    return sessions


def loading(sessions: list[Session]) -> bool:
    """Whether a prefetch of any of ``sessions`` is still loading chunks into L1."""
    return any(isinstance(s.job, PrefetchJob) and not s.job.done.is_set() for s in sessions)


@dataclass(frozen=True)
class Prepared:
    """The answer to the retrieves of ``sessions`` (one reply): each one's slots, and for an
    inline client one pooled buffer holding every session's bytes (or none, if there are none)."""

    slots: list[list[m.SlotRef]]
    frames: list[bytearray]


async def retrieve_later(
    state: ServerState,
    client: ClientEntry,
    sessions: list[Session],
    asked: list[int],
    wait_s: float,
    cut: Cut,
    common: bool = False,
    tips: list[int] | None = None,
) -> Prepared:
    """Wait (up to ``wait_s``) for the sessions' prefetches, then answer for all of them at once:
    so every shared-memory session's lease is renewed just before the reply leaves, and an
    inline reply is one frame. The sessions are held while they wait (their client is waiting
    too), so that one whose chunks were in L1 from the start does not expire meanwhile; one
    ended meanwhile is released when the wait is over, and then has no hit.

    ``common``: the sessions are one request's shards (:mod:`kvdock.server.shards`) of several: each hands
    out only the chunks every one of them holds, current in the same step, and the hit is counted
    once (for the first session's keys), not per shard. ``tips``: see :func:`vouched`."""
    mgr = state.manager
    for s in sessions:
        mgr.sessions.hold(s)
    try:
        await asyncio.gather(*(wait_prefetched(s, wait_s) for s in sessions))
    finally:
        for s in sessions:
            mgr.sessions.unhold(s)
    for s in sessions:
        if isinstance(s.job, PrefetchJob):
            s.job.cancelled = True  # the client gets what is loaded now; stop adding pins
    runs = [_current_run(s) for s in sessions]
    if common:
        n = min(map(len, runs))
        runs = [run[:n] for run in runs]
    runs = vouched(runs, asked, tips)
    if common:
        count_hits(state, len(runs[0]), asked[0])
    if client.transport == "shm":
        slots = [
            _shm_reply(state, client, s, run, n, not common) for s, run, n in zip(sessions, runs, asked, strict=True)
        ]
        return Prepared(slots, [])
    return await _inline_copy(state, client, sessions, runs, asked, cut, not common)


def _current_run(session: Session) -> list[L1Object]:
    """The session's pinned objects up to the first one replaced since it was pinned (by an
    overwrite acknowledged meanwhile): a reply never hands out an older version than that."""
    run = []
    for obj in session.pinned:
        if not obj.live:
            break
        run.append(obj)
    return run


def shm_slots(
    state: ServerState, client: ClientEntry, session: Session, asked: int, tips: list[int] | None = None
) -> list[m.SlotRef]:
    """The slots of a shared-memory session's hit (ending the session if it has none); its lease
    is renewed, so the client's copy gets a whole lease however long the wait was."""
    run = vouched([_current_run(session)], [asked], tips)[0]
    return _shm_reply(state, client, session, run, asked, True)


def _shm_reply(
    state: ServerState, client: ClientEntry, session: Session, hits: list[L1Object], asked: int, count: bool
) -> list[m.SlotRef]:
    mgr = state.manager
    mgr.sessions.renew(session)
    if count:
        count_hits(state, len(hits), asked)
    if not hits:
        mgr.end_session(client.client_id, session.session_id)
    alloc = mgr.l1.allocator
    return [m.SlotRef(i, o.offset, alloc.generation(o.offset)) for i, o in enumerate(hits)]


async def _inline_copy(
    state: ServerState,
    client: ClientEntry,
    sessions: list[Session],
    runs: list[list[L1Object]],
    asked: list[int],
    cut: Cut,
    count: bool,
) -> Prepared:
    """Copy ``cut``'s part of every session's ``runs`` into one buffer (the sessions hold the pins
    meanwhile), then end the sessions, also on failure. One frame for all: zmq then sends that
    buffer itself, and its tracker tells exactly when it is gone, before it is reused."""
    mgr = state.manager
    try:
        per = cut.nbytes
        rows: list[list[m.SlotRef]] = []
        sent: list[L1Object] = []
        for run, n in zip(runs, asked, strict=True):
            if count:
                count_hits(state, len(run), n)
            at = len(sent) - cut.first  # chunk i's part lies at (at + i) * per, from the first chunk on
            rows.append([m.SlotRef(i, (at + i) * per if i >= cut.first else 0) for i in range(len(run))])
            sent += run[cut.first :]
        if count and len(sessions) > 1 and len(sent) * per > state.max_unsent_bytes:
            # chunks shared by prompts are copied once per prompt: a batch could ask for far more
            # than the pool holds (a single retrieve cannot: it gets at most what L1 holds, and
            # neither can one request's shards, whose objects are all distinct)
            raise RequestError(
                f"this batch's inline reply would be {len(sent) * per} bytes, over the limit of "
                f"{state.max_unsent_bytes} per client; ask for fewer prompts at once",
                ErrorCode.LIMIT,
            )
        buf = state.reply_buffers.take(len(sent) * per) if sent else bytearray()
        if sent:
            for s in sessions:
                mgr.sessions.hold(s)
            try:
                await state.copy(_gather, [mgr.l1.view(o) for o in sent], memoryview(buf), cut)
            finally:
                for s in sessions:
                    mgr.sessions.unhold(s)
        if count:
            for run in runs:
                if run:
                    count_retrieved(state, len(run[cut.first :]) * per)
        elif sent:
            count_retrieved(state, len(sent) * per)
    finally:
        for s in sessions:
            mgr.end_session(client.client_id, s.session_id)
    return Prepared(rows, [buf] if sent else [])


def _gather(views: list[memoryview], out: memoryview, cut: Cut) -> None:
    """Copy ``cut``'s part of each slot in ``views`` into ``out``, one after another."""
    dst = np.frombuffer(out, np.uint8)
    per = cut.nbytes
    copier = Copier()
    for i, v in enumerate(views):
        rows = np.frombuffer(v, np.uint8).reshape(cut.planes, cut.layers, cut.row)[:, cut.picked]
        copier.add(dst[i * per : (i + 1) * per].reshape(rows.shape), rows)
    copier.run()  # without the GIL


def count_retrieved(state: ServerState, nbytes: int) -> None:
    state.metrics.retrieves.inc()
    state.metrics.retrieved_bytes.inc(nbytes)


def commit_retrieve(state: ServerState, req: m.CommitRetrieve, payload: Payload) -> Reply:
    client = client_of(state, req.client_id)
    mgr, n, found = state.manager, 0, False
    for sid in session_ids(req.session_id, len(shards_of(client))):
        if mgr.sessions.has(client.client_id, sid):
            n += mgr.commit_retrieve(client.client_id, sid)
            found = True
    if not found:  # the error of an unknown session
        mgr.sessions.get(client.client_id, req.session_id)
    count_retrieved(state, n * client.model.slot_nbytes)
    return Reply(m.Done())

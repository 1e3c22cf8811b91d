"""Handlers of the read ops: lookup across tiers, prefetch status, and retrieve.

A retrieve session pins the leading run of the prefix that L1 holds; when the tiers hold more, a
prefetch job loads it into L1 (pinning each chunk for the session) and the reply waits for it,
on the server, so a client needs a single round trip. A Lookup with ``prefetch`` starts the same
session early; QueryPrefetchStatus / WaitPrefetch report on it; PrepareRetrieve then reuses it.

Shared-memory clients copy the pinned slots themselves and release them with CommitRetrieve; each
slot comes with its generation, which the client checks after its copy. For inline clients a
copier thread copies the slots into a private buffer (the session holds the pins meanwhile), the
session ends at once, and the reply's frames are that buffer: a client that never reads its
socket holds no pool memory, only the unsent bytes, which are capped per client.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import numpy as np

from kvdock.errors import RequestError
from kvdock.keys import ObjectKey
from kvdock.memcpy import Copier
from kvdock.protocol import messages as m
from kvdock.protocol.codes import ErrorCode
from kvdock.server.handlers import client_of, count_hits, keys_of
from kvdock.server.registry import ClientEntry
from kvdock.server.state import Outcome, Payload, Reply, ServerState
from kvdock.storage import L1Object, Session
from kvdock.storage.manager import Chain, PrefetchJob


async def locate(state: ServerState, req: m.Locate, payload: Payload) -> Reply:
    client = client_of(state, req.client_id)
    keys = keys_of(state, client, req.tokens, req.cache_salt)
    found, down = await state.manager.locate(keys)
    chunks = [[m.Stored(p.tier, p.head.version, p.head.parent) for p in row] for row in found]
    return Reply(m.Located(chunks, down))


def lookup(state: ServerState, req: m.Lookup, payload: Payload) -> Outcome:
    client = client_of(state, req.client_id)
    keys = keys_of(state, client, req.tokens, req.cache_salt)
    state.metrics.lookups.inc()
    mgr = state.manager
    if req.prefetch:
        session = mgr.open_retrieve(client.client_id, req.session_id, keys)
        if mgr.start_prefetch(session) is None and not session.pinned:
            mgr.end_session(client.client_id, req.session_id)
        pinned = session.pinned
        in_l1 = Chain(len(pinned), pinned[-1].version if pinned else 0)
    else:
        in_l1 = mgr.l1_hit(keys)
    return count_all(state, [in_l1], [keys], lambda runs: lookup_result(state, runs))


def lookup_result(state: ServerState, runs: list[Chain]) -> Reply:
    """The LookupResult of one request's runs (one per shard, all of one length)."""
    n = runs[0].count
    return Reply(m.LookupResult(n * state.chunk_size, [r.parent for r in runs] if n else []))


def count_all(
    state: ServerState,
    in_l1: list[Chain],
    keysets: list[list[ObjectKey]],
    reply: Callable[[list[Chain]], Reply],
    common: bool = False,
) -> Outcome:
    """``reply(the run of each key list)`` (cached in any tier as one version chain), given the run
    of list ``i`` that L1 held when the handler looked (``in_l1[i]``): at once when no lower tier
    can add any, else once they have been asked (every list at the same time; L1 may have changed
    by then). ``common``: the lists are one request's shards; each run is cut to the shortest,
    with its own tip there (or all are empty when a shard changed while they were counted)."""
    mgr = state.manager
    if not mgr.lanes or all(h.count == len(k) for h, k in zip(in_l1, keysets, strict=True)):
        runs = list(in_l1)
        if common:  # nothing changed since in_l1 was taken: L1 gives each shard's tip at the cut
            n = min(r.count for r in runs)
            runs = [r if r.count == n else mgr.l1_hit(keys[:n]) for r, keys in zip(runs, keysets, strict=True)]
        return _counted(state, runs, keysets, reply, common)
    return _count_lower(state, in_l1, keysets, reply, common)


async def _count_lower(
    state: ServerState,
    in_l1: list[Chain],
    keysets: list[list[ObjectKey]],
    reply: Callable[[list[Chain]], Reply],
    common: bool,
) -> Reply:
    mgr = state.manager

    async def chain(hit: Chain, keys: list[ObjectKey]) -> Chain:
        return hit if hit.count == len(keys) else await mgr.chain(keys, hit)

    runs = list(await asyncio.gather(*(chain(h, keys) for h, keys in zip(in_l1, keysets, strict=True))))
    if common and len({r.count for r in runs}) > 1:  # the longer runs' tips at the cut, counted again
        n = min(r.count for r in runs)
        cut = [keys[:n] for keys in keysets]
        runs = list(await asyncio.gather(*(chain(mgr.l1_hit(keys), keys) for keys in cut)))
        if any(r.count != n for r in runs):  # a shard changed meanwhile: vouch for nothing
            runs = [Chain(0, 0) for _ in runs]
    return _counted(state, runs, keysets, reply, common)


def _counted(
    state: ServerState,
    runs: list[Chain],
    keysets: list[list[ObjectKey]],
    reply: Callable[[list[Chain]], Reply],
    common: bool,
) -> Reply:
    counted = list(zip(runs[:1], keysets[:1], strict=True) if common else zip(runs, keysets, strict=True))
    for run, keys in counted:
        count_hits(state, run.count, len(keys))
    return reply(runs)


def _status(state: ServerState, session: Session) -> Reply:
    job = session.job
    done = not isinstance(job, PrefetchJob) or job.done.is_set()
    return Reply(m.PrefetchStatus(done, len(session.pinned) * state.chunk_size))


def query_prefetch_status(state: ServerState, req: m.QueryPrefetchStatus, payload: Payload) -> Reply:
    client = client_of(state, req.client_id)
    return _status(state, state.manager.sessions.get(client.client_id, req.session_id))


async def wait_prefetch(state: ServerState, req: m.WaitPrefetch, payload: Payload) -> Reply:
    client = client_of(state, req.client_id)
    session = state.manager.sessions.get(client.client_id, req.session_id)
    await _wait(session, req.timeout_s)
    return _status(state, session)


async def _wait(session: Session, timeout_s: float) -> None:
    job = session.job
    if isinstance(job, PrefetchJob) and not job.done.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(job.done.wait(), max(0.0, timeout_s))


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
    keys = keys_of(state, client, req.tokens, req.cache_salt)
    cut = cut_of(client, req.part)
    check_tips(req.tips, 1)
    if state.fault_retrieve_miss:
        return Reply(m.RetrievePrepared([]))
    mgr = state.manager
    if mgr.sessions.has(client.client_id, req.session_id):  # opened by a prefetching Lookup
        session = mgr.sessions.get(client.client_id, req.session_id)
        if session.keys != keys:
            raise RequestError(f"session {req.session_id!r} was opened for other tokens or cache_salt")
    else:
        session = mgr.open_retrieve(client.client_id, req.session_id, keys)
        mgr.start_prefetch(session)
    if loading([session]) or client.transport == "inline":
        return _one(retrieve_later(state, client, [session], [len(keys)], req.wait_s, cut, tips=req.tips))
    return Reply(m.RetrievePrepared(shm_slots(state, client, session, len(keys), req.tips)))


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


async def _one(pending: Awaitable[Prepared]) -> Reply:
    p = await pending
    return Reply(m.RetrievePrepared(p.slots[0]), p.frames, pooled=True)


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

    ``common``: the sessions are one request's shards (:mod:`kvdock.server.shards`): each hands
    out only the chunks every one of them holds, current in the same step, and the hit is counted
    once (for the first session's keys), not per shard. ``tips``: see :func:`vouched`."""
    mgr = state.manager
    for s in sessions:
        mgr.hold(s)
    try:
        await asyncio.gather(*(_wait(s, wait_s) for s in sessions))
    finally:
        for s in sessions:
            mgr.unhold(s)
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
                mgr.hold(s)
            try:
                await state.copy(_gather, [mgr.l1.view(o) for o in sent], memoryview(buf), cut)
            finally:
                for s in sessions:
                    mgr.unhold(s)
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
    n = state.manager.commit_retrieve(client.client_id, req.session_id)
    count_retrieved(state, n * client.model.slot_nbytes)
    return Reply(m.Done())

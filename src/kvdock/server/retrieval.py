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
from dataclasses import dataclass

import numpy as np

from kvdock.errors import RequestError
from kvdock.protocol import messages as m
from kvdock.server.handlers import client_of, count_hits, keys_of
from kvdock.server.registry import ClientEntry
from kvdock.server.state import Outcome, Payload, Reply, ServerState
from kvdock.storage import L1Object, Session
from kvdock.storage.manager import PrefetchJob


async def locate(state: ServerState, req: m.Locate, payload: Payload) -> Reply:
    client = client_of(state, req.client_id)
    keys = keys_of(state, client, req.tokens, req.cache_salt)
    found = await state.manager.locate(keys)
    return Reply(m.Located([[m.Stored(p.tier, p.head.version, p.head.parent) for p in row] for row in found]))


def lookup(state: ServerState, req: m.Lookup, payload: Payload) -> Outcome:
    client = client_of(state, req.client_id)
    keys = keys_of(state, client, req.tokens, req.cache_salt)
    state.metrics.lookups.inc()
    mgr = state.manager
    if req.prefetch:
        session = mgr.open_retrieve(client.client_id, req.session_id, keys)
        if mgr.start_prefetch(session) is None and not session.pinned:
            mgr.end_session(client.client_id, req.session_id)
        in_l1 = len(session.pinned)
    else:
        in_l1 = mgr.lookup_l1(keys)
    if in_l1 == len(keys) or not mgr.lanes:
        return _lookup_reply(state, in_l1, len(keys))
    return _count_lower(state, keys, in_l1)


async def _count_lower(state: ServerState, keys: list, in_l1: int) -> Reply:  # type: ignore[type-arg]
    return _lookup_reply(state, await state.manager.count(keys, in_l1), len(keys))


def _lookup_reply(state: ServerState, hits: int, asked: int) -> Reply:
    count_hits(state, hits, asked)
    return Reply(m.LookupResult(hits * state.chunk_size))


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
    job = session.job
    if (isinstance(job, PrefetchJob) and not job.done.is_set()) or client.transport == "inline":
        return retrieve_later(state, client, session, len(keys), req.wait_s, cut)
    return shm_reply(state, client, session, len(keys))


async def retrieve_later(
    state: ServerState, client: ClientEntry, session: Session, asked: int, wait_s: float, cut: Cut
) -> Reply:
    await _wait(session, wait_s)
    if isinstance(session.job, PrefetchJob):
        session.job.cancelled = True  # the client gets what is loaded now; stop adding pins
    if client.transport == "shm":
        return shm_reply(state, client, session, asked)
    return await _inline_reply(state, client, session, asked, cut)


def _current_run(session: Session) -> list[L1Object]:
    """The session's pinned objects up to the first one replaced since it was pinned (by an
    overwrite acknowledged meanwhile): a reply never hands out an older version than that."""
    run = []
    for obj in session.pinned:
        if not obj.live:
            break
        run.append(obj)
    return run


def shm_reply(state: ServerState, client: ClientEntry, session: Session, asked: int) -> Reply:
    mgr = state.manager
    mgr.sessions.renew(session)  # the client's copy gets a whole lease, however long the wait was
    hits = _current_run(session)
    count_hits(state, len(hits), asked)
    if not hits:
        mgr.end_session(client.client_id, session.session_id)
    alloc = mgr.l1.allocator
    return Reply(m.RetrievePrepared([m.SlotRef(i, o.offset, alloc.generation(o.offset)) for i, o in enumerate(hits)]))


async def _inline_reply(state: ServerState, client: ClientEntry, session: Session, asked: int, cut: Cut) -> Reply:
    mgr = state.manager
    hits = _current_run(session)
    count_hits(state, len(hits), asked)
    per = cut.nbytes
    sent = hits[cut.first :]
    buf = state.reply_buffers.take(len(sent) * per) if sent else bytearray()
    if sent:
        mgr.hold(session)
        try:
            views = [mgr.l1.view(o) for o in sent]
            await state.copy(_gather, views, memoryview(buf), cut)
        finally:
            mgr.unhold(session)
    if hits:
        _count_retrieved(state, len(buf))
    mgr.end_session(client.client_id, session.session_id)
    # One frame for all chunks: zmq then sends that buffer itself, and its tracker tells exactly
    # when it is gone (small frames would be copied inside zmq, out of the unsent count's sight).
    slots = [m.SlotRef(i, max(i - cut.first, 0) * per) for i in range(len(hits))]
    return Reply(m.RetrievePrepared(slots), [buf] if sent else [], pooled=True)


def _gather(views: list[memoryview], out: memoryview, cut: Cut) -> None:
    """Copy ``cut``'s part of each slot in ``views`` into ``out``, one after another."""
    dst = np.frombuffer(out, np.uint8)
    per = cut.nbytes
    for i, v in enumerate(views):
        rows = np.frombuffer(v, np.uint8).reshape(cut.planes, cut.layers, cut.row)[:, cut.picked]
        np.copyto(dst[i * per : (i + 1) * per].reshape(rows.shape), rows)  # without the GIL


def _count_retrieved(state: ServerState, nbytes: int) -> None:
    state.metrics.retrieves.inc()
    state.metrics.retrieved_bytes.inc(nbytes)


def commit_retrieve(state: ServerState, req: m.CommitRetrieve, payload: Payload) -> Reply:
    client = client_of(state, req.client_id)
    n = state.manager.commit_retrieve(client.client_id, req.session_id)
    _count_retrieved(state, n * client.model.slot_nbytes)
    return Reply(m.Done())

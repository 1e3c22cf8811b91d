"""Handlers of the read ops: lookup across tiers, prefetch status, and retrieve.

A retrieve session pins the leading run of the prefix that L1 holds; when the tiers hold more, a
prefetch job loads it into L1 (pinning each chunk for the session) and the reply waits for it,
on the server, so a client needs a single round trip. A Lookup with ``prefetch`` starts the same
session early; QueryPrefetchStatus / WaitPrefetch report on it; PrepareRetrieve then reuses it.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from kvdock.errors import RequestError
from kvdock.protocol import messages as m
from kvdock.server.handlers import (
    HeldPayload,
    Payload,
    Result,
    ServerState,
    client_of,
    count_hits,
    keys_of,
)
from kvdock.server.registry import ClientEntry
from kvdock.storage.manager import Session
from kvdock.storage.tiers import PrefetchJob


def lookup(state: ServerState, req: m.Lookup, payload: Payload) -> Any:
    client = client_of(state, req.client_id)
    keys = keys_of(state, client, req.tokens, req.cache_salt)
    state.metrics.lookups.inc()
    if req.prefetch:
        session = state.manager.open_retrieve(client.client_id, req.session_id, keys)
        if len(session.pinned) < len(keys) and state.tiers.enabled:
            state.tiers.start_prefetch(session, keys)
        elif not session.pinned:
            state.manager.end_session(client.client_id, req.session_id)
        in_l1 = len(session.pinned)
    else:
        in_l1 = state.manager.lookup(keys)
    if in_l1 == len(keys) or not state.tiers.enabled:
        return _lookup_reply(state, in_l1, len(keys))
    return _count_lower(state, keys, in_l1)


async def _count_lower(state: ServerState, keys: list[Any], in_l1: int) -> Result:
    return _lookup_reply(state, await state.tiers.count(keys, in_l1), len(keys))


def _lookup_reply(state: ServerState, hits: int, asked: int) -> Result:
    count_hits(state, hits, asked)
    return m.LookupResult(hits * state.chunk_size), []


def _status(state: ServerState, session: Session) -> Result:
    job = session.job
    done = not isinstance(job, PrefetchJob) or job.done.is_set()
    return m.PrefetchStatus(done, len(session.pinned) * state.chunk_size), []


def query_prefetch_status(state: ServerState, req: m.QueryPrefetchStatus, payload: Payload) -> Result:
    client = client_of(state, req.client_id)
    return _status(state, state.manager.find(client.client_id, req.session_id))


async def wait_prefetch(state: ServerState, req: m.WaitPrefetch, payload: Payload) -> Result:
    client = client_of(state, req.client_id)
    session = state.manager.find(client.client_id, req.session_id)
    await _wait(session, req.timeout_s)
    return _status(state, session)


async def _wait(session: Session, timeout_s: float) -> None:
    job = session.job
    if isinstance(job, PrefetchJob) and not job.done.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(job.done.wait(), max(0.0, timeout_s))


def prepare_retrieve(state: ServerState, req: m.PrepareRetrieve, payload: Payload) -> Any:
    client = client_of(state, req.client_id)
    keys = keys_of(state, client, req.tokens, req.cache_salt)
    mgr = state.manager
    if mgr.has_session(client.client_id, req.session_id):  # opened by a prefetching Lookup
        session = mgr.find(client.client_id, req.session_id)
        if session.keys != keys:
            raise RequestError(f"session {req.session_id!r} was opened for other tokens or cache_salt")
    else:
        session = mgr.open_retrieve(client.client_id, req.session_id, keys)
        if len(session.pinned) < len(keys) and state.tiers.enabled:
            state.tiers.start_prefetch(session, keys)
    if isinstance(session.job, PrefetchJob) and not session.job.done.is_set():
        return _retrieve_when_loaded(state, client, session, len(keys), req.wait_s)
    return _retrieve_reply(state, client, session, len(keys))


async def _retrieve_when_loaded(
    state: ServerState, client: ClientEntry, session: Session, asked: int, wait_s: float
) -> Result:
    await _wait(session, wait_s)
    if isinstance(session.job, PrefetchJob):
        session.job.cancelled = True  # the client gets what is loaded now; stop adding pins
    return _retrieve_reply(state, client, session, asked)


def _retrieve_reply(state: ServerState, client: ClientEntry, session: Session, asked: int) -> Result:
    state.manager.renew(session)  # the client's copy gets a whole lease, however long the wait was
    hits = list(session.pinned)
    count_hits(state, len(hits), asked)
    if not hits:
        state.manager.end_session(client.client_id, session.session_id)
        return m.RetrievePrepared([]), []
    nbytes = client.model.slot_nbytes
    out: list[Any] = []
    if client.transport == "inline":
        # Zero-copy: zmq sends the slots themselves, in the background. They get pins of their own,
        # released when zmq is done with them, so a client too slow to read its reply within the
        # lease still receives these objects' bytes, never slots reused for others.
        for o in hits:
            state.manager.pin_background(o)

        def release() -> None:
            for o in hits:
                state.manager.unpin_background(o)

        out = HeldPayload([state.segment.buf[o.offset : o.offset + nbytes] for o in hits], release)
    return m.RetrievePrepared([m.SlotRef(i, o.offset) for i, o in enumerate(hits)]), out


def commit_retrieve(state: ServerState, req: m.CommitRetrieve, payload: Payload) -> Result:
    client = client_of(state, req.client_id)
    pinned = state.manager.session_pins(client.client_id, req.session_id)
    state.manager.commit_retrieve(client.client_id, req.session_id)
    state.metrics.retrieves.inc()
    state.metrics.retrieved_bytes.inc(pinned * client.model.slot_nbytes)
    return m.Done(), []

"""Handlers of the read ops that hand out no slots: Lookup (across tiers, of every shard a request
covers), Locate, and the status of a prefetching Lookup (QueryPrefetchStatus, WaitPrefetch).

A Lookup counts the leading run of chunks cached as one version chain, first in L1, then (when
L1 holds less) in the lower tiers; of several shards, a chunk counts only when every shard holds
it, each shard answering its tip at the common cut (:func:`count_all`, ``common``). A Lookup
with ``prefetch`` opens the retrieve session early (:mod:`kvdock.server.retrieval` reuses it).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from kvdock.errors import RequestError
from kvdock.keys import ObjectKey
from kvdock.protocol import messages as m
from kvdock.server.handlers import client_of, count_hits, keys_of
from kvdock.server.shards import refusal, request_keys
from kvdock.server.state import Outcome, Payload, Reply, ServerState
from kvdock.storage import Session
from kvdock.storage.manager import Chain, PrefetchJob


async def locate(state: ServerState, req: m.Locate, payload: Payload) -> Reply:
    client = client_of(state, req.client_id)
    keys = keys_of(state, client, req.tokens, req.cache_salt)
    found, down = await state.manager.locate(keys)
    chunks = [[m.Stored(p.tier, p.head.version, p.head.parent) for p in row] for row in found]
    return Reply(m.Located(chunks, down))


def lookup(state: ServerState, req: m.Lookup, payload: Payload) -> Outcome:
    """How many leading tokens every shard the request covers holds (each shard's tip there);
    with ``prefetch`` (one shard only), a retrieve session starts loading them into L1."""
    client = client_of(state, req.client_id)
    if req.prefetch and client.sharded:
        raise RequestError(refusal("a prefetching Lookup"))
    keysets = request_keys(state, client, req.tokens, req.cache_salt)
    state.metrics.lookups.inc()
    mgr = state.manager
    if req.prefetch:
        session = mgr.open_retrieve(client.client_id, req.session_id, keysets[0])
        if mgr.start_prefetch(session) is None and not session.pinned:
            mgr.end_session(client.client_id, req.session_id)
        pinned = session.pinned
        in_l1 = [Chain(len(pinned), pinned[-1].version if pinned else 0)]
    else:
        in_l1 = [mgr.l1_hit(keys) for keys in keysets]
    return count_all(state, in_l1, keysets, lambda runs: lookup_result(state, runs), common=True)


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
    await wait_prefetched(session, req.timeout_s)
    return _status(state, session)


async def wait_prefetched(session: Session, timeout_s: float) -> None:
    """Until the session's prefetch is done, or ``timeout_s`` passed."""
    job = session.job
    if isinstance(job, PrefetchJob) and not job.done.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(job.done.wait(), max(0.0, timeout_s))

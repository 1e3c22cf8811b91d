"""Routing a decoded request to its handler; expected failures become Error replies."""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import Any

from kvdock.errors import RequestError
from kvdock.protocol import messages as m
from kvdock.server import access
from kvdock.server import batch as b
from kvdock.server import fastreads as fr
from kvdock.server import handlers as h
from kvdock.server import lookups as lk
from kvdock.server import retrieval as r
from kvdock.server import shards as sh
from kvdock.server import storing as st
from kvdock.server.state import Outcome, Payload, Reply, ServerState
from kvdock.storage.coherence import until_vouched

Handler = Callable[[ServerState, Any, Payload], Outcome]

# the ops whose caller is not a registered client: they learn who it is from the CURVE key the
# request came with (b"": none, or the local socket) and the token it carries
IDENTIFIED: dict[type, Callable[[ServerState, Any, Payload, bytes], Outcome]] = {
    m.RegisterModel: h.register_model,
    m.RegisterClient: h.register_client,
    m.Describe: h.describe,
}

# Every client's table: a request of a whole-model client of a model stored in several shards
# (ClientEntry.sharded) is run once per shard by the same handlers (server.shards); the ops with
# per-shard state such a client could not tell apart are refused for it (sh.one_shard)
HANDLERS: dict[type, Handler] = {
    m.Ping: h.ping,
    m.Lookup: lk.lookup,
    m.QueryPrefetchStatus: sh.one_shard("prefetch status", lk.query_prefetch_status),
    m.WaitPrefetch: sh.one_shard("prefetch status", lk.wait_prefetch),
    m.PrepareStore: st.prepare_store,
    m.CommitStore: st.commit_store,
    m.PrepareRetrieve: r.prepare_retrieve,
    m.CommitRetrieve: r.commit_retrieve,
    m.FastReads: fr.fast_reads,
    m.LookupMany: sh.one_shard("a batch lookup", b.lookup_many),
    m.PrepareRetrieveMany: sh.one_shard("a batch retrieve", b.prepare_retrieve_many),
    m.Locate: sh.one_shard("locating chunks", lk.locate),
    m.EndSession: st.end_session,
    m.RenewSessions: sh.one_shard("a zero-copy view", h.renew_sessions),
    m.CheckIntegrity: h.check_integrity,
    m.CloseClient: h.close_client,
}


def handle(state: ServerState, req: Any, payload: Payload, key: bytes = b"") -> Outcome:
    """Run the handler of ``req``, which came with CURVE key ``key`` (b"": none), after the
    access checks (server.access); expected failures become an Error reply. Ops that wait for a
    lower tier return an awaitable (the caller must not block the loop on it)."""
    state.metrics.requests.labels(type(req).__name__).inc()
    try:
        identified = IDENTIFIED.get(type(req))
        if identified is not None:
            out = identified(state, req, payload, key)
        else:
            access.check(state, req, key)
            if type(req) in READS and not state.manager.vouched():
                out = _when_vouched(state, HANDLERS[type(req)], req, payload)
            else:
                out = HANDLERS[type(req)](state, req, payload)
    except EXPECTED as e:
        return error_reply(state, e)
    if inspect.isawaitable(out):
        return _guard(state, out)
    return out


# the reads that answer from L1 and L2: while the server cannot vouch that it applied the fleet's
# latest overwrites (kvdock.storage.coherence), they wait for it a little, then answer from L3 only
READS = {m.Lookup, m.PrepareRetrieve, m.LookupMany, m.PrepareRetrieveMany}
VOUCH_WAIT_BOUNDS = 10  # how long they wait, in coherence bounds


async def _when_vouched(state: ServerState, handler: Handler, req: Any, payload: Payload) -> Reply:
    coherence = state.manager.coherence
    if coherence is not None:
        await until_vouched(coherence, VOUCH_WAIT_BOUNDS * coherence.bound_s)
    out = handler(state, req, payload)
    return await out if inspect.isawaitable(out) else out


async def _guard(state: ServerState, pending: Awaitable[Reply]) -> Reply:
    try:
        return await pending
    except EXPECTED as e:
        return error_reply(state, e)


EXPECTED = (RequestError,)


def error_reply(state: ServerState, e: RequestError) -> Reply:
    state.metrics.errors.labels(e.code).inc()
    return Reply(m.Error(e.code, str(e)))

"""Routing a decoded request to its handler; expected failures become Error replies."""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import Any

from kvdock.errors import RequestError
from kvdock.protocol import messages as m
from kvdock.server import batch as b
from kvdock.server import handlers as h
from kvdock.server import retrieval as r
from kvdock.server import storing as st
from kvdock.server.state import Outcome, Payload, Reply, ServerState

Handler = Callable[[ServerState, Any, Payload], Outcome]

HANDLERS: dict[type, Handler] = {
    m.Ping: h.ping,
    m.RegisterModel: h.register_model,
    m.RegisterClient: h.register_client,
    m.Lookup: r.lookup,
    m.QueryPrefetchStatus: r.query_prefetch_status,
    m.WaitPrefetch: r.wait_prefetch,
    m.PrepareStore: st.prepare_store,
    m.CommitStore: st.commit_store,
    m.PrepareRetrieve: r.prepare_retrieve,
    m.CommitRetrieve: r.commit_retrieve,
    m.FastReads: r.fast_reads,
    m.LookupMany: b.lookup_many,
    m.PrepareRetrieveMany: b.prepare_retrieve_many,
    m.Locate: r.locate,
    m.EndSession: st.end_session,
    m.RenewSessions: h.renew_sessions,
    m.CheckIntegrity: h.check_integrity,
    m.CloseClient: h.close_client,
}


def handle(state: ServerState, req: Any, payload: Payload) -> Outcome:
    """Run the handler of ``req``; expected failures become an Error reply. Ops that wait for a
    lower tier return an awaitable (the caller must not block the loop on it)."""
    state.metrics.requests.labels(type(req).__name__).inc()
    try:
        out = HANDLERS[type(req)](state, req, payload)
    except EXPECTED as e:
        return error_reply(state, e)
    if inspect.isawaitable(out):
        return _guard(state, out)
    return out


async def _guard(state: ServerState, pending: Awaitable[Reply]) -> Reply:
    try:
        return await pending
    except EXPECTED as e:
        return error_reply(state, e)


EXPECTED = (RequestError,)


def error_reply(state: ServerState, e: RequestError) -> Reply:
    state.metrics.errors.labels(e.code).inc()
    return Reply(m.Error(e.code, str(e)))

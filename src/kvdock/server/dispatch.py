"""Routing a decoded request to its handler; expected failures become Error replies."""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

from kvdock.errors import RequestError
from kvdock.protocol import messages as m
from kvdock.protocol.codes import wire_code
from kvdock.server import access
from kvdock.server import batch as b
from kvdock.server import fastreads as fr
from kvdock.server import handlers as h
from kvdock.server import lookups as lk
from kvdock.server import retrieval as r
from kvdock.server import shards as sh
from kvdock.server import storing as st
from kvdock.server.state import Outcome, Payload, Reply, ServerState
from kvdock.storage.following import until_vouched

Q = TypeVar("Q", bound=m.RequestBase[Any])
H = TypeVar("H", bound=Callable[..., Outcome])


class Handlers(Generic[H]):
    """A handler table keyed by request type. :meth:`add` takes a handler only together with the
    request type its request parameter names (mypy checks it: ``add(m.Lookup, h.ping)`` does not
    type-check), each type once; :meth:`of` finds a request's handler (None: not in this table)."""

    def __init__(self) -> None:
        self._table: dict[type, H] = {}

    def _put(self, req_type: type, handler: H) -> None:
        assert req_type not in self._table, f"two handlers of {req_type.__name__}"
        self._table[req_type] = handler

    def of(self, req: m.RequestBase[Any]) -> H | None:
        return self._table.get(type(req))

    def types(self) -> set[type]:
        return set(self._table)


class ClientHandlers(Handlers[Callable[[ServerState, Any, Payload], Outcome]]):
    def add(self, req_type: type[Q], handler: Callable[[ServerState, Q, Payload], Outcome]) -> None:
        self._put(req_type, handler)


class IdentifiedHandlers(Handlers[Callable[[ServerState, Any, Payload, bytes], Outcome]]):
    """Handlers that also get the CURVE key the request came with."""

    def add(self, req_type: type[Q], handler: Callable[[ServerState, Q, Payload, bytes], Outcome]) -> None:
        self._put(req_type, handler)


# the ops whose caller is not a registered client: they learn who it is from the CURVE key the
# request came with (b"": none, or the local socket) and the token it carries
IDENTIFIED = IdentifiedHandlers()
IDENTIFIED.add(m.RegisterModel, h.register_model)
IDENTIFIED.add(m.RegisterClient, h.register_client)
IDENTIFIED.add(m.Describe, h.describe)

# Every client's table: a request of a whole-model client of a model stored in several shards
# (ClientEntry.sharded) is run once per shard by the same handlers (server.shards); the ops with
# per-shard state such a client could not tell apart are refused for it (sh.one_shard)
HANDLERS = ClientHandlers()
HANDLERS.add(m.Ping, h.ping)
HANDLERS.add(m.Lookup, lk.lookup)
HANDLERS.add(m.QueryPrefetchStatus, sh.one_shard("prefetch status", lk.query_prefetch_status))
HANDLERS.add(m.WaitPrefetch, sh.one_shard("prefetch status", lk.wait_prefetch))
HANDLERS.add(m.PrepareStore, st.prepare_store)
HANDLERS.add(m.CommitStore, st.commit_store)
HANDLERS.add(m.PrepareRetrieve, r.prepare_retrieve)
HANDLERS.add(m.CommitRetrieve, r.commit_retrieve)
HANDLERS.add(m.FastReads, fr.fast_reads)
HANDLERS.add(m.LookupMany, sh.one_shard("a batch lookup", b.lookup_many))
HANDLERS.add(m.PrepareRetrieveMany, sh.one_shard("a batch retrieve", b.prepare_retrieve_many))
HANDLERS.add(m.Locate, sh.one_shard("locating chunks", lk.locate))
HANDLERS.add(m.EndSession, st.end_session)
HANDLERS.add(m.RenewSessions, sh.one_shard("a zero-copy view", h.renew_sessions))
HANDLERS.add(m.CheckIntegrity, h.check_integrity)
HANDLERS.add(m.CloseClient, h.close_client)


def handle(state: ServerState, req: m.Request, payload: Payload, key: bytes = b"") -> Outcome:
    """Run the handler of ``req``, which came with CURVE key ``key`` (b"": none), after the
    access checks (server.access); expected failures become an Error reply. Ops that wait for a
    lower tier return an awaitable (the caller must not block the loop on it)."""
    state.metrics.requests.labels(type(req).__name__).inc()
    try:
        identified = IDENTIFIED.of(req)
        if identified is not None:
            out = identified(state, req, payload, key)
        else:
            access.check(state, req, key)
            handler = HANDLERS.of(req)
            assert handler is not None, f"no handler of {type(req).__name__}"  # every Request has one
            if type(req) in READS and not state.manager.vouched():
                out = _when_vouched(state, handler, req, payload)
            else:
                out = handler(state, req, payload)
    except EXPECTED as e:
        return error_reply(state, e)
    if inspect.isawaitable(out):
        return _guard(state, out)
    return out


# the reads that answer from L1 and L2: while the server cannot vouch that it applied the fleet's
# latest overwrites (kvdock.storage.coherence), they wait for it a little, then answer from L3 only
READS = {m.Lookup, m.PrepareRetrieve, m.LookupMany, m.PrepareRetrieveMany}
VOUCH_WAIT_BOUNDS = 10  # how long they wait, in coherence bounds


async def _when_vouched(
    state: ServerState, handler: Callable[[ServerState, Any, Payload], Outcome], req: m.Request, payload: Payload
) -> Reply:
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
    code = wire_code(e)
    state.metrics.errors.labels(code.value).inc()
    return Reply(m.Error(code.value, str(e)))

"""Handlers of the batched read ops: LookupMany and PrepareRetrieveMany, several prompts in one
round trip. Each prompt is served exactly as its single op would be (its own keys, its own retrieve
session, its own hit); the batch only shares the message and, while lower tiers load, the wait.
A malformed batch (lists of different lengths, too many prompts or tokens, a session id already
open) is refused whole, before any session opens."""

from __future__ import annotations

from collections.abc import Awaitable

from kvdock import keys as keymod
from kvdock.errors import RequestError
from kvdock.keys import ObjectKey
from kvdock.protocol import messages as m
from kvdock.protocol.codes import ErrorCode
from kvdock.protocol.limits import MAX_BATCH
from kvdock.server import lookups, retrieval
from kvdock.server.handlers import check_request, client_of, hashed_keys
from kvdock.server.registry import ClientEntry
from kvdock.server.state import Outcome, Payload, Reply, ServerState


def _batch_keys(
    state: ServerState, client: ClientEntry, tokens: list[bytes], salts: list[str]
) -> list[list[ObjectKey]]:
    """Each prompt's chunk keys; RequestError (before any hashing) for a malformed or oversized batch."""
    if len(salts) != len(tokens):
        raise RequestError(f"{len(tokens)} prompts but {len(salts)} cache salts (one per prompt)")
    if len(tokens) > MAX_BATCH:
        raise RequestError(f"a batch of {len(tokens)} prompts is over the limit of {MAX_BATCH}", ErrorCode.LIMIT)
    total = sum(len(t) for t in tokens) // keymod.TOKEN_DTYPE.itemsize
    cap = state.registry.max_request_tokens
    if total > cap:
        raise RequestError(
            f"a batch of {total} tokens is over the server's limit of {cap} tokens per request "
            "(max_request_tokens; the SDK splits batches that exceed it)",
            ErrorCode.LIMIT,
        )
    for t, s in zip(tokens, salts, strict=True):
        check_request(state, t, s)
    return [hashed_keys(state, client, t, s) for t, s in zip(tokens, salts, strict=True)]


def lookup_many(state: ServerState, req: m.LookupMany, payload: Payload) -> Outcome:
    client = client_of(state, req.client_id)
    keysets = _batch_keys(state, client, req.tokens, req.cache_salts)
    state.metrics.lookups.inc(len(keysets))
    in_l1 = [state.manager.l1_hit(keys) for keys in keysets]
    size = state.chunk_size
    return lookups.count_all(
        state, in_l1, keysets, lambda runs: Reply(m.LookupManyResult([r.count * size for r in runs]))
    )


def prepare_retrieve_many(state: ServerState, req: m.PrepareRetrieveMany, payload: Payload) -> Outcome:
    client = client_of(state, req.client_id)
    if len(req.session_ids) != len(req.tokens):
        raise RequestError(f"{len(req.tokens)} prompts but {len(req.session_ids)} session ids (one per prompt)")
    keysets = _batch_keys(state, client, req.tokens, req.cache_salts)
    cut = retrieval.cut_of(client, req.part)
    if len(set(req.session_ids)) != len(req.session_ids):
        raise RequestError("a batch names the same session id twice")
    if state.fault_retrieve_miss:
        return Reply(m.RetrieveManyPrepared([[] for _ in keysets]))
    mgr = state.manager
    taken = [sid for sid in req.session_ids if mgr.sessions.has(client.client_id, sid)]
    if taken:
        raise RequestError(f"session {taken[0]!r} is already open (a batch opens its own sessions)")
    sessions = retrieval.open_retrieves(state, client, req.session_ids, keysets)
    asked = [len(k) for k in keysets]
    if retrieval.loading(sessions) or client.transport == "inline":
        return _many(retrieval.retrieve_later(state, client, sessions, asked, req.wait_s, cut))
    slots = [retrieval.shm_slots(state, client, s, n) for s, n in zip(sessions, asked, strict=True)]
    return Reply(m.RetrieveManyPrepared(slots))


async def _many(pending: Awaitable[retrieval.Prepared]) -> Reply:
    p = await pending
    return Reply(m.RetrieveManyPrepared(p.slots), p.frames, pooled=True)

"""FastReads: what a shared-memory client read from its pool directory without asking the
server (``kvdock.sdk._fastpath``), reported afterwards: counted as if served, and the objects it
copied made most recently used, in the reporting client's own region only."""

from __future__ import annotations

from kvdock.errors import RequestError
from kvdock.protocol import messages as m
from kvdock.protocol.limits import MAX_REPORTED, MAX_REPORTED_READS
from kvdock.server import access
from kvdock.server.handlers import count_hits
from kvdock.server.state import Payload, Reply, ServerState


def fast_reads(state: ServerState, req: m.FastReads, payload: Payload) -> Reply:
    """Count lookups and retrieves a client answered from the pool directory, renew its lease,
    and make what the retrieves copied most recently used: only objects still in the slot the
    client found them in, at most the client's touch budget. Only for a client this server knows:
    a report of a client of the server before a restart names another pool, and one of nobody
    must not inflate the counters."""
    n, reads = len(req.entries), req.lookups + req.retrieves
    most_chunks = reads * (state.registry.max_request_tokens // state.chunk_size)
    largest = max((model.slot_nbytes for model in state.registry.models.values()), default=0)
    if not (
        min(req.lookups, req.retrieves, req.asked, req.hit, req.nbytes) >= 0
        and reads <= MAX_REPORTED_READS
        and req.hit <= req.asked <= most_chunks
        and req.nbytes <= req.hit * largest
        and len(req.offsets) == len(req.gens) == n <= MAX_REPORTED
    ):
        raise RequestError(
            f"FastReads of {reads} reads, {req.asked} chunks asked, {req.hit} hit, {req.nbytes} bytes "
            f"and {n} entries is not a possible report"
        )
    client = state.registry.touch(req.client_id)
    if client is None:  # not counted: of a registration this server does not know (or bogus)
        raise access.unknown_client(req.client_id)
    region = client.tenant.name if client.tenant is not None else None  # the pool it maps (shm.pool)
    l1 = state.manager.l1
    if client.transport != "shm" or not l1.has_directory(region):  # it reads no directory: made up
        raise RequestError("FastReads from a client that reads no pool directory")
    if n:
        allowed = client.allow_touches(n)
        for entry, offset, gen in zip(req.entries[:allowed], req.offsets[:allowed], req.gens[:allowed], strict=True):
            l1.touch(entry, offset, gen, region)
        if allowed < n:
            state.metrics.fast_reads_untouched.inc(n - allowed)
    metrics = state.metrics
    metrics.lookups.inc(req.lookups)
    metrics.retrieves.inc(req.retrieves)
    metrics.retrieved_bytes.inc(req.nbytes)
    metrics.fast_reads.labels("lookup").inc(req.lookups)
    metrics.fast_reads.labels("retrieve").inc(req.retrieves)
    count_hits(state, req.hit, req.asked)
    return Reply(m.Done())

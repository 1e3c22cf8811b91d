"""Prometheus metrics of one server (its own registry, so several servers can live in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, disable_created_metrics, generate_latest

# the *_created series double the output and nobody graphs them
disable_created_metrics()


class Metrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("kvdock_requests", "Control-plane requests by op", ["op"], registry=r)
        self.errors = Counter("kvdock_errors", "Requests answered with an error, by code", ["code"], registry=r)
        self.stores = Counter("kvdock_stores", "Committed store requests", registry=r)
        self.retrieves = Counter("kvdock_retrieves", "Committed retrieve requests", registry=r)
        self.lookups = Counter("kvdock_lookups", "Lookup requests", registry=r)
        self.hit_tokens = Counter("kvdock_hit_tokens", "Tokens found by lookups and retrieves", registry=r)
        self.miss_tokens = Counter("kvdock_miss_tokens", "Whole-chunk tokens asked for and not found", registry=r)
        self.stored_chunks = Counter("kvdock_stored_chunks", "Chunks written", registry=r)
        self.deduped_chunks = Counter("kvdock_deduped_chunks", "Chunks skipped as already stored", registry=r)
        self.pool_full_chunks = Counter("kvdock_pool_full_chunks", "Chunks refused for lack of room", registry=r)
        self.stored_bytes = Counter("kvdock_stored_bytes", "Bytes written into L1", registry=r)
        self.retrieved_bytes = Counter("kvdock_retrieved_bytes", "Bytes handed out from L1", registry=r)
        self.evictions = Counter("kvdock_evictions", "Objects evicted from L1", registry=r)
        self.expired_sessions = Counter("kvdock_expired_sessions", "Sessions whose lease ran out", registry=r)
        self.l1_used = Gauge("kvdock_l1_used_bytes", "L1 bytes in slots", registry=r)
        self.l1_capacity = Gauge("kvdock_l1_capacity_bytes", "L1 pool capacity", registry=r)
        self.l1_objects = Gauge("kvdock_l1_objects", "READY objects in L1", registry=r)
        self.sessions = Gauge("kvdock_sessions", "Open sessions", registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)

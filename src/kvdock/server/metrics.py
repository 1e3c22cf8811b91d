"""Prometheus metrics of one server (its own registry, so several servers can live in one process).

Latency histograms (buckets :data:`LATENCY_BUCKETS`, 10 µs to 10 s), all measured on the server:

* ``kvdock_request_duration_seconds{operation, request, transport}``: from a request's arrival to
  its reply being handed to the transport (a reply that waits for a lower tier included), or to
  the end of its handling for a message no reply answers (``FastReads``).
  ``operation`` is ``lookup``, ``retrieve``, ``store`` or ``other`` (:data:`OPERATIONS`), ``request``
  the message (a retrieve is PrepareRetrieve, then CommitRetrieve), ``transport`` the client's
  (``shm``, ``inline``; ``none`` before it registered). Fast reads never reach the server
  (``kvdock_fast_reads_total`` counts them); the reports a client sends of them later
  (``FastReads``, operation ``other``: the server's LRU touches of what was read) are in it, and
  in ``kvdock_tenant_requests_total{operation="other"}``.
* ``kvdock_tier_read_duration_seconds{tier}`` / ``kvdock_tier_write_duration_seconds{tier}``: one
  read (hit or miss) or write-down of one object by the tier's client, on its thread.

Besides: the standard ``process_*`` and ``python_*`` metrics, and with tenants a per-tenant view
(``kvdock_tenant_requests_total{tenant, operation}``, ``kvdock_tenant_used_bytes`` /
``kvdock_tenant_quota_bytes{tenant, tier}``). ``docs/grafana-dashboard.json`` graphs them.

``/metrics`` needs no token, so the per-tenant series are kept apart (:attr:`Metrics.tenant_registry`)
and rendered only for the tenants a scrape may see (:meth:`Metrics.render`): every tenant with the
admin token, a tenant's own with its token, none without one (a tenant must not learn the others'
names, usage or activity: ``/status`` shows a tenant only its own usage too).

Each reply's observation uses cached label children (:meth:`Metrics.observe_request`): ``labels()``
costs about as much as the observation itself, on the server's hot path.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import fields
from typing import Any

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvdock.server.registry import Registry
from kvdock.storage import L1Store, StorageManager, TierCounters
from kvdock.storage.coherence import CoherenceCounters

# the *_created series double the output and nobody graphs them
disable_created_metrics()

LATENCY_BUCKETS = (
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
OPERATIONS = {
    "Lookup": "lookup",
    "LookupMany": "lookup",
    "PrepareRetrieve": "retrieve",
    "PrepareRetrieveMany": "retrieve",
    "CommitRetrieve": "retrieve",
    "PrepareStore": "store",
    "CommitStore": "store",
}


class Metrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("kvdock_requests", "Control-plane requests by op", ["op"], registry=r)
        self.errors = Counter("kvdock_errors", "Requests answered with an error, by code", ["code"], registry=r)
        self.stores = Counter("kvdock_stores", "Committed store requests", registry=r)
        self.retrieves = Counter("kvdock_retrieves", "Committed retrieve requests", registry=r)
        self.lookups = Counter("kvdock_lookups", "Lookup requests", registry=r)
        self.fast_reads = Counter(
            "kvdock_fast_reads", "Lookups and retrieves clients answered from the pool directory", ["op"], registry=r
        )
        self.fast_reads_untouched = Counter(
            "kvdock_fast_reads_untouched",
            "Chunks read from the pool directory whose LRU touch was skipped (a client over its touch budget)",
            registry=r,
        )
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
        self.expired_clients = Counter(
            "kvdock_expired_clients", "Client registrations forgotten after client_ttl of silence", registry=r
        )
        self.clients = Gauge("kvdock_clients", "Live client registrations", registry=r)
        self.models = Gauge("kvdock_models", "Registered models", registry=r)
        self.request_seconds = Histogram(
            "kvdock_request_duration_seconds",
            "Seconds from a request's arrival to its reply (to its handling's end for a message no reply answers), "
            "on the server, by operation, message and client transport",
            ["operation", "request", "transport"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        # per-tenant series: rendered only for a scrape entitled to see them (render)
        self.tenant_registry = CollectorRegistry()
        self.tenant_requests = Counter(
            "kvdock_tenant_requests",
            "Requests of a tenant's clients by operation",
            ["tenant", "operation"],
            registry=self.tenant_registry,
        )
        self.tier_read_seconds = Histogram(
            "kvdock_tier_read_duration_seconds",
            "Seconds one read of one object from the tier took (hit or miss)",
            ["tier"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tier_write_seconds = Histogram(
            "kvdock_tier_write_duration_seconds",
            "Seconds one write-down of one object to the tier took",
            ["tier"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        # the standard process_* (CPU, memory, file descriptors) and python_* (GC, version) metrics
        for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
            r.register(collector)
        self._tenants_watched = False
        # label children by (request type, transport) and (tenant, operation): bounded sets (message
        # classes, the server's transports, the tenants file's names), never values a client chose
        self._request_children: dict[tuple[str, str], Any] = {}
        self._tenant_children: dict[tuple[str, str], Any] = {}

    def observe_request(self, registry: Registry, req: object, started: float) -> None:
        """Record one request that arrived at ``started`` (time.perf_counter), answered now or, a
        message no reply answers (FastReads), handled now; a tenant's counts it too."""
        elapsed = time.perf_counter() - started
        name = type(req).__name__
        client = registry.clients.get(getattr(req, "client_id", None) or "")
        transport = client.transport if client is not None else "none"
        child = self._request_children.get((name, transport))
        if child is None:
            child = self.request_seconds.labels(OPERATIONS.get(name, "other"), name, transport)
            self._request_children[(name, transport)] = child
        child.observe(elapsed)
        if client is not None and client.tenant is not None:
            key = (client.tenant.name, OPERATIONS.get(name, "other"))
            counter = self._tenant_children.get(key)
            if counter is None:
                counter = self._tenant_children[key] = self.tenant_requests.labels(*key)
            counter.inc()

    def watch_tenants(self, usage: Callable[[], dict[str, dict[str, dict[str, int]]]]) -> None:
        """Export ``usage()`` (tenant -> tier -> used_bytes, quota_bytes) at every scrape (once)."""
        if not self._tenants_watched:
            self._tenants_watched = True
            self.tenant_registry.register(_TenantCollector(usage))

    def watch_registry(self, registry: Registry) -> None:
        """Export the number of live clients and registered models at every scrape."""
        self.clients.set_function(lambda: len(registry.clients))
        self.models.set_function(lambda: len(registry.models))

    def watch_tiers(self, manager: StorageManager) -> None:
        """Export the lower tiers' counters and usage at every scrape, and time each tier's reads
        and writes: the tier objects' ``read_into`` and ``write_from`` are wrapped (on the
        instance) in a timer that observes the tier's histograms."""
        self.registry.register(_TierCollector(manager))
        for lane in manager.lanes:
            tier = lane.tier
            setattr(tier, "read_into", _timed(tier.read_into, self.tier_read_seconds.labels(lane.name)))  # noqa: B010
            setattr(tier, "write_from", _timed(tier.write_from, self.tier_write_seconds.labels(lane.name)))  # noqa: B010

    def render(self, tenants: Collection[str] = ()) -> bytes:
        """The exposition text: every server-wide metric, and the per-tenant series of ``tenants``
        only (the names the scrape may see; empty: none)."""
        text = generate_latest(self.registry)
        if tenants:
            text += generate_latest(_OnlyTenants(self.tenant_registry, frozenset(tenants)))
        return text


_HELP = {
    "hits": "Objects promoted into L1 from the tier",
    "bytes_read": "Bytes read from the tier into L1",
    "read_seconds": "Seconds spent reading from the tier (divide by hits for the mean latency)",
    "writes": "Objects written down to the tier",
    "bytes_written": "Bytes written down to the tier",
    "write_seconds": "Seconds spent writing to the tier",
    "write_errors": "Failed writes to the tier",
    "writes_skipped": "Objects not written down (tier down, no room, or evicted from L1 before their turn)",
    "corrupted": "Torn or corrupted objects found in the tier (deleted, never returned)",
    "deletes": "Older versions deleted from the tier for an overwrite",
    "fenced": "Write-downs the tier refused as stale (an overwrite on another server replaced them)",
}

_COHERENCE_HELP = {
    "polls": "Polls of the L3 invalidation stream",
    "poll_errors": "Polls of the L3 invalidation stream that failed",
    "entries": "Invalidations applied (overwrites on any server sharing the L3)",
    "dropped": "L1 objects dropped by invalidations",
    "full_drops": "Gaps in the invalidation stream: every L1 and L2 object dropped",
    "lapses": "Times this server stopped vouching for L1/L2 (its poll came later than the bound)",
    "published": "Invalidations this server appended (its overwrites, two each)",
    "keep_rounds": "Rounds keeping the L3 floors of the overwrites' versions held in L1",
    "keep_dropped": "Overwrites' versions dropped: their L3 floor was gone or raised, or L3 held another version",
    "keep_repaired": "Overwrites' versions written to L3 again: their floor was kept, their value gone",
}


class _TierCollector(Collector):
    def __init__(self, manager: StorageManager) -> None:
        self.manager = manager

    def collect(self) -> Iterator[Metric]:
        lanes = self.manager.lanes
        for f in fields(TierCounters):
            fam = CounterMetricFamily(f"kvdock_tier_{f.name}", _HELP[f.name], labels=["tier"])
            for lane in lanes:
                fam.add_metric([lane.name], getattr(lane.counters, f.name))
            yield fam
        cancelled = CounterMetricFamily(
            "kvdock_tier_writes_cancelled",
            "Queued write-downs an overwrite's deletion cancelled (older versions it removes anyway)",
            labels=["tier"],
        )
        for lane in lanes:
            cancelled.add_metric([lane.name], lane.writes_cancelled)
        yield cancelled
        gauges = {
            "up": GaugeMetricFamily("kvdock_tier_up", "1 if the tier is reachable", labels=["tier"]),
            "used_bytes": GaugeMetricFamily("kvdock_tier_used_bytes", "Bytes stored in the tier", labels=["tier"]),
            "capacity_bytes": GaugeMetricFamily(
                "kvdock_tier_capacity_bytes", "Byte budget of the tier", labels=["tier"]
            ),
            "objects": GaugeMetricFamily("kvdock_tier_objects", "Objects in the tier", labels=["tier"]),
        }
        for lane in lanes:
            status = lane.tier.status()
            for name, gauge in gauges.items():
                if name in status:
                    gauge.add_metric([lane.name], float(status[name]))
        nodes = GaugeMetricFamily(
            "kvdock_tier_cluster_nodes", "Nodes of a clustered tier as its client sees them", labels=["tier", "role"]
        )
        down = GaugeMetricFamily(
            "kvdock_tier_cluster_nodes_down", "Cluster nodes the tier's last probe could not reach", labels=["tier"]
        )
        for lane in lanes:
            found = lane.tier.status().get("nodes")
            if found is None:
                continue
            roles = [n["role"] for n in found]
            for role in sorted(set(roles)):
                nodes.add_metric([lane.name, role], roles.count(role))
            down.add_metric([lane.name], sum(n["state"] != "up" for n in found))
        gauges["cluster_nodes"] = nodes
        gauges["cluster_nodes_down"] = down
        backlog = GaugeMetricFamily("kvdock_writeback_backlog_bytes", "Bytes queued for write-down to lower tiers")
        backlog.add_metric([], sum(lane.backlog_bytes for lane in lanes))
        quarantined = GaugeMetricFamily(
            "kvdock_quarantined_bytes", "L1 slots of expired sessions whose writer may still write them"
        )
        quarantined.add_metric([], self.manager.sessions.quarantined_bytes())
        yield from (*gauges.values(), backlog, quarantined)
        yield from _l1_eviction(self.manager.l1)
        coherence = self.manager.coherence
        if coherence is not None:
            vouched = GaugeMetricFamily("kvdock_coherence_vouched", "1 while L1/L2 are served (coherence bound)")
            vouched.add_metric([], float(coherence.vouched()))
            yield vouched
            for f in fields(CoherenceCounters):
                fam = CounterMetricFamily(f"kvdock_coherence_{f.name}", _COHERENCE_HELP[f.name])
                fam.add_metric([], getattr(coherence.counters, f.name))
                yield fam


def _timed(fn: Callable[..., Any], histogram: Any) -> Callable[..., Any]:
    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            histogram.observe(time.perf_counter() - t0)

    return timed


class _OnlyTenants(Collector):
    """``source``'s metrics with only the samples labelled with one of ``tenants``."""

    def __init__(self, source: CollectorRegistry, tenants: frozenset[str]) -> None:
        self.source = source
        self.tenants = tenants

    def collect(self) -> Iterator[Metric]:
        for metric in self.source.collect():
            kept = Metric(metric.name, metric.documentation, metric.type, metric.unit)
            kept.samples = [s for s in metric.samples if s.labels.get("tenant") in self.tenants]
            yield kept


class _TenantCollector(Collector):
    def __init__(self, usage: Callable[[], dict[str, dict[str, dict[str, int]]]]) -> None:
        self.usage = usage

    def collect(self) -> Iterator[Metric]:
        labels = ["tenant", "tier"]
        used = GaugeMetricFamily("kvdock_tenant_used_bytes", "Bytes a tenant holds in a tier", labels=labels)
        quota = GaugeMetricFamily("kvdock_tenant_quota_bytes", "A tenant's byte quota in a tier", labels=labels)
        for tenant, tiers in self.usage().items():
            for tier, doc in tiers.items():
                used.add_metric([tenant, tier], doc["used_bytes"])
                quota.add_metric([tenant, tier], doc["quota_bytes"])
        yield used
        yield quota


def _l1_eviction(l1: L1Store) -> Iterator[Metric]:
    """L1's eviction policy, evictions by reason, and the stores' waits for write-downs
    (storage.writeback)."""
    c = l1.counters
    policy = GaugeMetricFamily("kvdock_l1_eviction_policy", "The L1 eviction policy in use (1)", labels=["policy"])
    policy.add_metric([l1.policy], 1.0)
    by = CounterMetricFamily("kvdock_l1_evictions_by_reason", "L1 evictions for room, by reason", labels=["reason"])
    by.add_metric(["clean"], c.evicted_clean)
    by.add_metric(["dirty"], c.evicted_dirty)  # before their write-down: acknowledged data dropped
    throttled = CounterMetricFamily("kvdock_l1_throttled_stores", "Stores that waited for write-downs")
    throttled.add_metric([], c.throttled_stores)
    waited = CounterMetricFamily("kvdock_l1_throttle_seconds", "Seconds stores waited for write-downs")
    waited.add_metric([], c.throttle_seconds)
    timeouts = CounterMetricFamily(
        "kvdock_l1_throttle_timeouts", "Stores whose wait for write-downs ran out (dirty objects may go)"
    )
    timeouts.add_metric([], c.throttle_timeouts)
    yield from (policy, by, throttled, waited, timeouts)

"""/metrics as operators expect it (issue 27): latency histograms per operation and transport
(server side, 10 µs to 10 s), tier read/write latency, the standard process metrics, a per-tenant
view; and docs/grafana-dashboard.json names only metrics a real server exports."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import torch
from prometheus_client.parser import text_string_to_metric_families

import kvdock.sdk as kvd
from helpers import CHUNK, GEOMETRY, MODEL, make_kv, make_tokens, wait_for
from kvdock.protocol.requests import Ping
from kvdock.server.metrics import LATENCY_BUCKETS

DASHBOARD = Path(__file__).parents[2] / "docs" / "grafana-dashboard.json"
ADMIN = "admin-0123456789"
ACME = "acme-token-0123456789"


def scrape(srv, token: str = "") -> str:  # type: ignore[no-untyped-def]
    """The server's /metrics as a scrape with ``token`` (Authorization: Bearer) sees it."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with urllib.request.urlopen(urllib.request.Request(srv.http_url + "/metrics", headers=headers), timeout=10) as r:
        return str(r.read().decode())


def samples(srv, token: str = "") -> dict[str, list]:  # type: ignore[no-untyped-def]
    """Every sample of the server's /metrics by sample name (``x_bucket``, ``x_total``, ...)."""
    found: dict[str, list] = {}
    for family in text_string_to_metric_families(scrape(srv, token)):
        for s in family.samples:
            found.setdefault(s.name, []).append(s)
    return found


def _count(found: dict[str, list], name: str, **labels: str) -> float:
    return sum(s.value for s in found.get(name, []) if all(s.labels.get(k) == v for k, v in labels.items()))


def test_request_and_tier_latency_histograms(make_server, tmp_path) -> None:
    srv = make_server("--disk-dir", str(tmp_path / "l2"), "--disk-size", "64MiB")
    tokens = make_tokens(2 * CHUNK)
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as c:
        c.fast_reads = False  # every read through the server: these are what it times
        assert kvd.store(c, make_kv(2 * CHUNK), tokens)
        assert kvd.lookup(c, tokens) == 2 * CHUNK
        assert kvd.retrieve(c, tokens) is not None
    wait_for(lambda: _count(samples(srv), "kvdock_tier_write_duration_seconds_count", tier="l2") >= 2, "2 writes")
    found = samples(srv)
    for operation in ("lookup", "retrieve", "store"):
        assert _count(found, "kvdock_request_duration_seconds_count", operation=operation) >= 1, operation
    counts = found["kvdock_request_duration_seconds_count"]
    stores = {s.labels["request"] for s in counts if s.labels["operation"] == "store"}
    assert stores == {"PrepareStore", "CommitStore"}
    transports = {s.labels["transport"] for s in found["kvdock_request_duration_seconds_count"]
                  if s.labels["operation"] != "other"}  # fmt: skip
    assert transports <= {"shm", "inline"} and len(transports) == 1, transports
    # the buckets: 10 µs to 10 s, and +Inf holds every observation
    les = sorted({float(s.labels["le"]) for s in found["kvdock_request_duration_seconds_bucket"]})
    assert les[0] == 1e-5 and les[-2] == 10.0 and les[-1] == float("inf") and les[:-1] == list(LATENCY_BUCKETS)
    # tier latency: the write-downs to L2, then a read of what only L2 holds
    assert _count(found, "kvdock_tier_write_duration_seconds_count", tier="l2") == 2
    urllib.request.urlopen(urllib.request.Request(srv.http_url + "/admin/clear?tier=l1", method="POST"), timeout=10)
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as c:
        got = kvd.retrieve(c, tokens)
        assert got is not None and torch.equal(got, make_kv(2 * CHUNK))
    found = samples(srv)
    assert _count(found, "kvdock_tier_read_duration_seconds_count", tier="l2") >= 2
    assert _count(found, "kvdock_tier_read_duration_seconds_sum", tier="l2") > 0
    # the standard process metrics
    assert found["process_resident_memory_bytes"][0].value > 0
    assert "process_cpu_seconds_total" in found and "process_open_fds" in found


def test_the_reports_of_fast_reads_are_timed_as_requests_of_their_own(make_server) -> None:
    """A fast read never reaches the server, but the report of it does (at the latest before the
    client's next request: when exactly is the reporter's timing, not asserted) and takes the
    server's time (the LRU touches): it is in the request histogram as ``FastReads`` (operation
    ``other``), one observation per report, and nothing of it as a retrieve."""
    srv = make_server("--no-disk")
    tokens = make_tokens(2 * CHUNK)
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as c:
        assert kvd.store(c, make_kv(2 * CHUNK), tokens)
        assert torch.equal(kvd.retrieve(c, tokens), make_kv(2 * CHUNK))  # from the pool directory
        c.ask(Ping())  # what is held is reported before it, on the same connection: handled when it answers
        found = samples(srv)
    assert _count(found, "kvdock_fast_reads_total", op="retrieve") == 1
    assert _count(found, "kvdock_request_duration_seconds_count", operation="retrieve") == 0
    one = {"request": "FastReads", "operation": "other", "transport": "shm"}
    reports = _count(found, "kvdock_request_duration_seconds_count", **one)
    reads = _count(found, "kvdock_fast_reads_total")  # (the store's own lookup may be one too)
    assert 1 <= reports <= reads, (reports, reads)
    assert _count(found, "kvdock_request_duration_seconds_count", request="FastReads") == reports
    assert _count(found, "kvdock_request_duration_seconds_sum", **one) > 0


def test_a_per_tenant_view(make_server, tmp_path) -> None:
    path = tmp_path / "tenants.toml"
    path.write_text(f'[tenants.acme]\ntokens = ["{ACME}"]\nmodels = ["{MODEL}"]\nsalts = ["acme"]\nl2 = {2**20}\n')
    srv = make_server("--tenants", str(path), "--admin-token", ADMIN, "--disk-dir", str(tmp_path / "l2"),
                      "--disk-size", "64MiB", register=None)  # fmt: skip
    kvd.register_model(srv.url, srv.http_url, MODEL, dtype="bfloat16", **GEOMETRY, timeout=10, admin_token=ADMIN)
    tokens = make_tokens(CHUNK)
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10, token=ACME) as c:
        assert kvd.store(c, make_kv(CHUNK), tokens, cache_salt="acme")
        assert kvd.lookup(c, tokens, cache_salt="acme") == CHUNK
    wait_for(lambda: _count(samples(srv, ADMIN), "kvdock_tenant_used_bytes", tenant="acme", tier="l2") > 0, "acme")
    found = samples(srv, ADMIN)
    assert _count(found, "kvdock_tenant_quota_bytes", tenant="acme", tier="l2") == 2**20
    assert _count(found, "kvdock_tenant_requests_total", tenant="acme", operation="store") == 2  # prepare, commit
    assert _count(found, "kvdock_tenant_requests_total", tenant="acme", operation="lookup") >= 1


def declared(srv, token: str = "") -> set[str]:  # type: ignore[no-untyped-def]
    """The sample names of every family /metrics declares, also those without samples yet (a
    labelled counter nothing has counted)."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum")}
    return {
        f.name + suffix
        for f in text_string_to_metric_families(scrape(srv, token))
        for suffix in suffixes.get(f.type, ("",))
    }


# PromQL words that look like metric names but are not
_NOT_METRICS = {"sum", "rate", "by", "le", "histogram_quantile", "instance", "label_values"}


def dashboard_metrics() -> set[str]:
    doc = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in doc["panels"] for t in p["targets"]]
    exprs += [v["query"] for v in doc["templating"]["list"] if v["type"] == "query"]
    names = set()
    for expr in exprs:
        names |= {m for m in re.findall(r"\b((?:kvdock|process|python)_[a-z0-9_]+)\b", expr)}
    return names - _NOT_METRICS


def test_every_metric_the_grafana_dashboard_names_exists(make_server, redis_server, tmp_path) -> None:
    """One server with every part a metric may come from (L2, L3 with its coherence, tenants),
    after a store, a retrieve and a lookup: every sample name the dashboard queries is exported."""
    path = tmp_path / "tenants.toml"
    path.write_text(f'[tenants.acme]\ntokens = ["{ACME}"]\nmodels = ["{MODEL}"]\nsalts = ["acme"]\nl2 = {2**20}\n')
    srv = make_server("--tenants", str(path), "--admin-token", ADMIN, "--disk-dir", str(tmp_path / "l2"),
                      "--disk-size", "64MiB", "--redis-url", redis_server.url, register=None)  # fmt: skip
    kvd.register_model(srv.url, srv.http_url, MODEL, dtype="bfloat16", **GEOMETRY, timeout=10, admin_token=ADMIN)
    tokens = make_tokens(CHUNK)
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10, token=ACME) as c:
        assert kvd.store(c, make_kv(CHUNK), tokens, cache_salt="acme")
        assert kvd.retrieve(c, tokens, cache_salt="acme") is not None
    wait_for(lambda: "kvdock_tier_write_duration_seconds_bucket" in samples(srv), "a write-down")
    exported = set(samples(srv, ADMIN)) | declared(srv, ADMIN)  # Prometheus scrapes with the admin token
    named = dashboard_metrics()
    assert len(named) >= 25, sorted(named)
    assert sorted(named - exported) == []


def test_metrics_show_a_tenant_no_other_tenants_series(make_server, tmp_path) -> None:
    """/metrics needs no token, so its per-tenant series are the admin's (every tenant) or a
    tenant's own (its token): an anonymous scrape and another tenant see neither acme's name, nor
    its usage, nor its activity (review R2: every tenant's were open to all)."""
    beta = "beta-token-0123456789"
    path = tmp_path / "tenants.toml"
    path.write_text(
        f'[tenants.acme]\ntokens = ["{ACME}"]\nmodels = ["{MODEL}"]\nsalts = ["acme"]\nl2 = {2**20}\n'
        f'[tenants.beta]\ntokens = ["{beta}"]\nmodels = ["{MODEL}"]\nsalts = ["beta"]\nl2 = {2**20}\n'
    )
    srv = make_server("--tenants", str(path), "--admin-token", ADMIN, "--disk-dir", str(tmp_path / "l2"),
                      "--disk-size", "64MiB", register=None)  # fmt: skip
    kvd.register_model(srv.url, srv.http_url, MODEL, dtype="bfloat16", **GEOMETRY, timeout=10, admin_token=ADMIN)
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10, token=ACME) as c:
        assert kvd.store(c, make_kv(CHUNK), make_tokens(CHUNK), cache_salt="acme")
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10, token=beta) as c:
        assert kvd.lookup(c, make_tokens(CHUNK), cache_salt="beta") == 0

    def tenants_in(token: str) -> set[str]:
        return {s.labels["tenant"] for name, found in samples(srv, token).items()
                if name.startswith("kvdock_tenant_") for s in found}  # fmt: skip

    wait_for(lambda: _count(samples(srv, ADMIN), "kvdock_tenant_used_bytes", tenant="acme", tier="l2") > 0, "acme")
    assert tenants_in(ADMIN) == {"acme", "beta"}
    assert tenants_in(ACME) == {"acme"}
    assert tenants_in(beta) == {"beta"}
    for token in ("", "not-a-token"):
        text = scrape(srv, token)
        assert "kvdock_tenant_" not in text and "acme" not in text and "beta" not in text, token
        assert _count(samples(srv, token), "kvdock_request_duration_seconds_count", operation="store") == 2
    # a tenant sees its own activity and usage, and none of the other's
    found = samples(srv, beta)
    assert _count(found, "kvdock_tenant_requests_total", tenant="beta", operation="lookup") >= 1
    assert _count(found, "kvdock_tenant_requests_total", tenant="acme") == 0
    assert _count(samples(srv, ACME), "kvdock_tenant_quota_bytes", tenant="acme", tier="l2") == 2**20

"""``writes_cancelled`` (storage/lane.py: queued write-downs an overwrite's deletion made moot) in
/status (per tier) and /metrics, after a real overwrite through a real server with a slow L2."""

from __future__ import annotations

import urllib.request

import torch
from prometheus_client.parser import text_string_to_metric_families

import kvdock.sdk as kvd
from helpers import CHUNK, MODEL, make_kv, make_tokens, wait_for


def _metric(srv, name: str, tier: str) -> float:  # type: ignore[no-untyped-def]
    with urllib.request.urlopen(srv.http_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and s.labels.get("tier") == tier
    )


def test_an_overwrite_cancels_the_queued_write_downs_of_its_older_version(make_server, tmp_path) -> None:
    # every L2 write and delete takes 0.4 s: a 4-chunk prompt X makes a backlog of 1.6 s, the
    # 3 chunks of v1 queue behind it, and the overwrite's deletion goes ahead of X's queued writes
    # and cancels v1's three (lane.py TierLane.delete), however the threads are scheduled: the
    # overwrite comes long before X's backlog is written
    srv = make_server(
        "--disk-dir", str(tmp_path / "l2"), "--disk-size", "64MiB", env={"KVDOCK_FAULT_L2_WRITE_DELAY_S": "0.4"}
    )
    other, tokens = make_tokens(4 * CHUNK, start=500_000), make_tokens(3 * CHUNK)
    old, new = make_kv(3 * CHUNK, seed=1), make_kv(3 * CHUNK, seed=2)
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=60) as c:
        assert kvd.store(c, make_kv(4 * CHUNK, seed=3), other)
        assert kvd.store(c, old, tokens)
        assert kvd.store(c, new, tokens, overwrite=True)
        l2 = srv.get("/status")["tiers"]["l2"]
        assert l2["writes_cancelled"] == 3, l2
        wait_for(lambda: srv.get("/status")["tiers"]["writeback_backlog_bytes"] == 0, "the backlog written", 60)
        l2 = srv.get("/status")["tiers"]["l2"]
        # X's 4 and v2's 3 written, v1's 3 cancelled (never written, never skipped), its keys deleted
        assert (l2["writes"], l2["writes_cancelled"], l2["writes_skipped"], l2["deletes"]) == (7, 3, 0, 3), l2
        assert _metric(srv, "kvdock_tier_writes_cancelled_total", "l2") == 3
        # L2 holds the new version only: with L1 cleared, the retrieve promotes v2 from L2
        urllib.request.urlopen(urllib.request.Request(srv.http_url + "/admin/clear?tier=l1", method="POST"), timeout=10)
        got = kvd.retrieve(c, tokens)
        assert got is not None and torch.equal(got, new)

"""The coherence bound, measured on real processes: two servers on one Redis Cluster, overwrites
through A, and how long B keeps serving the version each of them replaced (its L1, read through
the server and from the pool directory). benchmarks/fleet.py is the soak of the same thing."""

from __future__ import annotations

import time

import torch
from tests.helpers import CHUNK, MODEL, make_kv, make_tokens, wait_for

import kvdock.sdk as kvd
from kvdock.testing import RedisCluster

BOUND_S = 0.1  # --l3-coherence-ms, the default
MARGIN_S = 1.0  # what a window may take on a loaded 2-core machine
OVERWRITES = 10


def _versions(got: torch.Tensor | None, kvs: list[torch.Tensor]) -> list[int]:
    """Which version each retrieved chunk is; AssertionError for a chunk of no version."""
    if got is None:
        return []
    out = []
    for i in range(got.shape[2] // CHUNK):
        span = slice(i * CHUNK, (i + 1) * CHUNK)
        match = [v for v, kv in enumerate(kvs) if torch.equal(got[:, :, span], kv[:, :, span])]
        assert len(match) == 1, f"chunk {i} matches versions {match}"
        out.append(match[0])
    return out


def test_b_stops_serving_each_version_overwritten_through_a_within_the_bound(
    make_server, redis_cluster: RedisCluster
) -> None:
    a = make_server("--redis-url", redis_cluster.url, "--no-disk")
    b = make_server("--redis-url", redis_cluster.url, "--no-disk")
    for s in (a, b):
        wait_for(lambda s=s: s.get("/status")["tiers"]["l3"]["coherence"]["vouched"], "the server to vouch")
    tokens = make_tokens(2 * CHUNK, start=11_000_000)
    kvs = [make_kv(2 * CHUNK, seed=100 + v) for v in range(OVERWRITES + 1)]
    ca = kvd.connect(a.url, a.http_url, MODEL, timeout=10)
    fast = kvd.connect(b.url, b.http_url, MODEL, timeout=10)
    slow = kvd.connect(b.url, b.http_url, MODEL, timeout=10)
    slow.fast_reads = False
    windows: list[float] = []
    try:
        assert kvd.store(ca, kvs[0], tokens)
        for v in range(1, OVERWRITES + 1):
            # B holds the version about to be replaced in its L1 (loaded from L3 once A wrote it down)
            wait_for(lambda v=v: _versions(kvd.retrieve(slow, tokens), kvs) == [v - 1] * 2, f"B to serve {v - 1}")
            stored = kvd.store_chunks(ca, kvs[v], tokens, overwrite=True)
            acked = time.monotonic()
            assert stored == kvd.StoreResult(2, 0, 0, 0), f"overwrite {v} through A: {stored}"
            reads: list[tuple[float, list[int]]] = []
            while True:
                t0 = time.monotonic()
                got = _versions(kvd.retrieve((fast, slow)[len(reads) % 2], tokens), kvs)
                reads.append((t0, got))
                assert len(set(got)) <= 1, f"B returned a mixed prefix {got} {t0 - acked:.3f} s after the ack"
                assert set(got) <= {v - 1, v}, f"B returned versions {got} while {v} was acknowledged"
                if t0 - acked > MARGIN_S or (t0 - acked > BOUND_S * 2 and reads[-1][1] != [v - 1] * 2):
                    break
            late = [(round(t - acked, 3), g) for t, g in reads if t >= acked + BOUND_S and v - 1 in g]
            assert late == [], f"overwrite {v}: B served the replaced version to reads started after the bound"
            # the window: until the first read after which B served the replaced version no more
            last_old = max((i for i, (_t, g) in enumerate(reads) if v - 1 in g), default=-1)
            windows.append(reads[last_old + 1][0] - acked)
            assert windows[-1] < MARGIN_S, f"overwrite {v}: B served the replaced version for {windows[-1]:.3f} s"
        assert len(windows) == OVERWRITES
        st = b.get("/status")["tiers"]["l3"]["coherence"]
        assert st["entries_applied"] >= 2 * OVERWRITES and st["l1_dropped"] >= OVERWRITES, st
        assert kvd.check_server_integrity(fast) == []
    finally:
        for c in (ca, fast, slow):
            kvd.close(c)

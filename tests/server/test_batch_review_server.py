"""R-BATCH review (wave 4): ``--writeback-dirty-limit`` through a real server (in process: real
sockets, shared memory, a slow L2 through KVDOCK_FAULT_L2_WRITE_DELAY_S). The strict xfail is a
finding (its reason names the fix)."""

from __future__ import annotations

import time

import pytest
import torch

import kvdock.sdk as kvd
from helpers import CHUNK, MODEL, make_kv, make_tokens


def test_a_store_past_the_dirty_limit_stores_every_chunk_and_waits_at_most_the_bound(make_server, tmp_path) -> None:
    # 128 slots, dirty limit 0.05 (6 slots), each L2 write 0.1 s: a 40-chunk prompt leaves ~39
    # dirty chunks; a second prompt of 8 chunks waits (bounded by --writeback-wait-s 1.5), then
    # is stored whole; nothing acknowledged is dropped (no dirty eviction, no skipped write)
    srv = make_server(
        "--disk-dir", str(tmp_path / "l2"), "--disk-size", "64MiB",
        "--writeback-dirty-limit", "0.05", "--writeback-wait-s", "1.5",
        l1_size="512KiB", env={"KVDOCK_FAULT_L2_WRITE_DELAY_S": "0.1"},
    )  # fmt: skip
    a, b = make_tokens(40 * CHUNK), make_tokens(8 * CHUNK, start=700_000)
    kva, kvb = make_kv(40 * CHUNK, seed=1), make_kv(8 * CHUNK, seed=2)
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=60) as c:
        assert kvd.store(c, kva, a)
        t0 = time.monotonic()
        assert kvd.store(c, kvb, b)
        took = time.monotonic() - t0
        assert 0.5 < took < 1.5 + 3, took  # it waited, boundedly
        ev = srv.get("/status")["l1"]["eviction"]
        assert ev["throttled_stores"] >= 1 and ev["evicted_dirty"] == 0, ev
        for tokens, kv in ((a, kva), (b, kvb)):
            got = kvd.retrieve(c, tokens)
            assert got is not None and torch.equal(got, kv)


def test_a_store_that_writes_nothing_never_waits_for_the_dirty_limit(make_server, tmp_path) -> None:
    """A prompt stored again whole (every chunk deduped in L1: nothing to reserve, no room
    needed) must not wait for write-downs; today it waits the whole --writeback-wait-s whenever
    L1's dirty share is past the limit (writeback.needs_wait: dirty_now + 0 > limit)."""

    srv = make_server(
        "--disk-dir", str(tmp_path / "l2"), "--disk-size", "64MiB",
        "--writeback-dirty-limit", "0.05", "--writeback-wait-s", "1.5",
        l1_size="512KiB", env={"KVDOCK_FAULT_L2_WRITE_DELAY_S": "0.1"},
    )  # fmt: skip
    a = make_tokens(40 * CHUNK)
    kva = make_kv(40 * CHUNK, seed=1)
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=60) as c:
        assert kvd.store(c, kva, a)
        before = srv.get("/status")["l1"]["eviction"]["throttled_stores"]
        t0 = time.monotonic()
        kvd.store(c, kva, a)  # the same prompt again: all deduped
        took = time.monotonic() - t0
        waited = srv.get("/status")["l1"]["eviction"]["throttled_stores"] - before
        if took >= 1.0 or waited:
            pytest.fail(f"a store that writes nothing waited {took:.2f} s (throttled_stores +{waited})")

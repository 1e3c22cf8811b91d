"""LRU eviction in a real server's small pool: pinned objects stay, least recently used go first."""

from __future__ import annotations

import time

import pytest
import torch

import kvdock.sdk as kvd
from helpers import CHUNK, MODEL, make_kv, make_tokens
from kvdock.keys import normalize_tokens
from kvdock.protocol import messages as m


def _tok(name: str) -> list[int]:
    # one chunk per name, distinct first token so every chunk is its own prefix
    return make_tokens(CHUNK, start=1000 * (ord(name) - ord("A") + 1))


def _pin(c: kvd.KVCacheContext, name: str) -> None:
    reply = c.call(m.PrepareRetrieve(c.client_id, f"pin-{name}", normalize_tokens(_tok(name)).tobytes())).reply
    assert len(reply.slots) == 1


def _unpin(c: kvd.KVCacheContext, name: str) -> None:
    c.call(m.CommitRetrieve(c.client_id, f"pin-{name}"))


def test_lru_order_and_pins(make_server) -> None:
    srv = make_server("--eviction-policy", "lru", l1_size="16KiB")  # exactly four 4 KiB slots
    kvs = {n: make_kv(CHUNK, seed=i) for i, n in enumerate("ABCDEFGH")}
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=5) as c:
        for n in "ABCD":
            assert kvd.store(c, kvs[n], _tok(n))
        assert torch.equal(kvd.retrieve(c, _tok("A")), kvs["A"])  # A becomes most recently used
        _pin(c, "B")  # LRU now: C, D, A (B pinned)
        for new, evicted in (("E", "C"), ("F", "D"), ("G", "A")):
            assert kvd.store(c, kvs[new], _tok(new))
            assert kvd.lookup(c, _tok(evicted)) == 0, f"{new} should have evicted {evicted}"
            assert kvd.check_server_integrity(c) == []
        present = {n: kvd.lookup(c, _tok(n)) == CHUNK for n in "ABCDEFG"}
        assert present == {"A": False, "B": True, "C": False, "D": False, "E": True, "F": True, "G": True}
        assert torch.equal(kvd.retrieve(c, _tok("B")), kvs["B"])  # pinned object intact
        for n in "EFG":
            _pin(c, n)
        with pytest.raises(kvd.PoolFullError):
            kvd.store(c, kvs["H"], _tok("H"))
        for n in "BEFG":
            _unpin(c, n)
        assert kvd.store(c, kvs["H"], _tok("H"))
        assert kvd.check_server_integrity(c) == []
    status = srv.get("/status")
    assert status["l1"]["evictions"] == 4 and status["l1"]["objects"] == 4 and status["sessions"] == 0
    metrics = srv.text("/metrics")
    assert "kvdock_evictions_total 4.0" in metrics


@pytest.mark.parametrize(("policy", "kept"), [("lru", "EFGH"), ("s3fifo", "AFGH")])
def test_a_scan_of_new_chunks_keeps_a_read_chunk_under_s3fifo(make_server, policy: str, kept: str) -> None:
    srv = make_server("--eviction-policy", policy, l1_size="16KiB")  # four slots
    kvs = {n: make_kv(CHUNK, seed=i) for i, n in enumerate("ABCDEFGH")}
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=5) as c:
        for n in "ABCD":
            assert kvd.store(c, kvs[n], _tok(n))
        assert torch.equal(kvd.retrieve(c, _tok("A")), kvs["A"])  # A is read once
        for n in "EFGH":  # a scan of chunks nobody reads again
            assert kvd.store(c, kvs[n], _tok(n))
            assert kvd.check_server_integrity(c) == []
        present = "".join(n for n in "ABCDEFGH" if kvd.lookup(c, _tok(n)) == CHUNK)
        assert present == kept
    status = srv.get("/status")["l1"]
    assert status["eviction"]["eviction_policy"] == policy and status["evictions"] == 4


# ---------------------------------------------------------------- clean before dirty (issue 28)
# 16 MiB of L1 = 32 slots of 512 KiB chunks, an L2 below, 12 prompts of 4 chunks stored back to
# back (48 chunks: L1 must evict), then every prompt retrieved once the write-downs are done.

BIG = "big"
BIG_GEOMETRY = {"num_layers": 8, "num_kv_heads": 8, "head_dim": 128}  # 512 KiB per 16-token chunk
PROMPTS, CHUNKS_PER_PROMPT = 12, 4


def _big_kv(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    d = BIG_GEOMETRY["num_kv_heads"] * BIG_GEOMETRY["head_dim"]
    return torch.randn(2, BIG_GEOMETRY["num_layers"], CHUNK * CHUNKS_PER_PROMPT, d, generator=g).to(torch.bfloat16)


def _prompt(i: int) -> list[int]:
    return make_tokens(CHUNK * CHUNKS_PER_PROMPT, start=100_000 * (i + 1))


def _l2_idle(srv, deadline_s: float = 120.0) -> dict:  # type: ignore[no-untyped-def, type-arg]
    deadline = time.monotonic() + deadline_s
    while True:
        status = srv.get("/status")
        if status["tiers"]["writeback_backlog_bytes"] == 0:
            return status  # type: ignore[no-any-return]
        assert time.monotonic() < deadline, f"write-downs still queued after {deadline_s} s: {status['tiers']}"
        time.sleep(0.05)


def _store_burst(make_server, tmp_path, delay_s: str, wait_s: str):  # type: ignore[no-untyped-def]
    srv = make_server(
        "--disk-dir",
        str(tmp_path / "l2"),
        "--writeback-wait-s",
        wait_s,
        l1_size="16MiB",
        register=None,
        env={"KVDOCK_FAULT_L2_WRITE_DELAY_S": delay_s},
    )
    kvd.register_model(srv.url, srv.http_url, BIG, dtype="bfloat16", **BIG_GEOMETRY, timeout=30)
    kvs = [_big_kv(i) for i in range(PROMPTS)]
    ctx = kvd.connect(srv.url, srv.http_url, BIG, timeout=120)
    status = srv.get("/status")
    assert status["l1"]["capacity_bytes"] // (512 * 1024) == 32, status["l1"]
    for i, kv in enumerate(kvs):  # back to back, faster than a slow disk writes them
        result = kvd.store_chunks(ctx, kv, _prompt(i))
        assert (result.stored_chunks, result.pool_full_chunks, result.in_flight_chunks) == (CHUNKS_PER_PROMPT, 0, 0)
    return srv, ctx, kvs, _l2_idle(srv)


@pytest.mark.subprocess_server
@pytest.mark.parametrize("delay_s", ["0", "0.025"], ids=["disk", "slow-disk"])
def test_a_burst_larger_than_l1_loses_nothing_acknowledged(make_server, tmp_path, delay_s: str) -> None:
    srv, ctx, kvs, status = _store_burst(make_server, tmp_path, delay_s, wait_s="60")
    with ctx:
        l1, l2 = {**status["l1"], **status["l1"]["eviction"]}, status["tiers"]["l2"]
        assert (l2["writes_skipped"], l2["write_errors"], l2["writes"]) == (0, 0, PROMPTS * CHUNKS_PER_PROMPT)
        assert (l1["evicted_dirty"], l1["throttle_timeouts"]) == (0, 0)
        assert l1["evicted_clean"] == l1["evictions"] == PROMPTS * CHUNKS_PER_PROMPT - 32
        if delay_s != "0":
            assert l1["throttled_stores"] > 0 and l1["throttle_seconds"] > 0  # the stores waited for the disk
        for i, kv in enumerate(kvs):  # every prompt whole, from L1 or promoted from L2
            assert kvd.lookup(ctx, _prompt(i)) == CHUNK * CHUNKS_PER_PROMPT, f"prompt {i} is not whole"
            assert torch.equal(kvd.retrieve(ctx, _prompt(i)), kv), f"prompt {i} came back wrong"
        assert kvd.check_server_integrity(ctx) == []
    after = srv.get("/status")
    assert after["tiers"]["l2"]["writes_skipped"] == 0
    rate = after["hit_rate"]  # every retrieve whole: from L1, or promoted from L2
    assert rate["all"] == 1.0 and rate["l2"] > 0 and rate["l1"] + rate["l2"] == pytest.approx(1.0, abs=1e-3), rate
    metrics = srv.text("/metrics")
    assert 'kvdock_l1_eviction_policy{policy="s3fifo"} 1.0' in metrics  # the server's default
    clean = float(after["l1"]["eviction"]["evicted_clean"])
    assert f'kvdock_l1_evictions_by_reason_total{{reason="clean"}} {clean}' in metrics
    assert 'kvdock_l1_evictions_by_reason_total{reason="dirty"} 0.0' in metrics


@pytest.mark.subprocess_server
def test_a_disk_slower_than_the_wait_drops_tails_first_and_counts_them(make_server, tmp_path) -> None:
    # each write takes 0.1 s and a store waits at most 0.05 s: past 32 dirty chunks, the stores
    # (which never fail) evict unwritten chunks, newest first
    srv, ctx, kvs, status = _store_burst(make_server, tmp_path, "0.1", wait_s="0.05")
    with ctx:
        l1, l2 = {**status["l1"], **status["l1"]["eviction"]}, status["tiers"]["l2"]
        dropped = l1["evicted_dirty"]
        assert dropped > 0 and l1["throttle_timeouts"] > 0, l1
        assert l1["evicted_dirty_bytes"] == dropped * 512 * 1024
        assert l2["writes_skipped"] == dropped and l2["writes"] == PROMPTS * CHUNKS_PER_PROMPT - dropped
        assert "before its write-down" in srv.log()  # logged (once a minute at most)
        whole = 0
        for i, kv in enumerate(kvs):  # what is left of each prompt is a prefix, never a tail alone
            n = kvd.lookup(ctx, _prompt(i)) // CHUNK
            whole += n
            if n:
                assert torch.equal(kvd.retrieve(ctx, _prompt(i)), kv[:, :, : n * CHUNK]), f"prompt {i} wrong"
        # every chunk still stored (all were written down but the dropped ones) is reachable
        assert whole == l2["objects"] == PROMPTS * CHUNKS_PER_PROMPT - dropped
        assert kvd.check_server_integrity(ctx) == []

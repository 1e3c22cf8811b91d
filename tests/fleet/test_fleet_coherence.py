"""Several real servers sharing one L3 (a Redis, a Redis Cluster): an overwrite acknowledged
through one of them is what every server serves within the coherence bound (storage.coherence)."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request

import pytest
import torch
from tests.helpers import CHUNK, MODEL, make_kv, make_tokens, wait_for
from tests.server.test_overwrite import versions_of

import kvdock.sdk as kvd

BOUND_MS = 100


def _retrieve(ctx: kvd.KVCacheContext, tokens: list[int]) -> torch.Tensor | None:
    return kvd.retrieve(ctx, tokens)


def _status(srv) -> dict:
    return srv.get("/status")["tiers"]["l3"]["coherence"]


def _wait_vouched(srv) -> None:
    wait_for(lambda: _status(srv)["vouched"], "the server to vouch for its L1")


def fleet(make_server, redis_server, n: int, *extra: str) -> list:  # type: ignore[no-untyped-def]
    """``n`` servers (no disk; ``extra``: more flags) sharing ``redis_server`` as their L3, each
    vouching for its L1."""
    servers = [make_server("--redis-url", redis_server.url, "--no-disk", *extra) for _ in range(n)]
    for s in servers:
        _wait_vouched(s)
    return servers


def test_an_overwrite_through_one_server_is_served_by_the_others_within_the_bound(make_server, redis_server) -> None:
    servers = fleet(make_server, redis_server, 3)
    tokens = make_tokens(3 * CHUNK, start=7_000_000)
    old, new = make_kv(3 * CHUNK, seed=1), make_kv(3 * CHUNK, seed=2)
    ctxs = [kvd.connect(s.url, s.http_url, MODEL, timeout=10) for s in servers]
    try:
        assert kvd.store(ctxs[0], old, tokens)
        for s in servers:  # the old version reaches L3, then every server's L1
            wait_for(lambda s=s: s.get("/status")["tiers"]["writeback_backlog_bytes"] == 0, "write-downs")
        for c in ctxs:
            assert versions_of(_retrieve(c, tokens), {1: old, 2: new}) == [1, 1, 1]
        assert kvd.store(ctxs[0], new, tokens, overwrite=True)
        acked = time.monotonic()
        # B and C still hold the old version in L1 (and in their pool directories)
        seen: dict[int, float] = {}
        deadline = acked + 5
        while len(seen) < 2 and time.monotonic() < deadline:
            for i in (1, 2):
                got = versions_of(_retrieve(ctxs[i], tokens), {1: old, 2: new})
                assert 1 not in got or time.monotonic() - acked < BOUND_MS / 1000 * 20, (
                    f"server {i} serves the replaced version {time.monotonic() - acked:.3f} s after the ack"
                )
                if 1 not in got:
                    seen.setdefault(i, time.monotonic() - acked)
        assert len(seen) == 2, f"servers still serve the replaced version after 5 s: {seen}"
        for c in ctxs:
            assert set(versions_of(_retrieve(c, tokens), {1: old, 2: new})) <= {2}
            assert kvd.check_server_integrity(c) == []
        assert _status(servers[1])["entries_applied"] >= 2
        assert _status(servers[0])["published"] == 2
    finally:
        for c in ctxs:
            kvd.close(c)


def test_a_server_cut_off_from_l3_serves_nothing_it_cannot_vouch_for(make_server, redis_server) -> None:
    # (the lookup after the SIGSTOP waits out the L3 client's timeout: 1 s here, the default 5 s
    # took 6 s; the same path either way)
    srv = make_server("--redis-url", redis_server.url, "--no-disk", "--redis-timeout-s", "1")
    _wait_vouched(srv)
    tokens = make_tokens(2 * CHUNK, start=8_000_000)
    kv = make_kv(2 * CHUNK, seed=5)
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as c:
        assert kvd.store(c, kv, tokens)
        assert kvd.lookup(c, tokens) == 2 * CHUNK
        os.kill(redis_server.proc.pid, signal.SIGSTOP)  # L3 stops answering
        try:
            wait_for(lambda: not _status(srv)["vouched"], "the server to stop vouching")
            assert kvd.lookup(c, tokens) == 0
            assert kvd.retrieve(c, tokens) is None
        finally:
            os.kill(redis_server.proc.pid, signal.SIGCONT)
        wait_for(lambda: _status(srv)["vouched"], "the server to vouch again")
        assert torch.equal(kvd.retrieve(c, tokens), kv)
        assert kvd.check_server_integrity(c) == []


def test_http_clear_of_a_tier_keeps_the_coherence_status(make_server, redis_server) -> None:
    srv = make_server("--redis-url", redis_server.url, "--no-disk", "--l3-coherence-ms", "250")
    _wait_vouched(srv)
    st = _status(srv)
    assert st["bound_ms"] == 250 and st["polls"] >= 1
    urllib.request.urlopen(urllib.request.Request(srv.http_url + "/admin/clear?tier=l1", method="POST")).read()
    assert _status(srv)["vouched"]


@pytest.mark.subprocess_server  # the command line's refusal
@pytest.mark.parametrize("ms", ["0", "-5"])
def test_a_bound_that_is_not_positive_is_refused(make_server, redis_server, ms: str) -> None:
    with pytest.raises(RuntimeError, match="l3_coherence_ms must be positive"):
        make_server("--redis-url", redis_server.url, "--l3-coherence-ms", ms)


@pytest.mark.subprocess_server
def test_a_server_restarted_on_its_l2_replays_the_overwrites_it_missed(make_server, redis_server, tmp_path) -> None:
    disk = tmp_path / "l2-a"
    a = make_server("--redis-url", redis_server.url, "--disk-dir", str(disk))
    b = make_server("--redis-url", redis_server.url, "--no-disk")
    for s in (a, b):
        _wait_vouched(s)
    edited, kept = make_tokens(2 * CHUNK, start=9_000_000), make_tokens(2 * CHUNK, start=9_500_000)
    old, new, other = make_kv(2 * CHUNK, seed=1), make_kv(2 * CHUNK, seed=2), make_kv(2 * CHUNK, seed=3)
    with kvd.connect(a.url, a.http_url, MODEL, timeout=10) as ca:
        assert kvd.store(ca, old, edited) and kvd.store(ca, other, kept)
    wait_for(lambda: a.get("/status")["tiers"]["writeback_backlog_bytes"] == 0, "A's write-downs")
    assert a.stop() == 0
    assert (disk / "coherence.pos").exists()
    with kvd.connect(b.url, b.http_url, MODEL, timeout=10) as cb:
        assert kvd.store(cb, new, edited, overwrite=True)  # acknowledged while A is down
    wait_for(lambda: b.get("/status")["tiers"]["writeback_backlog_bytes"] == 0, "B's write-downs")
    a2 = make_server("--redis-url", redis_server.url, "--disk-dir", str(disk), register=None)
    _wait_vouched(a2)
    with kvd.connect(a2.url, a2.http_url, MODEL, timeout=10) as ca2:
        got = versions_of(kvd.retrieve(ca2, edited), {1: old, 2: new})
        tiers = a2.get("/status")["tiers"]
        assert got == [2, 2], f"A serves versions {got} after its restart: {tiers}"
        assert torch.equal(kvd.retrieve(ca2, kept), other)  # replayed, not cleared: A's other L2 objects stay
        assert kvd.check_server_integrity(ca2) == []
    assert "cleared" not in a2.log()


def test_metrics_show_the_coherence(make_server, redis_server) -> None:
    srv = make_server("--redis-url", redis_server.url, "--no-disk")
    _wait_vouched(srv)
    assert srv.metric("kvdock_coherence_vouched") == 1.0
    assert srv.metric("kvdock_coherence_polls_total") >= 1
    assert srv.metric("kvdock_tier_fenced_total{tier=\"l3\"}") == 0
    os.kill(redis_server.proc.pid, signal.SIGSTOP)
    try:
        wait_for(lambda: srv.metric("kvdock_coherence_vouched") == 0.0, "the gauge to drop")
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
    wait_for(lambda: srv.metric("kvdock_coherence_vouched") == 1.0, "the gauge to come back")
    assert srv.metric("kvdock_coherence_lapses_total") >= 1


def _master_of(cluster, key: str) -> int:
    """The port of the master serving ``key``'s slot."""
    slot = int(cluster.cli(cluster.ports[0], "cluster", "keyslot", key).strip())
    for rng in json.loads(cluster.cli(cluster.ports[0], "--json", "cluster", "slots")):
        if rng[0] <= slot <= rng[1]:
            return int(rng[2][1])
    raise AssertionError(f"no master for slot {slot}")


def test_overwrites_stay_coherent_through_a_failover_of_the_streams_master(make_server, redis_cluster) -> None:
    a = make_server("--redis-url", redis_cluster.url, "--no-disk")
    b = make_server("--redis-url", redis_cluster.url, "--no-disk")
    for s in (a, b):
        _wait_vouched(s)
    tokens = make_tokens(2 * CHUNK, start=11_000_000)
    versions = {v: make_kv(2 * CHUNK, seed=100 + v) for v in range(1, 4)}
    with (
        kvd.connect(a.url, a.http_url, MODEL, timeout=10) as ca,
        kvd.connect(b.url, b.http_url, MODEL, timeout=10) as cb,
    ):
        assert kvd.store(ca, versions[1], tokens)
        wait_for(lambda: versions_of(kvd.retrieve(cb, tokens), versions) == [1, 1], "B to read version 1")
        assert kvd.store(ca, versions[2], tokens, overwrite=True)
        wait_for(lambda: 1 not in versions_of(kvd.retrieve(cb, tokens), versions), "B to drop version 1", 2)
        redis_cluster.kill(_master_of(redis_cluster, "kvdock:v2:{invalidations}"))  # the stream's shard
        # until its replica takes over: no server vouches, overwrites are refused, nothing stale
        wait_for(lambda: not _status(b)["vouched"], "B to stop vouching")
        assert set(versions_of(kvd.retrieve(cb, tokens), versions)) <= {2}
        redis_cluster.wait_ok()
        for s in (a, b):
            wait_for(lambda s=s: _status(s)["vouched"], "vouching again after the failover", 60)

        errors: list[str] = []

        def overwrite() -> bool:
            try:
                stored = kvd.store(ca, versions[3], tokens, overwrite=True)
                errors.append(f"{time.time():.3f} returned {stored}")
                return stored
            except kvd.KVCacheSDKError as e:  # refused while a shard has no replica to WAIT for
                errors.append(f"{time.time():.3f} {e}")
                return False

        try:
            wait_for(overwrite, "an overwrite after the failover", 30)
        except AssertionError:
            raise AssertionError("\n".join(errors) + a.log()) from None
        acked = time.monotonic()
        wait_for(lambda: versions_of(kvd.retrieve(cb, tokens), versions) in ([], [3, 3]), "B to drop version 2", 2)
        assert time.monotonic() - acked < 2
        assert set(versions_of(kvd.retrieve(cb, tokens), versions)) <= {3}
        assert kvd.check_server_integrity(ca) == [] and kvd.check_server_integrity(cb) == []


def test_an_overwrite_fences_and_deletes_the_very_keys_objects_are_stored_under(make_server, redis_server) -> None:
    """Regression (the soak): the overwrite's deletions and floors went to keys without the
    model's geometry digest, so they deleted nothing and fenced nothing."""
    import redis as redis_py

    srv = make_server("--redis-url", redis_server.url, "--no-disk")
    _wait_vouched(srv)
    tokens = make_tokens(2 * CHUNK, start=12_000_000)
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as c:
        assert kvd.store(c, make_kv(2 * CHUNK, seed=1), tokens)
        wait_for(lambda: srv.get("/status")["tiers"]["writeback_backlog_bytes"] == 0, "write-downs")
        raw = redis_py.Redis.from_url(redis_server.url)
        try:
            keys = raw.keys("kvdock:v2:{*}")
            objects = sorted(k for k in keys if not k.endswith(b":f") and b"{invalidations}" not in k)
            assert len(objects) == 2
            assert kvd.store(c, make_kv(2 * CHUNK, seed=2), tokens, overwrite=True)
            floors = sorted(k for k in raw.keys("kvdock:v2:{*}:f"))
            assert floors == [k + b":f" for k in objects]
        finally:
            raw.close()


def test_a_plain_store_through_another_server_waits_for_an_overwrite_still_on_its_way_to_l3(
    make_server, redis_server
) -> None:
    """R-FLEET's residual case, through the servers' store path: A's overwrite is acknowledged
    but its write-down to L3 waits (a backlog); B applied its entries, no longer holds the chunks
    and (its RECENT_MS window over) no longer counts them as overwritten lately. B's plain store
    of other bytes would keep them for good: B sees the live floors with no value in L3 and leaves
    the chunks in flight; once A's write lands, B serves the overwrite."""
    import threading

    a, b = fleet(make_server, redis_server, 2)
    tokens = make_tokens(2 * CHUNK, start=8_000_000)
    new, other = make_kv(2 * CHUNK, seed=3), make_kv(2 * CHUNK, seed=4)
    l3 = next(lane.tier for lane in a.state.manager.lanes if lane.name == "l3")
    go = threading.Event()
    real_write = l3.write_from

    def slow_write(*args, **kw):  # type: ignore[no-untyped-def]
        go.wait(30)
        return real_write(*args, **kw)

    l3.write_from = slow_write
    ca = kvd.connect(a.url, a.http_url, MODEL, timeout=10)
    cb = kvd.connect(b.url, b.http_url, MODEL, timeout=10)
    try:
        applied = _status(b)["entries_applied"]
        assert kvd.store(ca, new, tokens, overwrite=True)  # acknowledged; its write-down waits
        wait_for(lambda: _status(b)["entries_applied"] >= applied + 2, "B to apply A's entries")
        b.call(lambda: b.state.manager.coherence.recent.clear())  # as if RECENT_MS had passed
        with pytest.raises(kvd.StoreConflictError, match="being written by another client"):
            kvd.store(cb, other, tokens)
        go.set()
        wait_for(lambda: a.get("/status")["tiers"]["writeback_backlog_bytes"] == 0, "A's write-down")
        assert not kvd.store(cb, other, tokens)  # dedups against the overwrite in L3
        assert torch.equal(_retrieve(cb, tokens), new) and torch.equal(_retrieve(ca, tokens), new)
    finally:
        go.set()
        kvd.close(ca)
        kvd.close(cb)

"""Issue 29's last case, through real servers sharing one real redis-server: an overwrite's
version is served only while its holders keep its floor alive in L3 (storage.keeping), so a
plain store through another server never makes a second truth, whether the overwrite's
write-down reaches L3 after the floor's TTL or L3 evicts its value.

The servers run with ``--l3-floor-ttl-ms 6000``: rounds every second, a lease of 3 s."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import pytest
import redis as redis_py
import torch
from tests.helpers import CHUNK, MODEL, backlog, l3_coherence, make_kv, make_tokens, wait_for

import kvdock.sdk as kvd

TTL_MS = 6000
REFRESH_S, LEASE_S = TTL_MS / 6000, TTL_MS / 2000
NEARLY_MS = 4000  # a floor's TTL all but run out (_keep_past_ttl)
FLAGS = ("--no-disk", "--l3-floor-ttl-ms", str(TTL_MS))


def _servers(make_server: Any, url: str, n: int, **kw: Any) -> list[Any]:
    servers = [make_server("--redis-url", url, *FLAGS, **kw) for _ in range(n)]
    for s in servers:
        wait_for(lambda s=s: l3_coherence(s)["vouched"], "the server to vouch", 30)
    return servers


def _objects(raw: Any) -> list[bytes]:
    """The L3 keys of objects (not floors, not the stream's)."""
    return sorted(k for k in _keys(raw, "kvdock:v2:{*}") if not k.endswith(b":f") and b"{invalidations}" not in k)


def _keys(raw: Any, pattern: str) -> list[bytes]:
    """KEYS on a server, or on every primary of a cluster."""
    if isinstance(raw, redis_py.RedisCluster):
        return list(raw.keys(pattern, target_nodes=redis_py.RedisCluster.PRIMARIES))
    return list(raw.keys(pattern))


def _l3(request: pytest.FixtureRequest, kind: str) -> tuple[str, Any]:
    """The L3's URL for the servers and a raw client of it: a redis-server, or a Redis Cluster."""
    if kind == "cluster":
        cluster = request.getfixturevalue("redis_cluster")
        return cluster.url, redis_py.RedisCluster(host="127.0.0.1", port=cluster.ports[0])
    server = request.getfixturevalue("redis_server")
    return server.url, redis_py.Redis.from_url(server.url)


def _same(got: torch.Tensor | None, want: torch.Tensor) -> bool:
    return got is not None and torch.equal(got, want)


def _keep_past_ttl(raw: Any, n: int) -> None:
    """As if the ``n`` floors' TTL had all but run out: each is cut to NEARLY_MS (less than the
    TTL_MS a round sets, more than a lease); a holder's round must set it back up, else it expires.
    (Waiting the TTL out proved nothing here: an overwrite's floor lives at least FLOOR_MIN_MS,
    15 s, longer than TTL_MS.)"""
    floors = _keys(raw, "kvdock:v2:{*}:f")
    assert len(floors) == n, floors
    for f in floors:
        raw.pexpire(f, NEARLY_MS)
    wait_for(lambda: all(raw.pttl(f) > NEARLY_MS for f in floors), "a holder's round to keep the floors", 15)


def _forget_recent(srv: Any) -> None:
    """As if RECENT_MS (10 s) had passed since the other server's overwrite (its in-flight window)."""
    srv.call(lambda: srv.state.manager.coherence.recent.clear())


def test_an_overwrite_written_down_past_its_floors_ttl_never_lets_a_plain_store_elsewhere_make_a_second_truth(
    make_server, redis_server
) -> None:
    """Case 1. A acknowledges an overwrite (v2) whose write-down to L3 waits (a backlog) past the
    floor's TTL. While A keeps the floor, B's plain store of other bytes (v1) is refused (in
    flight); A's late write lands under its live floor and B dedups against it. Then A stops
    keeping (its rounds fail) past the TTL: A serves nothing it holds (the lease), B's plain store
    lands, A's next round drops v2 and its write-down is refused: v1 is the one truth.
    Before storage.keeping, the floor expired at its TTL and B's v1 landed while A served v2."""
    a, b = _servers(make_server, redis_server.url, 2)
    tokens = make_tokens(2 * CHUNK, start=21_000_000)
    v1, v2, v3 = make_kv(2 * CHUNK, seed=31), make_kv(2 * CHUNK, seed=32), make_kv(2 * CHUNK, seed=33)
    l3 = next(lane.tier for lane in a.state.manager.lanes if lane.name == "l3")
    go = threading.Event()
    real_write, real_keep = l3.write_from, l3.keep

    def slow_write(*args: Any, **kw: Any) -> Any:
        go.wait(60)
        return real_write(*args, **kw)

    l3.write_from = slow_write
    ca = kvd.connect(a.url, a.http_url, MODEL, timeout=10)
    cb = kvd.connect(b.url, b.http_url, MODEL, timeout=10)
    raw = redis_py.Redis.from_url(redis_server.url)
    try:
        applied = l3_coherence(b)["entries_applied"]
        assert kvd.store(ca, v2, tokens, overwrite=True)  # acknowledged; its write-down waits
        wait_for(lambda: l3_coherence(b)["entries_applied"] >= applied + 2, "B to apply A's entries")
        _forget_recent(b)
        _keep_past_ttl(raw, 2)  # past the floor's TTL: only A's rounds keep it
        wait_for(lambda: l3_coherence(a)["keep_rounds"] >= 3, "A's rounds", 15)
        with pytest.raises(kvd.StoreConflictError, match="being written by another client"):
            kvd.store(cb, v1, tokens)
        assert l3_coherence(a)["keep_rounds"] >= 3 and l3_coherence(a)["held"] == 2
        assert _same(kvd.retrieve(ca, tokens), v2)
        go.set()
        wait_for(lambda: backlog(a) == 0, "A's write-down")
        assert not kvd.store(cb, v1, tokens)  # dedups against the overwrite in L3: nothing stored
        assert _same(kvd.retrieve(cb, tokens), v2) and _same(kvd.retrieve(ca, tokens), v2)

        # A stops keeping (cut off for its rounds) while a second overwrite's write-down waits
        go.clear()
        assert kvd.store(ca, v3, tokens, overwrite=True)
        wait_for(lambda: l3_coherence(b)["entries_applied"] >= applied + 4, "B to apply A's second entries")
        _forget_recent(b)

        cut = threading.Event()

        def cut_off(*args: Any, **kw: Any) -> Any:
            cut.set()
            raise redis_py.ConnectionError("A's keeping rounds cannot reach L3 (test)")

        l3.keep = cut_off
        # The lease runs out: a round failed (rounds run one at a time, so none sent before the
        # cut-off is left to renew it) and the last one that kept the floors was sent more than a
        # lease ago. (Waiting for 'not vouched' alone was not enough under load: a poll a little
        # late clears it for a moment, while the lease still runs, and the read then rightly got v3.)
        wait_for(
            lambda: cut.is_set() and l3_coherence(a)["keep_round_age_s"] > LEASE_S, "A's lease to run out", LEASE_S + 10
        )
        assert not l3_coherence(a)["vouched"]
        got = kvd.retrieve(ca, tokens)  # (not vouched: L3 alone, which has no value)
        assert got is None, "A served its overwrite past its lease"
        # the floors' TTL runs out (cut to 1.5 s: a floor lives at least FLOOR_MIN_MS, 15 s, as an
        # allkeys-lru L3 may evict it sooner); they expire unless someone keeps them
        for f in raw.keys("kvdock:v2:{*}:f"):
            raw.pexpire(f, 1500)
        wait_for(lambda: not [k for k in raw.keys("kvdock:v2:{*}:f")], "the floors to expire", TTL_MS / 1000 + 10)
        assert kvd.store(cb, v1, tokens)  # no floor, no value: a plain store lands
        l3.keep = real_keep  # A's next round finds another version under no floor: drops v3
        wait_for(
            lambda: l3_coherence(a)["keep_dropped"] >= 2 and l3_coherence(a)["vouched"], "A to drop v3", REFRESH_S + 10
        )
        go.set()
        wait_for(lambda: backlog(a) == 0 and backlog(b) == 0, "A's write-down (refused) and B's")
        for ctx in (ca, cb):
            assert _same(kvd.retrieve(ctx, tokens), v1), "two truths after A dropped its overwrite"
        assert kvd.check_server_integrity(ca) == [] and kvd.check_server_integrity(cb) == []
    finally:
        go.set()
        l3.write_from, l3.keep = real_write, real_keep
        raw.close()
        kvd.close(ca)
        kvd.close(cb)


@pytest.mark.parametrize("kind", ["redis", "cluster"])
def test_an_overwrites_value_evicted_from_l3_is_kept_by_its_holders_until_they_drop_it(
    make_server, request: pytest.FixtureRequest, kind: str
) -> None:
    """Case 2. A overwrites (v2), C loads v2 from L3. Past the floor's TTL, L3 loses the value
    (DEL, as allkeys-lru would evict it, cold in L3 because hot in A's and C's L1): A and C keep
    serving v2, keep its floor and write it again; B's plain store of v1 is refused or dedups,
    never lands. Then L3 loses the floors too: A and C drop v2 within a round, and from then on
    B's v1 is the one truth. On one Redis and on a Redis Cluster (the rounds go to each node)."""
    url, raw = _l3(request, kind)
    a, b, c = _servers(make_server, url, 3)
    tokens = make_tokens(2 * CHUNK, start=22_000_000)
    v1, v2 = make_kv(2 * CHUNK, seed=41), make_kv(2 * CHUNK, seed=42)
    ca, cb, cc = (kvd.connect(s.url, s.http_url, MODEL, timeout=10) for s in (a, b, c))
    try:
        applied = l3_coherence(c)["entries_applied"]
        assert kvd.store(ca, v2, tokens, overwrite=True)
        wait_for(lambda: backlog(a) == 0, "A's write-down")
        wait_for(lambda: l3_coherence(c)["entries_applied"] >= applied + 2, "C to apply A's entries")  # (else it
        # drops what it loads before applying them: a load older than an entry)
        assert _same(kvd.retrieve(cc, tokens), v2)  # C loads it from L3 (KEEP first): held there too
        _keep_past_ttl(raw, 2)  # past the floor's TTL: only the holders' rounds keep it
        objects = _objects(raw)
        assert len(objects) == 2
        raw.delete(*objects)  # evicted
        _forget_recent(b)
        try:
            stored = kvd.store(cb, v1, tokens)
        except kvd.StoreConflictError:  # the floors live with no value: in flight
            stored = None
        assert not stored, "B stored other bytes while A and C serve the overwrite"
        floors = _keys(raw, "kvdock:v2:{*}:f")
        assert len(floors) == 2 and all(raw.pttl(f) > 0 for f in floors), "the holders let the floors expire"
        assert l3_coherence(a)["held"] == 2 and l3_coherence(c)["held"] == 2, (l3_coherence(a), l3_coherence(c))
        wait_for(lambda: len(_objects(raw)) == 2, "a holder to write v2 again", REFRESH_S + 10)
        assert l3_coherence(a)["keep_repaired"] + l3_coherence(c)["keep_repaired"] >= 2
        for ctx in (ca, cb, cc):
            assert _same(kvd.retrieve(ctx, tokens), v2)
        assert _same(kvd.retrieve(cb, tokens), v2)  # B too (from L3)
        # L3 loses floors and values at once: the holders drop v2 at their next round
        raw.delete(*_keys(raw, "kvdock:v2:{*}:f"), *_objects(raw))
        lost = time.monotonic()
        for ctx in (ca, cc):
            wait_for(lambda ctx=ctx: kvd.retrieve(ctx, tokens) is None, "the holder to drop v2", REFRESH_S + 10)
        assert time.monotonic() - lost < REFRESH_S + LEASE_S + 5
        wait_for(lambda: not l3_coherence(b)["held"], "B to hold nothing")
        assert kvd.store(cb, v1, tokens)  # no floor, no value: lands
        wait_for(lambda: backlog(b) == 0, "B's write-down")
        for ctx in (ca, cb, cc):
            assert _same(kvd.retrieve(ctx, tokens), v1), "two truths after the holders dropped v2"
        for ctx in (ca, cb, cc):
            assert kvd.check_server_integrity(ctx) == []
    finally:
        raw.close()
        for ctx in (ca, cb, cc):
            kvd.close(ctx)


@pytest.mark.subprocess_server
def test_a_holder_paused_past_its_lease_serves_nothing_it_holds_until_its_round(make_server, redis_server) -> None:
    """A holds an overwrite (v2) and is SIGSTOPped past its lease; meanwhile L3 loses the floors
    and the values. Resumed, A serves nothing (through the server or its pool directory) until a
    poll and a round complete, and that round drops v2. Before storage.keeping, A served v2 from
    its L1 once its first poll came back."""
    (a,) = _servers(make_server, redis_server.url, 1)
    tokens = make_tokens(2 * CHUNK, start=23_000_000)
    v2 = make_kv(2 * CHUNK, seed=52)
    fast = kvd.connect(a.url, a.http_url, MODEL, timeout=30)
    slow = kvd.connect(a.url, a.http_url, MODEL, timeout=30)
    slow.fast_reads = False
    raw = redis_py.Redis.from_url(redis_server.url)
    try:
        assert kvd.store(fast, v2, tokens, overwrite=True)
        wait_for(lambda: backlog(a) == 0, "A's write-down")
        assert _same(kvd.retrieve(fast, tokens), v2) and _same(kvd.retrieve(slow, tokens), v2)
        os.kill(a.proc.pid, signal.SIGSTOP)
        try:
            time.sleep(LEASE_S + 1)
            raw.delete(*raw.keys("kvdock:v2:{*}:f"), *_objects(raw))  # the floors expired, the values evicted
        finally:
            os.kill(a.proc.pid, signal.SIGCONT)
        for ctx in (fast, slow, fast, slow):
            assert kvd.retrieve(ctx, tokens) is None, "A served an overwrite whose floor it no longer kept"
        wait_for(lambda: l3_coherence(a)["keep_dropped"] >= 2 and l3_coherence(a)["held"] == 0, "A's round to drop v2")
        assert a.metric("kvdock_coherence_keep_dropped_total") >= 2
        assert a.metric("kvdock_coherence_keep_rounds_total") >= 1
        assert kvd.check_server_integrity(slow) == []
    finally:
        raw.close()
        kvd.close(fast)
        kvd.close(slow)

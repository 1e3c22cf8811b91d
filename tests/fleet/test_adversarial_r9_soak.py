"""A-FLEET round 9's soak of storage.keeping (--l3-floor-ttl-ms 3000: rounds every 0.5 s, a
lease of 1.5 s): three ``kvdock serve`` processes with L2 share one redis-server whose
``maxmemory`` is small enough, with ``allkeys-lru``, that Redis really evicts (values, floors;
another application's keys push them out), while clients of every server overwrite, plain-store,
retrieve and look up the same prefixes; servers are SIGSTOPped past their lease, one is SIGKILLed
and restarted on its L2, Redis is flushed once. Every read is checked by the round 8 ledger
(tests/fleet/test_adversarial_r8_fleet.py: bytes of no store, another prefix's bytes, mixed
versions in one retrieve, a version an acknowledged overwrite replaced more than the bound
before the read), then every server must agree, and serve hits again (liveness)."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from pathlib import Path

import pytest
import redis as redis_py
from tests.fleet.test_adversarial_r8_fleet import (
    CHUNKS,
    Fleet,
    Ledger,
    Worker,
    decode,
    fresh_reader_check,
    quiescent_check,
    run_phase,
    tokens_of,
)
from tests.helpers import MODEL, RedisProc, free_port

import kvdock.sdk as kvd

TTL_MS = 3000
LRU = ("--maxmemory", "6mb", "--maxmemory-policy", "allkeys-lru")


class _ShortFloors(Fleet):
    """Round 8's fleet with short floors. (A slow L2, KVDOCK_FAULT_L2_WRITE_DELAY_S, stops a
    server's L3 hits for as long as its invalidations' L2 deletions queue up: the strict xfail
    test_a_server_with_a_slow_l2_serves_an_overwritten_key_from_l3_soon_after_the_overwrites_stop.)"""

    def _flags(self, i: int) -> list[str]:
        return [*super()._flags(i), "--l3-floor-ttl-ms", str(TTL_MS)]


def _keep_counters(fleet: Fleet) -> dict[str, int]:
    out: dict[str, int] = {}
    for s in fleet.servers:
        coh = s.get("/status")["tiers"]["l3"]["coherence"]
        for k in ("keep_rounds", "keep_dropped", "keep_repaired", "full_drops", "lapses", "l1_dropped"):
            out[k] = out.get(k, 0) + int(coh[k])
    return out


def _other_app(url: str, stop: threading.Event, written: list[int]) -> None:
    """Another application's keys on the same redis-server: with maxmemory, Redis evicts."""
    raw = redis_py.Redis.from_url(url, socket_timeout=2)
    blob = os.urandom(48 * 1024)
    n = 0
    while not stop.is_set():
        try:
            raw.set(f"other-app:{n}", blob)
            n += 1
        except redis_py.RedisError:
            time.sleep(0.2)
        time.sleep(0.01)
    written.append(n)
    raw.close()


def _evicted(url: str) -> int:
    try:
        with redis_py.Redis.from_url(url, socket_timeout=2) as raw:
            return int(raw.info("stats")["evicted_keys"])
    except redis_py.RedisError:
        return 0


def _serves(ctx: kvd.KVCacheContext, fleet: Fleet, i: int, prefix: int, want: int, what: str) -> None:
    """Liveness: server ``i`` serves the whole of ``prefix``'s version ``want`` within 30 s."""
    deadline = time.monotonic() + 30
    got: list[int] = []
    while time.monotonic() < deadline:
        got = decode(kvd.retrieve(ctx, tokens_of(prefix)), prefix)
        if got == [want] * CHUNKS:
            return
        time.sleep(0.1)
    status = fleet.servers[i].get("/status")["tiers"]
    raise AssertionError(f"{what}: server {i} serves {got} of prefix {prefix}, not version {want}: {status}")


# Was a non-strict xfail: once in ~10 runs all three servers served a version an acknowledged
# overwrite had replaced, most likely allkeys-lru evicting a fresh floor (and value) while a plain
# write-down issued before the overwrite was on its way; such write-downs are staged and checked
# against the stream now (storage/_redisstage.py).
@pytest.mark.subprocess_server
def test_keeping_under_real_lru_evictions_sigstop_past_the_lease_sigkill_and_flushall(
    make_server, tmp_path: Path
) -> None:
    lru = RedisProc(free_port(), extra=LRU).start()
    fleet = _ShortFloors(make_server, lru.url, 3, tmp_path, disk=True)
    ledger = Ledger()
    prefixes = [1, 2, 3]
    rng = random.Random(9)
    evicted = 0
    stopped: list[float] = []

    def chaos(deadline: float, phase: int) -> None:
        acted = False
        while time.monotonic() < deadline - 1.5:
            time.sleep(rng.uniform(0.3, 1.0))
            i = rng.randrange(3)
            if not acted and time.monotonic() > deadline - 6:
                acted = True
                if phase == 1:
                    fleet.restart(i)
                else:
                    with redis_py.Redis.from_url(lru.url) as raw:
                        raw.flushall()
                continue
            pid = fleet.servers[i].proc.pid
            pause = rng.uniform(0.2, 4.0)  # past the 1.5 s lease most of the time, the 3 s TTL some
            os.kill(pid, signal.SIGSTOP)
            try:
                time.sleep(pause)
            finally:
                os.kill(pid, signal.SIGCONT)
            stopped.append(pause)

    totals: dict[str, int] = {}
    try:
        for phase in range(2):
            stop = threading.Event()
            workers = [Worker(fleet, ledger, i % 3, prefixes, stop, seed=900 + 10 * phase + i) for i in range(6)]
            written: list[int] = []
            other = threading.Thread(target=_other_app, args=(lru.url, stop, written), daemon=True)
            other.start()
            before = _evicted(lru.url)
            run_phase(workers, 10, lambda d, phase=phase: chaos(d, phase))
            other.join(30)
            evicted += _evicted(lru.url) - before
            for w in workers:
                for k, v in w.counts.items():
                    totals[k] = totals.get(k, 0) + v
            quiescent_check(fleet, ledger, prefixes, f"phase {phase}")
            # liveness: once the faults are over every server serves the last version again
            for prefix in prefixes:
                want = max(op.version for op in ledger.ops.values() if op.prefix == prefix)
                for i in range(3):
                    ctx, _ = fleet.connect(i)
                    try:
                        _serves(ctx, fleet, i, prefix, want, f"phase {phase}")
                    finally:
                        kvd.close(ctx)
        fresh_reader_check(make_server, lru.url, ledger, prefixes)
        problems = ledger.check_all()
        summary = (
            f"totals {totals}, reads {len(ledger.reads)}, evicted {evicted}, stops {len(stopped)} "
            f"(past the lease {sum(p > TTL_MS / 2000 for p in stopped)}), servers' counters {_keep_counters(fleet)}"
        )
        print(summary)
        assert problems == [], f"{len(problems)} problems ({summary}):\n" + "\n".join(problems[:20])
        assert totals["overwrite"] >= 10 and totals["retrieve"] >= 20, summary
        assert evicted > 0, f"Redis evicted nothing: {summary}"
        for s in fleet.servers:
            with kvd.connect(s.url, s.http_url, MODEL, timeout=30) as c:
                assert kvd.check_server_integrity(c) == []
    finally:
        lru.stop()

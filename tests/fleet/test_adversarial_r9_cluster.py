"""A-FLEET round 9's soak of storage.keeping on a Redis Cluster (3 masters, 3 replicas, each node
with ``maxmemory`` and ``allkeys-lru``): three ``kvdock serve`` processes (L2, --l3-floor-ttl-ms
3000) overwrite, plain-store and read the same prefixes while another application's keys make
every node evict, a master is killed (its replica takes over, floors and values as far as they
were replicated) and comes back as a replica, and a server is SIGSTOPped past its lease. The
round 8 ledger checks every read (tests/fleet/test_adversarial_r8_fleet.py), then agreement,
a fresh reader, and liveness."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import redis as redis_py
from redis.cluster import RedisCluster as ClusterClient
from tests.fleet.test_adversarial_r8_fleet import Fleet, Ledger, Worker, fresh_reader_check, quiescent_check, run_phase
from tests.fleet.test_adversarial_r9_soak import _keep_counters, _serves

import kvdock.sdk as kvd

TTL_MS = 3000


class _ShortFloors(Fleet):
    def _flags(self, i: int) -> list[str]:
        return [*super()._flags(i), "--l3-floor-ttl-ms", str(TTL_MS)]


def _other_app(port: int, stop: threading.Event) -> None:
    client = ClusterClient(host="127.0.0.1", port=port, socket_timeout=2)
    blob = os.urandom(48 * 1024)
    n = 0
    while not stop.is_set():
        try:
            client.set(f"other-app:{n}", blob)
            n += 1
        except redis_py.RedisError:
            time.sleep(0.2)
        time.sleep(0.005)
    client.close()


def _evicted(cluster: Any) -> int:
    """Keys the live nodes evicted so far (INFO stats)."""
    total = 0
    for port in cluster.live():
        with contextlib.suppress(Exception):
            stats = dict(line.split(":", 1) for line in cluster.cli(port, "info", "stats").split() if ":" in line)
            total += int(stats.get("evicted_keys", 0))
    return total


# Was a non-strict xfail: once in ~10 runs all three servers served a version an acknowledged
# overwrite had replaced, most likely allkeys-lru evicting a fresh floor (and value) while a plain
# write-down issued before the overwrite was on its way; such write-downs are staged and checked
# against the stream now (storage/_redisstage.py).
@pytest.mark.subprocess_server
def test_keeping_on_a_cluster_under_lru_evictions_a_master_failover_and_sigstop(
    make_server, redis_cluster, tmp_path: Path
) -> None:
    for port in redis_cluster.ports:
        redis_cluster.cli(port, "config", "set", "maxmemory", "6mb")
        redis_cluster.cli(port, "config", "set", "maxmemory-policy", "allkeys-lru")
    fleet = _ShortFloors(make_server, redis_cluster.url, 3, tmp_path, disk=True)
    ledger = Ledger()
    prefixes = [1, 2, 3]
    rng = random.Random(19)
    stopped: list[float] = []
    failed: list[int] = []
    evicted = 0

    def chaos(deadline: float, phase: int) -> None:
        acted = False
        while time.monotonic() < deadline - 1.5:
            time.sleep(rng.uniform(0.3, 1.0))
            if not acted and phase == 0 and time.monotonic() > deadline - 8:
                acted = True
                master = next(p for p, role in redis_cluster.roles().items() if role == "master")
                redis_cluster.kill(master)
                failed.append(master)
                time.sleep(3)  # (the replica takes over after cluster-node-timeout, 1 s)
                redis_cluster.start_node(master)
                continue
            i = rng.randrange(3)
            pid = fleet.servers[i].proc.pid
            pause = rng.uniform(0.2, 3.0)
            os.kill(pid, signal.SIGSTOP)
            try:
                time.sleep(pause)
            finally:
                os.kill(pid, signal.SIGCONT)
            stopped.append(pause)

    totals: dict[str, int] = {}
    for phase in range(2):
        stop = threading.Event()
        workers = [Worker(fleet, ledger, i % 3, prefixes, stop, seed=1900 + 10 * phase + i) for i in range(6)]
        other = threading.Thread(target=_other_app, args=(redis_cluster.ports[0], stop), daemon=True)
        other.start()
        before = _evicted(redis_cluster)
        run_phase(workers, 12, lambda d, phase=phase: chaos(d, phase))
        other.join(30)
        evicted += max(_evicted(redis_cluster) - before, 0)
        redis_cluster.wait_ok(60)
        for w in workers:
            for k, v in w.counts.items():
                totals[k] = totals.get(k, 0) + v
        quiescent_check(fleet, ledger, prefixes, f"phase {phase}")
        for prefix in prefixes:
            want = max(op.version for op in ledger.ops.values() if op.prefix == prefix)
            for i in range(3):
                ctx, _ = fleet.connect(i)
                try:
                    _serves(ctx, fleet, i, prefix, want, f"phase {phase}")
                finally:
                    kvd.close(ctx)
    fresh_reader_check(make_server, redis_cluster.url, ledger, prefixes)
    problems = ledger.check_all()
    summary = (
        f"totals {totals}, reads {len(ledger.reads)}, evicted {evicted}, stops {len(stopped)}, failovers {failed}, "
        f"servers' counters {_keep_counters(fleet)}"
    )
    print(summary)
    assert problems == [], f"{len(problems)} problems ({summary}):\n" + "\n".join(problems[:20])
    assert totals["overwrite"] >= 10 and totals["retrieve"] >= 20, summary
    assert evicted > 0, f"no node evicted anything: {summary}"

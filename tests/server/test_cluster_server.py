"""kvdock servers sharing a real local Redis Cluster as L3 (3 masters + 3 replicas): objects on
every master, byte-exact reads from another server, salts isolated, a master killed under load
(no client errors, no wrong bytes, L3 back after the promotion), the whole cluster down and back."""

from __future__ import annotations

import random
import threading
import time

import pytest
import redis as redis_py
import torch

import kvdock.sdk as kvd
from helpers import CHUNK, MODEL, ServerProc, make_kv, make_tokens, tier, wait_for, wait_written
from kvdock.testing import RedisCluster


def keys_per_master(cluster: RedisCluster) -> dict[int, int]:
    """The objects each master holds (not model records, nor the invalidation stream and its incarnation)."""

    def objects(port: int) -> int:
        return sum(1 for k in redis_py.Redis(port=port).scan_iter(b"kvdock:v2:{*") if b"{invalidations}" not in k)

    return {p: objects(p) for p, role in cluster.roles().items() if role == "master"}


def prompt(i: int) -> list[int]:
    return make_tokens(2 * CHUNK, start=100_000 * (i + 1))


@pytest.mark.valkey  # also on a Valkey cluster (conftest)
def test_two_servers_share_a_cluster_every_master_holds_objects_salts_stay_apart(
    make_server, redis_cluster: RedisCluster
) -> None:
    node = redis_cluster.ports[0]
    with pytest.raises(RuntimeError, match="is a Redis Cluster node: give the cluster as redis\\+cluster://"):
        make_server("--redis-url", f"redis://127.0.0.1:{node}/0")  # one node reaches one shard only
    a = make_server("--redis-url", redis_cluster.url, "--redis-max-bytes", "1MiB")
    b = make_server("--redis-url", redis_cluster.url)
    with kvd.connect(a.url, a.http_url, MODEL, timeout=10) as ca:
        for i in range(12):
            kvd.store(ca, make_kv(2 * CHUNK, seed=i), prompt(i))
        shared = make_tokens(CHUNK, start=7)
        kvd.store(ca, make_kv(CHUNK, seed=100), shared, cache_salt="alice")
        kvd.store(ca, make_kv(CHUNK, seed=101), shared, cache_salt="bob")
    wait_written(a, "l3", 26)
    budget = tier(a, "l3")
    assert budget["capacity_bytes"] == 2**20 and 26 * 3072 < budget["used_bytes"] <= 26 * (3072 + 4096)  # + a header
    counts = keys_per_master(redis_cluster)
    assert len(counts) == 3 and sum(counts.values()) == 26 and min(counts.values()) > 0, counts
    with kvd.connect(b.url, b.http_url, MODEL, timeout=10) as cb:
        assert b.get("/status")["l1"]["objects"] == 0  # every byte below comes from the cluster
        got = kvd.retrieve_many(cb, [prompt(i) for i in range(12)])
        assert all(g is not None and torch.equal(g, make_kv(2 * CHUNK, seed=i)) for i, g in enumerate(got))
        assert torch.equal(kvd.retrieve(cb, shared, cache_salt="alice"), make_kv(CHUNK, seed=100))
        assert torch.equal(kvd.retrieve(cb, shared, cache_salt="bob"), make_kv(CHUNK, seed=101))
        assert kvd.retrieve(cb, shared, cache_salt="eve") is None and kvd.retrieve(cb, shared) is None
        assert kvd.check_server_integrity(cb) == []
    t = tier(b, "l3")
    assert t["kind"] == "redis-cluster" and t["hits"] == 26
    assert sorted(n["role"] for n in t["nodes"]) == ["primary"] * 3 + ["replica"] * 3
    assert {n["state"] for n in t["nodes"]} == {"up"}
    metrics = b.text("/metrics")
    assert 'kvdock_tier_cluster_nodes{role="primary",tier="l3"} 3.0' in metrics
    assert 'kvdock_tier_cluster_nodes{role="replica",tier="l3"} 3.0' in metrics


class Load:
    """Stores of new prompts on one server and retrieves of stored ones on another, in threads,
    counting client errors and wrong bytes (a miss is fine)."""

    def __init__(self, writer: ServerProc, reader: ServerProc, first: int, stored: list[int]) -> None:
        self.writer, self.reader, self.next, self.stored = writer, reader, first, list(stored)
        self.errors: list[str] = []
        self.wrong = self.hits = self.misses = 0
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._write), threading.Thread(target=self._read)]

    def _write(self) -> None:
        with kvd.connect(self.writer.url, self.writer.http_url, MODEL, timeout=20) as c:
            while not self.stop.is_set():
                try:
                    kvd.store(c, make_kv(2 * CHUNK, seed=self.next), prompt(self.next))
                    self.stored.append(self.next)
                    self.next += 1
                except Exception as e:  # counted: the test wants none
                    self.errors.append(f"store: {type(e).__name__}: {e}")

    def _read(self) -> None:
        rng = random.Random(1)
        with kvd.connect(self.reader.url, self.reader.http_url, MODEL, timeout=20) as c:
            while not self.stop.is_set():
                i = rng.choice(self.stored)
                try:
                    got = kvd.retrieve(c, prompt(i))
                except Exception as e:
                    self.errors.append(f"retrieve: {type(e).__name__}: {e}")
                    continue
                if got is None:
                    self.misses += 1
                elif torch.equal(got, make_kv(2 * CHUNK, seed=i)[:, :, : got.shape[2]]):
                    self.hits += 1  # the whole prompt, or a prefix of it (a chunk lost with its shard)
                else:
                    self.wrong += 1

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)


@pytest.mark.valkey  # also on a Valkey cluster (conftest)
def test_a_master_killed_under_load_costs_no_errors_no_wrong_bytes_and_l3_comes_back(
    make_server, redis_cluster: RedisCluster
) -> None:
    a = make_server("--redis-url", redis_cluster.url)
    b = make_server("--redis-url", redis_cluster.url, l1_size="1MiB")  # small: it reads from L3 again and again
    with kvd.connect(a.url, a.http_url, MODEL, timeout=10) as ca:
        for i in range(40):
            kvd.store(ca, make_kv(2 * CHUNK, seed=i), prompt(i))
    wait_written(a, "l3", 80)
    victim = next(p for p, role in redis_cluster.roles().items() if role == "master")
    with Load(a, b, 40, list(range(40))) as load:
        time.sleep(1.0)
        redis_cluster.kill(victim)
        # the replica is promoted after cluster-node-timeout (1 s) and an election; the load goes
        # on through it and for a second after
        wait_for(lambda: list(redis_cluster.roles().values()).count("master") == 3, "the replica's promotion", 30)
        time.sleep(1.0)
    assert load.errors == [] and load.wrong == 0, (load.errors[:5], load.wrong)
    assert load.hits > 50, (load.hits, load.misses)
    redis_cluster.wait_ok()  # three masters again: the victim's replica took over
    wait_for(lambda: tier(a, "l3")["up"] and tier(b, "l3")["up"], "both servers to see L3 up again", 40)
    written = tier(a, "l3")["writes"]
    with kvd.connect(a.url, a.http_url, MODEL, timeout=10) as ca:
        fresh = [prompt(10_000 + i) for i in range(6)]
        for i, p in enumerate(fresh):
            kvd.store(ca, make_kv(2 * CHUNK, seed=10_000 + i), p)
    wait_for(lambda: tier(a, "l3")["writes"] >= written + 12 and tier(a, "l3")["backlog_bytes"] == 0, "fresh writes")
    hits = tier(b, "l3")["hits"]
    with kvd.connect(b.url, b.http_url, MODEL, timeout=10) as cb:
        got = kvd.retrieve_many(cb, fresh)
        assert all(g is not None and torch.equal(g, make_kv(2 * CHUNK, seed=10_000 + i)) for i, g in enumerate(got))
        assert kvd.check_server_integrity(cb) == []
    assert tier(b, "l3")["hits"] == hits + 12  # from the cluster, after the promotion
    assert f"127.0.0.1:{victim}" not in {n["addr"] for n in tier(b, "l3")["nodes"] if n["role"] == "primary"}


def test_the_whole_cluster_down_and_back(make_server, redis_cluster: RedisCluster) -> None:
    a = make_server("--redis-url", redis_cluster.url)
    b = make_server("--redis-url", redis_cluster.url)
    with (
        kvd.connect(a.url, a.http_url, MODEL, timeout=10) as ca,
        kvd.connect(b.url, b.http_url, MODEL, timeout=10) as cb,
    ):
        kvd.store(ca, make_kv(2 * CHUNK, seed=1), prompt(1))
        wait_written(a, "l3", 2)
        redis_cluster.stop()
        assert kvd.store(ca, make_kv(2 * CHUNK, seed=2), prompt(2))  # L1 takes it; the write-down is skipped
        # cut off from L3, A cannot learn of other servers' overwrites: past the bound it serves
        # nothing from L1 (docs/scale-out.md), a miss at once
        wait_for(lambda: not tier(a, "l3")["coherence"]["vouched"], "A to stop vouching")
        assert kvd.retrieve(ca, prompt(2)) is None
        assert kvd.retrieve(cb, prompt(1)) is None  # only the cluster had it: a miss, not an error
        wait_for(lambda: not tier(b, "l3")["up"], "B to see L3 down")
        for port in redis_cluster.ports:
            redis_cluster.start_node(port)  # the same nodes (nodes-*.conf), no data: a cache
        redis_cluster.wait_ok()
        wait_for(lambda: tier(a, "l3")["up"] and tier(b, "l3")["up"], "L3 up again without a restart", 60)
        # the cluster lost its invalidation stream: each server sees a new incarnation (a gap: it
        # drops its L1) and writes under it from then on; a write-down issued before a server
        # noticed goes where no reader looks (a miss, never stale bytes)
        wait_for(
            lambda: all(
                tier(s, "l3")["coherence"]["full_drops"] >= 1 and tier(s, "l3")["coherence"]["vouched"] for s in (a, b)
            ),
            "both servers to follow the new stream",
        )
        assert kvd.store(ca, make_kv(2 * CHUNK, seed=3), prompt(3))
        wait_for(lambda: tier(a, "l3")["writes"] >= 4, "the write-down after the outage")
        assert torch.equal(kvd.retrieve(cb, prompt(3)), make_kv(2 * CHUNK, seed=3))
        assert kvd.check_server_integrity(ca) == [] and kvd.check_server_integrity(cb) == []


def test_a_shard_that_stops_answering_costs_one_bounded_wait_then_misses(
    make_server, redis_cluster: RedisCluster
) -> None:
    """Both nodes of a shard SIGSTOPped (they accept connections and never answer): a request that
    needs L3 waits at most about two socket timeouts (--redis-timeout-s 2), once; then the tier is
    down and requests are served from L1 or miss at once, and L3 comes back after SIGCONT. (redis-py's
    default of ten retries once made each such call take a minute, and clients got errors; ten
    retries of 2 s would still take longer than the 15 s allowed.)"""
    import os
    import signal

    a = make_server("--redis-url", redis_cluster.url, "--redis-timeout-s", "2")
    b = make_server("--redis-url", redis_cluster.url, "--redis-timeout-s", "2")
    with kvd.connect(a.url, a.http_url, MODEL, timeout=30) as ca:
        for i in range(20):
            kvd.store(ca, make_kv(2 * CHUNK, seed=i), prompt(i))
    wait_written(a, "l3", 40)
    master = next(p for p, role in redis_cluster.roles().items() if role == "master")
    stopped = [master] + [p for p, r in redis_cluster.roles().items() if r == "slave" and
                          f"master_port:{master}" in redis_cluster.cli(p, "info", "replication")]  # fmt: skip
    for p in stopped:
        os.kill(redis_cluster.procs[p].pid, signal.SIGSTOP)
    try:
        with kvd.connect(b.url, b.http_url, MODEL, timeout=30) as cb:
            t0 = time.monotonic()
            got = kvd.retrieve_many(cb, [prompt(i) for i in range(20)])  # some need the stopped shard
            first = time.monotonic() - t0
            assert first < 15, first
            assert all(
                g is None or torch.equal(g, make_kv(2 * CHUNK, seed=i)[:, :, : g.shape[2]]) for i, g in enumerate(got)
            )
            wait_for(lambda: not tier(b, "l3")["up"], "B to see L3 down", 20)
            addr = f"127.0.0.1:{master}"
            wait_for(
                lambda: any(n["addr"] == addr and n["state"].startswith("down: ") for n in tier(b, "l3")["nodes"]),
                "/status to name the master that does not answer",
                30,
            )
            assert b.metric('kvdock_tier_cluster_nodes_down{tier="l3"}') == 1
            t0 = time.monotonic()
            assert kvd.retrieve(cb, prompt(999)) is None  # not cached anywhere: a miss, at once
            assert time.monotonic() - t0 < 2
    finally:
        for p in stopped:
            os.kill(redis_cluster.procs[p].pid, signal.SIGCONT)
    wait_for(lambda: tier(b, "l3")["up"], "L3 back after SIGCONT", 60)
    assert {n["state"] for n in tier(b, "l3")["nodes"]} == {"up"}

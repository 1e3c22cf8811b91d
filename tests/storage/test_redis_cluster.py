"""kvdock.storage.redis on a real local Redis Cluster (3 masters, 3 replicas): objects spread over
every shard, atomic writes within a slot, a cluster that is down at start, the nodes in status."""

from __future__ import annotations

import pytest
import redis as redis_py
from test_redis_store import CHUNK, GEO, NB, H, K, get, payload, put

from kvdock.storage._coherence_lua import OBJECT_TTL_MS
from kvdock.storage.redis import RedisTier, redis_key
from kvdock.testing import RedisCluster, cluster_ports

pytestmark = pytest.mark.valkey  # each test on a Redis Cluster and on a Valkey one (conftest)


def masters(cluster: RedisCluster) -> list[int]:
    return [port for port, role in cluster.roles().items() if role == "master"]


def test_objects_spread_over_every_master_and_read_back_byte_exact(redis_cluster: RedisCluster) -> None:
    store = RedisTier(redis_cluster.url, timeout=2.0)
    try:
        store.probe()
        assert store.up()
        for i in range(1, 61):
            put(store, K(i))
        assert all(get(store, K(i)) == payload(i) for i in range(1, 61))
        assert store.heads([K(i) for i in range(1, 61)]) == [H(i) for i in range(1, 61)]  # pipelined over nodes
        counts = [redis_py.Redis(port=p).dbsize() for p in masters(redis_cluster)]
        assert len(counts) == 3 and sum(counts) == 60 and min(counts) > 5, counts  # not one slot for all
        ttls = [
            redis_py.Redis(port=p).ttl(k) for p in masters(redis_cluster) for k in redis_py.Redis(port=p).scan_iter()
        ]
        # no temporary keys; each object expires after OBJECT_TTL_MS (volatile-* policies evict objects only)
        assert len(ttls) == 60 and all(OBJECT_TTL_MS // 1000 - 60 < t <= OBJECT_TTL_MS // 1000 for t in ttls)
        store.delete(K(7))
        assert get(store, K(7)) is None and store.heads([K(6), K(7), K(8)]) == [H(6)]
        doc = store.status()
        assert doc["kind"] == "redis-cluster" and doc["up"] is True
        assert sorted(n["role"] for n in doc["nodes"]) == ["primary"] * 3 + ["replica"] * 3
        assert {n["addr"] for n in doc["nodes"]} == {f"127.0.0.1:{p}" for p in redis_cluster.ports}
    finally:
        store.close()


def test_a_cluster_that_is_down_at_start_is_a_down_tier_until_it_comes(tmp_path, l3_server: str) -> None:
    work = tmp_path / "c"
    work.mkdir()
    cluster = RedisCluster(cluster_ports(6), work, server=l3_server)
    store = RedisTier(cluster.url, timeout=0.5)
    try:
        store.probe()  # no node answers: down, and no client yet
        doc = store.status()
        assert not store.up() and doc["nodes"] == [] and "cannot be connected" in doc["last_error"]
        out = memoryview(bytearray(NB))
        try:
            store.read_into(K(1), out, GEO, CHUNK)
            raise AssertionError("a read with no cluster must raise (the lane marks the tier down)")
        except redis_py.ConnectionError as e:
            assert "has not been reached yet" in str(e)
        cluster.start()
        store.probe()
        assert store.up()
        put(store, K(1))
        assert get(store, K(1)) == payload(1)
    finally:
        store.close()
        cluster.stop()


def test_a_deletion_no_replica_acknowledges_is_refused(redis_cluster: RedisCluster) -> None:
    """Replication is asynchronous: a replica promoted after a master acknowledged a DEL (the
    older version an overwrite replaced) could bring that version back. A deletion waits for a
    replica of its shard, and raises (the overwrite is then refused) when none has it in time."""
    import os
    import signal

    store = RedisTier(redis_cluster.url, timeout=5.0)
    try:
        store.probe()
        put(store, K(1))
        master = store._redis.get_node_from_key(redis_key(K(1))).port
        replica = next(
            p for p, role in redis_cluster.roles().items()
            if role == "slave" and f"master_port:{master}" in redis_cluster.cli(p, "info", "replication")
        )  # fmt: skip
        os.kill(redis_cluster.procs[replica].pid, signal.SIGSTOP)  # it stops taking the stream,
        redis_cluster.cli(master, "client", "kill", "type", "replica")  # and the master forgets it
        try:
            with pytest.raises(redis_py.RedisError, match=r"no replica of .* acknowledged the deletion"):
                store.delete(K(1))
        finally:
            os.kill(redis_cluster.procs[replica].pid, signal.SIGCONT)
        put(store, K(2))
        store.delete(K(2))  # acknowledged: fine
        assert get(store, K(2)) is None
    finally:
        store.close()

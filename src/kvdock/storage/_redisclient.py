"""redis-py plumbing of the L3 tier (storage.redis): the client for a URL, the errors that mean
"L3 is unreachable", a cluster's EVAL WAITed for by a replica, and its nodes for /status."""

from __future__ import annotations

import contextlib
import hashlib
from typing import Any

import redis as redis_py
import redis.cluster as redis_cluster
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvdock.redisurl import CLUSTER_SCHEMES, parse_cluster_url

__all__ = ["DELETE_WAIT_MS", "ERRORS", "cluster_nodes", "eval_each", "make_client", "ping_primaries", "run_waited"]

# RedisClusterException (no slots, cluster down at start) is not a RedisError
ERRORS = (redis_py.RedisError, redis_py.exceptions.RedisClusterException, OSError)
DELETE_WAIT_MS = 1000  # how long a deletion waits for a replica to have it too (cluster)


def make_client(url: str, timeout: float) -> Any:
    """A redis-py client for ``url``: one server (``redis://``, ``rediss://``, ``unix://``), or a
    Redis Cluster from its start nodes (the client discovers the others). A cluster client
    connects when made: RedisClusterException or RedisError if no start node answers."""
    if not url.startswith(CLUSTER_SCHEMES):
        return redis_py.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
    parts = parse_cluster_url(url)
    return redis_cluster.RedisCluster(
        startup_nodes=[redis_cluster.ClusterNode(h, p) for h, p in parts.nodes],
        username=parts.username,
        password=parts.password,
        ssl=parts.tls,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        require_full_coverage=False,  # the shards that are up keep serving while one fails over
        # one retry (after a failover the first attempt finds the old primary gone); the default
        # of ten turned a shard that stopped answering into a minute per call on the lane's thread
        retry=Retry(NoBackoff(), 1),
    )


def run_waited(client: Any, rkey: bytes, *args: Any) -> Any:
    """[cluster] EVAL ``args`` on ``rkey``'s node, then WAIT on the same connection until a
    replica of its shard has it; the script's result. A change no replica acknowledged raises
    (the overwrite is then refused) while the topology lists a replica for the shard: a failover
    could bring the old version back. (Best effort, as Redis says of WAIT: a replica
    disconnected then may be promoted later.)"""
    if len(client.nodes_manager.slots_cache.get(client.keyslot(rkey), [])) < 2:
        return client.eval(*args)  # no replica listed for the shard (after a failover): no WAIT
    node = client.get_node_from_key(rkey)
    pipe = client.get_redis_connection(node).pipeline(transaction=False)
    pipe.eval(*args)
    pipe.execute_command("WAIT", 1, DELETE_WAIT_MS)
    try:
        result, acked = pipe.execute()
    except ERRORS:
        # a node's own connection does not follow a failover as the cluster client does:
        # learn the topology again, so that the retry finds the promoted replica
        with contextlib.suppress(*ERRORS):
            client.nodes_manager.initialize()
        raise
    shard = client.nodes_manager.slots_cache.get(client.keyslot(rkey), [])
    if int(acked) < 1 and len(shard) > 1:
        raise redis_py.exceptions.RedisError(
            f"no replica of {node.name} acknowledged the deletion of an overwritten chunk (or its "
            f"invalidation) within {DELETE_WAIT_MS} ms; a failover could bring the old version back"
        )
    return result


def cluster_nodes(client: Any, down: dict[str, str]) -> list[dict[str, str]]:
    """A cluster's nodes as ``client`` last saw them: ``addr``, ``role`` (primary or replica)
    and ``state`` ("up", or "down: <error>" for a primary in ``down``), from the client's
    topology cache: no I/O. A node that failed drops out of the topology once the cluster has
    noticed (its replica then shows as primary)."""
    found = list(client.nodes_manager.nodes_cache.values())
    docs = [
        {"addr": n.name, "role": str(n.server_type), "state": f"down: {down[n.name]}" if n.name in down else "up"}
        for n in found
    ]
    return sorted(docs, key=lambda d: d["addr"])


def eval_each(client: Any, script: str, calls: list[tuple[Any, ...]]) -> list[Any]:
    """[worker] ``script`` once per call (``numkeys, *keys, *args``), pipelined: one round trip (per
    node on a cluster), by the script's digest (EVALSHA), then in full (EVAL) for the nodes that
    lack it. One result per call: a call's own script error (ResponseError, OOM say) is its result,
    any other error raises."""
    sha = hashlib.sha1(script.encode()).hexdigest()
    out: list[Any] = [redis_py.exceptions.NoScriptError()] * len(calls)
    for cmd, body in (("EVALSHA", sha), ("EVAL", script)):
        todo = [i for i, r in enumerate(out) if isinstance(r, redis_py.exceptions.NoScriptError)]
        if not todo:
            break
        pipe = client.pipeline(transaction=False)
        for i in todo:
            pipe.execute_command(cmd, body, *calls[i])
        for i, r in zip(todo, pipe.execute(raise_on_error=False), strict=True):
            out[i] = r
    for r in out:
        if isinstance(r, Exception) and not isinstance(r, redis_py.exceptions.ResponseError):
            raise r
    return out


def ping_primaries(client: Any) -> dict[str, str]:
    """PING every primary a cluster client knows: the ones that do not answer, with why."""
    down: dict[str, str] = {}
    for node in client.get_primaries():
        try:
            client.ping(target_nodes=node)
        except ERRORS as e:
            down[node.name] = f"{type(e).__name__}: {e}"
    return down

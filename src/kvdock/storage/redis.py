"""L3: objects as Redis/Valkey values, shared by kvdock servers on several hosts: one server, or a
Redis Cluster (``redis+cluster://`` URLs, :func:`make_client`), where objects spread over every
shard by their keys' hash slots and redis-py follows redirections, failovers and re-sharding.

Keys are ``kvdock:v2:{<namespace>:<chunk hash hex>}`` (:func:`redis_key`) where the namespace is
a hash of (model, rank, cache_salt, geometry digest), so salts, models and the geometries of one
model name never see each other's objects. Values use the same
self-describing form as disk files (:mod:`kvdock.storage.objfile`), checked on every read.

All methods that talk to Redis run in the tier's worker threads. A failure marks the tier down
(logged once); while it is down, callers skip it, and :meth:`RedisTier.probe` (driven by the
server) reconnects with exponential backoff. The up/down state is shared by both threads and the
event loop, so it is guarded by a lock.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any

import redis as redis_py

from kvdock.errors import CorruptObject, WriteFenced
from kvdock.keys import ObjectKey, storage_namespace
from kvdock.layout import KVGeometry
from kvdock.redisurl import CLUSTER_SCHEMES, redacted
from kvdock.storage import _redisstage, coherence, objfile
from kvdock.storage._coherence_lua import FLOOR_MIN_MS, INCARNATION_KEY, OBJECT_TTL_MS
from kvdock.storage._redisclient import ERRORS, cluster_nodes, eval_each, make_client, ping_primaries, run_waited
from kvdock.storage._redisholding import FloorScripts, floor_key
from kvdock.storage._redisread import FALLBACK, read_fast, read_heads, read_plain
from kvdock.storage.budget import Budget
from kvdock.storage.coherence import DELETE_SCRIPT, Coherence
from kvdock.storage.policy import Policy
from kvdock.storage.shares import Shares
from kvdock.storage.stream import Fence, pos_text
from kvdock.storage.tier import Head, StorageTier, TierCounters

__all__ = ["ERRORS", "RedisTier", "floor_key", "make_client", "redis_key"]

log = logging.getLogger(__name__)

BACKOFF_MAX = 30.0
# SET + APPEND of one key as one script: Redis runs a script atomically, so readers see the old
# value or the whole new one, and it is a single-key command (it goes to the key's node, follows
# slot migrations, and needs no temporary key: no leftovers, no multi-key RENAME); with
# OBJECT_TTL_MS (volatile-* policies evict objects only)
WRITE_SCRIPT = (
    "redis.call('SET', KEYS[1], ARGV[1]); redis.call('APPEND', KEYS[1], ARGV[2]); "
    f"redis.call('PEXPIRE', KEYS[1], {OBJECT_TTL_MS})"
)


def redis_key(key: ObjectKey, identity: str = "") -> bytes:
    """``kvdock:v2:{<namespace>:<chunk hex>}``: the braces are a Redis Cluster hash tag, so that the
    object's floor (:func:`floor_key`) lives in the same hash slot (one script reads both). The
    namespace covers the geometry digest ``identity`` the object is written under
    (:func:`kvdock.keys.storage_namespace`)."""
    ns = storage_namespace(key.model, key.rank, key.salt, identity)
    return f"kvdock:v2:{{{ns}:{key.chunk.hex()}}}".encode()


class RedisTier(FloorScripts, StorageTier):
    """L3 on one Redis/Valkey server (see the module docstring)."""

    name = "l3"

    def __init__(
        self,
        url: str,
        timeout: float = 5.0,
        max_bytes: int = 0,
        shares: Shares | None = None,
        identity_of: Callable[[str], str | None] = lambda model: "",
        policy: Policy[Hashable] | None = None,
    ) -> None:
        self.url = url
        # a model's geometry digest now (the server's registry): in its objects' keys (redis_key)
        self.identity_of = identity_of
        self.timeout = timeout
        # with max_bytes, this server keeps at most that many bytes of its own writes in L3,
        # deleting the least recently used of them (written or read here) to make room; with
        # shares, each tenant's writes from this server stay within its quota (storage.shares)
        self.max_bytes = max_bytes
        self.shares = shares
        self._tracking = bool(max_bytes or shares)
        # this server's writes by redis key: bytes, owner, eviction order (under _lock; storage.budget)
        self._written: Budget[bytes] = Budget(shares, policy, "L3")
        self._down_nodes: dict[str, str] = {}  # cluster nodes the last probe could not reach (under _lock)
        self.cluster = url.startswith(CLUSTER_SCHEMES)
        self.counters = TierCounters()
        # a cluster client connects when made: made by the first probe, so that a server whose
        # cluster is down at start starts anyway (with L3 down)
        self._client: Any = None if self.cluster else make_client(url, timeout)
        self._lock = threading.Lock()
        self._up = True
        self.last_error = ""
        self._backoff = 1.0
        self._retry_at = 0.0
        self.coherence: Coherence | None = None  # the fleet's invalidations (set by the server)
        self._staging: list[_redisstage.Staged] = []  # plain write-downs staged, to settle (writer thread)

    @property
    def display_url(self) -> str:
        """The URL without its password."""
        return redacted(self.url)

    def up(self) -> bool:
        return self._up

    def failed(self, err: BaseException) -> None:
        """Mark the tier down after an error (logs on the transition only). A script's own error
        (a value someone else wrote where kvdock keeps a floor, say) is no outage: logged only."""
        if isinstance(err, redis_py.exceptions.ResponseError) and "script" in str(err).lower():
            log.warning("L3 %s: a script failed (%s); the tier stays up", self.display_url, err)
            return
        with self._lock:
            self.last_error = f"{type(err).__name__}: {err}"
            if self._up:
                log.warning(
                    "L3 %s is down (%s); serving from L1/L2, retrying with backoff", self.display_url, self.last_error
                )
            self._up = False
            self._retry_at = time.monotonic() + self._backoff
            self._backoff = min(self._backoff * 2, BACKOFF_MAX)

    def probe_due(self) -> bool:
        with self._lock:
            return not self._up and time.monotonic() >= self._retry_at

    def probe_soon(self) -> None:
        """[any] Let the next probe come at once, not after the backoff (L3 was seen answering:
        the coherence poll got through again). The probe still decides whether the tier is up."""
        with self._lock:
            self._retry_at = 0.0

    def probe(self) -> None:
        """PING (making the cluster client first if need be; every primary of a cluster); on
        success mark the tier up again. While a shard of a cluster is down the whole tier is
        down for this server: its reads are misses until the shard's replica has taken over."""
        try:
            if self._client is None:
                self._client = make_client(self.url, self.timeout)
            if self.cluster:  # every shard: a default node answering says nothing of a dead master
                down = ping_primaries(self._client)
                with self._lock:
                    self._down_nodes = down  # (for /status)
                if down:
                    name, err = next(iter(down.items()))
                    raise redis_py.ConnectionError(f"{len(down)} primary node(s) do not answer; {name}: {err}")
            else:
                self._client.ping()
        except ERRORS as e:
            self.failed(e)
            return
        with self._lock:
            self._down_nodes.clear()
            if not self._up:
                log.warning("L3 %s is back", self.display_url)
            self._up = True
            self._backoff = 1.0

    def is_cluster_node(self) -> bool:
        """[any, at start] Whether a single-server URL points at a Redis Cluster node (it would
        answer MOVED for the other shards' keys)."""
        try:
            return not self.cluster and int(self._redis.info("cluster").get("cluster_enabled", 0)) == 1
        except ERRORS:
            return False

    def _key(self, key: ObjectKey, incarnation: bytes | None = None) -> bytes:
        """``key``'s L3 key: its geometry's digest and, with the fleet's coherence, the incarnation
        of the invalidation stream (the one known now, or a write's, from its fence): a write
        issued before L3 lost everything lands under a key no reader of the new one asks for."""
        identity = self.identity_of(key.model) or ""
        if self.coherence is not None:
            identity += "@" + (self.coherence.incarnation if incarnation is None else incarnation).decode()
        return redis_key(key, identity)

    def run_script(self, script: str, keys: list[bytes], args: list[bytes | str]) -> Any:
        """[worker] EVAL ``script`` (small records kept beside the objects: server.fleet)."""
        return self._redis.eval(script, len(keys), *keys, *args)

    @property
    def _redis(self) -> Any:
        if self._client is None:  # a cluster never reached yet (the lane marks the tier down)
            raise redis_py.ConnectionError(f"the cluster {self.display_url} has not been reached yet")
        return self._client

    def write_from(self, key: ObjectKey, header: bytes, payload: memoryview, fence: Fence | None = None) -> int:
        """Store ``header + payload`` under the key in one atomic script (WRITE_SCRIPT); with a
        ``fence``, the script refuses (WriteFenced) a write that an overwrite's floor or its age
        makes stale (kvdock.storage.coherence), and a plain version's is only staged: readable once
        :meth:`settle` commits it (storage._redisstage)."""
        final = self._key(key, fence.incarnation if fence is not None else None)
        size = len(header) + len(payload)
        owner = self.shares.owner(key) if self.shares is not None else None
        self._make_room(final, size, owner)
        # its version and parent (storage.budget), an overwrite's E2 (written only while its floor lives)
        head = objfile.decode_header(header)[0] if fence is not None or self._tracking else None
        if fence is None:
            self._redis.eval(WRITE_SCRIPT, 1, final, header, payload)
        else:
            assert head is not None
            try:  # (a plain version's is staged: settle commits it)
                staged = _redisstage.write(
                    self._redis, key, final, floor_key(final), header, payload, fence, head.overwrite
                )
            except WriteFenced:
                self.counters.fenced += 1
                raise
            if staged is not None:
                with self._lock:
                    self._staging.append(staged._replace(counted=final in self._written))
        if head is not None and self._tracking:  # its place after its prompt's head (storage.budget)
            with self._lock:
                self._written.remove(final)
                self._written.add(final, size, owner, version=head.version, parent=head.parent)
        return size

    @property
    def stages(self) -> bool:  # type: ignore[override]
        """Plain versions' write-downs are staged with the fleet's coherence (storage._redisstage)."""
        return self.coherence is not None

    def settle(self) -> dict[ObjectKey, Exception]:
        """[writer] Commit the plain versions :meth:`write_from` staged since the last call
        (storage._redisstage.settle); those that did not land, with WriteFenced (an overwrite
        replaced them: their server drops its copy) or WriteLate (not there any more, or not
        provably current: skipped)."""
        staged, self._staging = self._staging, []
        if not staged or self.coherence is None:
            return {}
        outcomes = _redisstage.settle(self.coherence.client(), self._commit, staged, self.coherence.incarnation)
        last = {s.key: i for i, s in enumerate(staged)}  # (an earlier staging of a key was replaced by it)
        out: dict[ObjectKey, Exception] = {}
        for i, (s, outcome) in enumerate(zip(staged, outcomes, strict=True)):
            err = _redisstage.refusal(s, outcome)
            if err is None or last[s.key] != i:
                continue
            self.counters.fenced += 1
            if outcome == _redisstage.REFUSED or not s.counted:  # (else its earlier write may be there)
                with self._lock:
                    self._forget(s.final)
            out[s.key] = err
        return out

    def _commit(self, staged: list[_redisstage.Staged], commit: list[bool]) -> list[int]:
        """[writer] COMMIT_SCRIPT for each staged write, pipelined (dropped where ``commit`` is
        False); a write whose script failed (OOM say) did not land: GONE."""
        calls = [_redisstage.commit_args(s, floor_key(s.final), c) for s, c in zip(staged, commit, strict=True)]
        done = eval_each(self._redis, _redisstage.COMMIT_SCRIPT, calls)
        return [_redisstage.GONE if isinstance(r, Exception) else int(r) for r in done]

    def _forget(self, final: bytes) -> None:
        """Stop counting this server's write of ``final`` (under _lock)."""
        self._written.remove(final)

    def _make_room(self, final: bytes, size: int, owner: str | None) -> None:
        """[writer] Delete this server's writes, first in the eviction policy's order, until
        ``size`` more bytes of ``owner`` fit in its quota (its own writes) and in ``max_bytes``
        (writes it may evict: storage.budget); NoRoom if they never can. (A key deleted here may
        hold another server's newer write by now: that is a miss for it, never wrong bytes.)"""
        while True:
            with self._lock:
                victim = self._written.next_victim(size, owner, self.max_bytes or None, replacing=final)
                if victim is None:
                    return
                self._written.remove(victim, evicted=True)
            self._redis.delete(victim, *_redisstage.staged_keys(victim))  # (a write staged in this batch too)

    def read_into(self, key: ObjectKey, out: memoryview, geometry: KVGeometry, chunk_size: int) -> Head | None:
        """The fast read (_redisread.read_fast), or redis-py's GET where it cannot decide."""
        rkey = self._key(key)
        found = (
            read_fast(self._redis, self.cluster, rkey, key, out, geometry, chunk_size) if self.fast_reads else FALLBACK
        )
        if found is FALLBACK:
            found = self._read_plain(rkey, key, out, geometry, chunk_size)
        if found is not None and self._superseded():
            return None
        if found is not None and self._tracking:
            with self._lock:
                self._written.touch(rkey)
        return found

    fast_reads = True  # False: every read is one GET parsed by redis-py (the only read before resp.py)

    def _read_plain(
        self, rkey: bytes, key: ObjectKey, out: memoryview, geometry: KVGeometry, chunk_size: int
    ) -> Head | None:
        """One GET through redis-py (_redisread.read_plain); a corrupted value is deleted so
        lookups stop counting it (a newer value renamed onto the key meanwhile would go too, which
        is only a miss)."""
        found = read_plain(self._redis, key, rkey, out, geometry, chunk_size)
        if isinstance(found, CorruptObject):
            self.counters.corrupted += 1
            self._redis.delete(rkey)
            log.warning("L3: corrupted value for %s (%s); deleted", key.chunk.hex()[:16], found)
            return None
        return found

    def heads(self, keys: list[ObjectKey]) -> list[Head]:
        """One pipelined round trip reading the first bytes of each value (its header)."""
        found = read_heads(self._redis, [self._key(k) for k in keys])
        return [] if found and self._superseded() else found

    def _superseded(self) -> bool:
        """[worker] While this server does not vouch (its poller late: it answers from L3 alone),
        whether L3's stream started another incarnation than the one it knows: its keys are then
        not what overwrites delete any more (A-STAGE r10 #2), so what it read is a miss. One GET,
        after the read, only while not vouching."""
        c = self.coherence
        return c is not None and not c.vouched() and c.client().get(INCARNATION_KEY) != c.incarnation

    def delete(self, key: ObjectKey) -> None:
        """DEL (on a cluster, WAITed for by a replica: _redisclient.run_waited); with the default appendfsync
        the deletion is as durable as Redis makes anything. (An overwrite's go through
        :meth:`delete_keys`.)"""
        final = self._key(key)
        keys = (final, *_redisstage.staged_keys(final))  # (a write staged before it goes too)
        if self.cluster:
            run_waited(self._redis, final, "return redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])", 3, *keys)
        else:
            self._redis.delete(*keys)
        with self._lock:
            self._forget(final)

    def delete_keys(self, keys: list[ObjectKey]) -> int:
        """An overwrite's deletions. With the fleet's :class:`Coherence`: append an invalidation
        of ``keys`` (E1), delete each while raising its floor to E1 (so that no write issued
        before its server learned of E1 lands after), append the invalidation again (E2), and
        delete each again while raising the floors to E2 (of two concurrent overwrites of a key,
        the one whose E2 comes later is what L3 keeps, as every L1 does: a version the other
        wrote between our E1 and E2 goes too, or L3 would serve it once we acknowledged, until
        our own write-down lands), and return E2 (the epoch of the new versions). On a cluster
        each step WAITs for a replica (_redisclient.run_waited)."""
        if self.coherence is None:
            for key in keys:
                self.delete(key)
            return 0
        run = functools.partial(run_waited, self._redis) if self.cluster else None
        position = 0
        for _ in ("E1", "E2"):
            position = self.coherence.publish(keys, run)
            for key in keys:
                self._floor(self._key(key), position)
        return position

    def _floor(self, final: bytes, floor: int) -> None:
        """Delete ``final`` and raise its floor to ``floor`` (one script)."""
        ttl = self.coherence.floor_ttl_ms if self.coherence is not None else coherence.FLOOR_TTL_MS
        ttl = max(ttl, FLOOR_MIN_MS)  # (a write-down issued before it lands within ISSUE_LIMIT_MS)
        keys = (final, floor_key(final), *_redisstage.staged_keys(final))
        args = (DELETE_SCRIPT, 4, *keys, pos_text(floor), ttl)
        if self.cluster:
            run_waited(self._redis, final, *args)
        else:
            self._redis.eval(*args)
        with self._lock:
            self._forget(final)

    def clear(self) -> int:
        return 0  # shared by other servers: never cleared from here

    def check_integrity(self) -> None:
        """Assert: the bytes of this server's writes add up, and so do their owners' shares."""
        with self._lock:
            self._written.check()

    def status(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"kind": "redis", "up": self._up, "url": self.display_url, "last_error": self.last_error}
        if self.max_bytes:  # what this server wrote and keeps there (other servers' writes not counted)
            doc["used_bytes"], doc["capacity_bytes"] = self._written.used, self.max_bytes
        if self.coherence is not None:  # the fleet's invalidations, as this server follows them
            doc["coherence"] = self.coherence.status()
        if self.cluster:
            doc["kind"] = "redis-cluster"
            doc["nodes"] = self.nodes()
        return doc

    def nodes(self) -> list[dict[str, str]]:
        """[any] A cluster's nodes as its client last saw them (no I/O; _redisclient.cluster_nodes)."""
        if self._client is None:
            return []
        with self._lock:
            down = dict(self._down_nodes)
        return cluster_nodes(self._client, down)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()

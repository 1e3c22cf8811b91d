"""L3's side of storage.keeping and of a plain store's check (storage.redis): the per-key floor
scripts, each run for many keys in one pipelined round trip (per node on a cluster). A mixin of
:class:`~kvdock.storage.redis.RedisTier`: it uses the tier's ``_key``, ``_redis`` and
``coherence``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvdock.keys import ObjectKey
from kvdock.storage._coherence_lua import KEEP_SCRIPT, SHARD_SCRIPT, UNKEEP_SCRIPT
from kvdock.storage._redisclient import eval_each

if TYPE_CHECKING:
    from kvdock.storage.coherence import Coherence

__all__ = ["FloorScripts", "floor_key"]


def floor_key(rkey: bytes) -> bytes:
    """The key of an object's floor (kvdock.storage.coherence: fenced writes)."""
    return rkey + b":f"


class FloorScripts:
    """The floor scripts of a shared L3 tier (empty answers without the fleet's coherence)."""

    coherence: Coherence | None

    def _key(self, key: ObjectKey, incarnation: bytes | None = None) -> bytes:
        raise NotImplementedError

    @property
    def _redis(self) -> Any:
        raise NotImplementedError

    def _each(self, script: str, items: list[tuple[ObjectKey, tuple[Any, ...]]]) -> list[int]:
        """[worker] ``script`` on (value, floor) of each item's key with its args, pipelined
        (_redisclient.eval_each); -1 where that key's script failed (OOM, say: R-KEEP 3)."""
        calls = [(2, self._key(k), floor_key(self._key(k)), *args) for k, args in items]
        return [-1 if isinstance(r, Exception) else int(r) for r in eval_each(self._redis, script, calls)]

    def floored(self, keys: list[ObjectKey]) -> set[ObjectKey]:
        """[worker, reader] Those of ``keys`` (a plain store's heads found no value of them) whose
        floor is live (an overwrite raised it, or a holder keeps it: storage.keeping): an
        overwrite's version not written down yet, or not at all, or written since those heads were
        read (the store would write over it: R-KEEP 1). One round trip."""
        if self.coherence is None or not keys:
            return set()
        pipe = self._redis.pipeline(transaction=False)
        for k in keys:
            pipe.exists(floor_key(self._key(k)))
        return {k for k, floor in zip(keys, pipe.execute(), strict=True) if floor}

    def keep(self, items: list[tuple[ObjectKey, str, bytes]]) -> list[int]:
        """[worker] KEEP_SCRIPT for each (key, its overwrite's E2, the mark of the version held):
        1 serve on, 0 write it again, -1 drop it (storage.keeping)."""
        if self.coherence is None or not items:
            return []
        ttl = self.coherence.floor_ttl_ms
        return self._each(KEEP_SCRIPT, [(key, (e2, mark, ttl)) for key, e2, mark in items])

    def shards_kept(self, items: list[tuple[ObjectKey, str]]) -> list[int]:
        """[worker] SHARD_SCRIPT for each (key, an overwrite's E2): 1 that shard is still that
        overwrite's, -1 not (storage.keeping: a sibling shard of a held one)."""
        if self.coherence is None or not items:
            return [1] * len(items)
        return self._each(SHARD_SCRIPT, [(key, (e2,)) for key, e2 in items])

    def unkeep(self, items: list[tuple[ObjectKey, str]]) -> list[int]:
        """[worker] UNKEEP_SCRIPT for each (key, its overwrite's E2): that overwrite's version of
        each goes from L3 and its floor is poisoned (storage.keeping: a shard dropped with its
        chunk); one answer per item (values deleted; -1: that key's script failed)."""
        if self.coherence is None or not items:
            return []
        ttl = self.coherence.floor_ttl_ms
        return self._each(UNKEEP_SCRIPT, [(key, (e2, ttl)) for key, e2 in items])

"""L1's evictable objects, by bucket (pool region, slot size): eviction looks only where a slot of
the size asked for would come free. Owned by :class:`kvdock.storage.memory.L1Store` (event loop).

Each bucket keeps its objects apart in two sets:

* **clean** ones (every write-down done, or no lower tier): ordered by the bucket's eviction
  policy (:mod:`kvdock.storage.policy`), the only ones an ordinary eviction takes;
* **dirty** ones (a write-down to a lower tier queued or in flight, :mod:`kvdock.storage.lane`):
  acknowledged data that exists nowhere else yet. They are evicted only when the store asks for
  it (a store whose bounded wait for write-downs ran out: :mod:`kvdock.storage.writeback`), and
  then the one committed *last* goes first: a prompt's chunks are committed head first and
  written down in commit order, so the newest dirty object is the tail of the newest prompt, and
  a head is never dropped while a tail after it stays.

A dirty object that becomes clean enters the policy then, as new unless it was used meanwhile.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, cast

from kvdock.keys import ObjectKey
from kvdock.shm.slots import aligned
from kvdock.storage.policy import Policy

if TYPE_CHECKING:
    from kvdock.storage.memory import L1Object
    from kvdock.storage.prefixes import Prefixes

Bucket = tuple[str | None, int]  # (region, slot size)

log = logging.getLogger("kvdock.storage.memory")


@dataclass
class L1Counters:
    """L1's eviction counters (/status ``l1.eviction``, /metrics ``kvdock_l1_*``)."""

    evicted_clean: int = 0  # evicted for room, every write-down done (or no lower tier)
    evicted_dirty: int = 0  # evicted for room before its write-down: acknowledged data dropped
    evicted_dirty_bytes: int = 0
    throttled_stores: int = 0  # stores that waited for write-downs to free clean room
    throttle_seconds: float = 0.0  # time they waited
    throttle_timeouts: int = 0  # ... of which the wait ran out (then dirty objects may go)

    _logged = 0.0  # (a class default: not a field)

    def evicted(self, obj: L1Object, wait_s: float) -> None:
        """Count an eviction; one of a dirty object is logged (at most once a minute)."""
        if not obj.dirty:
            self.evicted_clean += 1
            return
        self.evicted_dirty += 1
        self.evicted_dirty_bytes += obj.nbytes
        now = time.monotonic()
        if now - self._logged > 60:
            self._logged = now
            log.warning(
                "L1: evicted an object before its write-down to a lower tier (%d so far, %d bytes): stores came "
                "faster than the lower tier wrote for longer than --writeback-wait-s (%.3g s); the newest chunks "
                "go first, never a prefix's head before its tail",
                self.evicted_dirty,
                self.evicted_dirty_bytes,
                wait_s,
            )

    def doc(self, policy: str, dirty: list[L1Object], wait_s: float, limit: float = 1.0) -> dict[str, Any]:
        """/status ``l1.eviction``."""
        return {
            "eviction_policy": policy,
            **{f.name: getattr(self, f.name) for f in fields(self)},
            "dirty_objects": len(dirty),
            "dirty_bytes": sum(o.nbytes for o in dirty),
            "writeback_wait_s": wait_s,
            "writeback_dirty_limit": limit,
        }


def bucket_of(obj: L1Object) -> Bucket:
    return (obj.region, aligned(obj.nbytes))


class _Bucket:
    __slots__ = ("clean", "dirty", "heap", "policy")

    def __init__(self, policy: Policy[ObjectKey]) -> None:
        self.policy = policy
        self.clean: dict[ObjectKey, L1Object] = {}
        self.dirty: dict[ObjectKey, L1Object] = {}
        self.heap: list[tuple[int, int, L1Object]] = []  # (-seq, tiebreak, obj): newest dirty first (lazy)

    def __len__(self) -> int:
        return len(self.clean) + len(self.dirty)


class Evictable:
    """The evictable objects of L1 (READY, live, unpinned), by bucket; see the module docstring."""

    def __init__(self, make_policy: Callable[[], Policy[Hashable]], prefixes: Prefixes) -> None:
        self._prefixes = prefixes
        self._make_policy = make_policy
        self._buckets: dict[Bucket, _Bucket] = {}
        self._tiebreak = itertools.count()
        self.waiters: list[Callable[[], None]] = []  # told when an object turns clean (storage.writeback)
        self.policy_name = make_policy().name

    def __len__(self) -> int:
        return sum(len(b) for b in self._buckets.values())

    def __contains__(self, obj: L1Object) -> bool:
        b = self._buckets.get(bucket_of(obj))
        return b is not None and (b.clean.get(obj.key) is obj or b.dirty.get(obj.key) is obj)

    def buckets(self) -> Iterator[Bucket]:
        return iter(self._buckets)

    def count(self, bucket: Bucket) -> tuple[int, int]:
        """(clean, dirty) objects of ``bucket``."""
        b = self._buckets.get(bucket)
        return (len(b.clean), len(b.dirty)) if b is not None else (0, 0)

    def region(self, region: str | None) -> tuple[int, int, int]:
        """(bytes of the clean, bytes of the dirty, dirty objects) of ``region``'s buckets."""
        out = [0, 0, 0]
        for (r, size), b in self._buckets.items():
            if r == region:
                out[0] += len(b.clean) * size
                out[1] += len(b.dirty) * size
                out[2] += len(b.dirty)
        return out[0], out[1], out[2]

    def add(self, obj: L1Object, new: bool) -> None:
        """``obj`` became evictable (committed, unpinned, written down)."""
        b = self._bucket(obj)
        if obj.dirty:
            b.dirty[obj.key] = obj
            heapq.heappush(b.heap, (-obj.seq, next(self._tiebreak), obj))
            if len(b.heap) > 2 * len(b.dirty) + 64:  # stale entries of objects since cleaned
                b.heap = [(-o.seq, next(self._tiebreak), o) for o in b.dirty.values()]
                heapq.heapify(b.heap)
        else:
            b.clean[obj.key] = obj
            b.policy.insert(obj.key, new=new, before=self._prefixes.parent_key(obj))

    def _bucket(self, obj: L1Object) -> _Bucket:
        """``obj``'s bucket, made now if there is none."""
        key = bucket_of(obj)
        b = self._buckets.get(key)
        if b is None:
            b = self._buckets[key] = _Bucket(cast(Policy[ObjectKey], self._make_policy()))
        return b

    def enter(self, objs: Iterable[L1Object]) -> None:
        """Each of ``objs`` in turn was committed (READY now): a chunk of its prompt
        (storage.prefixes), evictable as new (:meth:`add`); an orphan goes first (:meth:`demote`)."""
        for obj in objs:
            orphan = self._prefixes.add(obj)
            self.add(obj, new=True)
            if orphan:
                self.demote(obj)

    def redirty(self, obj: L1Object, delta: int) -> None:
        """One more (+1) or one fewer (-1) write-down of ``obj`` pending; an evictable object moves
        between the dirty and clean sets (as new if it was not read meanwhile)."""
        assert obj.dirty + delta >= 0, "cleaning a clean object"
        evictable = obj in self
        if evictable:
            self.drop(obj)
        obj.dirty += delta
        if evictable:
            self.add(obj, new=obj.uses == 0)
        if not obj.dirty:
            self.wake()

    def wake(self) -> None:
        """Room may have come free: call (and forget) every waiter."""
        waiters, self.waiters = self.waiters, []
        for callback in waiters:
            callback()

    def drop(self, obj: L1Object) -> None:
        """``obj`` stops being evictable (pinned, retired, evicted)."""
        key = bucket_of(obj)
        b = self._buckets[key]
        if b.clean.get(obj.key) is obj:
            del b.clean[obj.key]
            b.policy.remove(obj.key)
        else:
            assert b.dirty.get(obj.key) is obj, "dropping an object that is not evictable"
            del b.dirty[obj.key]
        if not b.clean and not b.dirty:
            del self._buckets[key]

    def access(self, obj: L1Object) -> None:
        """``obj`` (evictable) was read without a pin (a client's fast read)."""
        b = self._buckets[bucket_of(obj)]
        if b.clean.get(obj.key) is obj:
            b.policy.access(obj.key, before=self._prefixes.parent_key(obj))

    def demote(self, obj: L1Object) -> None:
        """``obj`` is an orphan (the chunk before it left L1): a clean one goes next."""
        b = self._buckets.get(bucket_of(obj))
        if b is not None and b.clean.get(obj.key) is obj:
            b.policy.demote(obj.key)

    def victim(self, bucket: Bucket, dirty: bool = False) -> L1Object | None:
        """The clean object of ``bucket`` to evict next; with ``dirty``, when there is none, the
        dirty one committed last. None if there is nothing (of that kind)."""
        b = self._buckets.get(bucket)
        if b is None:
            return None
        key = b.policy.victim()
        if key is not None:
            return b.clean[key]
        if not dirty:
            return None
        while b.heap:
            _, _, obj = b.heap[0]
            if b.dirty.get(obj.key) is obj:
                return obj
            heapq.heappop(b.heap)  # since cleaned, pinned or gone
        return None

    def evict(self, obj: L1Object) -> None:
        """``obj`` (a victim) is evicted: dropped, remembered by a policy with history."""
        key = bucket_of(obj)
        b = self._buckets[key]
        if b.clean.get(obj.key) is obj:
            del b.clean[obj.key]
            b.policy.evict(obj.key)
            if not b.clean and not b.dirty:
                del self._buckets[key]
        else:
            self.drop(obj)

    def order(self, bucket: Bucket | None = None) -> list[L1Object]:
        """Every evictable object (of ``bucket``) in eviction order: the clean ones by the policy,
        then the dirty ones newest first (O(n): tests and checks)."""
        out: list[L1Object] = []
        for key, b in self._buckets.items():
            if bucket is None or key == bucket:
                out += [b.clean[k] for k in b.policy.order()]
                out += sorted(b.dirty.values(), key=lambda o: -o.seq)
        return out

    def check(self, is_evictable: Callable[[L1Object], bool]) -> None:
        """Assert: every object held is evictable, in its own bucket, in the set its dirtiness
        says, and each policy holds exactly its bucket's clean objects."""
        for key, b in self._buckets.items():
            assert b.clean or b.dirty, "an empty bucket is kept"
            b.policy.check()
            assert set(b.policy.order()) == set(b.clean), "a policy holds other keys than its bucket"
            for k, obj in (*b.clean.items(), *b.dirty.items()):
                assert obj.key == k and bucket_of(obj) == key and is_evictable(obj), "a stray evictable object"
            assert all(not o.dirty for o in b.clean.values()), "a dirty object among the clean ones"
            assert all(o.dirty for o in b.dirty.values()), "a clean object among the dirty ones"
            assert not b.clean.keys() & b.dirty.keys(), "an object both clean and dirty"
            live = {id(o) for o in b.dirty.values()}
            assert live <= {id(o) for _, _, o in b.heap}, "a dirty object is missing from the heap"

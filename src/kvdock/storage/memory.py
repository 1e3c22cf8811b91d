"""L1 object store: object states, pin counts and LRU eviction over a :class:`SlotAllocator`.

Invariants (checked by :meth:`L1Store.check_integrity`):

* an object is RESERVED (being written, invisible) or READY (visible to lookups);
* at most one READY and one RESERVED object per key;
* the evictable set (:mod:`kvdock.storage.evictable`) holds exactly the READY, live objects
  with no pin and no hold (a lane's writer copying it: :meth:`L1Store.hold`): the *clean* ones
  ordered by the eviction policy (:mod:`kvdock.storage.policy`), the *dirty* ones (a write-down
  to a lower tier pending) apart, evicted only when a store asks for it after its bounded wait
  (:mod:`kvdock.storage.writeback`), newest first (tails before heads);
* an object replaced by an overwrite (or deleted) while pinned or held is no longer *live*: it
  keeps its slot until its last pin and hold are released, then the slot is freed;
* with a directory (:mod:`kvdock.shm.directory`) for its region, every READY object is published
  there (or, its bucket being full, counted as unindexed) from the moment it becomes READY until
  it stops being READY, which is before its slot is freed: clients that read the directory
  without the server never find a key whose object is gone, nor a slot whose object is. Each
  region's directory lives in its own segment and lists only that region's objects (a tenant's
  pool: that tenant's).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterator
from typing import Any

from kvdock.keys import ObjectKey
from kvdock.shm.directory import Directory
from kvdock.shm.pool import SlotMemory
from kvdock.shm.slots import Partitions, SlotAllocator, aligned
from kvdock.storage._l1checks import check_store
from kvdock.storage.evictable import Evictable, L1Counters
from kvdock.storage.l1object import L1Object, L1Watcher, State
from kvdock.storage.listings import Listings
from kvdock.storage.policy import DEFAULT_POLICY, Policy, make_policy
from kvdock.storage.prefixes import Prefixes
from kvdock.storage.shares import Shares

__all__ = ["L1Object", "L1Store", "L1Watcher", "State"]


class L1Store:
    """Objects of the L1 pool. Not thread-safe: the server calls it from its event loop only."""

    def __init__(
        self,
        allocator: SlotAllocator | Partitions,
        watcher: L1Watcher | None = None,
        memory: SlotMemory | None = None,
        directories: dict[str | None, Directory] | None = None,
        shares: Shares | None = None,
        policy: str | Callable[[], Policy[Hashable]] = DEFAULT_POLICY,
    ) -> None:
        assert shares is None or not shares.quotas or isinstance(allocator, Partitions), "quotas need regions"
        self.allocator = allocator
        # who owns each object (storage.shares): a tenant with a region of the pool
        # (shm.slots.Partitions: its L1 quota) has its slots there, everyone else in the rest; a
        # region's own byte count is what its tenant holds in L1 (no charges kept beside it)
        self.shares = shares
        self._memory = memory  # the pool's bytes, for workers that copy to and from lower tiers
        self._ready: dict[ObjectKey, L1Object] = {}
        self._prefixes = Prefixes()  # READY objects as prompts (prefix-aware eviction)
        self._reserved: dict[ObjectKey, L1Object] = {}
        # evictable objects by (region, slot size), clean ones in policy order (storage.evictable)
        self._evictable = Evictable(policy if callable(policy) else lambda: make_policy(policy), self._prefixes)
        self.counters = L1Counters()
        self._seq = 0
        # storage.writeback: how long a store waits for write-downs (--writeback-wait-s), and the share
        # of the pool dirty objects may fill before stores wait (--writeback-dirty-limit)
        self.writeback_wait_s, self.dirty_limit = 2.0, 1.0
        self._dirty_ok = False  # reservations may evict dirty objects (dirty_eviction)
        self._retired: set[L1Object] = set()  # not live, still pinned
        self._detached: set[L1Object] = set()  # reservations set aside, still holding a slot
        self._watcher = watcher
        self.evictions = 0
        self._listings = Listings(directories)  # what the pool directories list (by region)

    def __len__(self) -> int:
        return len(self._ready)

    def has_directory(self, region: str | None) -> bool:  # whether region's objects are in a pool directory
        return self._listings.has(region)

    def get(self, key: ObjectKey) -> L1Object | None:  # the READY object for ``key`` or None
        return self._ready.get(key)

    def is_reserved(self, key: ObjectKey) -> bool:
        return key in self._reserved

    def view(self, obj: L1Object) -> memoryview:
        """The slot bytes of ``obj`` (the store must have been given the pool's memory)."""
        assert self._memory is not None, "this store has no memory attached"
        return self._memory.view(obj.offset, obj.nbytes)

    def pinned_objects(self) -> list[L1Object]:
        """Every object with at least one pin, live or retired (or only held: storage.lane)."""
        return [o for o in self._ready.values() if o.pins] + list(self._retired)

    def reserved_count(self) -> int:  # reservations, detached ones included
        return len(self._reserved) + len(self._detached)

    def reservation(self, key: ObjectKey) -> L1Object | None:
        return self._reserved.get(key)

    @property
    def policy(self) -> str:  # the eviction policy's name
        return self._evictable.policy_name

    def lru_keys(self) -> list[ObjectKey]:
        """Evictable keys in eviction order, by bucket (clean ones by the policy, then dirty ones newest first)."""
        return [o.key for o in self._evictable.order()]

    def reserve(self, key: ObjectKey, nbytes: int, evict_dirty: bool | None = None) -> L1Object | None:
        """Reserve a slot for a new version of ``key``, evicting clean objects of the same slot
        size (and region) in policy order if needed; dirty ones (a write-down pending) only with
        ``evict_dirty`` (default: while :meth:`dirty_eviction` allows it), newest first. Returns
        None when nothing can make room ("pool full"); pinned data is never evicted. A tenant with
        a region (its L1 quota) is served from it alone, and only its own objects are evicted there;
        everyone else shares the rest. Precondition: ``key`` has no pending reservation."""
        assert key not in self._reserved, "key already reserved"
        dirty = self._dirty_ok if evict_dirty is None else evict_dirty
        region = self.region_for(key)
        offset = self.allocator.alloc(nbytes, region)
        while offset is None:
            bucket = (region, aligned(nbytes))
            if not self._evict_one(bucket, dirty) and not self._recarve(region, aligned(nbytes), dirty):
                return None
            offset = self.allocator.alloc(nbytes, region)
        obj = L1Object(key, offset, nbytes, region=region)
        self._reserved[key] = obj
        return obj

    @contextlib.contextmanager
    def dirty_eviction(self) -> Iterator[None]:
        """``with store.dirty_eviction():`` reservations made inside may evict dirty objects (a
        store whose wait for write-downs is over: storage.writeback)."""
        self._dirty_ok = True
        try:
            yield
        finally:
            self._dirty_ok = False

    def room(self, key: ObjectKey, nbytes: int) -> tuple[int, int]:
        """(slots of ``nbytes`` that reservations for ``key``'s owner can get without evicting a
        dirty object: free ones and clean evictable ones; dirty evictable ones there, or in all of
        a tenant's region carved for other sizes: :meth:`_recarve` then gives the room)."""
        region = self.region_for(key)
        size = aligned(nbytes)
        clean, dirty = self._evictable.count((region, size))
        free = self.allocator.free_slots(nbytes, region)
        if free + clean or region is None or not isinstance(self.allocator, Partitions):
            return free + clean, dirty
        area = self.allocator.regions[region]  # carved for other sizes: only _recarve gives this one
        clean_bytes, dirty_bytes, dirty_all = self._evictable.region(region)
        if size > area.capacity or clean_bytes + dirty_bytes != area.used_bytes:
            return 0, dirty_all  # (a pinned or reserved object there: no recarving now)
        return (0 if dirty_all else area.capacity // size), dirty_all

    def dirty_room(self, region: str | None) -> tuple[int, int]:
        """(bytes of ``region``'s evictable dirty objects, its capacity): the dirty limit's terms."""
        alloc = self.allocator.regions[region] if isinstance(self.allocator, Partitions) else self.allocator
        return self._evictable.region(region)[1], alloc.capacity

    def when_clean(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once, the next time an object turns clean (or leaves L1)."""
        self._evictable.waiters.append(callback)

    def mark_dirty(self, obj: L1Object) -> None:
        """A write-down of ``obj`` was queued (storage.lane): it is evicted only after it, or last."""
        self._evictable.redirty(obj, +1)

    def mark_clean(self, obj: L1Object) -> None:
        """A write-down of ``obj`` is over (written, skipped or failed)."""
        self._evictable.redirty(obj, -1)

    def _recarve(self, region: str | None, size: int, dirty: bool) -> bool:
        """A tenant's region has no slot of ``size`` to give nor to evict (carved for its other
        sizes): when all there can be evicted (dirty objects only with ``dirty``), evict it all and
        carve the region anew (SlotAllocator.recarve); whether it did."""
        if region is None or not isinstance(self.allocator, Partitions):
            return False  # (the shared rest holds others' objects: never emptied for one store)
        area = self.allocator.regions[region]
        clean_bytes, dirty_bytes, _ = self._evictable.region(region)
        if size > area.capacity or clean_bytes + (dirty_bytes if dirty else 0) != area.used_bytes:
            return False
        buckets = [b for b in self._evictable.buckets() if b[0] == region]
        for bucket in buckets:
            while self._evict_one(bucket, dirty):
                pass
        area.recarve()
        return True

    def region_for(self, key: ObjectKey) -> str | None:
        if self.shares is None or not isinstance(self.allocator, Partitions):
            return None
        owner = self.shares.owner(key)
        return owner if owner in self.allocator.regions else None

    def _evict_one(self, bucket: tuple[str | None, int], dirty: bool = False) -> bool:
        """Evict the policy's victim among the clean objects of ``bucket`` (region, slot size),
        or with ``dirty`` and none clean, the dirty one committed last; whether there was one. A
        dirty object of a sharded chunk takes the other shards' dirty objects of that chunk with
        it (committed just before it, unless being written or written already): a chunk is cached
        only whole, so one shard's part alone would be written down for nothing."""
        obj = self._evictable.victim(bucket, dirty)
        if obj is None:
            return False
        while True:
            self._evict(obj)
            nxt = self._evictable.victim(bucket, dirty) if obj.dirty and obj.unit else None
            if nxt is None or not nxt.dirty or nxt.unit != obj.unit:
                return True
            obj = nxt

    def _evict(self, obj: L1Object) -> None:
        self._evictable.evict(obj)
        del self._ready[obj.key]
        self._orphaned(obj)
        self._listings.unpublish(obj)
        obj.live = False
        self.allocator.free(obj.offset)
        self.evictions += 1
        self.counters.evicted(obj, self.writeback_wait_s)
        if self._watcher:
            self._watcher.removed(obj, evicted=True)

    def _orphaned(self, obj: L1Object) -> None:
        """``obj`` left READY: the chunks after it in L1 go first now."""
        for orphan in self._prefixes.discard(obj):
            self._evictable.demote(orphan)

    def stats(self) -> dict[str, Any]:
        """What /status shows of eviction: the policy, the counters, dirty objects now."""
        dirty = [o for o in self._ready.values() if o.dirty]
        return self.counters.doc(self.policy, dirty, self.writeback_wait_s, self.dirty_limit)

    def _evictable_now(self, obj: L1Object) -> bool:
        return obj.state is State.READY and obj.live and not obj.pins + obj.holds and self._ready.get(obj.key) is obj

    def commit(self, *objs: L1Object) -> None:
        """RESERVED → READY (most recently used), in order, each as if committed alone: each
        replaces an older READY version of its key. Runs of new keys enter the evictable set
        together; the new keys go into the directory together once all are READY (one write),
        then the watcher hears of each."""
        gens = self.allocator.generations([obj.offset for obj in objs])  # (a reserved slot's cannot move)
        reserved, ready = self._reserved, self._ready
        run: list[L1Object] = []  # READY, to enter the evictable set (before any older version retires)
        fresh: list[int] = []  # which of objs are new keys (no older version to hand its entry over)
        done = 0
        try:
            for obj, gen in zip(objs, gens, strict=True):
                key = obj.key
                assert obj.state is State.RESERVED and reserved.get(key) is obj
                del reserved[key]
                old = ready.get(key)
                if old is not None:
                    entering, run = run, []
                    self._evictable.enter(entering)
                    self._retire(old, successor=obj, gen=gen)
                else:
                    fresh.append(done)
                obj.state = State.READY
                self._seq += 1
                obj.seq = self._seq
                ready[key] = obj
                run.append(obj)
                done += 1
        finally:  # (an object committed is evictable, published and told, even if a later one fails)
            entering, run = run, []
            self._evictable.enter(entering)
            self._listings.publish([objs[i] for i in fresh], [gens[i] for i in fresh])
            if self._watcher:
                for obj in objs[:done]:
                    self._watcher.stored(obj)

    def abort(self, obj: L1Object) -> None:
        """Drop a reservation (or a detached one) and free its slot."""
        assert obj.state is State.RESERVED
        if obj in self._detached:
            self._detached.remove(obj)
        else:
            assert self._reserved.get(obj.key) is obj
            del self._reserved[obj.key]
        obj.live = False
        self.allocator.free(obj.offset)

    def detach(self, obj: L1Object) -> None:
        """Set a reservation aside: it keeps its slot (a worker may still be writing into it) but no
        longer blocks its key; it can only be aborted."""
        assert obj.state is State.RESERVED and self._reserved.get(obj.key) is obj
        del self._reserved[obj.key]
        self._detached.add(obj)

    def pin(self, obj: L1Object) -> None:
        """One more pin. A retired object (replaced or deleted while pinned) can take more pins only
        while it still has some: its bytes are intact until the last one goes."""
        assert obj.state is State.READY and (obj.live or obj.pins > 0)
        self._take(obj)
        obj.pins += 1

    def unpin(self, obj: L1Object, used: bool = True) -> None:
        """Release one pin; the object is evictable again, as just used (``used``: a read; a
        write-down's pin is not one), or is freed if no longer live."""
        assert obj.pins > 0
        obj.pins -= 1
        if used:
            obj.uses += 1
        self._let_go(obj)

    def hold(self, obj: L1Object) -> None:
        """A lane's writer will copy ``obj`` (READY, live): like a pin, its slot stays, it is not
        evictable, until :meth:`release`; not a session's pin (storage.lane's batches)."""
        assert obj.state is State.READY and obj.live
        self._take(obj)
        obj.holds += 1

    def release(self, obj: L1Object) -> None:
        """A lane's writer is done with ``obj`` (see :meth:`hold`)."""
        assert obj.holds > 0
        obj.holds -= 1
        self._let_go(obj)

    def _take(self, obj: L1Object) -> None:
        if obj.pins == 0 and obj.holds == 0 and obj.live:
            self._evictable.drop(obj)

    def _let_go(self, obj: L1Object) -> None:
        if obj.pins or obj.holds:
            return
        if obj.live:
            self._evictable.add(obj, new=obj.uses == 0)
        else:
            self._retired.discard(obj)
            self.allocator.free(obj.offset)

    def remove(self, key: ObjectKey) -> bool:
        """Delete the READY object of ``key`` (its slot is freed now, or at its last unpin)."""
        obj = self._ready.pop(key, None)
        if obj is None:
            return False
        self._retire(obj)
        if self._watcher:
            self._watcher.removed(obj, evicted=False)
        return True

    def clear(self) -> int:
        """Delete every READY object; returns how many. Reservations in flight are kept."""
        objs = list(self._ready.values())
        self._ready.clear()
        self._prefixes.clear()
        for obj in objs:
            self._retire(obj)
        if self._watcher:
            self._watcher.cleared()
        return len(objs)

    def _retire(self, obj: L1Object, successor: L1Object | None = None, gen: int = 0) -> None:
        """``obj`` (READY and live, maybe no longer in ``_ready``: clear) stops being readable;
        ``successor``, a new version of its key (its slot of generation ``gen``), takes its place
        in the directory."""
        if self._ready.get(obj.key) is obj:
            del self._ready[obj.key]
        self._orphaned(obj)
        if successor is not None:
            self._listings.hand_over(obj, successor, gen)
        else:
            self._listings.unpublish(obj)
        obj.live = False
        if obj.pins or obj.holds:
            self._retired.add(obj)
        else:
            self._evictable.drop(obj)
            self.allocator.free(obj.offset)
        if obj.dirty:
            self._evictable.wake()

    def touch(self, entry: int, offset: int, gen: int, region: str | None) -> bool:
        """A client read the object published at ``entry`` of ``region``'s directory (found in
        slot ``offset`` of generation ``gen``) without the server: make it most recently used, as
        a retrieve's unpin would. False if that object is gone (its slot was freed since, or the
        entry holds another)."""
        obj = self._listings.at(region, entry)
        if obj is None or obj.offset != offset or self.allocator.generation(offset) != gen:
            return False
        obj.uses += 1
        if obj in self._evictable:
            self._evictable.access(obj)
        return True

    def check_integrity(self) -> None:
        """Assert the invariants in the module docstring and the allocator's own."""
        check_store(self)

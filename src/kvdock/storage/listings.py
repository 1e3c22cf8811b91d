"""What the pool directories list: the L1 store's bookkeeping of its READY objects in them.

Each region of the pool that clients map has a directory (:mod:`kvdock.shm.directory`) in its
own segment: the whole pool's without tenants, each quota'd tenant's own with them. A READY
object is published in its region's directory (or, its bucket being full, counted there as
unindexed) from the moment it becomes READY until it stops being READY, which the store makes
sure is before its slot is freed. The entry ↔ object pair is kept twice, on purpose: in
``obj.entry`` (to unpublish it) and here by (region, entry) (to find the object a client's
FastReads report names); :meth:`Listings.check` asserts they agree with each other and with the
directory's own bytes.

Owned by :class:`kvdock.storage.memory.L1Store`, on the event loop (not thread-safe).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from kvdock.keys import namespace_digest
from kvdock.shm.directory import Directory

if TYPE_CHECKING:
    from kvdock.storage.memory import L1Object


class Listings:
    """The directories by region (None: the shared rest) and what each lists."""

    def __init__(self, directories: dict[str | None, Directory] | None = None) -> None:
        self._directories = dict(directories or {})
        self._published: dict[tuple[str | None, int], L1Object] = {}  # (region, entry) -> the READY object there
        self._unindexed: dict[str | None, int] = dict.fromkeys(self._directories, 0)

    def has(self, region: str | None) -> bool:
        """Whether ``region``'s objects are listed in a directory."""
        return region in self._directories

    def at(self, region: str | None, entry: int) -> L1Object | None:
        """The object published at ``entry`` of ``region``'s directory, if any."""
        return self._published.get((region, entry))

    def publish(self, objs: Sequence[L1Object], gens: Sequence[int]) -> None:
        """``objs`` (their slots of generations ``gens``) became READY, new keys: each into its
        region's directory, in order (one write of all of a region's), or counted there as
        unindexed when its bucket is full (nothing when its region has none)."""
        regions: dict[str | None, list[tuple[L1Object, int]]] = {}
        for obj, gen in zip(objs, gens, strict=True):
            regions.setdefault(obj.region, []).append((obj, gen))
        for region, mine in regions.items():
            d = self._directories.get(region)
            if d is None:
                continue
            items = [
                (namespace_digest(k.model, k.rank, k.salt), k.chunk, o.offset, g, o.nbytes, o.version, o.parent)
                for o, g in mine
                for k in (o.key,)
            ]
            full = 0  # (their buckets full: counted unindexed, once the write is done)
            for (obj, _), entry in zip(mine, d.publish(items), strict=True):
                obj.entry = entry
                if entry >= 0:
                    self._published[(region, entry)] = obj
                else:
                    full += 1
            if full:
                self._unindexed[region] += full
                d.set_unindexed(self._unindexed[region])

    def hand_over(self, old: L1Object, new: L1Object, gen: int) -> None:
        """``new`` (slot generation ``gen``) replaces ``old`` (READY, live, same key) in the
        directory in one write: a reader during an overwrite's commit finds one version or the
        other, never a miss that could pass for a final one."""
        assert old.region == new.region, "a key's versions in two regions"  # (its owner is its salt's)
        d = self._directories.get(new.region)
        if d is None:
            return
        if old.entry < 0:  # it had no entry: nor does its successor
            new.entry = -1
            return
        k = new.key
        ns = namespace_digest(k.model, k.rank, k.salt)
        d.rewrite(old.entry, ns, k.chunk, new.offset, gen, new.nbytes, new.version, new.parent)
        new.entry, old.entry = old.entry, -1
        self._published[(new.region, new.entry)] = new

    def unpublish(self, obj: L1Object) -> None:
        """``obj`` (READY, live) stops being readable: out of its directory, before its slot may
        be freed."""
        d = self._directories.get(obj.region)
        if d is None:
            return
        if obj.entry >= 0:
            d.unpublish(obj.entry)
            del self._published[(obj.region, obj.entry)]
            obj.entry = -1
        else:
            self._unindexed[obj.region] -= 1
            d.set_unindexed(self._unindexed[obj.region])

    def check(self, ready: Iterable[L1Object], generation: Callable[[int], int]) -> None:
        """Assert that the READY objects ``ready`` and the directories agree: each listed object's
        entry holds its key, slot (at ``generation(offset)``) and version; each directory holds
        no other entry; the unindexed counts are right; objects of regions without a directory
        have no entry."""
        objs = list(ready)
        for region, d in self._directories.items():
            self._check_one(region, d, [o for o in objs if o.region == region], generation)
        assert all(r in self._directories for r, _ in self._published), "an entry of no directory"
        assert all(o.entry < 0 for o in objs if o.region not in self._directories)

    def _check_one(
        self, region: str | None, d: Directory, objs: list[L1Object], generation: Callable[[int], int]
    ) -> None:
        published = [o for o in objs if o.entry >= 0]
        for obj in published:
            assert self._published.get((region, obj.entry)) is obj, "a READY object's entry names another object"
            k = obj.key
            got = d.read(obj.entry)
            want = (namespace_digest(k.model, k.rank, k.salt), k.chunk, obj.offset, generation(obj.offset))
            assert got is not None and (got.ns, got.chunk, got.offset, got.gen) == want, "a directory entry is wrong"
            assert (got.nbytes, got.version, got.parent) == (obj.nbytes, obj.version, obj.parent)
        mine = sum(1 for r, _ in self._published if r == region)
        assert mine == len(published), "a published object is no longer READY"
        d.check_integrity(len(published))  # (its message: more entries in use than published)
        unindexed = len(objs) - len(published)
        assert unindexed == self._unindexed[region] == d.unindexed, "the unindexed count is wrong"

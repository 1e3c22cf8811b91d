"""Slot allocator for the L1 pool: byte-offset bookkeeping only (no memory access).

Slots are carved on first use from a bump pointer and, once freed, reused only for the same slot
size (each registered model has one fixed slot size). That keeps alloc and free O(1); the price is
that a pool shared by models of different sizes does not move memory between them once carved.

Each slot has a *generation* (one u64 per page, kept in the segment's generation table so that
clients can read it): :meth:`SlotAllocator.free` bumps it before the slot can be allocated again.
A reader that is told "chunk i is at offset o, generation g", copies the slot, then reads the
generation again and finds g, copied bytes that nobody could have been handed for writing since
it was told (the seqlock read side: the reader loads the generation after an acquire fence,
``_native.moved``, and the server's bump reaches the next writer only through a socket, after the
bump is stored).
"""

from __future__ import annotations

import bisect
import itertools
import sys
from collections.abc import Sequence

import numpy as np

ALIGN = 4096  # page-aligned slots: clean copies, and O_DIRECT-friendly for the disk tier


def aligned(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


class SlotAllocator:
    """Allocates ``aligned(nbytes)``-sized slots from ``[base, base + capacity)``.

    ``generations`` (one u64 per page of the slot area, e.g. a view of the segment's table) is
    written here only; without one the allocator keeps a private table."""

    def __init__(self, base: int, capacity: int, generations: np.ndarray | None = None) -> None:
        assert base % ALIGN == 0
        self.base = base
        self.capacity = capacity
        pages = -(-capacity // ALIGN)
        self._gens = np.zeros(pages, dtype="<u8") if generations is None else generations
        assert len(self._gens) >= pages, "generation table too small for the pool"
        assert sys.byteorder == "little" and self._gens.dtype == np.dtype("<u8")
        self._words = self._gens.data.cast("B").cast("Q")  # the same words, read as Python ints
        self._bump = 0  # bytes carved so far
        self._free: dict[int, list[int]] = {}  # slot size -> free offsets
        self._used: dict[int, int] = {}  # offset -> slot size
        self.used_bytes = 0

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used_bytes

    def alloc(self, nbytes: int, region: str | None = None) -> int | None:
        """Return the offset of a free slot of ``nbytes`` (rounded up to a page), or None if none
        fits. (``region``: one pool has none; see :class:`Partitions`.)"""
        assert nbytes > 0, "zero-size slot"
        assert region is None, "a SlotAllocator has no regions"
        size = aligned(nbytes)
        free = self._free.get(size)
        if free:
            off = free.pop()
        elif self._bump + size <= self.capacity:
            off = self.base + self._bump
            self._bump += size
        else:
            return None
        self._used[off] = size
        self.used_bytes += size
        return off

    def free_slots(self, nbytes: int, region: str | None = None) -> int:
        """How many slots of ``nbytes`` :meth:`alloc` can hand out now (freed ones and uncarved room)."""
        size = aligned(nbytes)
        return len(self._free.get(size, ())) + (self.capacity - self._bump) // size

    def generation(self, offset: int) -> int:
        """The current generation of the slot at ``offset``."""
        return self._words[(offset - self.base) // ALIGN]

    def generations(self, offsets: Sequence[int]) -> list[int]:
        """:meth:`generation` of each of ``offsets``, in their order."""
        words, base = self._words, self.base
        return [words[(off - base) // ALIGN] for off in offsets]

    def free(self, offset: int) -> None:
        """Return a slot (KeyError if ``offset`` is not an allocated slot); its generation moves on
        before anyone can allocate it again, so readers of its old bytes can tell."""
        size = self._used.pop(offset)
        self._words[(offset - self.base) // ALIGN] += 1
        self.used_bytes -= size
        free = self._free.get(size)
        if free is None:
            self._free[size] = [offset]
        else:
            free.append(offset)

    def recarve(self) -> None:
        """Forget how the empty area was carved, so that slots of any size can be carved anew.
        Every page's generation moves on first: a slot of the new carving may start inside an old
        slot, and a reader still holding that old slot's offset and generation must see it moved
        (its generation lives at its own start page). Precondition: no slot is allocated."""
        assert self.used_bytes == 0 and not self._used, "recarving a pool with slots in use"
        self._gens[: -(-self.capacity // ALIGN)] += 1
        self._bump = 0
        self._free.clear()

    def check_integrity(self) -> None:
        """Assert: used + free-listed == carved, no offset both used and free, all inside the pool."""
        free_offs = [o for offs in self._free.values() for o in offs]
        assert len(free_offs) == len(set(free_offs)), "an offset is on a free list twice"
        assert not set(free_offs) & self._used.keys(), "an offset is both used and free"
        carved = sum(self._used.values()) + sum(s * len(o) for s, o in self._free.items())
        assert carved == self._bump, f"carved {carved} != bump {self._bump}"
        assert sum(self._used.values()) == self.used_bytes
        for off, size in self._used.items():
            assert self.base <= off and off + size <= self.base + self.capacity


class Partitions:
    """The pool's slot area cut into regions: one per tenant with an L1 quota (exactly its quota,
    carved only for that tenant's objects) and the shared rest (region None). Each region is a
    :class:`SlotAllocator` over its own range of pool offsets and its own generation table (a
    tenant's segment's, :mod:`kvdock.shm.pool`), so no tenant's slot sizes can carve another's
    share (a pool carves a freed slot only for its size again). The same reads as a
    SlotAllocator, over the whole pool."""

    def __init__(self, regions: dict[str | None, SlotAllocator]) -> None:
        """``regions`` by name (None: the shared rest, which must be there), their ranges apart."""
        assert None in regions, "no shared rest"
        self.regions = dict(regions)
        # the regions by start (an empty one before the region that starts where it does)
        ordered = sorted(self.regions.items(), key=lambda item: (item[1].base, item[1].capacity))
        for (_, a), (_, b) in itertools.pairwise(ordered):
            assert a.base + a.capacity <= b.base, "regions overlap"
        self._bases = [a.base for _, a in ordered]
        self._ordered = ordered
        self.capacity = sum(a.capacity for a in self.regions.values())

    def name_of(self, offset: int) -> str | None:
        """The region holding ``offset`` (the last one starting at or before it)."""
        return self._ordered[bisect.bisect_right(self._bases, offset) - 1][0]

    def region_of(self, offset: int) -> SlotAllocator:
        return self._ordered[bisect.bisect_right(self._bases, offset) - 1][1]

    @property
    def used_bytes(self) -> int:
        return sum(a.used_bytes for a in self.regions.values())

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used_bytes

    def alloc(self, nbytes: int, region: str | None = None) -> int | None:
        """A free slot of ``nbytes`` in ``region`` (its tenant's, or the shared rest), or None."""
        return self.regions[region].alloc(nbytes)

    def free_slots(self, nbytes: int, region: str | None = None) -> int:
        return self.regions[region].free_slots(nbytes)

    def generation(self, offset: int) -> int:
        return self.region_of(offset).generation(offset)

    def generations(self, offsets: Sequence[int]) -> list[int]:
        """:meth:`generation` of each of ``offsets``, in their order (a run of one region's
        offsets, as one request's slots are, finds its region once)."""
        out: list[int] = []
        start = end = 0  # the range of the region found last (none yet)
        for off in offsets:
            if not start <= off < end:
                area = self.region_of(off)
                start, end, words = area.base, area.base + area.capacity, area._words
            out.append(words[(off - start) // ALIGN])
        return out

    def free(self, offset: int) -> None:
        self.region_of(offset).free(offset)

    def check_integrity(self) -> None:
        for a in self.regions.values():
            a.check_integrity()

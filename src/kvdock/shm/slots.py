"""Slot allocator for the L1 pool: byte-offset bookkeeping only (no memory access).

Slots are carved on first use from a bump pointer and, once freed, reused only for the same slot
size (each registered model has one fixed slot size). That keeps alloc and free O(1); the price is
that a pool shared by models of different sizes does not move memory between them once carved.
"""

from __future__ import annotations

ALIGN = 4096  # page-aligned slots: clean copies, and O_DIRECT-friendly for the disk tier


def aligned(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


class SlotAllocator:
    """Allocates ``aligned(nbytes)``-sized slots from ``[base, base + capacity)``."""

    def __init__(self, base: int, capacity: int) -> None:
        assert base % ALIGN == 0
        self.base = base
        self.capacity = capacity
        self._bump = 0  # bytes carved so far
        self._free: dict[int, list[int]] = {}  # slot size -> free offsets
        self._used: dict[int, int] = {}  # offset -> slot size
        self.used_bytes = 0

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used_bytes

    def alloc(self, nbytes: int) -> int | None:
        """Return the offset of a free slot of ``nbytes`` (rounded up to a page), or None if none fits."""
        assert nbytes > 0, "zero-size slot"
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

    def free(self, offset: int) -> None:
        size = self._used.pop(offset)
        self.used_bytes -= size
        self._free.setdefault(size, []).append(offset)

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

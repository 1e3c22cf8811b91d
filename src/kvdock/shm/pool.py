"""The L1 pool: its segments and how its offsets are carved among them.

Pool offsets (the ``offset`` of every slot the server hands out) run over one range:

* ``[first, first + rest)``: the shared rest, in the *main* segment: a named segment every
  shared-memory client of a server without tenants maps, or, with tenants or ``--no-shm``,
  private memory nobody maps (it holds every quota-less tenant's objects);
* then, in name order, one region per tenant with an L1 quota, exactly that quota (page-rounded
  down), each in a segment of its own: a memfd only that tenant's clients are handed
  (:mod:`kvdock.transport.door`), so a zero-copy client maps its own tenant's objects and no one
  else's (its pool directory too: it lists that tenant's objects only); anonymous memory with
  ``--no-shm``.

Each segment's header says which pool offset its slot area starts at (``PoolSegment.first``),
and each region's :class:`~kvdock.shm.slots.SlotAllocator` keeps its generations in its own
segment's table, where that segment's clients read them.

The pool owns its segments: it creates them and closes (and unlinks) them. The event loop's
thread allocates; the lanes' worker threads copy through :meth:`Pool.view`.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass, field
from typing import Protocol

from kvdock.shm.directory import entries_for
from kvdock.shm.segment import PoolSegment
from kvdock.shm.slots import ALIGN, Partitions, SlotAllocator, aligned

log = logging.getLogger(__name__)


class SlotMemory(Protocol):
    """Where the slots' bytes are, by pool offset (what L1Store copies through)."""

    def view(self, offset: int, nbytes: int) -> memoryview:
        """The bytes at pool offsets ``[offset, offset + nbytes)``."""
        ...


class FlatMemory:
    """One buffer whose byte ``o`` is pool offset ``o`` (a pool of one segment, or a test's)."""

    def __init__(self, buf: memoryview) -> None:
        self.buf = buf

    def view(self, offset: int, nbytes: int) -> memoryview:
        return self.buf[offset : offset + nbytes]


@dataclass(eq=False)
class Pool:
    """``main``: the shared rest's segment; ``own``: each quota'd tenant's. ``allocator`` carves
    all of them (one region per segment)."""

    main: PoolSegment
    own: dict[str, PoolSegment]
    allocator: Partitions
    shared: bool  # whether clients may map ``main`` (by name) at all
    _areas: list[tuple[int, int, memoryview]] = field(default_factory=list, repr=False)
    _firsts: list[int] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        # (pool offset of the first slot byte, end, that segment's slot area) by first offset
        segs = [self.main, *self.own.values()]
        self._areas = sorted(((s.first, s.first + s.data_size, s.data) for s in segs), key=lambda a: a[:2])
        self._firsts = [a[0] for a in self._areas]

    @classmethod
    def create(
        cls,
        size: int,
        quotas: dict[str, int] | None = None,
        *,
        shm: bool = True,
        tenants: bool = False,
        directories: bool = False,
    ) -> Pool:
        """A pool of ``size`` bytes of slots, ``quotas[t]`` of them (page-rounded down) tenant
        ``t``'s region in a segment of its own. ``shm``: the server shares memory at all (memfd
        tenant segments; and, for a server without ``tenants``, a named main segment), each
        shared segment with a pool directory when ``directories``; otherwise every segment is
        anonymous. OSError if memory cannot hold it (nothing is left behind then)."""
        quotas = {t: q // ALIGN * ALIGN for t, q in sorted((quotas or {}).items())}
        rest = size - sum(quotas.values())
        assert rest >= 0, "quotas larger than the pool"
        assert tenants or not quotas, "quotas are tenants'"
        named = shm and not tenants
        own: dict[str, PoolSegment] = {}
        if named:
            main = PoolSegment.create(rest, entries_for(rest) if directories else 0)
        else:
            main = PoolSegment.anonymous(rest)
        try:
            at = main.first + aligned(rest)  # (a tenant's slots start on a page, as every slot does)
            for tenant, quota in quotas.items():
                if shm and quota:  # (a quota under a page holds nothing: nobody maps it)
                    entries = entries_for(quota) if directories else 0
                    own[tenant] = PoolSegment.create_private(quota, at, tenant, entries)
                else:
                    own[tenant] = PoolSegment.anonymous(quota, at)
                at += quota
        except BaseException:
            for seg in (main, *own.values()):
                seg.unlink()
                seg.close()
            raise
        regions: dict[str | None, SlotAllocator] = {None: SlotAllocator(main.first, rest, main.generations())}
        for tenant, seg in own.items():
            regions[tenant] = SlotAllocator(seg.first, seg.data_size, seg.generations())
        return cls(main, own, Partitions(regions), named)

    @property
    def capacity(self) -> int:
        return self.allocator.capacity

    def shared_segments(self) -> dict[str | None, PoolSegment]:
        """The segments clients may map, by region (None: the main one): the named main segment
        of a server without tenants; a tenant's memfd unless it is empty (a quota under a page)."""
        out: dict[str | None, PoolSegment] = {None: self.main} if self.shared else {}
        out.update((t, s) for t, s in self.own.items() if s.private and s.data_size)
        return out

    @property
    def mappable(self) -> bool:
        """Whether any client may map any of it (else every client uses the inline transport)."""
        return bool(self.shared_segments())

    def segment_of(self, tenant: str | None) -> PoolSegment | None:
        """The segment a client of ``tenant`` may map (None: none): its own, or for a server
        without tenants the main one."""
        return self.shared_segments().get(tenant)

    def view(self, offset: int, nbytes: int) -> memoryview:
        """The bytes at pool offsets ``[offset, offset + nbytes)`` (within one segment: a slot)."""
        i = bisect.bisect_right(self._firsts, offset) - 1
        while i >= 0:  # (an empty segment may start where the next one does)
            first, end, area = self._areas[i]
            if offset + nbytes <= end:
                return area[offset - first : offset - first + nbytes]
            if end > first:
                break
            i -= 1
        raise AssertionError(f"pool offsets [{offset}, {offset + nbytes}) are in no segment")

    def close(self) -> None:
        """Unlink the named segment and unmap every one. Harmless twice."""
        self._areas, self._firsts = [], []
        for seg in (self.main, *self.own.values()):
            seg.unlink()
            seg.close()

    def check_integrity(self) -> None:
        """Each region is its segment's slot area, the allocator's own invariants hold."""
        segs: dict[str | None, PoolSegment] = {None: self.main}
        segs.update(self.own)
        assert segs.keys() == self.allocator.regions.keys(), "a region without its segment"
        for name, seg in segs.items():
            area = self.allocator.regions[name]
            assert (area.base, area.capacity) == (seg.first, seg.data_size), f"region {name!r} is not its segment's"
        self.allocator.check_integrity()

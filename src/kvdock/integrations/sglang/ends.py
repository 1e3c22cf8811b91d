"""SGLang host pool pages as the two ends of an SDK transfer: :class:`Pages` (a batch's pages at
host indices, ``ChunkSource`` and ``ChunkSink``, copied as runs planned once per pool:
:meth:`~kvdock.integrations.sglang.pools.HostPages.slot_plan`) and :class:`Flat` (one flat data
page of SGLang's generic path)."""

from __future__ import annotations

import numpy as np
import torch

from kvdock.errors import PrefixMissingError
from kvdock.integrations.sglang.pools import HostPages, Plan
from kvdock.memcpy import Copier


class Pages:
    """Chunks ``first ..`` of a transfer as the host pool's pages at host indices ``starts``
    (a ChunkSource and a ChunkSink); chunks before ``first`` (the prefix) are never copied.

    The copies of all its pages are planned at once from the pool's :meth:`HostPages.slot_plan`
    (the runs of one page, the same for every page), offset by each slot's and page's address:
    over shared memory the transfer hands it every slot's address in one call
    (:meth:`add_slots`, no per-slot view), else slot by slot (``put`` / ``take``), planned at
    :meth:`finish`. A pool whose pages reduce to no runs is copied page by page by the Copier."""

    direct_slots = True  # ShmTransfer may call add_slots (kvdock.sdk._transfer)

    def __init__(self, pages: HostPages, starts: list[int] | np.ndarray, first: int, *, checked: bool = False) -> None:
        """``checked``: ``starts`` comes from :meth:`HostPages.starts`, which checked it."""
        self.pages, self.first = pages, first
        if checked:
            self.starts = np.asarray(starts)
        else:
            self.starts = np.asarray(starts, dtype=np.int64).reshape(-1)
            pages.check_starts(self.starts)
        self.copier = Copier()
        self._plan: Plan | None = None
        self._slots: list[int] = []  # the slots queued one by one: their first bytes
        self._at: list[int] = []  # ... and their pages' numbers in the pool
        self._keep: list[torch.Tensor] = []
        self._taking = False

    def _index(self, chunks: np.ndarray, taking: bool) -> tuple[np.ndarray | None, np.ndarray]:
        """(which of ``chunks`` this end copies, None: all of them; their positions among
        ``starts``): a put of a chunk before ``first`` is PrefixMissingError, of one past the
        pages ValueError; a take skips both."""
        j = chunks - self.first if self.first else chunks
        n = len(self.starts)
        if len(j) and j.min() >= 0 and j.max() < n:  # (the usual: this call's pages, a numpy op or two)
            return None, j
        mine = (j >= 0) & (j < n)
        if not taking and not mine.all():
            bad = int(chunks[np.flatnonzero(~mine)[0]])
            if bad < self.first:
                raise PrefixMissingError(bad)
            raise ValueError(f"chunk {bad} is past the {n} pages of this call")
        return mine, j[mine]

    def put(self, index: int, dst: torch.Tensor) -> None:
        _, j = self._index(np.array([index], np.int64), False)
        self._queue(int(self.starts[j[0]]), dst, False)

    def take(self, index: int, src: torch.Tensor) -> None:
        _, j = self._index(np.array([index], np.int64), True)
        if len(j):
            self._queue(int(self.starts[j[0]]), src, True)

    def add_slots(
        self, taking: bool, chunks: np.ndarray, slots: np.ndarray, shape: tuple[int, ...], layers: slice,
        dtype: torch.dtype,
    ) -> bool:  # fmt: skip
        """Queue the copies of chunks ``chunks`` to or from (``taking``) the slots at addresses
        ``slots`` (one per chunk, each a contiguous ``shape`` chunk of ``dtype``), all at once;
        False (nothing queued: the caller puts or takes each) unless they are this pool's whole
        chunks and its pages reduce to runs. ``slots`` is read when the copies run (:meth:`finish`):
        it must not change before."""
        hp = self.pages
        plan = hp.slot_plan() if dtype == hp.dtype and tuple(shape) == hp.shape and layers == slice(None) else None
        if plan is None or (self._plan is not None and self._plan is not plan) or not len(chunks):
            return False
        mine, j = self._index(np.asarray(chunks, np.int64), taking)
        slots = np.ascontiguousarray(slots if mine is None else slots[mine], np.int64)
        self._grid(plan, taking, slots, self.starts[j] // hp.page_size, hp.buffer)
        return True

    def _grid(self, plan: Plan, taking: bool, slots: np.ndarray, at: np.ndarray, keep: object) -> None:
        """Queue the copies of pages ``at`` (numbers in the pool) to or from the slots at
        addresses ``slots`` (int64) as runs planned per page by ``plan``: the Copier computes
        their addresses natively (a set reads each page in the page's order, a get in the slot's)."""
        in_slot, in_page = (plan.in_slot, plan.in_page) if taking else (plan.page_slot, plan.page_page)
        self.copier.add_grid(plan.ptr0, plan.step, at, slots, in_page, in_slot, plan.run, taking, keep)

    def _queue(self, start: int, slot: torch.Tensor, taking: bool) -> None:
        plan = self.pages.plan(slot)
        if plan is None or (self._plan is not None and plan is not self._plan):
            page, view = self.pages.page(start), self.pages.chunk5(slot)
            self.copier.add(*((page, view) if taking else (view, page)))
            return
        self._plan, self._taking = plan, taking
        self._slots.append(slot.data_ptr())
        self._at.append(start // self.pages.page_size)
        self._keep.append(slot)

    def finish(self) -> None:
        plan, self._plan = self._plan, None
        if plan is not None and self._slots:
            at = np.array(self._at, np.int64)
            self._grid(plan, self._taking, np.array(self._slots, np.int64), at, (self.pages.buffer, self._keep))
        self._slots, self._at, self._keep = [], [], []
        self.copier.run()


class Flat:
    """One flat data page (SGLang's generic path) as chunk ``first`` of a transfer (the page of a
    batch of one, after ``first`` prefix chunks that are never copied)."""

    def __init__(self, pages: HostPages, flat: torch.Tensor, first: int = 0) -> None:
        self.pages, self.view, self.first = pages, pages.flat_page(flat), first

    def put(self, index: int, dst: torch.Tensor) -> None:
        if index != self.first:
            raise PrefixMissingError(index) if index < self.first else ValueError(f"chunk {index} is past the page")
        self.pages.chunk5(dst).copy_(self.view)

    def take(self, index: int, src: torch.Tensor) -> None:
        if index == self.first:
            self.view.copy_(self.pages.chunk5(src))

    def finish(self) -> None:
        pass


__all__ = ["Flat", "Pages"]

"""Bulk copies between CPU tensors and mapped memory, at memory bandwidth.

A KV chunk moves as a few long contiguous runs (one per K/V plane and layer), so every copy of
the data plane is a list of ``(dst, src)`` address pairs of one run length, handed in one call to
the native helper (``kvdock._native``): it splits the bytes across threads, releases the GIL and
uses streaming stores for large copies. torch's ``copy_`` of the same strided views ran at
0.6-0.7x of it (docs/benchmarks.md).

:class:`Copier` collects the copies of one transfer (every chunk of a store or retrieve) and runs
them together at :meth:`Copier.run`, so the threads start once per transfer, not once per chunk.
Tensors whose layouts do not reduce to runs (non-CPU, mismatched shapes, odd strides) are copied
with ``copy_`` at once; the result is the same either way.

Thread count: :func:`default_threads` (``KVDOCK_COPY_THREADS``, else the CPUs this process may
run on, at most :data:`MAX_DEFAULT_THREADS`); each Copier may be given its own.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

import numpy as np

from kvdock import _native  # type: ignore[attr-defined]

MAX_DEFAULT_THREADS = 8  # memory bandwidth is saturated long before: more threads only contend
MIN_PART = 1 << 20  # a thread is worth starting for a MiB or more
STREAM_MIN = 8 << 20  # streaming stores from this much on: the destination is not read from cache soon
ENV_THREADS = "KVDOCK_COPY_THREADS"


def default_threads() -> int:
    """``KVDOCK_COPY_THREADS`` if set (a positive int; ValueError otherwise), else the number of
    CPUs this process may use, at most MAX_DEFAULT_THREADS (as it was when first asked: every
    transfer asks, and the affinity is a system call)."""
    return _threads_for(os.environ.get(ENV_THREADS, "").strip())


@functools.lru_cache(maxsize=8)
def _threads_for(raw: str) -> int:
    if raw:
        if not (raw.isascii() and raw.isdigit()) or not 0 < int(raw) <= _native.MAX_THREADS:
            raise ValueError(f"{ENV_THREADS}={raw!r}: expected a whole number of threads in 1..{_native.MAX_THREADS}")
        return int(raw)
    return max(1, min(len(os.sched_getaffinity(0)), MAX_DEFAULT_THREADS))


def check_threads(threads: int) -> int:
    """``threads`` if it is a usable thread count (0 means :func:`default_threads`, not looked up
    here); ValueError otherwise."""
    if isinstance(threads, bool) or not isinstance(threads, int) or not 0 <= threads <= _native.MAX_THREADS:
        raise ValueError(f"copy threads must be an int in 0..{_native.MAX_THREADS} (0: default), got {threads!r}")
    return threads


MIN_RUN = 256  # shorter runs: torch's copy_ does better than a call per run

if TYPE_CHECKING:
    import torch

# torch is not imported at run time: the server copies numpy arrays only, and importing torch
# costs a server ~2.5 s of start-up
Array = Union["torch.Tensor", np.ndarray]


@dataclass(frozen=True)
class _Layout:
    addr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in bytes
    itemsize: int

    def dense_tail(self) -> int:
        """How many trailing dims are laid out densely, row-major (size-1 dims always are)."""
        expected, k = self.itemsize, 0
        for n, st in zip(reversed(self.shape), reversed(self.strides), strict=True):
            if n != 1 and st != expected:
                break
            expected *= n
            k += 1
        return k

    def addresses(self, dims: int) -> np.ndarray:
        """The start address of every run when the first ``dims`` dims are the outer ones
        (strides may be negative: the arithmetic is signed, user-space addresses fit)."""
        addr = np.full(1, self.addr, dtype=np.int64)
        for n, st in zip(self.shape[:dims], self.strides[:dims], strict=True):
            addr = (addr[:, None] + np.arange(n, dtype=np.int64) * st).reshape(-1)
        return addr.view(np.uint64)

    def bounds(self, dims: int, run: int) -> tuple[int, int]:
        """The first byte and one past the last that the runs of :meth:`addresses` (``run``
        bytes each) span, from the shape alone (no pass over the addresses)."""
        lo = hi = self.addr
        for n, st in zip(self.shape[:dims], self.strides[:dims], strict=True):
            if st < 0:
                lo += (n - 1) * st
            else:
                hi += (n - 1) * st
        return lo, hi + run


def _layout(x: Array, writing: bool) -> _Layout | None:
    """``x``'s layout, or None where only copy_ / copyto know what a copy means (a lazily
    conjugated or negated tensor) or must refuse it (a read-only array, a leaf that needs grad)."""
    if isinstance(x, np.ndarray):
        if writing and not x.flags.writeable:
            return None
        return _Layout(x.ctypes.data, x.shape, x.strides, x.itemsize)
    if x.device.type != "cpu" or x.is_conj() or x.is_neg() or (writing and x.requires_grad):
        return None
    esz = x.element_size()
    return _Layout(x.data_ptr(), tuple(x.shape), tuple(st * esz for st in x.stride()), esz)


def _disjoint(addr: np.ndarray, run: int) -> bool:
    """Whether runs of ``run`` bytes at ``addr`` never overlap (a destination written twice,
    e.g. an expanded tensor, is copy_'s to refuse)."""
    if len(addr) < 2:
        return True
    return bool((np.diff(np.sort(addr)) >= run).all())


def _overlapping(dst: tuple[int, int], src: tuple[int, int]) -> bool:
    """Whether two byte spans (:meth:`_Layout.bounds`) meet."""
    return dst[0] < src[1] and src[0] < dst[1]


class Copier:
    """The copies of one transfer, run together. Not thread-safe: one per transfer.

    :meth:`add` may copy at once (a layout that does not reduce to long runs) or later, at
    :meth:`run`: both arrays must stay alive and unchanged until then."""

    def __init__(self, threads: int = 0) -> None:
        self._threads = check_threads(threads)
        self._pending: dict[int, tuple[list[np.ndarray], list[np.ndarray]]] = {}  # run bytes -> addresses
        self._grids: list[tuple[object, ...]] = []  # copy_grid arguments
        self._keep: list[object] = []  # what the addresses point into

    @property
    def threads(self) -> int:
        """How many threads a large copy runs on (a copy too small to split runs on one)."""
        return self._threads or default_threads()

    def add(self, dst: Array, src: Array) -> None:
        """Copy ``src`` into ``dst`` (two tensors, or two numpy arrays, of one shape and element
        size): now, or at :meth:`run`."""
        if tuple(dst.shape) != tuple(src.shape):
            raise ValueError(f"cannot copy an array of shape {tuple(src.shape)} into one of {tuple(dst.shape)}")
        runs = self._runs(dst, src)
        if runs is None:
            if isinstance(dst, np.ndarray) and isinstance(src, np.ndarray):
                np.copyto(dst, src)
            elif not isinstance(dst, np.ndarray) and not isinstance(src, np.ndarray):
                dst.copy_(src)  # two tensors
            else:
                raise TypeError("copy between two tensors or two numpy arrays, not one of each")
            return
        run, d, s = runs
        dsts, srcs = self._pending.setdefault(run, ([], []))
        dsts.append(d)
        srcs.append(s)
        self._keep += (dst, src)

    def add_runs(self, run: int, dst: np.ndarray, src: np.ndarray, keep: object) -> None:
        """Copy ``run`` bytes from each address of ``src`` to the address at the same index of
        ``dst`` (uint64 arrays) at :meth:`run`, holding ``keep`` (what they point into) until
        then. The caller vouches for the addresses: valid, and no two destination runs overlap."""
        assert run > 0 and dst.dtype == src.dtype == np.uint64 and len(dst) == len(src)
        dsts, srcs = self._pending.setdefault(run, ([], []))
        dsts.append(dst)
        srcs.append(src)
        self._keep.append(keep)

    def add_grid(
        self,
        base: int,
        step: int,
        chunks: np.ndarray,
        slots: np.ndarray,
        in_tensor: np.ndarray,
        in_slot: np.ndarray,
        run: int,
        taking: bool,
        keep: object,
    ) -> None:
        """Copy between chunks of a tensor and slots at :meth:`run`, planned per chunk (see
        ``_native.copy_grid``; int64 arrays), holding ``keep`` until then. The caller vouches for
        the addresses, as for :meth:`add_runs`."""
        assert run > 0 and len(chunks) == len(slots) and len(in_tensor) == len(in_slot)
        self._grids.append((base, step, chunks, slots, in_tensor, in_slot, run, taking))
        self._keep.append(keep)

    @staticmethod
    def _runs(dst: Array, src: Array) -> tuple[int, np.ndarray, np.ndarray] | None:
        """(run bytes, dst addresses, src addresses), or None if copy_ / copyto should do it."""
        if type(dst) is not type(src) or dst.dtype != src.dtype:
            return None
        ld, ls = _layout(dst, writing=True), _layout(src, writing=False)
        if ld is None or ls is None or 0 in ld.shape:
            return None
        k = min(ld.dense_tail(), ls.dense_tail())
        outer = len(ld.shape) - k
        run = ld.itemsize * math.prod(ld.shape[outer:])  # np.prod of a tuple costs ~15 us
        if not k or run < MIN_RUN:
            return None
        d = ld.addresses(outer)
        if not _disjoint(d, run):
            return None
        if _overlapping(ld.bounds(outer, run), ls.bounds(outer, run)):  # runs would read bytes already
            return None  # written: copy_'s to do or refuse
        return run, d, ls.addresses(outer)

    def run(self) -> None:
        """Run the pending copies (the GIL is released meanwhile). Harmless twice."""
        pending, self._pending = self._pending, {}
        grids, self._grids = self._grids, []
        try:
            for grid in grids:
                total = grid[6] * len(grid[2]) * len(grid[4])  # type: ignore[operator, arg-type]
                _native.copy_grid(*grid, self.threads if total >= 2 * MIN_PART else 1, MIN_PART, STREAM_MIN)
            for run, (dsts, srcs) in pending.items():
                d = dsts[0] if len(dsts) == 1 else np.concatenate(dsts)
                s = srcs[0] if len(srcs) == 1 else np.concatenate(srcs)
                # (the default thread count is an environment lookup: not for a copy too small to split)
                threads = self.threads if run * len(d) >= 2 * MIN_PART else 1
                _native.copy_runs(d, s, run, threads, MIN_PART, STREAM_MIN)
        finally:
            self._keep.clear()


def copy(dst: Array, src: Array, threads: int = 0) -> None:
    """``dst.copy_(src)`` (or ``np.copyto``) for same-shaped arrays, through a :class:`Copier`."""
    c = Copier(threads)
    c.add(dst, src)
    c.run()


def populate(addr: int, nbytes: int, write: bool = True) -> None:
    """Fault in the pages of ``[addr, addr + nbytes)`` now, without the GIL (OSError if unmapped)."""
    _native.populate(addr, nbytes, write)


def blank(addr: int, nbytes: int) -> None:
    """Replace a page-aligned range of this process's mappings with read-only zero pages."""
    _native.blank(addr, nbytes)

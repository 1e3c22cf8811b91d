"""Already-faulted memory for the tensors retrieve returns, so a fresh tensor costs no page faults.

A retrieve into a new ``torch.empty`` spends most of its time faulting in the new memory (262,144
minor faults per GiB, ~70% of the call on our machines); into a reused buffer the same retrieve
is ~3x faster. :class:`BufferPool` keeps blocks of memory that were faulted in once (anonymous
mappings, transparent huge pages where the kernel allows them) and hands them out as ordinary
CPU tensors. A block comes back to the pool by itself when the last tensor using its memory
(the returned tensor and every view of it) is freed, never earlier, so no two live tensors ever
share memory.

Bounds: the pool holds at most ``max_bytes`` of blocks, in use or free (the process's pool:
``KVDOCK_BUFFER_POOL_BYTES``, default :data:`DEFAULT_MAX_BYTES`; :func:`set_buffer_pool_bytes`
changes it; 0 turns pooling off). Requests smaller than :data:`MIN_POOLED` or larger than the
bound get a plain ``torch.empty``; so does any request that finds no free block that fits while
the blocks in use fill the bound. Free blocks are unmapped least recently used first to make room.
A block is reused for a request between half its size and its size.

Tensors from the pool are ordinary, except that their storage cannot be resized (``resize_``
raises), as with any tensor made from a buffer. ``share_memory_()`` (which torch.multiprocessing
calls when a tensor is put on a queue) moves the tensor to new memory and gives its block back:
a numpy array or DLPack capsule taken from the tensor *before* that points into the block, which
the next retrieve may reuse -- as with torch's own allocator, where it would point into freed
memory. Take such exports after ``share_memory_()``, or copy them.
"""

from __future__ import annotations

import math
import mmap
import os
import queue
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from kvdock.errors import ConfigError
from kvdock.memcpy import populate
from kvdock.sizes import parse_size

MIN_POOLED = 1 << 20  # smaller tensors come from malloc's own free lists without new faults
GRAIN = 2 << 20  # blocks are whole huge pages
DEFAULT_MAX_BYTES = 1 << 30
ENV_MAX_BYTES = "KVDOCK_BUFFER_POOL_BYTES"


@dataclass(frozen=True)
class PoolStats:
    held_bytes: int  # blocks mapped, in use or free
    free_bytes: int
    reused: int  # requests served by a free block
    mapped: int  # requests that mapped a new block
    unpooled: int  # requests served by torch.empty


class _Block:
    __slots__ = ("array", "id", "mm", "size")

    def __init__(self, size: int, ident: int) -> None:
        self.size = size
        self.id = ident
        self.mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            self.mm.madvise(mmap.MADV_HUGEPAGE)
        self.array = np.frombuffer(self.mm, dtype=np.uint8)
        populate(self.array.ctypes.data, size, write=True)

    def unmap(self) -> None:
        """Let the mapping go: it is unmapped as soon as nothing refers to it (when a block comes
        back from a finalizer, the dying array still refers to it for a moment)."""
        del self.array, self.mm


class BufferPool:
    """Pre-faulted blocks handed out as tensors. Thread-safe: blocks come back from whichever
    thread frees their last tensor (through a queue, taken in at the next call)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = _check_bytes(max_bytes)
        self._lock = threading.Lock()
        self._free: OrderedDict[int, _Block] = OrderedDict()  # least recently freed first
        self._used: dict[int, _Block] = {}
        # ids of blocks whose last tensor is gone, queued by their finalizers: a finalizer may run
        # inside any locked section of this thread (a GC pass), so it must not take _lock;
        # SimpleQueue.put is safe there. Drained under _lock by _reap.
        self._returned: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._held = 0
        self._next_id = 0
        self._reused = self._mapped = self._unpooled = 0

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized contiguous CPU tensor (like ``torch.empty``), from a pooled block when
        one fits."""
        nbytes = math.prod(shape) * dtype.itemsize  # (np.prod of a tuple costs ~15 us)
        block = self._take(nbytes) if nbytes >= MIN_POOLED else None
        if block is None:
            with self._lock:
                self._unpooled += 1
            return torch.empty(shape, dtype=dtype)
        view = block.array[:nbytes]
        # the tensor's storage holds ``view``; when the last tensor on it is freed, so is ``view``
        weakref.finalize(view, self._returned.put, block.id).atexit = False
        return torch.from_numpy(view).view(dtype).view(shape)

    def _take(self, nbytes: int) -> _Block | None:
        size = -(-nbytes // GRAIN) * GRAIN
        with self._lock:
            self._reap()
            if size > self.max_bytes:
                return None
            fits = [b for b in self._free.values() if size <= b.size <= 2 * size]
            if fits:
                block = min(fits, key=lambda b: b.size)
                del self._free[block.id]
                self._used[block.id] = block
                self._reused += 1
                return block
            while self._free and self._held + size > self.max_bytes:
                self._drop(next(iter(self._free)))
            if self._held + size > self.max_bytes:
                return None
            self._held += size  # counted now: other threads must not overfill meanwhile
            ident = self._next_id
            self._next_id += 1
        try:
            block = _Block(size, ident)  # faulting in takes a while: outside the lock
        except BaseException:
            with self._lock:
                self._held -= size
            raise
        with self._lock:
            self._used[ident] = block
            self._mapped += 1
        return block

    def _reap(self) -> None:  # under _lock
        while True:
            try:
                ident = self._returned.get_nowait()
            except queue.Empty:
                return
            block = self._used.pop(ident)
            if self._held > self.max_bytes:  # the bound was lowered meanwhile
                self._held -= block.size
                block.unmap()
            else:
                self._free[ident] = block

    def _drop(self, ident: int) -> None:  # under _lock
        block = self._free.pop(ident)
        self._held -= block.size
        block.unmap()

    def resize(self, max_bytes: int) -> None:
        """Change the bound; free blocks over it are unmapped now, blocks in use when they come back."""
        max_bytes = _check_bytes(max_bytes)
        with self._lock:
            self._reap()
            self.max_bytes = max_bytes
            while self._free and self._held > max_bytes:
                self._drop(next(iter(self._free)))

    def trim(self) -> None:
        """Unmap every free block."""
        with self._lock:
            self._reap()
            while self._free:
                self._drop(next(iter(self._free)))

    def stats(self) -> PoolStats:
        with self._lock:
            self._reap()
            free = sum(b.size for b in self._free.values())
            return PoolStats(self._held, free, self._reused, self._mapped, self._unpooled)

    def check_integrity(self) -> list[str]:
        """Problems with the pool's bookkeeping (empty: sound)."""
        with self._lock:
            self._reap()
            problems = []
            held = sum(b.size for b in (*self._free.values(), *self._used.values()))
            if held != self._held:
                problems.append(f"blocks add up to {held} bytes, {self._held} counted")
            if set(self._free) & set(self._used):
                problems.append("a block is both free and in use")
            if sum(b.size for b in self._free.values()) > self.max_bytes:
                problems.append("free blocks exceed the bound")
            for ident, b in (*self._free.items(), *self._used.items()):
                if b.id != ident or b.size % GRAIN or len(b.array) != b.size:
                    problems.append(f"block {ident} is malformed")
            return problems


def _check_bytes(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"a buffer pool size must be a whole number of bytes >= 0, got {value!r}")
    return value


def default_max_bytes() -> int:
    """``KVDOCK_BUFFER_POOL_BYTES`` (a size: ``1GiB``, ``512MiB``, ``0``) or DEFAULT_MAX_BYTES;
    ValueError for anything else."""
    raw = os.environ.get(ENV_MAX_BYTES, "").strip()
    if not raw:
        return DEFAULT_MAX_BYTES
    try:
        return parse_size(raw)
    except ConfigError:
        raise ValueError(
            f"{ENV_MAX_BYTES}={raw!r}: expected a size such as 1GiB or 512MiB (0 turns pooling off)"
        ) from None


_process_pool: BufferPool | None = None
_process_lock = threading.Lock()


def buffer_pool() -> BufferPool:
    """This process's pool, which :func:`kvdock.sdk.retrieve` draws new tensors from."""
    global _process_pool
    with _process_lock:
        if _process_pool is None:
            _process_pool = BufferPool(default_max_bytes())
        return _process_pool


def set_buffer_pool_bytes(max_bytes: int) -> None:
    """Bound this process's pool to ``max_bytes`` (0: no pooling; ValueError for a negative or
    non-int value)."""
    buffer_pool().resize(max_bytes)

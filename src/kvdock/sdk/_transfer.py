"""The data plane of a client: moving chunk bytes between a ``KV_2LTD`` tensor and the server.

Two transports behind one interface, so store/retrieve never branch on the transport:

* :class:`ShmTransfer` copies straight into / out of slots of the mapped L1 pool (one copy), and
  after a read checks that every slot's generation is still the one the server handed out: if
  the lease ran out during the copy (the process was paused) and a slot was reused, the copy is
  refused with LeaseExpiredError instead of returning another object's bytes;
* :class:`InlineTransfer` turns chunks into raw ZMQ frames and back (no pickling, ever).

What is copied comes from a :class:`~kvdock.sdk.chunks.ChunkSource` and goes to a
:class:`~kvdock.sdk.chunks.ChunkSink` (:mod:`kvdock.sdk.chunks`).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import threading
import time
import warnings
from collections.abc import Iterable, Sequence

import numpy as np
import torch

from kvdock import _native  # type: ignore[attr-defined]
from kvdock.errors import KVCacheSDKError, LeaseExpiredError
from kvdock.layout import KVGeometry
from kvdock.memcpy import populate
from kvdock.protocol.messages import ReadPart, SlotRef
from kvdock.sdk.buffers import buffer_pool
from kvdock.sdk.chunks import ChunkSink, ChunkSource, ShardedChunks, TensorChunks, finish
from kvdock.shm import PoolSegment
from kvdock.shm.directory import DirectoryReader
from kvdock.transport.local import PeerWatch

log = logging.getLogger("kvdock.sdk")

MAX_ACCEPTED = 1 << 16  # cache_salt namespaces a transfer remembers the server accepted (more: read through it)


def layer_slice(part: ReadPart | None) -> slice:
    return slice(None) if part is None else slice(part.layer_start, part.layer_stop, part.layer_step)


class Transfer:
    name = ""
    commits_reads = True  # the server waits for CommitRetrieve to release a read's pins

    def __init__(self, geometry: KVGeometry, chunk_size: int, dtype: torch.dtype) -> None:
        self.chunk_size = chunk_size
        self.dtype = dtype
        self.chunk_shape = geometry.chunk_shape(chunk_size)
        self.chunk_nbytes = geometry.chunk_nbytes(chunk_size)

    def directory(self) -> DirectoryReader | None:
        """The pool directory, when reads may use it now (:mod:`kvdock.sdk._fastpath`)."""
        return None

    def accepted(self, cache_salt: str) -> bool:
        """Whether the directory may answer reads of ``cache_salt`` (see :meth:`ShmTransfer.accepted`)."""
        return False

    def accept(self, salts: Iterable[str]) -> None:
        """The server answered a request of this transfer's registration naming ``salts``."""

    def write(self, slots: Sequence[SlotRef], source: ChunkSource) -> list[memoryview]:
        """Put chunk ``slot.index`` of ``source`` into each slot; returns payload frames to send (inline)."""
        raise NotImplementedError

    def read(
        self, slots: Sequence[SlotRef], frames: Sequence[memoryview], sink: ChunkSink, part: ReadPart | None = None
    ) -> None:
        """Hand chunk ``j`` (the ``j``-th slot) to ``sink.take(j, ...)``, from the slots or the
        reply's frames: with ``part``, only chunks from ``part.first_chunk`` on, and of each
        only the part's layers (``[planes, len(layers), chunk_size, D]``, the request must have
        asked for the same part). LeaseExpiredError if the slots were reused meanwhile (the sink
        then holds garbage)."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class Prefault:
    """Faults a mapping's pages into this process's page tables on a background thread, so that
    connect() returns at once (populating 4 GiB takes ~140 ms) and copies then take no page
    faults. A copy that comes before the thread is done populates its own range first
    (:meth:`ensure`), which costs what the faults would, in one call."""

    STEP = 64 << 20  # per call: stop() waits for at most one step

    def __init__(self, addr: int, nbytes: int) -> None:
        self._addr, self._nbytes = addr, nbytes
        self.done = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvdock-prefault", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for at in range(0, self._nbytes, self.STEP):
                if self._stop.is_set():
                    return
                populate(self._addr + at, min(self.STEP, self._nbytes - at))
            self.done = True
        except OSError as e:  # not fatal: the copies fault the pages in themselves
            log.debug("prefaulting the pool stopped: %s", e)

    def ensure(self, addr: int, nbytes: int) -> None:
        """Populate ``[addr, addr + nbytes)`` now unless the whole mapping already is (an error
        only means the copy faults the pages in itself)."""
        if not self.done:
            with contextlib.suppress(OSError):
                populate(addr, nbytes)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class ShmTransfer(Transfer):
    """Copies through the mapped pool. With a watch of a local connection to the process that
    created ``segment`` (``watch``, or one given later to :meth:`rewatch`: the caller checked it)
    and a directory in the segment, reads may skip the server (:meth:`directory`). The transfer
    owns its watches, and closes them when it closes."""

    name = "shm"

    def __init__(
        self,
        geometry: KVGeometry,
        chunk_size: int,
        dtype: torch.dtype,
        segment: PoolSegment,
        watch: PeerWatch | None = None,
    ) -> None:
        super().__init__(geometry, chunk_size, dtype)
        self.segment = segment
        self._watch = watch
        self._watch_lock = threading.Lock()
        self._directory = DirectoryReader(segment) if segment.directory_entries else None
        # the cache_salt namespaces the server accepted in a request of this registration; None:
        # every one (a named pool is a server's without tenants; a tenant's pool is a memfd, shm.pool)
        self._salts: set[str] | None = set() if segment.private else None
        self._pool: torch.Tensor | None = torch.frombuffer(segment.data, dtype=torch.uint8)
        self._gens = segment.generations()
        self._gens_addr = self._gens.ctypes.data
        # the server names slots by pool offset: the one at ``o`` is at ``data[o - first]`` (a
        # tenant's segment holds one region of the pool); anything outside it is refused
        self._base = segment.first
        self._end = segment.first + segment.data_size
        self._addr = self._pool.data_ptr() - segment.first  # the address pool offset 0 would have
        self._prefault = Prefault(self._pool.data_ptr(), segment.data_size)

    def directory(self) -> DirectoryReader | None:
        """The pool directory while the server publishes one, is alive (the process that made
        the segment still holds our local connection: a directory whose server is gone may show
        what a server started since has overwritten) and vouches for it (before the segment's
        ``valid_until_ns``, CLOCK_MONOTONIC); else None. A fast read asks this before it reads the
        directory and again after its copy (:func:`kvdock.sdk._fastpath.vouched`)."""
        d, watch = self._directory, self._watch
        if d is None or watch is None or not d.live or not watch.alive():
            return None
        if time.monotonic_ns() >= self.segment.valid_until_ns():
            return None
        return d

    def accepted(self, cache_salt: str) -> bool:
        """Whether the directory may answer reads of ``cache_salt``: on a server without tenants
        (a named pool) always; on a tenant's own pool once the server answered a request of this
        registration that named it (it refuses a salt that is not the tenant's, the same way
        whether or not fast reads are on; the model is the registration's own, which the server
        accepted when it registered us). Until then reads of it ask the server."""
        salts = self._salts
        return salts is None or cache_salt in salts

    def accept(self, salts: Iterable[str]) -> None:
        known = self._salts
        if known is not None and len(known) < MAX_ACCEPTED:
            known.update(salts)  # (atomic under the GIL: readers only test membership)

    @property
    def watch_lost(self) -> bool:
        """Whether reads could use the directory but for the watch: it hung up (the server dropped
        or broke that local connection, or is gone), or there never was one."""
        d, watch = self._directory, self._watch
        return d is not None and d.live and (watch is None or not watch.alive())

    def rewatch(self, watch: PeerWatch) -> None:
        """Watch the server through ``watch`` from now on (of the process that made the segment:
        the caller checked); the old watch is closed (a thread polling it meanwhile is told the
        server is gone, and asks the server)."""
        with self._watch_lock:
            old, self._watch = self._watch, watch
        if old is not None:
            old.close()

    def _within(self, lo: int, hi: int) -> None:
        """KVCacheSDKError unless pool offsets ``[lo, hi)`` lie in this segment's slot area."""
        if not (self._base <= lo and hi <= self._end):
            raise KVCacheSDKError("the server named a slot outside the pool this client maps (nothing was copied)")

    def _slot(self, offset: int) -> torch.Tensor:
        assert self._pool is not None, "transfer closed"
        self._within(offset, offset + self.chunk_nbytes)
        self._prefault.ensure(self._addr + offset, self.chunk_nbytes)
        at = offset - self._base
        return self._pool[at : at + self.chunk_nbytes].view(self.dtype).view(self.chunk_shape)

    def _direct(self, end: object, taking: bool, indices: np.ndarray, offsets: np.ndarray, layers: slice) -> bool:
        """Queue the copies of a plain tensor ``end`` with the slots at ``offsets`` as runs
        (TensorChunks.add_slots), or of an end whose class sets ``direct_slots = True`` and has
        the same ``add_slots`` (SGLang's host pages); False if ``end`` is something else or has
        no such runs (then each slot is put or taken)."""
        direct = type(end) in (TensorChunks, ShardedChunks) or getattr(type(end), "direct_slots", False) is True
        if not direct or not len(offsets):  # (a subclass may put or take otherwise; an engine's end may say so)
            return False
        self._within(int(offsets.min()), int(offsets.max()) + self.chunk_nbytes)
        if not self._prefault.done:
            for off in offsets.tolist():
                self._prefault.ensure(self._addr + off, self.chunk_nbytes)
        return end.add_slots(  # type: ignore[attr-defined, no-any-return]
            taking, indices, self._addr + offsets, self.chunk_shape, layers, self.dtype
        )

    def write(self, slots: Sequence[SlotRef], source: ChunkSource) -> list[memoryview]:
        try:
            indices = np.fromiter((s.index for s in slots), np.int64, len(slots))
            offsets = np.fromiter((s.offset for s in slots), np.int64, len(slots))
            if not self._direct(source, False, indices, offsets, slice(None)):
                for s in slots:
                    source.put(s.index, self._slot(s.offset))
        finally:
            finish(source)
        return []

    def read(
        self, slots: Sequence[SlotRef], frames: Sequence[memoryview], sink: ChunkSink, part: ReadPart | None = None
    ) -> None:
        offsets = np.fromiter((s.offset for s in slots), np.int64, len(slots))
        gens = np.fromiter((s.gen for s in slots), np.uint64, len(slots))
        self.read_at(offsets, gens, sink, part)

    def read_at(self, offsets: np.ndarray, gens: np.ndarray, sink: ChunkSink, part: ReadPart | None = None) -> None:
        """:meth:`read` of the chunks whose slots are at ``offsets`` with generations ``gens``
        (chunk ``j`` at ``offsets[j]``)."""
        layers, first = layer_slice(part), part.first_chunk if part else 0
        try:
            rest = offsets[first:]
            if not self._direct(sink, True, np.arange(first, len(offsets)), rest, layers):
                for j, off in enumerate(rest.tolist(), first):
                    sink.take(j, self._slot(off)[:, layers])
        finally:
            finish(sink)
        # seqlock read side: the copies above are complete (finish returned); the generations
        # are read after an acquire fence (native), so no load of the copy comes after them
        moved = self._count_moved(offsets, gens)
        if moved:
            raise LeaseExpiredError(
                f"the lease of this retrieve ran out during the copy and {moved} slot(s) were "
                "reused (was the process paused?); the bytes were discarded"
            )

    def _count_moved(self, offsets: np.ndarray, gens: np.ndarray) -> int:
        """How many of the slots at ``offsets`` were freed since they had the generations ``gens``."""
        offs, want = np.ascontiguousarray(offsets, np.int64), np.ascontiguousarray(gens, np.uint64)
        return int(_native.moved(self._gens_addr, len(self._gens), self._base, offs, want, None))

    def _moved(self, offsets: np.ndarray, gens: np.ndarray) -> np.ndarray:
        """Which of the slots at ``offsets`` were freed since they had the generations ``gens``
        (a uint8 mask; see ``_native.moved``)."""
        mask = np.zeros(len(offsets), np.uint8)
        offs, want = np.ascontiguousarray(offsets, np.int64), np.ascontiguousarray(gens, np.uint64)
        _native.moved(self._gens_addr, len(self._gens), self._base, offs, want, mask)
        return mask

    def moved(self, slots: Sequence[SlotRef]) -> list[int]:
        """The chunks whose slot was freed (and maybe handed out again) since ``slots`` were
        handed out: their generation is no longer the one the server gave."""
        offsets = np.fromiter((s.offset for s in slots), np.int64, len(slots))
        gens = np.fromiter((s.gen for s in slots), np.uint64, len(slots))
        return [slots[i].index for i in np.flatnonzero(self._moved(offsets, gens)).tolist()]

    def map_readonly(self, offset: int, length: int) -> mmap.mmap:
        """A new read-only mapping of pool offsets ``[offset, offset + length)`` (page-aligned; for
        zero-copy views)."""
        self._within(offset, offset + length)
        return self.segment.map_readonly(offset, length)

    def close(self) -> None:
        self._prefault.stop()
        self._pool = None
        del self._gens
        if self._directory is not None:
            self._directory.close()
        with self._watch_lock:
            watch, self._watch = self._watch, None
        if watch is not None:
            watch.close()
        self.segment.close()


class InlineTransfer(Transfer):
    name = "inline"
    commits_reads = False  # the server copied the bytes into the reply and released them at once

    def write(self, slots: Sequence[SlotRef], source: ChunkSource) -> list[memoryview]:
        # one staging tensor for all chunks, from the buffer pool: it goes back when zmq is done
        # with the frames (their memoryviews hold it)
        staging = buffer_pool().empty((len(slots), *self.chunk_shape), self.dtype)
        try:
            for i, s in enumerate(slots):
                source.put(s.index, staging[i])
        finally:
            finish(source)
        raw = staging.view(torch.uint8).view(len(slots), -1).numpy()
        return [raw[i].data for i in range(len(slots))]

    def read(
        self, slots: Sequence[SlotRef], frames: Sequence[memoryview], sink: ChunkSink, part: ReadPart | None = None
    ) -> None:
        """The reply has one frame holding the chunks' parts (``slot.offset`` into it; a batch's
        frame holds every prompt's), or none if it has no bytes."""
        planes, num_layers, chunk, d = self.chunk_shape
        first = part.first_chunk if part else 0
        shape = (planes, len(range(num_layers)[layer_slice(part)]), chunk, d)
        per = self.chunk_nbytes // num_layers * shape[1]
        sent = slots[first:]
        size = len(frames[0]) if len(frames) == 1 else 0
        if len(frames) > 1 or (sent and not all(s.offset >= 0 and s.offset + per <= size for s in sent)):
            got = [len(f) for f in frames]
            raise KVCacheSDKError(f"malformed inline reply: frames of {got} bytes for {len(sent)} chunks of {per}")
        try:
            if not sent:
                return
            with warnings.catch_warnings():
                # the frame is read-only; we only read it, once, into ``out``
                warnings.filterwarnings("ignore", message="The given buffer is not writable")
                whole = torch.frombuffer(frames[0], dtype=torch.uint8)
            for j, s in enumerate(sent, first):
                sink.take(j, whole[s.offset : s.offset + per].view(self.dtype).view(shape))
        finally:
            finish(sink)

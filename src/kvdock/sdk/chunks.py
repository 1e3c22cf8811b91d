"""The two ends of a transfer: where a store's chunks come from (:class:`ChunkSource`) and where a
retrieve's go (:class:`ChunkSink`). For the SDK's own calls both are a ``KV_2LTD`` tensor
(:class:`TensorChunks`); for an engine, its paged KV through a codec, so each chunk moves between
the engine's pages and a slot in one copy. The transfers (:mod:`kvdock.sdk._transfer`) hand each
end one chunk at a time, or a plain tensor all of its chunks' copies at once
(:meth:`TensorChunks.add_slots`)."""

from __future__ import annotations

import functools
from typing import Protocol

import numpy as np
import torch

from kvdock.memcpy import Copier


class ChunkSource(Protocol):
    def put(self, index: int, dst: torch.Tensor) -> None:
        """Write chunk ``index`` (of the tokens being stored) into ``dst``, a contiguous
        ``[2, L, chunk_size, D]`` buffer that stays valid until :meth:`finish` returns."""

    def finish(self) -> None:
        """The puts of this transfer are over: complete any copy still pending (a source may
        batch them). Called once per transfer, also when a put raised, before the chunks are
        committed. Optional: a source without it copies in put."""


class ChunkSink(Protocol):
    def take(self, index: int, src: torch.Tensor) -> None:
        """Read chunk ``index`` of the retrieved prefix from ``src`` (``[2, L, chunk_size, D]``,
        valid until :meth:`finish` returns)."""

    def finish(self) -> None:
        """The takes of this transfer are over: complete any copy still pending. Called once
        per transfer, also when a take raised (or nothing was taken). The bytes are verified
        only after it: a transfer that then raises LeaseExpiredError has handed garbage to some
        takes. Optional: a sink without it copies in take."""


class TensorChunks:
    """A ``KV_2LTD`` tensor ``[planes, L, T, D]`` as a source or sink of ``chunk_size``-token
    chunks, chunk ``first_chunk`` at token 0 (a sink of a read from chunk ``first_chunk`` on).
    The copies of one transfer run together at :meth:`finish`, on ``threads`` threads
    (:mod:`kvdock.memcpy`)."""

    def __init__(
        self, kv: torch.Tensor, chunk_size: int, first_chunk: int = 0, threads: int = 0, copier: Copier | None = None
    ) -> None:
        self.kv = kv
        self.chunk_size = chunk_size
        self.first_chunk = first_chunk
        self._copier = copier or Copier(threads)

    @property
    def copier(self) -> Copier:
        """Where this end queues its copies (others may queue theirs there, to run together)."""
        return self._copier

    def _span(self, index: int) -> torch.Tensor:
        c = self.chunk_size
        at = (index - self.first_chunk) * c
        return self.kv[:, :, at : at + c]

    def put(self, index: int, dst: torch.Tensor) -> None:
        self._copier.add(dst, self._span(index))

    def take(self, index: int, src: torch.Tensor) -> None:
        self._copier.add(self._span(index), src)

    def finish(self) -> None:
        self._copier.run()

    def add_slots(
        self, taking: bool, chunks: np.ndarray, slots: np.ndarray, shape: Shape, layers: slice, dtype: torch.dtype
    ) -> bool:
        """Queue the copies between chunks ``chunks`` (indices) of the tensor and the slots at addresses
        ``slots`` (one per chunk; a slot holds a ``shape`` chunk ``[planes, L, chunk_size, D]``
        of ``dtype``, of which the tensor holds ``layers``), into the tensor when ``taking``, as
        one run per chunk, plane and layer: what :meth:`put` / :meth:`take` of each chunk do,
        computed at once. False (nothing queued) when the tensor has no such runs."""
        kv = self.kv
        if kv.dtype != dtype or not kv.is_cpu or kv.is_conj() or kv.is_neg() or (taking and kv.requires_grad):
            return False
        n = len(chunks)
        lo, hi = (int(chunks.min()), int(chunks.max())) if n > 1 else (int(chunks[0]), int(chunks[0])) if n else (0, -1)
        plan = _plan(tuple(kv.shape), kv.stride(), kv.element_size(), shape, range(shape[1])[layers])
        if plan is None or not n or lo < self.first_chunk or (hi - self.first_chunk + 1) * shape[2] > kv.shape[2]:
            return False
        run, in_tensor, in_slot, step = plan
        positions = chunks - self.first_chunk if self.first_chunk else chunks
        self._copier.add_grid(kv.data_ptr(), step, positions, slots, in_tensor, in_slot, run, taking, kv)
        return True


@functools.lru_cache(maxsize=64)
def _plan(
    size: tuple[int, ...], stride: tuple[int, ...], itemsize: int, shape: Shape, picked: range
) -> tuple[int, np.ndarray, np.ndarray, int] | None:
    """How chunks of a tensor of ``size`` and ``stride`` (elements) copy to and from slots of a
    ``shape`` chunk, of which it holds layers ``picked``: (run bytes, each run's offset in the
    tensor's chunk, each run's offset in the slot, bytes from one chunk of the tensor to the
    next): one run per plane and picked layer when the tensor's rows are dense (one run for all
    when both sides are), else one per token (rows of ``D`` elements further apart: one shard's
    heads of a whole-model tensor). None when the tensor's chunks are no such runs: its rows must
    be ``D`` contiguous elements that do not overlap. Cached: a transfer asks for every chunk's
    copies."""
    planes, num_layers, c, d = shape
    if not picked or len(size) != 4 or (size[0], size[1], size[3]) != (planes, len(picked), d):
        return None
    s0, s1, s2, s3 = stride
    layer = (size[2] - 1) * s2 + d  # elements one (plane, layer) of the tensor spans
    span = (len(picked) - 1) * s1 + layer  # of a plane
    if s3 != 1 or s2 < d or not _apart(len(picked), s1, layer) or not _apart(planes, s0, span):
        return None
    p = np.arange(planes, dtype=np.int64)[:, None, None]
    layers = np.arange(len(picked), dtype=np.int64)[None, :, None]
    in_slot_layers = np.asarray(picked, dtype=np.int64)[None, :, None]
    if s2 != d:
        run = d * itemsize
        t = np.arange(c, dtype=np.int64)
        in_tensor = ((p * s0 + layers * s1 + t * s2) * itemsize).reshape(-1)
        in_slot = (((p * num_layers + in_slot_layers) * c + t) * run).reshape(-1)
        return run, in_tensor, in_slot, c * s2 * itemsize
    row = c * d * itemsize  # one layer of one chunk
    in_tensor = ((p * s0 + layers * s1) * itemsize).reshape(-1)
    in_slot = ((p * num_layers + in_slot_layers) * row).reshape(-1)
    dense = np.arange(len(in_slot), dtype=np.int64) * row
    if np.array_equal(in_tensor, dense) and np.array_equal(in_slot, dense):
        return row * len(dense), dense[:1], dense[:1], row
    return row, in_tensor, in_slot, row


Shape = tuple[int, int, int, int]


def _apart(n: int, stride: int, extent: int) -> bool:
    """Whether ``n`` blocks of ``extent`` elements, ``stride`` apart, never overlap."""
    return n <= 1 or stride >= extent


class ShardedChunks:
    """A source or sink of a model's chunks as the chunks of the ``shards`` shards it is stored in
    (tensor and pipeline parallelism: :mod:`kvdock.server.shards`): position ``j`` of a transfer
    is shard ``s = j % shards`` of chunk ``j // shards``; of ``stages`` pipeline stages of equal
    size, shard ``s`` holds layer block ``s // (shards / stages)`` and, of the chunk's last axis,
    head block ``s % (shards / stages)``. Over a :class:`TensorChunks` each shard is a view of the
    tensor (the copies planned natively, all run together at :meth:`finish`); any other end gets
    and gives whole chunks through staging tensors (``shape`` ``[planes, L, chunk_size, D]`` of
    ``dtype``, kept until :meth:`finish`, as the seam's contract asks)."""

    def __init__(
        self, end: ChunkSource | ChunkSink, shards: int, shape: Shape, dtype: torch.dtype, stages: int = 1
    ) -> None:
        self.end, self.shards, self.shape, self.dtype = end, shards, shape, dtype
        self.per_stage = shards // stages
        self.depth = shape[1] // stages  # layers of a stage
        self.width = shape[3] // self.per_stage  # values of a shard's heads
        self.parts: list[TensorChunks] = []
        if type(end) is TensorChunks:
            kv = end.kv
            self.parts = [
                TensorChunks(self._part(kv, s), end.chunk_size, end.first_chunk, copier=end.copier)
                for s in range(shards)
            ]
        self._staged: dict[int, torch.Tensor] = {}
        self._pending: dict[int, int] = {}  # chunk -> shards taken so far
        self._puts: list[tuple[torch.Tensor, int, int]] = []  # (slot, chunk, shard) to fill at finish

    def _part(self, t: torch.Tensor, s: int) -> torch.Tensor:
        stage, block = divmod(s, self.per_stage)
        layers = slice(stage * self.depth, (stage + 1) * self.depth)
        return t[:, layers, :, block * self.width : (block + 1) * self.width]

    def put(self, index: int, dst: torch.Tensor) -> None:
        i, s = divmod(index, self.shards)
        if self.parts:
            self.parts[s].put(i, dst)
            return
        staged = self._staged.get(i)
        if staged is None:
            staged = self._staged[i] = torch.empty(self.shape, dtype=self.dtype)
            self.end.put(i, staged)  # type: ignore[union-attr]
        # the end may fill ``staged`` only at its finish (the seam allows it: an engine's Copier),
        # so the shard is copied out at :meth:`finish`, after the end's
        self._puts.append((dst, i, s))

    def take(self, index: int, src: torch.Tensor) -> None:
        i, s = divmod(index, self.shards)
        if self.parts:
            self.parts[s].take(i, src)
            return
        staged = self._staged.get(i)
        if staged is None:
            staged = self._staged[i] = torch.empty(self.shape, dtype=self.dtype)
        self._part(staged, s).copy_(src)
        self._pending[i] = self._pending.get(i, 0) + 1
        if self._pending[i] == self.shards:  # every shard of the chunk is in: hand it over whole
            self.end.take(i, staged)  # type: ignore[union-attr]

    def add_slots(
        self, taking: bool, chunks: np.ndarray, slots: np.ndarray, shape: Shape, layers: slice, dtype: torch.dtype
    ) -> bool:
        """:meth:`TensorChunks.add_slots` of each shard's positions among ``chunks``; False (the
        caller then puts or takes each position) when the tensor has no such runs."""
        if not self.parts:
            return False
        shard = chunks % self.shards
        for s, part in enumerate(self.parts):
            mine = shard == s
            at = chunks[mine] // self.shards
            if mine.any() and not part.add_slots(taking, at, slots[mine], shape, layers, dtype):
                return False  # (a shard queued before is copied again by the caller: the same bytes)
        return True

    def finish(self) -> None:
        try:
            finish(self.end)
            for dst, i, s in self._puts:
                dst.copy_(self._part(self._staged[i], s))
        finally:
            self._staged.clear()
            self._pending.clear()
            self._puts.clear()


def finish(end: ChunkSource | ChunkSink) -> None:
    """End a transfer at ``end``: its pending copies run (also after a failed put or take: the
    slots are still held then, and a reused sink must not carry them into its next transfer)."""
    done = getattr(end, "finish", None)
    if done is not None:
        done()

"""A request's blocks in vLLM's pages, and a save's staged KV, as the SDK's chunk sources and
sinks (:func:`kvdock.sdk.store_from`, :func:`kvdock.sdk.retrieve_into`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvdock.errors import PrefixMissingError

if TYPE_CHECKING:
    from kvdock.integrations.vllm.worker import WorkerSide


class _Blocks:
    """One request's blocks as a source and sink of kvdock chunks (chunk ``i`` = blocks
    ``[i * per_chunk, (i + 1) * per_chunk)``); a sink fills only blocks from ``start_block`` on."""

    def __init__(self, worker: WorkerSide, block_ids: list[int] | list[list[int]], start_block: int = 0) -> None:
        self.w = worker
        # one list for every layer, or one per layer (vLLM's KV cache groups; -1: a block vLLM
        # does not keep, which a load skips)
        self.ids = torch.tensor(block_ids, dtype=torch.long)
        self.start_block = start_block

    def put(self, index: int, dst: torch.Tensor) -> None:
        per = self.w.blocks_per_chunk
        self.w.bridge.gather(self.w.codec, self.ids[..., index * per : (index + 1) * per], dst)

    def take(self, index: int, src: torch.Tensor) -> None:
        per = self.w.blocks_per_chunk
        first, end = max(index * per, self.start_block), (index + 1) * per
        if first >= end:
            return  # vLLM computed or cached these blocks itself
        self.w.bridge.scatter(
            self.w.codec, self.ids[..., first:end], src[:, :, (first - index * per) * self.w.block_size :]
        )

    def finish(self) -> None:
        pass  # every gather and scatter is done when it returns


class _Part:
    """A sink of chunks that hold more heads than this rank (a stored shard it holds part of):
    hands the rank's values ``[lo, hi)`` of each chunk's last axis on."""

    def __init__(self, inner: _Blocks, lo: int, hi: int) -> None:
        self.inner, self.lo, self.hi = inner, lo, hi

    def take(self, index: int, src: torch.Tensor) -> None:
        self.inner.take(index, src[..., self.lo : self.hi].contiguous())

    def finish(self) -> None:
        self.inner.finish()


class _Staged:
    """A save's staged KV (its tokens from ``first`` on) as a source of kvdock chunks. A chunk
    that starts before ``first`` is not staged: PrefixMissingError (with ``at``, the chunk's first
    token), which ends the store with nothing written -- kvdock lacks a chunk the request's earlier
    saves were believed to have stored, and writing the later ones alone would orphan them."""

    def __init__(self, staged: torch.Tensor, chunk: int, first: int = 0) -> None:
        self.staged, self.chunk, self.first = staged, chunk, first

    def put(self, index: int, dst: torch.Tensor) -> None:
        lo = index * self.chunk - self.first
        if lo < 0:
            err = PrefixMissingError(
                f"kvdock lacks chunk {index} (tokens from {index * self.chunk}) of a prefix whose KV was "
                f"staged from token {self.first} on: nothing stored; the next save copies from there"
            )
            err.at = index * self.chunk  # type: ignore[attr-defined]
            raise err
        dst.copy_(self.staged[:, :, lo : lo + self.chunk])

    def finish(self) -> None:
        pass

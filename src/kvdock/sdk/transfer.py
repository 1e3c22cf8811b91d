"""The data plane of a client: moving chunk bytes between a ``KV_2LTD`` tensor and the server.

Two transports behind one interface, so store/retrieve never branch on the transport:

* :class:`ShmTransfer` copies straight into / out of slots of the mapped L1 pool (one copy);
* :class:`InlineTransfer` turns chunks into raw ZMQ frames and back (no pickling, ever).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch

from kvdock.layout import Geometry
from kvdock.protocol.messages import SlotRef
from kvdock.shm import PoolSegment


class Transfer:
    def __init__(self, geometry: Geometry, chunk_size: int, dtype: torch.dtype) -> None:
        self.chunk_size = chunk_size
        self.dtype = dtype
        self.chunk_shape = geometry.chunk_shape(chunk_size)
        self.chunk_nbytes = geometry.chunk_nbytes(chunk_size)

    def _span(self, kv: torch.Tensor, index: int) -> torch.Tensor:
        c = self.chunk_size
        return kv[:, :, index * c : (index + 1) * c]

    def write(self, slots: Sequence[SlotRef], kv: torch.Tensor) -> list[memoryview]:
        """Put chunk ``slot.index`` of ``kv`` into each slot; returns payload frames to send (inline)."""
        raise NotImplementedError

    def read(self, slots: Sequence[SlotRef], frames: Sequence[memoryview], out: torch.Tensor) -> None:
        """Fill ``out`` (``[2, L, len(slots)*chunk, D]``) from the slots or the reply's frames."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class ShmTransfer(Transfer):
    name = "shm"

    def __init__(self, geometry: Geometry, chunk_size: int, dtype: torch.dtype, segment: PoolSegment) -> None:
        super().__init__(geometry, chunk_size, dtype)
        self._segment = segment
        self._pool: torch.Tensor | None = torch.frombuffer(segment.buf, dtype=torch.uint8)

    def _slot(self, offset: int) -> torch.Tensor:
        assert self._pool is not None, "transfer closed"
        return self._pool[offset : offset + self.chunk_nbytes].view(self.dtype).view(self.chunk_shape)

    def write(self, slots: Sequence[SlotRef], kv: torch.Tensor) -> list[memoryview]:
        for s in slots:
            self._slot(s.offset).copy_(self._span(kv, s.index))
        return []

    def read(self, slots: Sequence[SlotRef], frames: Sequence[memoryview], out: torch.Tensor) -> None:
        for j, s in enumerate(slots):
            self._span(out, j).copy_(self._slot(s.offset))

    def close(self) -> None:
        self._pool = None
        self._segment.close()


class InlineTransfer(Transfer):
    name = "inline"

    def write(self, slots: Sequence[SlotRef], kv: torch.Tensor) -> list[memoryview]:
        return [self._span(kv, s.index).contiguous().view(torch.uint8).numpy().data for s in slots]

    def read(self, slots: Sequence[SlotRef], frames: Sequence[memoryview], out: torch.Tensor) -> None:
        assert len(frames) == len(slots), f"{len(frames)} frames for {len(slots)} slots"
        with warnings.catch_warnings():
            # the frames are read-only; we only read them, once, into ``out``
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            for j, f in enumerate(frames):
                self._span(out, j).copy_(torch.frombuffer(f, dtype=self.dtype).view(self.chunk_shape))

"""ShmTransfer over a tenant's segment, which holds one region of the pool's offsets: slots are
found at their pool offset less the segment's shift, and an offset outside the segment is refused
(an error, never another place's bytes)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from helpers import CHUNK, GEOMETRY, make_kv
from kvdock.errors import KVCacheSDKError
from kvdock.protocol.messages import SlotRef
from kvdock.sdk._transfer import ShmTransfer
from kvdock.sdk.chunks import TensorChunks
from kvdock.sdk.registration import make_layout
from kvdock.shm.segment import PoolSegment
from kvdock.shm.slots import ALIGN

FIRST = 100 * ALIGN  # the pool offset of the segment's first slot byte


class Pieces:
    """A per-chunk source and sink (not a plain tensor: the transfer's slot-by-slot path)."""

    def __init__(self, kv: torch.Tensor) -> None:
        self.kv = kv

    def put(self, j: int, slot: torch.Tensor) -> None:
        slot.copy_(self.kv[:, :, j * CHUNK : (j + 1) * CHUNK])

    def take(self, j: int, slot: torch.Tensor) -> None:
        self.kv[:, :, j * CHUNK : (j + 1) * CHUNK].copy_(slot)


@pytest.fixture
def shm() -> Iterator[tuple[PoolSegment, ShmTransfer]]:
    server = PoolSegment.create_private(4 * ALIGN, FIRST, "transfer-test")
    geo = make_layout("tiny", dtype="bfloat16", **GEOMETRY).geometry  # type: ignore[arg-type]
    meta, data = server.filenos()
    transfer = ShmTransfer(geo, CHUNK, torch.bfloat16, PoolSegment.from_fds(os.dup(meta), os.dup(data)))
    yield server, transfer
    transfer.close()
    server.close()


@pytest.mark.parametrize("plain", [True, False], ids=["tensor", "per-chunk"])
def test_slots_are_found_at_their_pool_offset_less_the_shift(shm, plain: bool) -> None:  # type: ignore[no-untyped-def]
    server, transfer = shm
    kv = make_kv(2 * CHUNK, seed=3)
    slots = [SlotRef(0, FIRST + 2 * ALIGN), SlotRef(1, FIRST)]
    transfer.write(slots, TensorChunks(kv, CHUNK) if plain else Pieces(kv))  # type: ignore[arg-type]
    nbytes = transfer.chunk_nbytes
    for s in slots:
        at = s.offset - FIRST
        want = kv[:, :, s.index * CHUNK : (s.index + 1) * CHUNK].contiguous().view(torch.uint8).numpy().tobytes()
        assert bytes(server.data[at : at + nbytes]) == want
    out = torch.zeros_like(kv)
    transfer.read(slots, [], TensorChunks(out, CHUNK) if plain else Pieces(out))  # type: ignore[arg-type]
    assert torch.equal(out, kv)
    ro = transfer.map_readonly(FIRST + 2 * ALIGN, ALIGN)
    assert bytes(ro[:nbytes]) == bytes(server.data[2 * ALIGN :][:nbytes])
    ro.close()


@pytest.mark.parametrize("plain", [True, False], ids=["tensor", "per-chunk"])
@pytest.mark.parametrize("offset", [FIRST - ALIGN, FIRST + 4 * ALIGN, FIRST + 4 * ALIGN - 1, 0])
def test_an_offset_outside_the_segment_is_refused(shm, plain: bool, offset: int) -> None:  # type: ignore[no-untyped-def]
    server, transfer = shm
    kv = make_kv(CHUNK, seed=4)
    with pytest.raises(KVCacheSDKError, match="outside the pool this client maps"):
        transfer.write([SlotRef(0, offset)], TensorChunks(kv, CHUNK) if plain else Pieces(kv))  # type: ignore[arg-type]
    with pytest.raises(KVCacheSDKError, match="outside the pool this client maps"):
        transfer.read([SlotRef(0, offset)], [], TensorChunks(kv, CHUNK) if plain else Pieces(kv))  # type: ignore[arg-type]
    assert not any(bytes(server.data))  # nothing was written anywhere
    with pytest.raises(KVCacheSDKError, match="outside the pool this client maps"):
        transfer.map_readonly(offset // ALIGN * ALIGN, 2 * ALIGN)

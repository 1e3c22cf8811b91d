"""The GPU staging path (DeviceBridge), run on CPU tensors: the same steps, no CUDA events; it
must move exactly the bytes the direct path moves, and refuse what does not fit its buffers."""

from __future__ import annotations

import pytest
import torch

from kvdock.codecs import CodecKey, codec_for
from kvdock.integrations.vllm.staging import DeviceBridge, HostBridge, bridge_for
from kvdock.layout import KVGeometry

GEO = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32")
BLOCK, BLOCKS = 4, 6


def layers() -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [torch.randn(BLOCKS, 2, BLOCK, 16) for _ in range(GEO.num_layers)]


def test_staged_gather_and_scatter_move_the_same_bytes_as_the_direct_path() -> None:
    key = CodecKey("vllm", "FLASH_ATTN", "LBHNC")
    src = layers()
    codec = codec_for(key, src, GEO, BLOCK)
    staged = DeviceBridge(torch.device("cpu"), GEO.chunk_shape(3 * BLOCK), torch.float32)
    ids = torch.tensor([5, 0, 2])
    direct, via = torch.zeros(GEO.chunk_shape(3 * BLOCK)), torch.zeros(GEO.chunk_shape(3 * BLOCK))
    HostBridge().gather(codec, ids, direct)
    staged.gather(codec, ids, via)
    assert torch.equal(direct, via) and direct.abs().sum() > 0

    dst = [torch.zeros_like(t) for t in src]
    out_codec = codec_for(key, dst, GEO, BLOCK)
    staged.scatter(out_codec, ids[:2], via[:, :, : 2 * BLOCK])
    staged.synchronize()
    for a, b in zip(src, dst, strict=True):
        assert torch.equal(a[[5, 0]], b[[5, 0]]) and not b[[1, 2, 3, 4]].any()


def test_a_transfer_larger_than_the_staging_buffers_is_refused() -> None:
    codec = codec_for(CodecKey("vllm", "FLASH_ATTN", "LBHNC"), layers(), GEO, BLOCK)
    staged = DeviceBridge(torch.device("cpu"), GEO.chunk_shape(BLOCK), torch.float32)
    with pytest.raises(ValueError, match="do not fit the 4-token staging buffers"):
        staged.gather(codec, torch.tensor([0, 1]), torch.zeros(GEO.chunk_shape(2 * BLOCK)))


def test_cpu_tensors_get_the_direct_bridge() -> None:
    assert isinstance(bridge_for(torch.device("cpu"), GEO.chunk_shape(BLOCK), torch.float32), HostBridge)
    assert isinstance(bridge_for(torch.device("meta"), GEO.chunk_shape(BLOCK), torch.float32), DeviceBridge)

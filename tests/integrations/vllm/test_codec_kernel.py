"""The vllm-cpu codec against vLLM's own cache-write kernel (``cpu_attn_reshape_and_cache``).

The kernel writes known K/V into pages exactly as a running engine does; the codec must read back
the canonical KV, and its own writes must be byte-identical to the kernel's."""

from __future__ import annotations

import pytest
import torch
import vllm._custom_ops as ops

from kvdock.codecs import CodecKey, codec_for
from kvdock.layout import KVGeometry

BLOCKS, H, L = 5, 2, 2


def kernel_write(isa: str, cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
    """What vLLM's CPUAttentionBackendImpl.do_kv_cache_update does with one layer's cache."""
    b, h, n, _ = cache.shape
    key_cache, value_cache = cache.view(b, h, 2 * n, -1).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)


@pytest.mark.parametrize("isa", ["vec", "vec16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("head_dim", "block"), [(32, 32), (64, 32), (128, 64)])
def test_codec_reads_and_writes_pages_exactly_as_the_kernel(
    isa: str, dtype: torch.dtype, head_dim: int, block: int
) -> None:
    torch.manual_seed(head_dim + block)
    blocks = [3, 0, 4]
    t = len(blocks) * block
    kv = torch.randn(2, L, t, H * head_dim).to(dtype)
    slots = torch.tensor([blocks[i // block] * block + i % block for i in range(t)], dtype=torch.long)
    by_kernel = [torch.zeros(BLOCKS, H, block, 2 * head_dim, dtype=dtype) for _ in range(L)]
    for layer, cache in enumerate(by_kernel):
        kernel_write(isa, cache, kv[0, layer].view(t, H, head_dim), kv[1, layer].view(t, H, head_dim), slots)

    geo = KVGeometry(num_layers=L, num_kv_heads=H, head_dim=head_dim, dtype=str(dtype).removeprefix("torch."))
    key = CodecKey("vllm", "CPU_ATTN", "LBHNC", isa)
    out = torch.zeros_like(kv)
    codec_for(key, by_kernel, geo, block).gather(torch.tensor(blocks), out)
    assert torch.equal(out, kv)

    by_codec = [torch.zeros_like(c) for c in by_kernel]
    codec_for(key, by_codec, geo, block).scatter(torch.tensor(blocks), kv)
    for mine, theirs in zip(by_codec, by_kernel, strict=True):
        assert torch.equal(mine.view(torch.uint8), theirs.view(torch.uint8))

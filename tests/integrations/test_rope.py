"""Re-rotation is exact: layer-0 keys (a function of token and position only) computed at positions
p and re-rotated to q equal the keys the model computes at q directly, for every RoPE type."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from kvdock.integrations.rope import (
    head_dim_of,
    positions_after_drop,
    rerotate_keys,
    rerotate_kv,
    rotary_params,
)

VOCAB = 128
T = 40
ROPES: dict[str, dict[str, Any]] = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
        "rope_theta": 500000.0,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
}
FAMILIES = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}
# p spans past max_position_embeddings (128), so dynamic NTK really rescales; q stays inside it.
P = torch.arange(T) * 3 + 17
Q = torch.arange(T) + 5


def tiny(family: str, rope: str, dtype: torch.dtype = torch.float32) -> Any:
    config_cls, model_cls = FAMILIES[family]
    cfg = config_cls(
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=VOCAB,
        max_position_embeddings=128,
        rope_parameters=dict(ROPES[rope]),
    )
    torch.manual_seed(0)
    return model_cls(cfg).eval().to(dtype)


@torch.no_grad()
def layer_keys(model: torch.nn.Module, ids: torch.Tensor, pos: torch.Tensor, layer: int = 0) -> torch.Tensor:
    """Keys [kv_heads, T, head_dim] of ``layer`` for ``ids`` at ``pos``, from a fresh copy of the
    model (dynamic NTK's rotary module keeps state between calls)."""
    m = copy.deepcopy(model)
    out = m(input_ids=ids[None], position_ids=pos[None], use_cache=True)
    cache = out.cache if hasattr(out, "cache") else out.past_key_values
    return cache.layers[layer].keys[0]


def ulp(x: torch.Tensor) -> float:
    """The spacing of x.dtype at x's largest magnitude."""
    big = x.float().abs().max()
    return float(torch.finfo(x.dtype).eps * 2 ** torch.floor(torch.log2(big)))


def ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (T,), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("rope", sorted(ROPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rerotated_layer0_keys_equal_direct(family: str, rope: str, dtype: torch.dtype) -> None:
    model = tiny(family, rope, dtype)
    kp, kq = layer_keys(model, ids(), P), layer_keys(model, ids(), Q)
    got = rerotate_keys(kp, P, Q, model)
    assert got.dtype == dtype and got.shape == kq.shape == (2, T, 16)
    tol = (4 if dtype == torch.float32 else 2) * ulp(kq)
    err = (got.float() - kq.float()).abs().max().item()
    assert err <= tol, f"{family}/{rope}/{dtype}: max error {err} > {tol}"
    # the check can fail: keys left at p, or rotated with unscaled default RoPE, are far off
    far = 0.2 * kq.float().abs().max().item()
    assert far > 10 * tol
    assert (kp.float() - kq.float()).abs().max().item() > far
    if rope in ("linear", "llama3", "yarn"):
        plain = copy.deepcopy(model.config)
        plain.rope_parameters = {"rope_type": "default", "rope_theta": ROPES[rope]["rope_theta"]}
        wrong = rerotate_keys(kp, P, Q, plain)
        assert (wrong.float() - kq.float()).abs().max().item() > far


@pytest.mark.parametrize("rope", ["default", "linear", "llama3", "yarn"])
def test_config_and_model_sources_agree(rope: str) -> None:
    """A float32 model's inv_freq buffer equals what ROPE_INIT_FUNCTIONS computes from its config."""
    model = tiny("llama", rope)
    from_model, from_config = rotary_params(model), rotary_params(model.config)
    assert from_model.rope_type == from_config.rope_type == rope
    assert torch.equal(from_model.inv_freq, from_config.inv_freq)
    assert from_model.attention_scaling == from_config.attention_scaling
    assert from_model.rotary_dim == 16
    if rope == "yarn":
        assert from_model.attention_scaling > 1.0  # yarn's mscale is carried, and cancels in re-rotation


def test_partial_rotary_gpt_neox() -> None:
    """Partial RoPE (partial_rotary_factor 0.5): only the first half of head_dim rotates, the rest passes."""
    cfg = GPTNeoXConfig(
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        vocab_size=VOCAB,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    )
    torch.manual_seed(0)
    model = GPTNeoXForCausalLM(cfg).eval()
    assert rotary_params(model).rotary_dim == 8 and head_dim_of(model) == 16
    kp, kq = layer_keys(model, ids(), P), layer_keys(model, ids(), Q)
    got = rerotate_keys(kp, P, Q, cfg)
    assert (got - kq).abs().max().item() <= 4 * ulp(kq)
    assert torch.equal(got[..., 8:], kp[..., 8:])


def to_kv2ltd(cache: Any, num_tokens: int) -> torch.Tensor:
    """A transformers cache (batch 1) as KV_2LTD [2, L, T, heads * head_dim]."""
    ks = [layer.keys[0].transpose(0, 1).reshape(num_tokens, -1) for layer in cache.layers]
    vs = [layer.values[0].transpose(0, 1).reshape(num_tokens, -1) for layer in cache.layers]
    return torch.stack([torch.stack(ks), torch.stack(vs)])


@torch.no_grad()
def full_cache(model: torch.nn.Module, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    out = model(input_ids=tokens[None], position_ids=pos[None], use_cache=True)
    return to_kv2ltd(out.cache if hasattr(out, "cache") else out.past_key_values, len(tokens))


def test_rerotate_kv_2ltd_llama() -> None:
    """The KV_2LTD helper: layer 0 keys exact, values untouched, input not modified."""
    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        rope_parameters=dict(ROPES["llama3"]),
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    kvp, kvq = full_cache(model, ids(), P), full_cache(model, ids(), Q)
    assert kvp.shape == (2, 3, T, 32)
    before = kvp.clone()
    got = rerotate_kv(kvp, P, Q, model)
    assert torch.equal(kvp, before)
    assert got.is_contiguous() and got.shape == kvp.shape
    assert (got[0, 0] - kvq[0, 0]).abs().max().item() <= 4 * ulp(kvq[0, 0])
    assert torch.equal(got[1], kvp[1])
    # same as rotating each layer/head through rerotate_keys
    per_head = kvp[0].reshape(3, T, 2, 16).transpose(1, 2)
    assert torch.equal(got[0], rerotate_keys(per_head, P, Q, model).transpose(1, 2).reshape(3, T, 32))


def test_rerotate_kv_per_layer_type_gemma3() -> None:
    """Nested per-layer-type RoPE (Gemma3: linear for full attention, default for sliding): each
    layer is rotated with its own type's frequencies."""
    for first in ("sliding_attention", "full_attention"):
        other = "full_attention" if first == "sliding_attention" else "sliding_attention"
        cfg = Gemma3TextConfig(
            hidden_size=64,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            vocab_size=VOCAB,
            sliding_window=512,
            layer_types=[first, other],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        )
        torch.manual_seed(0)
        model = Gemma3ForCausalLM(cfg).eval()
        kvp, kvq = full_cache(model, ids(), P), full_cache(model, ids(), Q)
        got = rerotate_kv(kvp, P, Q, model)
        assert (got[0, 0] - kvq[0, 0]).abs().max().item() <= 4 * ulp(kvq[0, 0]), first
        with pytest.raises(ValueError, match="per layer type"):
            rerotate_keys(kvp[0, 0].reshape(T, 2, 16).transpose(0, 1), P, Q, model)


def test_drop_span_positions_and_identity() -> None:
    old, new = positions_after_drop(10, 3, 7)
    assert old.tolist() == [0, 1, 2, 7, 8, 9] and new.tolist() == [0, 1, 2, 3, 4, 5]
    with pytest.raises(ValueError, match="drop span"):
        positions_after_drop(10, 6, 3)
    model = tiny("llama", "yarn")
    keys = torch.randn(2, 6, 16)
    # p -> p is the identity; p -> q -> p comes back
    assert torch.allclose(rerotate_keys(keys, old, old, model), keys, atol=0, rtol=0)
    back = rerotate_keys(rerotate_keys(keys, old, new, model), new, old, model)
    assert (back - keys).abs().max().item() < 1e-6


def test_errors() -> None:
    model = tiny("llama", "default")
    keys = torch.zeros(T, 16)
    with pytest.raises(ValueError, match="head_dim=16"):
        rerotate_keys(torch.zeros(T, 8), P, Q, model)
    with pytest.raises(ValueError, match="do not broadcast"):
        rerotate_keys(keys, P[:5], Q, model)
    with pytest.raises(ValueError, match="integer positions"):
        rerotate_keys(keys, P.float(), Q, model)
    with pytest.raises(ValueError, match=">= 0"):
        rerotate_keys(keys, P - 100, Q, model)
    with pytest.raises(ValueError, match="KV_2LTD"):
        rerotate_kv(torch.zeros(2, 1, T, 30), P, Q, model)
    with pytest.raises(ValueError, match="layers"):
        rerotate_kv(torch.zeros(2, 2, T, 32), P, Q, model)
    with pytest.raises(ValueError, match=r"shape \[40\]"):
        rerotate_kv(torch.zeros(2, 1, T, 32), P[:3], Q[:3], model)
    for model_type, match in (("gptj", "interleaved"), ("cohere", "interleaved")):
        cfg = copy.deepcopy(model.config)
        cfg.model_type = model_type
        with pytest.raises(ValueError, match=match):
            rerotate_keys(keys, P, Q, cfg)
    cfg = copy.deepcopy(model.config)
    cfg.no_rope_layers = [1]
    with pytest.raises(ValueError, match="without RoPE"):
        rerotate_keys(keys, P, Q, cfg)
    cfg = copy.deepcopy(model.config)
    cfg.rope_parameters = {"rope_type": "mystery", "rope_theta": 1.0}
    with pytest.raises(ValueError, match="unsupported RoPE type 'mystery'"):
        rerotate_keys(keys, P, Q, cfg)
    with pytest.raises(ValueError, match="not a transformers decoder config"):
        rerotate_keys(keys, P, Q, object())


def test_longrope_switches_factor_sets() -> None:
    """longrope (float32): keys computed over a sequence longer than original_max_position_embeddings
    use the long factors, shorter ones the short factors; re-rotation crosses between the two."""
    rope = {
        "rope_type": "longrope",
        "short_factor": [1.0 + 0.1 * i for i in range(8)],
        "long_factor": [2.0 + 0.3 * i for i in range(8)],
        "original_max_position_embeddings": 64,
        "rope_theta": 10000.0,
    }
    ROPES["longrope"] = rope
    try:
        model = tiny("llama", "longrope")
    finally:
        del ROPES["longrope"]
    long_p, short_p = rotary_params(model, seq_len=int(P.max()) + 1), rotary_params(model, seq_len=int(Q.max()) + 1)
    assert not torch.equal(long_p.inv_freq, short_p.inv_freq)
    kp, kq = layer_keys(model, ids(), P), layer_keys(model, ids(), Q)
    assert (rerotate_keys(kp, P, Q, model) - kq).abs().max().item() <= 4 * ulp(kq)
    assert (rerotate_keys(kq, Q, P, model) - kp).abs().max().item() <= 4 * ulp(kp)

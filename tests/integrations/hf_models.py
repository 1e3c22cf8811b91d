"""Tiny random-weight transformers models built from configs (no hub download), for the HF tests."""

from __future__ import annotations

import inspect
from typing import Any

import torch
import transformers as tf

VOCAB = 512
FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
_COMMON: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,  # GQA: 2 query heads per KV head
    "head_dim": 16,  # Qwen3 defaults to 128 otherwise
    "intermediate_size": 128,
    "vocab_size": VOCAB,
    # larger than the default 0.02 so logits are O(1): tolerances then mean something, and greedy
    # decisions are not near-ties
    "initializer_range": 0.1,
}
_CLASSES = {
    "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
    "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
    "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
    "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
}


def tiny_model(
    family: str, dtype: torch.dtype = torch.float32, attn: str = "sdpa", seed: int = 0, **overrides: Any
) -> tf.PreTrainedModel:
    """A 2-layer model of ``family`` (head_dim 16, 2 KV heads) with seeded random weights, in eval mode."""
    config_cls, model_cls = _CLASSES[family]
    kwargs = {**_COMMON, "attn_implementation": attn, **overrides}
    if family == "mistral":
        kwargs.setdefault("sliding_window", None)  # Mistral's default (4096) is a window; ask for one explicitly
    config = config_cls(**kwargs)
    torch.manual_seed(seed)
    return model_cls(config).to(dtype).eval()


def prompt(n: int, seed: int = 1) -> torch.Tensor:
    """``[1, n]`` random token ids, none of them a special token of the tiny configs."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (1, n), generator=g)


# transformers renamed forward's ``past_key_values`` to ``cache`` during 5.x
CACHE_KW = "cache" if "cache" in inspect.signature(tf.LlamaForCausalLM.forward).parameters else "past_key_values"


def forward(model: tf.PreTrainedModel, input_ids: torch.Tensor, cache: Any = None) -> Any:
    """``model(input_ids)``, continuing from and filling ``cache`` when one is given."""
    with torch.no_grad():
        return model(input_ids, use_cache=cache is not None, **{CACHE_KW: cache})


def full_cache(model: tf.PreTrainedModel, input_ids: torch.Tensor) -> tf.DynamicCache:
    """Prefill ``input_ids`` into a cache of plain layers (every layer keeps every position)."""
    cache = tf.DynamicCache()
    forward(model, input_ids, cache)
    return cache


def last_logits(model: tf.PreTrainedModel, input_ids: torch.Tensor, cache: Any = None) -> torch.Tensor:
    """Float32 logits of the last position, optionally continuing from ``cache``."""
    return forward(model, input_ids, cache).logits[0, -1].float()  # type: ignore[no-any-return]


def reference(model: tf.PreTrainedModel, input_ids: torch.Tensor, new: int) -> torch.Tensor:
    """Greedy continuation by plain ``model.generate`` (full recompute, transformers' own cache)."""
    out = model.generate(input_ids, max_new_tokens=new, do_sample=False)
    assert out.shape == (1, input_ids.shape[1] + new), "the tiny model stopped early; pick another prompt seed"
    return out


# absolute tolerance for last-position logits (O(1) values): a few ulps of the dtype
LOGIT_ATOL = {torch.float32: 1e-4, torch.bfloat16: 5e-2}

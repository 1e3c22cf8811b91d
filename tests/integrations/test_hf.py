"""kvdock.integrations.hf against a real server and tiny random-weight transformers models.

Every test starts its own ``kvdock serve`` (chunk size 16) and registers the model through
``hf.connect``; prompts are a few chunks long so the whole file runs in seconds.
"""

from __future__ import annotations

import json
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers
from hf_models import LOGIT_ATOL, full_cache, last_logits, prompt, reference, tiny_model

import kvdock.integrations.hf as kvhf
import kvdock.sdk as kvd
import zygote
from helpers import CHUNK, ServerProc
from kvdock.layout import KVGeometry

NEW = 8  # generated tokens per comparison
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _noise_like(kv: torch.Tensor, seed: int = 7) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(kv.shape, generator=g).mul(kv.float().std()).to(kv.dtype)


CASES = [
    (family, dtype, attn) for family in ("llama", "qwen3") for dtype in ("fp32", "bf16") for attn in ("sdpa", "eager")
] + [("qwen2", "fp32", "sdpa"), ("qwen2", "bf16", "eager"), ("mistral", "fp32", "sdpa"), ("mistral", "bf16", "eager")]


@pytest.mark.parametrize(("family", "dtype", "attn"), CASES)
def test_loaded_prefix_matches_full_recompute(
    make_server: Callable[..., ServerProc], family: str, dtype: str, attn: str
) -> None:
    srv = make_server(register=None)
    model = tiny_model(family, DTYPES[dtype], attn)
    ids = prompt(56)  # 3 whole chunks + 8 tokens
    ref = reference(model, ids, NEW)
    with kvhf.connect(model, srv.url, srv.http_url, model_name=f"{family}-{dtype}-{attn}") as ctx:
        first = kvhf.generate(model, ctx, ids, max_new_tokens=NEW, do_sample=False)
        assert first.hit_tokens == 0
        assert torch.equal(first.output_ids, ref)
        assert kvd.lookup(ctx, ids[0]) == 48  # the prompt's whole chunks were saved

        second = kvhf.generate(model, ctx, ids, max_new_tokens=NEW, do_sample=False)
        assert second.hit_tokens == 48
        assert torch.equal(second.output_ids, ref), (second.output_ids[0, 56:], ref[0, 56:])

        # last-position logits: loaded prefix + computed tail vs one full forward
        cache, hit = kvhf.load_kv(ctx, ids[0])
        assert hit == 48 and cache is not None and cache.get_seq_length() == 48
        loaded = last_logits(model, ids[:, hit:], cache)
        full = last_logits(model, ids)
        torch.testing.assert_close(loaded, full, atol=LOGIT_ATOL[DTYPES[dtype]], rtol=0)


@pytest.mark.parametrize(
    ("family", "dtype"), [("llama", "fp32"), ("llama", "bf16"), ("qwen3", "fp32"), ("qwen3", "bf16")]
)
def test_loaded_noise_changes_the_output(make_server: Callable[..., ServerProc], family: str, dtype: str) -> None:
    """Store noise under the prompt (with the real KV's scale): the loaded prefix must be what the
    model attends to, so tokens and logits move far outside the tolerance the real KV meets."""
    srv = make_server(register=None)
    model = tiny_model(family, DTYPES[dtype])
    ids = prompt(56)
    ref = reference(model, ids, NEW)
    with kvhf.connect(model, srv.url, srv.http_url, model_name="m") as ctx:
        assert kvhf.save_kv(ctx, full_cache(model, ids), ids[0])
        real = kvd.retrieve(ctx, ids[0])
        assert real is not None and real.shape[2] == 48
        assert kvd.store(ctx, _noise_like(real), ids[0, :48], cache_salt="noise")

        res = kvhf.generate(model, ctx, ids, cache_salt="noise", max_new_tokens=NEW, do_sample=False)
        assert res.hit_tokens == 48
        assert not torch.equal(res.output_ids[0, 56:], ref[0, 56:])

        cache, hit = kvhf.load_kv(ctx, ids[0], cache_salt="noise")
        assert hit == 48 and cache is not None
        diff = (last_logits(model, ids[:, hit:], cache) - last_logits(model, ids)).abs().max().item()
        assert diff > 10 * LOGIT_ATOL[DTYPES[dtype]], diff

        real_hit = kvhf.generate(model, ctx, ids, max_new_tokens=NEW, do_sample=False)  # default salt: real KV
        assert real_hit.hit_tokens == 48 and torch.equal(real_hit.output_ids, ref)


def test_whole_prompt_cap(make_server: Callable[..., ServerProc]) -> None:
    """A prompt of exactly N chunks loads N-1 of them, even when all N are cached."""
    srv = make_server(register=None)
    model = tiny_model("llama")
    ids = prompt(64)
    with kvhf.connect(model, srv.url, srv.http_url, model_name="m") as ctx:
        assert kvhf.save_kv(ctx, full_cache(model, ids), ids[0])
        assert kvd.lookup(ctx, ids[0]) == 64
        for n, want in ((64, 48), (48, 32), (49, 48), (17, 16), (16, 0), (1, 0)):
            cache, hit = kvhf.load_kv(ctx, ids[0, :n])
            assert hit == want, n
            assert (cache is None) == (want == 0)
            if cache is not None:
                assert cache.get_seq_length() == want

        ref = reference(model, ids[:, :48], NEW)
        res = kvhf.generate(model, ctx, ids[:, :48], max_new_tokens=NEW, do_sample=False)
        assert res.hit_tokens == 32 and torch.equal(res.output_ids, ref)
        res = kvhf.generate(model, ctx, ids[:, :16], max_new_tokens=NEW, do_sample=False)
        assert res.hit_tokens == 0 and torch.equal(res.output_ids, reference(model, ids[:, :16], NEW))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_save_load_round_trip_is_exact(make_server: Callable[..., ServerProc], dtype: str) -> None:
    srv = make_server(register=None)
    model = tiny_model("qwen3", DTYPES[dtype])
    ids = torch.cat([prompt(40, seed=1), prompt(40, seed=2)])  # a batch of two prompts
    cache = full_cache(model, ids)
    with kvhf.connect(model, srv.url, srv.http_url, model_name="m") as ctx:
        assert kvhf.save_kv(ctx, cache, ids[1], row=1)  # 2 whole chunks of row 1
        assert not kvhf.save_kv(ctx, cache, ids[1], row=1)  # already stored: dedup
        assert not kvhf.save_kv(ctx, cache, ids[0, :15])  # no whole chunk: nothing to store
        assert kvd.lookup(ctx, ids[0]) == 0 and kvd.lookup(ctx, ids[1]) == 32

        loaded, hit = kvhf.load_kv(ctx, ids[1])
        assert hit == 32 and loaded is not None and len(loaded.layers) == 2
        for i, layer in enumerate(loaded.layers):
            assert layer.keys.shape == (1, 2, 32, 16) and layer.keys.dtype == DTYPES[dtype]
            assert torch.equal(layer.keys[0], cache.layers[i].keys[1, :, :32])
            assert torch.equal(layer.values[0], cache.layers[i].values[1, :, :32])


def test_registration_and_kv_2ltd_seen_from_another_process(
    make_server: Callable[..., ServerProc], tmp_path: Path
) -> None:
    """A plain ``kvdock.sdk.connect`` in a second process finds the model hf.connect registered, and
    retrieves ``[2, L, T, D]`` with ``D = head * head_dim + dim``, tokens-major."""
    srv = make_server(register=None)
    model = tiny_model("llama", torch.bfloat16, "eager")
    ids = prompt(40)
    cache = full_cache(model, ids)
    with kvhf.connect(model, srv.url, srv.http_url, model_name="org/tiny-llama") as ctx:
        assert kvhf.save_kv(ctx, cache, ids[0])
    entry = {e["model_name"]: e for e in srv.get("/status")["cache_context_meta"]}["org/tiny-llama"]
    assert entry["layout"]["engine"] == {
        "name": "transformers",
        "version": transformers.__version__,
        "attention_backend": "eager",
        "kv_cache_layout": "HND",
        "view_shape": [2, 1, 2, 16, 16],
        "view_strides": [],
        "pp_rank": 0,
        "pp_size": 1,
    }
    assert entry["layout"]["geometry"] == {
        "num_layers": 2,
        "num_kv_heads": 2,
        "head_dim": 16,
        "dtype": "bfloat16",
        "kv_kind": "pair",
        "world_size": 1,
        "rank": 0,
        "total_kv_heads": 0,
        "pp_size": 1,
        "pp_rank": 0,
    }
    assert entry["kv_cache_layout"]["engine_kv_format"] == "HND"
    assert entry["kv_cache_layout"]["engine_kv_concrete_shape"] == [2, 1, 2, 16, 16]
    assert CHUNK % entry["kv_cache_layout"]["tokens_per_block"] == 0

    out = tmp_path / "kv.pt"
    script = textwrap.dedent(f"""
        import json, sys, torch
        import kvdock.sdk as kvd
        with kvd.connect({srv.url!r}, {srv.http_url!r}, "org/tiny-llama", timeout=10) as ctx:
            kv = kvd.retrieve(ctx, {ids[0].tolist()!r})
            torch.save(kv, {str(out)!r})
            g = ctx.geometry
            print(json.dumps([g.num_layers, g.num_kv_heads, g.head_dim, g.dtype, ctx.chunk_size]))
    """)
    proc = zygote.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [2, 2, 16, "bfloat16", CHUNK]
    kv = torch.load(out)
    assert kv.shape == (2, 2, 32, 32) and kv.dtype == torch.bfloat16
    for i, layer in enumerate(cache.layers):
        for j, t in enumerate((layer.keys, layer.values)):
            for h in range(2):
                assert torch.equal(kv[j, i, :, h * 16 : (h + 1) * 16], t[0, h, :32])


def test_connect_names_and_tokens_per_block(make_server: Callable[..., ServerProc]) -> None:
    srv = make_server(register=None)
    model = tiny_model("qwen3")
    with kvhf.connect(model, srv.url, srv.http_url) as ctx:  # no name, no _name_or_path: the model type
        assert ctx.model_name == "qwen3"
        assert (ctx.geometry.num_layers, ctx.geometry.num_kv_heads, ctx.geometry.head_dim) == (2, 2, 16)
    model.config._name_or_path = "local/qwen3-tiny"
    with kvhf.connect(model, srv.url, srv.http_url) as ctx:
        assert ctx.model_name == "local/qwen3-tiny"
    # a name registered before with the same geometry (here with tokens_per_block 8) keeps its layout
    kvd.register_model(
        srv.url, srv.http_url, "pre", num_layers=2, num_kv_heads=2, head_dim=16, dtype="float32", tokens_per_block=8
    )
    with kvhf.connect(model, srv.url, srv.http_url, model_name="pre") as ctx:
        assert ctx.layout.tokens_per_block == 8 and ctx.layout.engine.name == "sdk"
        assert ctx.geometry == KVGeometry(2, 2, 16, "float32")
    # the same name with another geometry is refused by the server, naming both
    with pytest.raises(kvd.ServerError, match="different geometry"):
        kvhf.connect(model.to(torch.bfloat16), srv.url, srv.http_url, model_name="pre")


def test_generate_extends_an_edited_prefix_only_with_kv_computed_over_it(
    make_server: Callable[..., ServerProc],
) -> None:
    """An overwrite edits the prompt's first two chunks. A save of KV computed before the edit
    (over the original prefix: save_kv without ``over``) stores nothing past it; generate loads the
    edit, computes the rest over it and saves it with the edit's tips, so the next call loads the
    edit and that continuation (not the original's chunk 2) and answers alike."""
    srv = make_server(register=None)
    model = tiny_model("llama")
    ids = prompt(56)  # 3 whole chunks + 8 tokens
    with kvhf.connect(model, srv.url, srv.http_url, model_name="m") as ctx:
        assert kvhf.save_kv(ctx, full_cache(model, ids), ids[0], cache_salt="original")
        original = kvd.retrieve(ctx, ids[0], cache_salt="original")
        assert original is not None and original.shape[2] == 48
        assert kvd.store(ctx, original[:, :, :32], ids[0, :32])
        edit = _noise_like(original[:, :, :32])
        assert kvd.store(ctx, edit, ids[0, :32], overwrite=True)

        assert not kvhf.save_kv(ctx, full_cache(model, ids), ids[0])  # computed over the original
        assert kvd.lookup(ctx, ids[0]) == 32

        first = kvhf.generate(model, ctx, ids, max_new_tokens=NEW, do_sample=False)
        assert first.hit_tokens == 32
        assert kvd.lookup(ctx, ids[0]) == 48  # chunk 2, computed over the edit, extends it
        stored = kvd.retrieve(ctx, ids[0])
        assert stored is not None and torch.equal(stored[:, :, :32], edit)
        assert not torch.equal(stored[:, :, 32:], original[:, :, 32:])
        second = kvhf.generate(model, ctx, ids, max_new_tokens=NEW, do_sample=False)
        assert second.hit_tokens == 48 and torch.equal(second.output_ids, first.output_ids)


def test_saves_are_the_models_kv_extending_plain_prefixes_never_a_users_remap(
    make_server: Callable[..., ServerProc],
) -> None:
    """save_kv stores the model's own KV (not marked edited): a longer prompt's save extends the
    chunks a shorter one saved. A user's SDK store of another prompt's KV under this prompt's ids
    (a remap) is an edit: the model's save of the prompt and more, computed over its own KV,
    stores nothing past it; generate loads the remap, computes the rest over it and extends it."""
    from kvdock.sdk.engine import lookup_tips
    from kvdock.storage.plans import DERIVED, EDITED

    srv = make_server(register=None)
    model = tiny_model("llama")
    ids, other = prompt(56), prompt(56, seed=2)
    with kvhf.connect(model, srv.url, srv.http_url, model_name="m") as ctx:
        assert kvhf.save_kv(ctx, full_cache(model, ids[:, :32]), ids[0, :32])
        (tip,) = lookup_tips(ctx, ids[0, :32]).versions
        assert not tip & (EDITED | DERIVED)
        assert kvhf.save_kv(ctx, full_cache(model, ids), ids[0])  # extends the plain prefix
        assert kvd.lookup(ctx, ids[0]) == 48

        remap = kvd.retrieve(ctx, ids[0, :32])  # the first prompt's KV, stored under other's ids
        assert remap is not None and kvd.store(ctx, remap, other[0, :32])
        seen = lookup_tips(ctx, other[0, :32])
        assert seen.hit_tokens == 32 and seen.versions[0] & EDITED
        assert not kvhf.save_kv(ctx, full_cache(model, other), other[0])  # computed over other's own KV
        assert kvd.lookup(ctx, other[0]) == 32
        got = kvd.retrieve(ctx, other[0])
        assert got is not None and torch.equal(got, remap)

        first = kvhf.generate(model, ctx, other, max_new_tokens=NEW, do_sample=False)
        assert first.hit_tokens == 32
        assert kvd.lookup(ctx, other[0]) == 48  # chunk 2, computed over the remap, extends it
        (tip,) = lookup_tips(ctx, other[0]).versions
        assert tip & (EDITED | DERIVED) == DERIVED

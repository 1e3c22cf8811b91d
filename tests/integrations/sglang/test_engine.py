"""SGLang's whole engine on CPU with kvdock as its HiCache storage: a tiny random Llama (built
from a config with a fixed seed), ``SGLANG_USE_CPU_ENGINE=1``, ``torch_native`` attention, and the
test-only stand-ins of ``standins/`` (``sgl_kernel``'s one op in torch; ``sitecustomize``: unpinned
host buffers and torch host<->device copies), which only these tests put on the engine
processes' path. If a later SGLang breaks the stand-ins, test_hicache_storage still guards the
backend against SGLang's own classes."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import kvdock.sdk as kvd
from kvdock.testing import ServerProcess, start_server

STANDINS = str(Path(__file__).parent / "standins")
PAGE = 16
MODEL = "sgl-engine-tiny"
# the engine's KV pool, in tokens: SGLang sizes it from the memory free at its start (mem_fraction_static), so
# another engine or test starting beside it could leave it no room ("Loaded weights leave no GPU memory"); a
# larger fraction capped here gives a small pool whatever the machine has free
MAX_TOKENS = 16384


def tiny_llama(path: Path) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1234)
    cfg = LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, torch_dtype="float32",
    )  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, ServerProcess]]:
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (STANDINS, os.environ.get("PYTHONPATH")) if p)
    sys.path.insert(0, STANDINS)
    import sglang as sgl

    root = tmp_path_factory.mktemp("sgl-engine")
    srv = start_server("--no-disk", chunk_size=PAGE, l1_size="128MiB", log_path=root / "server.log")
    extra = {
        "backend_name": "kvdock", "module_path": "kvdock.integrations.sglang", "class_name": "KvdockHiCacheStorage",
        "interface_v1": 1, "hicache_storage_pass_prefix_keys": True, "prefetch_threshold": PAGE,
        "kvdock.url": srv.url, "kvdock.http_url": srv.http_url, "kvdock.model_name": MODEL,
    }  # fmt: skip
    eng = sgl.Engine(
        model_path=tiny_llama(root / "model"), device="cpu", attention_backend="torch_native",
        skip_tokenizer_init=True, page_size=PAGE, dtype="float32", disable_cuda_graph=True,
        mem_fraction_static=0.3, max_total_tokens=MAX_TOKENS, log_level="warning", enable_hierarchical_cache=True,
        hicache_ratio=2.0,
        hicache_write_policy="write_through", hicache_storage_backend="dynamic",
        hicache_storage_backend_extra_config=json.dumps(extra),
    )  # fmt: skip
    try:
        yield eng, srv
    finally:
        eng.shutdown()
        srv.stop()


def generate(eng: Any, ids: list[int]) -> tuple[list[int], dict[str, Any]]:
    out = eng.generate(input_ids=ids, sampling_params={"max_new_tokens": 8, "temperature": 0})
    return list(out["output_ids"]), out["meta_info"]


def wait_stored(srv: ServerProcess, ids: list[int], tokens: int) -> None:
    """Until kvdock holds ``tokens`` of ``ids`` (SGLang writes through to storage in the background)."""
    with kvd.connect(srv.url, srv.http_url, MODEL) as ctx:
        deadline = time.monotonic() + 60
        while kvd.lookup(ctx, ids) < tokens:
            assert time.monotonic() < deadline, f"kvdock holds {kvd.lookup(ctx, ids)} of {tokens} tokens"
            time.sleep(0.05)


def test_a_flushed_prompt_loads_from_kvdock_with_identical_output(engine: tuple[Any, ServerProcess]) -> None:
    eng, srv = engine
    ids = [(7 * i + 3) % 500 + 1 for i in range(12 * PAGE + 7)]
    first, meta = generate(eng, ids)
    assert meta["cached_tokens"] == 0
    wait_stored(srv, ids, 12 * PAGE)
    assert eng.flush_cache().success
    again, meta = generate(eng, ids)
    assert again == first
    assert meta["cached_tokens_details"]["storage"] == 12 * PAGE
    assert meta["cached_tokens_details"]["storage_backend"] == "KvdockHiCacheStorage"


def test_kv_retrieved_by_the_sdk_and_stored_under_other_tokens_gives_the_sources_output(
    engine: tuple[Any, ServerProcess],
) -> None:
    eng, srv = engine
    tail = [11, 22, 33, 44, 55]
    source = [(13 * i + 5) % 500 + 1 for i in range(8 * PAGE)]
    target = [(17 * i + 9) % 500 + 1 for i in range(8 * PAGE)]
    want, _ = generate(eng, source + tail)
    plain, _ = generate(eng, target + tail)
    assert plain != want  # (else the test shows nothing)
    wait_stored(srv, source, 8 * PAGE)
    with kvd.connect(srv.url, srv.http_url, MODEL) as ctx:
        assert ctx.layout.engine.name == "sglang"
        assert ctx.layout.fingerprint.startswith("sglang-v1:")  # (from SGLang's server arguments)
        kv = kvd.retrieve(ctx, source)
        assert kv is not None and kv.shape == (2, 2, 8 * PAGE, 2 * 16)
        kvd.store(ctx, kv, target, overwrite=True)  # (SGLang stored the target's own KV just now)
    assert eng.flush_cache().success
    got, meta = generate(eng, target + tail)
    assert meta["cached_tokens_details"]["storage"] == 8 * PAGE
    assert got == want
    # SGLang's continuation of the edit it loaded is stored after it (the backend passes ``over``)
    longer = target + [(19 * i + 1) % 500 + 1 for i in range(2 * PAGE + 3)]
    generate(eng, longer)
    wait_stored(srv, longer, 10 * PAGE)
    with kvd.connect(srv.url, srv.http_url, MODEL) as ctx:
        stored = kvd.retrieve(ctx, longer)
        assert stored is not None and torch.equal(stored[:, :, : 8 * PAGE], kv)

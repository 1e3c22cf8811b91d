"""The examples with ``--engine vllm``: the reference's end-to-end remap flow and token dropping,
entirely through vLLM (kvdock's connector) and the SDK, checked value by value."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import kvdock.sdk as kvd
from kvdock.testing import ServerProcess, start_server

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
CHUNK = 64
TINY = "kvdock-example-tiny-llama"


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProcess]:
    srv = start_server("--no-disk", chunk_size=CHUNK, l1_size="128MiB", log_path=tmp_path / "server.log")
    yield srv
    srv.stop()


def run_example(script: str, srv: ServerProcess, *extra: str) -> dict[str, Any]:
    cmd = [sys.executable, str(EXAMPLES / script), "--engine", "vllm", "--url", srv.url, "--http-url", srv.http_url]
    proc = subprocess.run([*cmd, *extra], capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, f"{script} exited {proc.returncode}\nstderr:\n{proc.stderr[-6000:]}"
    report: dict[str, Any] = json.loads(proc.stdout)
    return report


def test_kv_edit_e2e_through_vllm_in_two_engines(server: ServerProcess) -> None:
    report = run_example("kv_edit_e2e.py", server, "--cache-salt", "e2e")
    n, cached = 6 * CHUNK + CHUNK // 4, 6 * CHUNK
    assert report["engine"] == "vllm" and report["vllm_engine_starts"] == 2  # the target ran on a fresh engine
    assert (report["prompt_tokens"], report["cached_tokens"], report["chunk_size"]) == (n, cached, CHUNK)
    assert report["source_hit_tokens"] == 0 and report["target_hit_tokens_before_remap"] == 0
    assert report["retrieved_shape"] == [2, 2, cached, 64] and report["stored"] is True
    assert report["target_hit_tokens_after_remap"] == cached == report["target_engine_hit_tokens"]
    assert report["baseline_hit_tokens"] == 0
    assert report["source_output_preview"] == report["target_output_preview"]
    assert report["baseline_output_preview"] != report["source_output_preview"]
    assert report["outputs_match"] is True and report["baseline_differs"] is True
    assert len(report["source_output_preview"]) == report["new_tokens"] == 16
    with kvd.connect(server.url, server.http_url, TINY) as ctx:  # the engine registered the model
        assert ctx.geometry.head_dim == 32 and ctx.layout.engine.name == "vllm"


def test_token_dropping_through_vllm(server: ServerProcess) -> None:
    report = run_example("token_dropping.py", server, "--reuse-engine", "--cache-salt", "drop")
    n, cached = 12 * CHUNK + CHUNK // 4, 12 * CHUNK
    assert report["engine"] == "vllm" and report["prompt_tokens"] == n and report["cached_tokens"] == cached
    assert report["dropped_span"] == [CHUNK, cached - CHUNK] and report["kept_cached_tokens"] == 2 * CHUNK
    assert report["full_hit_tokens"] == 0
    assert report["dropped_hit_tokens"] == 2 * CHUNK  # the compacted prompt loaded the compacted KV
    assert report["rerotation_exact"] is True and report["stored"] is True
    assert report["new_tokens"] == 32 and report["full_generate_s"] > 0

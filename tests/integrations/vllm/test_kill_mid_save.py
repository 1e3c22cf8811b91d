"""A kvdock server killed while a batch's saves are in flight (issue 30), checked through vLLM's
own block bookkeeping (the BlockPool's hand-outs and frees, recorded in the engine process by
:mod:`blockwatch`) and through the KV each save read back:

* no block is freed or handed out while a save still reads it: between a save's submission (right
  after the forward pass) and the end of its copy out of the pages, and for a request whose frees
  the connector delayed, until the connector reports it finished sending;
* what each copy read is byte for byte what the pages held right after the forward pass (a block
  reused before its read would hold another prompt's KV);
* every delayed request is reported finished sending and every block comes back (no leak);
* the batches during and after the kill produce a plain engine's tokens.

The server is SIGSTOPped before the batch, so its stores hang; it is SIGKILLed as soon as the first
store has started. Each copy out of the pages waits BLOCKWATCH_COPY_DELAY_S first, so copies run
after their requests finished (the delayed-free path), and the KV cache is small enough that the
next batch takes the blocks the saves give back.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import blockwatch
import pytest
from engines import CHUNK, Engine, make_tiny_model
from test_connector import MODEL, prompt

import kvdock.sdk as kvd
from kvdock.testing import start_server

BLOCK_BYTES = 2 * 2 * 32 * 64 * 4  # one block of every layer of the tiny model (float32)
# 80 blocks of 32 tokens: a batch of six 200-token prompts (7 blocks each) still held for its saves
# leaves room for five of the next batch's, which then takes the blocks those saves give back
CACHE = {"kv_cache_memory_bytes": 80 * BLOCK_BYTES, "max_model_len": 1024}
COPY_DELAY_S = 0.3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


def touched(events: list[dict[str, Any]], blocks: list[int], after: int, before: int) -> list[dict[str, Any]]:
    """The hand-outs and frees of any of ``blocks`` strictly between two points of the log."""
    mine = set(blocks)
    return [
        x for x in events
        if x["kind"] in ("alloc", "free") and after < x["seq"] < before and mine.intersection(x["blocks"])
    ]  # fmt: skip


def test_a_server_killed_mid_save_never_lets_vllm_reuse_a_block_a_save_still_reads(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mark = tmp_path / "store.mark"
    monkeypatch.setenv(blockwatch.DELAY_ENV, str(COPY_DELAY_S))
    monkeypatch.setenv(blockwatch.MARK_ENV, str(mark))
    batches = {name: [prompt(seed + i, 200) for i in range(6)] for name, seed in (("b", 900), ("c", 910), ("d", 920))}
    with Engine(model_dir, "float32", None, tmp_path / "plain.log", **CACHE) as plain:
        expected = {name: plain.generate(prompts) for name, prompts in batches.items()}

    srv = start_server("--no-disk", chunk_size=CHUNK, l1_size="64MiB", log_path=tmp_path / "server.log")
    cfg = {"kvdock.url": srv.url, "kvdock.http_url": srv.http_url, "kvdock.model_name": MODEL,
           "kvdock.timeout": 3.0, "kvdock.retry_s": 0.5}  # fmt: skip
    try:
        with Engine(model_dir, "float32", cfg, tmp_path / "engine.log", plugin=Path(blockwatch.__file__), **CACHE) as e:
            warm = prompt(899, 70)
            e.generate([warm])  # registers the model, the scheduler learns the chunk size; one chunk saved
            with kvd.connect(srv.url, srv.http_url, MODEL, timeout=30) as ctx:
                assert kvd.lookup(ctx, warm) == CHUNK
            mark.unlink()  # (the warm-up's store)

            # batch b against a stopped server, killed once its first store is in flight
            os.kill(srv.proc.pid, signal.SIGSTOP)
            answer: dict[str, Any] = {}

            def run_b() -> None:
                answer.update(e.call(op="generate", prompts=batches["b"], max_tokens=8, settle=False, timeout=120))

            runner = threading.Thread(target=run_b)
            runner.start()
            deadline = time.monotonic() + 60
            while not mark.exists():
                assert time.monotonic() < deadline, "no save of batch b ever reached the network thread"
                time.sleep(0.005)
            killed_at = time.time()
            os.kill(srv.proc.pid, signal.SIGKILL)
            srv.proc.wait(10)
            runner.join(120)
            assert answer["outputs"] == expected["b"]

            # the next batches reuse batch b's blocks; their saves fail (no server); the same tokens
            res = e.call(op="generate", prompts=batches["c"], max_tokens=8, settle=False, timeout=120)
            assert res["outputs"] == expected["c"]
            res = e.call(op="generate", prompts=batches["d"], max_tokens=8, timeout=120)  # (settled)
            assert res["outputs"] == expected["d"] and res["drained"]
            watch = e.call(op="blockwatch")
    finally:
        if srv.proc.poll() is None:
            os.kill(srv.proc.pid, signal.SIGCONT)
            srv.stop()

    events: list[dict[str, Any]] = watch["events"]
    of = lambda kind: [x for x in events if x["kind"] == kind]  # noqa: E731
    assert not of("preempted")  # (a preemption frees a request's blocks at once: not this test's case)
    heads = {tuple(p[:16]) for p in batches["b"]}
    b_reqs = {x["req"] for x in of("submit") if tuple(x["head"]) in heads}
    assert len(b_reqs) == 6, b_reqs  # every request of batch b saved (its three whole chunks)
    finished = {x["req"]: x for x in of("finished")}
    sent: dict[str, int] = {}
    for x in of("sent"):
        for rid in x["reqs"]:
            sent.setdefault(rid, x["seq"])

    # the server died mid-save: a store of batch b began before the kill and failed after it,
    # while copies of batch b were still to be read
    b_stores = [x for x in of("store") if x["req"] in b_reqs]
    assert any(x["start"] <= killed_at < x["t"] and not x["written"] for x in b_stores), (killed_at, b_stores)
    assert any(x["t"] > killed_at for x in of("read") if x["req"] in b_reqs)

    late = 0  # reads over after their request had finished
    for read in of("read"):
        rid = read["req"]
        submit = max((x for x in of("submit") if x["req"] == rid and x["seq"] < read["start"]), key=lambda x: x["seq"])
        # what the copy read is what the pages held right after the forward pass
        assert read["equal"] and all(read["equal"]), read
        # no block of the save was freed or handed out before the copy was over
        assert not touched(events, submit["blocks"], submit["seq"], read["seq"]), (read, submit)
        done = finished.get(rid)
        if done is not None and done["seq"] < read["seq"]:
            late += 1
            # request_finished delayed the frees, and the request was reported finished sending
            # only after the copy; until then none of its blocks was freed or handed out
            assert done["delay"], done
            assert sent.get(rid, 0) > read["seq"], (rid, sent.get(rid), read)
            assert not touched(events, submit["blocks"], submit["seq"], sent[rid]), (rid, submit)
    assert late >= 2, f"only {late} copies ran after their request finished: the test did not exercise delayed frees"

    # every delayed request was reported finished sending (once), after its request finished
    for rid, done in finished.items():
        if done["delay"]:
            assert sent.get(rid, 0) > done["seq"], (rid, done)
    # batch b's blocks went to later requests once its saves were over (the test exercised reuse)
    b_blocks = {b for x in of("submit") if x["req"] in b_reqs for b in x["blocks"]}
    assert any(b_blocks.intersection(x["blocks"]) for x in of("alloc") if x["seq"] > min(sent[r] for r in b_reqs))
    # and every block came back: nothing leaked behind a save that never reported
    assert watch["free_blocks"] == watch["num_blocks"] - 1, watch["free_blocks"]

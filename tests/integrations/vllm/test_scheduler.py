"""The connector's scheduler side against a real kvdock server, fed vLLM-shaped scheduler outputs
(vLLM's scheduler itself is exercised by the engine tests): load ranges, never-cached requests,
lookups that hold the scheduler up for one bounded wait at most, and preemption within one step."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import kvdock.sdk as kvd
from kvdock.integrations.vllm.config import ConnectorConfig
from kvdock.integrations.vllm.scheduler import SchedulerSide, lora_cache_salt, request_salt
from kvdock.testing import ServerProcess, start_server

CHUNK, BLOCK = 64, 32
MODEL = "sched"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProcess]:
    srv = start_server("--no-disk", chunk_size=CHUNK, l1_size="16MiB", log_path=tmp_path / "s.log")
    kvd.register_model(srv.url, srv.http_url, MODEL, num_layers=2, num_kv_heads=2, head_dim=32, dtype="float32")
    yield srv
    if srv.proc.poll() is None:
        os.kill(srv.proc.pid, signal.SIGCONT)
        srv.stop()


def side(
    srv: ServerProcess, clock: Clock | None = None, lookup_wait: float = 0.01, timeout: float = 2.0
) -> SchedulerSide:
    cfg = ConnectorConfig(
        url=srv.url, http_url=srv.http_url, model_name=MODEL, timeout=timeout, retry_s=1.0, lookup_wait=lookup_wait
    )
    return SchedulerSide(cfg, BLOCK, clock=clock or time.monotonic)


def request(rid: str, tokens: list[int], **more: Any) -> SimpleNamespace:
    fields: dict[str, Any] = {"cache_salt": None, "lora_request": None, "mm_features": [], "prompt_embeds": None}
    return SimpleNamespace(request_id=rid, prompt_token_ids=tokens, all_token_ids=tokens, **{**fields, **more})


def ask(s: SchedulerSide, req: SimpleNamespace, computed: int = 0) -> int:
    deadline = time.monotonic() + 10
    while True:
        n, is_async = s.matched_tokens(req, computed)
        assert is_async is False
        if n is not None:
            return n
        assert time.monotonic() < deadline
        time.sleep(0.005)


def output(new: list[Any] = (), cached: Any = None, scheduled: dict[str, int] | None = None, preempted=None) -> Any:  # type: ignore[assignment]
    cached = cached or SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[])
    return SimpleNamespace(
        scheduled_new_reqs=list(new), scheduled_cached_reqs=cached, num_scheduled_tokens=scheduled or {},
        preempted_req_ids=preempted, total_num_scheduled_tokens=sum((scheduled or {}).values()),
    )  # fmt: skip


def store_prefix(srv: ServerProcess, tokens: list[int]) -> None:
    with kvd.connect(srv.url, srv.http_url, MODEL) as ctx:
        kvd.store(ctx, torch.randn(2, 2, len(tokens), 64), tokens)


def test_the_load_starts_at_vllms_own_hit_and_saves_cover_new_chunks(server: ServerProcess) -> None:
    toks = list(range(1, 301))
    store_prefix(server, toks[:192])
    s = side(server)
    req = request("r", toks)
    assert ask(s, req, computed=64) == 128  # kvdock holds 192: 128 beyond vLLM's own 64
    assert s.matched_tokens(req, 64) == (128, False)  # asked again: the same, no new lookup
    s.allocated(req, 128)
    new = SimpleNamespace(req_id="r", block_ids=(list(range(10, 20)),), num_computed_tokens=192)
    meta = s.plan(output([new], scheduled={"r": 108}))
    [load] = meta.loads
    assert (load.start, load.end, load.block_ids, load.tokens) == (64, 192, list(range(10, 16)), toks[:192])
    [save] = meta.saves  # 300 computed: chunks up to 256; the loaded ones are known stored
    assert save.tokens == toks[:256] and save.block_ids == list(range(10, 18))
    s.shutdown()


def test_the_whole_prompt_is_never_a_hit(server: ServerProcess) -> None:
    toks = list(range(1, 129))
    store_prefix(server, toks)
    s = side(server)
    assert ask(s, request("r", toks)) == 64
    s.shutdown()


def test_images_and_prompt_embeddings_are_never_looked_up_or_saved(server: ServerProcess) -> None:
    toks = list(range(1, 201))
    store_prefix(server, toks[:192])
    s = side(server)
    img = request("img", toks, mm_features=[object()])
    emb = request("emb", toks, prompt_embeds=object())
    assert s.matched_tokens(img, 0) == (0, False) and s.matched_tokens(emb, 0) == (0, False)  # no lookup
    news = [SimpleNamespace(req_id=r, block_ids=(list(range(7)),), num_computed_tokens=0) for r in ("img", "emb")]
    assert s.plan(output(news, scheduled={"img": 200, "emb": 200})).saves == []
    s.shutdown()


def test_a_request_that_must_not_read_a_prefix_cache_is_not_looked_up_but_is_saved(server: ServerProcess) -> None:
    toks = list(range(1, 201))
    store_prefix(server, toks[:192])
    s = side(server)
    assert ask(s, request("warm", list(range(900, 1000)))) == 0  # learns the chunk size
    req = request("lp", toks, skip_reading_prefix_cache=True)  # e.g. prompt logprobs
    assert s.matched_tokens(req, 0) == (0, False)  # answered at once: no lookup
    new = SimpleNamespace(req_id="lp", block_ids=(list(range(7)),), num_computed_tokens=0)
    [save] = s.plan(output([new], scheduled={"lp": 200})).saves
    assert save.tokens == toks[:192] and save.block_ids == list(range(6))
    s.shutdown()


def test_a_lookup_done_within_the_wait_is_answered_by_the_first_ask(server: ServerProcess) -> None:
    toks = list(range(1, 201))
    store_prefix(server, toks[:128])
    s = side(server, lookup_wait=10.0)  # ample: the answer never depends on the machine's speed
    assert s.matched_tokens(request("r", toks), 0) == (128, False)  # no None: admitted this step
    assert s.matched_tokens(request("miss", list(range(300, 500))), 0) == (0, False)
    s.shutdown()


def test_a_hung_server_never_blocks_the_scheduler_and_is_a_miss_after_timeout(
    server: ServerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a stopped server's pool directory still answers lookups (fast reads: its state cannot change);
    # these lookups must reach the server, which does not answer
    monkeypatch.setenv("KVDOCK_FAST_READS", "0")
    clock = Clock()
    s = side(server, clock, lookup_wait=0.0)
    assert ask(s, request("warm", list(range(1, 100)))) == 0  # connected
    os.kill(server.proc.pid, signal.SIGSTOP)
    req = request("r", list(range(500, 700)))
    start = time.monotonic()
    assert s.matched_tokens(req, 0) == (None, False)  # in flight: vLLM asks again later
    assert s.matched_tokens(req, 0) == (None, False)
    clock.now = 2.5  # past kvdock.timeout since the first ask
    assert s.matched_tokens(req, 0) == (0, False)
    assert time.monotonic() - start < 1.0  # none of these calls waited for the server
    s.shutdown()


def test_a_hung_server_costs_one_lookup_wait_then_busy_steps_never_wait(
    server: ServerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVDOCK_FAST_READS", "0")  # the lookups must reach the stopped server (see above)
    # the injected clock never moves: no request times out; the SDK's own timeout (20 s) is far away
    s = side(server, Clock(), lookup_wait=1.0, timeout=20.0)
    assert ask(s, request("warm", list(range(1, 100)))) == 0  # connected: a fast lookup
    s.plan(output(scheduled={"warm": 99}))  # a busy step: the whole budget again
    os.kill(server.proc.pid, signal.SIGSTOP)
    req, other = request("r", list(range(500, 700))), request("r2", list(range(800, 900)))
    start = time.monotonic()
    assert s.matched_tokens(req, 0) == (None, False)  # waited the budget, then: ask again later
    assert 1.0 <= time.monotonic() - start < 3.0
    start = time.monotonic()
    assert s.matched_tokens(other, 0) == (None, False)  # lookups are slow now: no second wait...
    s.plan(output(scheduled={"busy": 16}))
    assert s.matched_tokens(req, 0) == (None, False)  # ...nor in the next busy step
    assert s.matched_tokens(other, 0) == (None, False)
    assert time.monotonic() - start < 0.5
    s.plan(output())  # a step that scheduled nothing: waiting holds nothing up
    start = time.monotonic()
    assert s.matched_tokens(other, 0) == (None, False)
    assert 1.0 <= time.monotonic() - start < 3.0
    os.kill(server.proc.pid, signal.SIGCONT)
    assert ask(s, req) == 0  # the hung lookup finishes (a miss): it was slow, so still no waits
    s.plan(output(scheduled={"busy": 16}))
    assert ask(s, other) == 0  # this one ran after the server woke up: fast again
    toks = list(range(1000, 1200))
    store_prefix(server, toks[:128])
    s.plan(output(scheduled={"busy": 16}))
    assert s.matched_tokens(request("r3", toks), 0) == (128, False)  # a busy step waits again
    s.shutdown()


def test_a_request_preempted_and_resumed_in_one_step_keeps_its_load(server: ServerProcess) -> None:
    toks = list(range(1, 201))
    store_prefix(server, toks[:192])
    s = side(server)
    req = request("r", toks)
    assert ask(s, req) == 192
    s.allocated(req, 192)
    cached = SimpleNamespace(
        req_ids=["r"], resumed_req_ids={"r"}, new_block_ids=[(list(range(30, 37)),)], num_computed_tokens=[192]
    )
    meta = s.plan(output(cached=cached, scheduled={"r": 8}, preempted={"r"}))
    [load] = meta.loads
    assert (load.start, load.end, load.block_ids) == (0, 192, list(range(30, 36)))
    s.shutdown()


def test_a_lora_adapter_gets_its_own_namespace(server: ServerProcess) -> None:
    toks = list(range(1, 201))
    store_prefix(server, toks[:192])  # stored without an adapter
    s = side(server)
    lora = request("l", toks, lora_request=SimpleNamespace(lora_name="sql"))
    assert request_salt(lora) == lora_cache_salt("", "sql") != ""
    assert ask(s, lora) == 0  # the base model's KV is not the adapter's
    with kvd.connect(server.url, server.http_url, MODEL) as ctx:
        kvd.store(ctx, torch.randn(2, 2, 128, 64), toks[:128], cache_salt=lora_cache_salt("", "sql"))
    assert ask(s, request("l2", toks, lora_request=SimpleNamespace(lora_name="sql"))) == 128
    s.shutdown()

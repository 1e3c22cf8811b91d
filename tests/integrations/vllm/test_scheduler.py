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
    srv: ServerProcess,
    clock: Clock | None = None,
    lookup_wait: float = 0.01,
    timeout: float = 2.0,
    load_async: bool = False,
    model: str = MODEL,
) -> SchedulerSide:
    cfg = ConnectorConfig(
        url=srv.url, http_url=srv.http_url, model_name=model, timeout=timeout, retry_s=1.0, lookup_wait=lookup_wait,
        load_async=load_async,
    )  # fmt: skip
    return SchedulerSide(cfg, BLOCK, clock=clock or time.monotonic)


def blocks(ids: list[int]) -> SimpleNamespace:
    """vLLM's KVCacheBlocks as update_state_after_alloc gets them (one KV cache group)."""
    return SimpleNamespace(get_block_ids=lambda: (list(ids),))


def request(rid: str, tokens: list[int], **more: Any) -> SimpleNamespace:
    fields: dict[str, Any] = {"cache_salt": None, "lora_request": None, "mm_features": [], "prompt_embeds": None}
    return SimpleNamespace(request_id=rid, prompt_token_ids=tokens, all_token_ids=tokens, **{**fields, **more})


def ask(s: SchedulerSide, req: SimpleNamespace, computed: int = 0) -> int:
    deadline = time.monotonic() + 10
    while True:
        n, is_async = s.matched_tokens(req, computed)
        assert is_async is bool(n and s.cfg.load_async)
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
        # the model's KV as an engine saved it (edited=False: no SDK edit, loadable after vLLM's own blocks)
        kvd.store(ctx, torch.randn(2, 2, len(tokens), 64), tokens, edited=False)


def test_the_load_starts_at_vllms_own_hit_and_saves_cover_new_chunks(server: ServerProcess) -> None:
    toks = list(range(1, 301))
    store_prefix(server, toks[:192])
    s = side(server)
    req = request("r", toks)
    assert ask(s, req, computed=64) == 128  # kvdock holds 192: 128 beyond vLLM's own 64
    assert s.matched_tokens(req, 64) == (128, False)  # asked again: the same, no new lookup
    s.allocated(req, blocks(range(10, 20)), 128)
    new = SimpleNamespace(req_id="r", block_ids=(list(range(10, 20)),), num_computed_tokens=192)
    meta = s.plan(output([new], scheduled={"r": 108}))
    [load] = meta.loads
    assert (load.start, load.end, load.block_ids, load.tokens) == (64, 192, list(range(10, 16)), toks[:192])
    [save] = meta.saves  # 300 computed: chunks up to 256; the loaded ones are known stored
    assert save.tokens == toks[:256] and save.block_ids == list(range(10, 18))
    assert save.over is None  # vLLM's own blocks [0, 64): their versions are unknown
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
    s.allocated(req, blocks(range(30, 37)), 192)
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


def test_a_background_load_is_planned_with_the_blocks_allocated_for_it(server: ServerProcess) -> None:
    toks = list(range(1, 301))
    store_prefix(server, toks[:192])
    s = side(server, load_async=True)
    req = request("r", toks)
    assert ask(s, req, computed=64) == 128
    assert s.matched_tokens(req, 64) == (128, True)  # load_kv_async: vLLM holds the request back
    s.allocated(req, blocks(range(10, 20)), 128)
    meta = s.plan(output(scheduled={"other": 16}))  # the request is not scheduled while it loads
    [load] = meta.loads
    assert load.is_async and (load.start, load.end, load.block_ids) == (64, 192, list(range(10, 16)))
    assert meta.saves == []
    s.allocated(req, blocks(range(10, 20)), 0)  # vLLM's second call, after the load: nothing new
    new = SimpleNamespace(req_id="r", block_ids=(list(range(10, 20)),), num_computed_tokens=192)
    meta = s.plan(output([new], scheduled={"r": 108}))
    assert meta.loads == []
    [save] = meta.saves  # only the chunks computed after the loaded ones
    assert save.tokens == toks[:256] and save.block_ids == list(range(10, 18))
    s.shutdown()


def test_a_failed_background_load_has_its_recomputed_chunks_saved(server: ServerProcess) -> None:
    toks = list(range(1, 301))
    store_prefix(server, toks[:256])
    s = side(server, load_async=True)
    req = request("r", toks)
    assert ask(s, req) == 256
    s.allocated(req, blocks(range(10, 20)), 256)
    [load] = s.plan(output()).loads
    assert load.block_ids == list(range(10, 18))
    # the workers could not fill blocks 14 and 15 (tokens 128..192): vLLM recomputes from token 128
    s.output(SimpleNamespace(finished_sending=None, invalid_block_ids={14, 15}))
    assert s.matched_tokens(req, 128) == (0, False)  # asked again: only what was loaded is a hit
    new = SimpleNamespace(req_id="r", block_ids=(list(range(10, 20)),), num_computed_tokens=128)
    [save] = s.plan(output([new], scheduled={"r": 172})).saves
    assert save.tokens == toks[:256] and save.block_ids == list(range(10, 18))
    assert save.over is None  # computed over a partial load, not over the lookup's versions
    s.shutdown()


def test_saves_after_a_whole_load_from_kvdock_name_its_tips_and_an_edit_never_follows_vllms_blocks(
    server: ServerProcess,
) -> None:
    toks = list(range(1, 301))
    with kvd.connect(server.url, server.http_url, MODEL) as ctx:
        kvd.store(ctx, torch.randn(2, 2, 128, 64), toks[:128], overwrite=True)  # an edit (SDK overwrite)
        seen = kvd.lookup_tips(ctx, toks[:256])
    assert seen.hit_tokens == 128 and len(seen.versions) == 1 and seen.versions[0] >> 62 & 1
    s = side(server)
    # 1. loaded from token 0: the load names the lookup's versions, and every later save of the
    # request (chunked prefill: two steps) passes them as over
    req = request("r", toks)
    assert ask(s, req) == 128
    s.allocated(req, blocks(range(10, 20)), 128)
    new = SimpleNamespace(req_id="r", block_ids=(list(range(10, 20)),), num_computed_tokens=128)
    meta = s.plan(output([new], scheduled={"r": 64}))
    [load] = meta.loads
    assert (load.start, load.end, load.tips) == (0, 128, seen.versions)
    [save] = meta.saves
    assert save.tokens == toks[:192] and save.over == seen.versions
    cached = SimpleNamespace(req_ids=["r"], resumed_req_ids=set(), new_block_ids=[None], num_computed_tokens=[192])
    [save] = s.plan(output(cached=cached, scheduled={"r": 108})).saves
    assert save.tokens == toks[:256] and save.over == seen.versions
    # 2. vLLM's own prefix cache holds the first 64 tokens: kvdock's edit is not loaded after them
    other = request("o", toks)
    assert ask(s, other, computed=64) == 0
    s.allocated(other, blocks(range(30, 40)), 0)
    new = SimpleNamespace(req_id="o", block_ids=(list(range(30, 40)),), num_computed_tokens=64)
    meta = s.plan(output([new], scheduled={"o": 236}))
    assert meta.loads == []
    [save] = meta.saves
    assert save.tokens == toks[:256] and save.over is None
    # 3. nothing in kvdock: nothing loaded, no over
    fresh = request("f", list(range(1000, 1200)))
    assert ask(s, fresh) == 0
    new = SimpleNamespace(req_id="f", block_ids=(list(range(50, 57)),), num_computed_tokens=0)
    [save] = s.plan(output([new], scheduled={"f": 200})).saves
    assert save.tokens == list(range(1000, 1192)) and save.over is None
    s.shutdown()


def test_a_finished_request_keeps_its_blocks_only_while_a_save_may_read_them(server: ServerProcess) -> None:
    s = side(server)
    assert ask(s, request("warm", list(range(900, 1000)))) == 0  # learns the chunk size
    saved, short, gone = request("saved", list(range(1, 201))), request("short", list(range(300, 340))), request(
        "gone", list(range(400, 600))
    )
    for r in (saved, short, gone):
        assert ask(s, r) == 0
    news = [
        SimpleNamespace(req_id=r.request_id, block_ids=(list(range(i * 10, i * 10 + 7)),), num_computed_tokens=0)
        for i, r in enumerate((saved, short, gone))
    ]
    meta = s.plan(output(news, scheduled={"saved": 200, "short": 40, "gone": 200}))
    assert sorted(x.req_id for x in meta.saves) == ["gone", "saved"]  # "short" has no whole chunk
    meta = s.plan(output(scheduled={"x": 1}, preempted={"gone"}))  # its copies are dropped or done
    assert meta.preempted == {"gone"}
    assert s.finished(saved) == (True, None)  # its save may still be copying out of its blocks
    assert s.finished(short) == (False, None)
    assert s.finished(gone) == (False, None)
    assert s.pending_frees()  # vLLM waits for these blocks rather than preempting
    meta = s.plan(output())
    assert meta.delayed == {"saved"}  # the workers report exactly these
    assert s.plan(output()).delayed == set()
    s.output(SimpleNamespace(finished_sending={"saved"}, invalid_block_ids=set()))
    assert not s.pending_frees()
    s.shutdown()


def test_a_scheduler_with_the_workers_layout_registers_the_model_itself(tmp_path: Path) -> None:
    """The server came up after the engine (or restarted without disk): the scheduler's first
    lookup registers the layout the workers handed over, learns the chunk size, and plans saves."""
    from kvdock.layout import KVGeometry
    from kvdock.protocol.messages import EngineInfo, ModelLayout

    srv = start_server("--no-disk", chunk_size=CHUNK, l1_size="16MiB", log_path=tmp_path / "s.log")
    try:
        s = side(srv, model="late")
        toks = list(range(1, 201))
        assert ask(s, request("r0", toks)) == 0 and s.chunk_size == 0  # no layout: not registered
        s.set_layout(ModelLayout("late", KVGeometry(2, 2, 32, "float32"), BLOCK, EngineInfo(name="vllm")))
        s.link._down_until = float("-inf")  # (past retry_s)
        assert ask(s, request("r1", toks)) == 0 and s.chunk_size == CHUNK
        assert "late" in [m["model_name"] for m in kvd.server_status(srv.http_url)["cache_context_meta"]]
        new = SimpleNamespace(req_id="r1", block_ids=(list(range(7)),), num_computed_tokens=0)
        [save] = s.plan(output([new], scheduled={"r1": 200})).saves
        assert save.tokens == toks[:192]
        s.shutdown()
    finally:
        srv.stop()


def test_a_request_carrying_num_publishable_block_hashes_saves_only_those_blocks(server: ServerProcess) -> None:
    s = side(server)
    assert ask(s, request("warm", list(range(900, 1000)))) == 0  # learns the chunk size
    toks = list(range(1, 301))
    req = request("r", toks, num_publishable_block_hashes=5)  # (a field of vLLMs newer than 0.32)
    assert ask(s, req) == 0
    new = SimpleNamespace(req_id="r", block_ids=(list(range(10)),), num_computed_tokens=0)
    [save] = s.plan(output([new], scheduled={"r": 300})).saves
    assert save.tokens == toks[:128] and save.block_ids == list(range(4))  # 5 blocks: 2 whole chunks
    s.shutdown()

"""Review R6 of the asynchronous vLLM connector (issue 30): regressions for what the review found.

* A model whose every layer is sliding-window keeps one KV cache group with vLLM's hybrid
  allocator off, and vLLM frees the blocks that leave the window while the request runs: the
  connector refused it then (a save would copy reused blocks: another request's KV); since
  SupportsHMA it copies such layers out in the step that computed them, and loads them right.
* A background load that fails without saying which blocks reports the planned blocks only,
  never vLLM's own prefix-cache blocks before them (shared with other requests).
* Shutdown waits (bounded) for copies in flight and the network thread's work, so the link is
  never closed under a store and no copy reads pages vLLM is about to release.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheGroupSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from kvdock.errors import UnsupportedLayoutError
from kvdock.integrations.vllm import check_kv_cache_groups
from kvdock.integrations.vllm.plan import LoadSpec, SaveSpec
from kvdock.integrations.vllm.transfers import Transfers

BPT = 100


def _config(*specs: Any) -> Any:
    return SimpleNamespace(kv_cache_groups=[KVCacheGroupSpec([f"l{i}"], s) for i, s in enumerate(specs)])


def _full(**kw: Any) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32, **kw)


def test_kv_cache_groups_that_free_blocks_mid_request_are_mapped_or_refused() -> None:
    """(Since SupportsHMA: kvdock.integrations.vllm.groups.) A sliding-window group, alone or with
    full-attention ones, is mapped (its layers copied out while vLLM holds their blocks, loaded
    only into the blocks it keeps); chunked-local attention is refused, naming the group."""
    window = SlidingWindowSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32, sliding_window=64)
    alone = check_kv_cache_groups(_config(window))
    assert alone is not None and [g.window for g in alone.groups] == [64]
    local = ChunkedLocalAttentionSpec(
        block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32, attention_chunk_size=64
    )
    with pytest.raises(UnsupportedLayoutError, match=r"group 0 \(ChunkedLocalAttentionSpec"):
        check_kv_cache_groups(_config(local))
    both = check_kv_cache_groups(_config(_full(), window))
    assert both is not None and [g.window for g in both.groups] == [0, 64]
    # what kvdock maps as before: full attention (also sliding-window layers promoted to it), MLA, no config
    mla = MLAAttentionSpec(block_size=32, num_kv_heads=1, head_size=64, dtype=torch.float32)
    for spec in (_full(), _full(sliding_window=64), mla):
        mapped = check_kv_cache_groups(_config(spec))
        assert mapped is not None and mapped.plain
    assert check_kv_cache_groups(None) is None


class _Fake:
    def __init__(self) -> None:
        self.copy_gate = threading.Event()
        self.copy_gate.set()
        self.store_gate = threading.Event()
        self.store_gate.set()
        self.copying = threading.Event()
        self.stored: list[str] = []
        self.raise_on_fetch = False

    def mark(self) -> None:
        return None

    def copy_out(self, block_ids: list[int], mark: Any) -> torch.Tensor:
        self.copying.set()
        assert self.copy_gate.wait(30)
        return torch.tensor(block_ids)

    def store(self, spec: SaveSpec, staged: torch.Tensor) -> int:
        assert self.store_gate.wait(30)
        self.stored.append(spec.req_id)
        return len(spec.tokens) * BPT

    def fetch(self, spec: LoadSpec) -> tuple[set[int], int]:
        if self.raise_on_fetch:
            raise RuntimeError("a bug in the load path")
        return set(), 0


def _until(cond: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_a_background_load_that_raises_reports_only_its_planned_blocks() -> None:
    w = _Fake()
    w.raise_on_fetch = True
    t = Transfers(w, 1 << 20, BPT)
    try:
        # blocks 7, 8 are vLLM's own prefix hit (tokens [0, 64)); kvdock loads blocks 9, 10
        t.load(LoadSpec("r", list(range(128)), [7, 8, 9, 10], 64, 128, "", (), True))
        _until(lambda: t.drain(0.01))
        _, recved, errors = t.finished()
        assert recved == {"r"} and errors == {9, 10}
    finally:
        t.shutdown()


def test_shutdown_waits_for_copies_in_flight_and_queued_stores() -> None:
    w = _Fake()
    t = Transfers(w, 1 << 20, BPT)
    w.copy_gate.clear()
    assert t.save(SaveSpec("a", list(range(64)), [1, 2], ""))
    assert w.copying.wait(30)
    done = threading.Event()

    def stop() -> None:
        t.shutdown()
        done.set()

    stopper = threading.Thread(target=stop)
    stopper.start()
    time.sleep(0.2)
    assert not done.is_set(), "shutdown returned while a copy still read vLLM's pages"
    w.copy_gate.set()
    assert done.wait(30)
    stopper.join(30)
    assert w.stored == ["a"]  # stored before the worker closes its link
    assert all(not th.is_alive() for th in t._threads)


def test_shutdown_is_bounded_when_a_store_hangs() -> None:
    w = _Fake()
    t = Transfers(w, 1 << 20, BPT)
    w.store_gate.clear()
    assert t.save(SaveSpec("a", list(range(64)), [1, 2], ""))
    _until(lambda: not t._reading)
    start = time.monotonic()
    t.shutdown(timeout=0.5)
    assert time.monotonic() - start < 10
    w.store_gate.set()


def test_a_real_engine_of_an_all_sliding_window_model_loads_what_it_saved(tmp_path: Any) -> None:
    """vLLM keeps a uniform sliding-window model's single group as SlidingWindowSpec (its blocks
    outside the window are freed while the request runs). It was refused before SupportsHMA; now
    its KV is copied out in the step that computed it, and a hit loads the window's blocks: the
    same tokens as computing the prompt."""
    from engines import TINY, Engine
    from transformers import MistralConfig, MistralForCausalLM

    from kvdock.testing import start_server

    torch.manual_seed(0)
    path = tmp_path / "mistral"
    MistralForCausalLM(MistralConfig(**{**TINY, "sliding_window": 64}, torch_dtype="float32")).eval().save_pretrained(
        path
    )
    srv = start_server("--no-disk", chunk_size=64, l1_size="64MiB", log_path=tmp_path / "server.log")
    extra = {"kvdock.url": srv.url, "kvdock.http_url": srv.http_url, "kvdock.model_name": "m"}
    p = [(i * 37) % 500 + 1 for i in range(200)]
    try:
        with Engine(path, "float32", extra, tmp_path / "e.log") as engine:
            assert engine.call(op="kv_cache")["groups"] == ["SlidingWindowSpec"]
            first = engine.call(op="generate", prompts=[p], max_tokens=8)
            assert first["cached"] == [0]
            assert engine.call(op="reset_prefix_cache")["ok"]
            again = engine.call(op="generate", prompts=[p], max_tokens=8)
            assert again["cached"] == [192] and again["outputs"] == first["outputs"]
    finally:
        srv.stop()


def test_a_step_without_a_forward_pass_waits_a_little_for_delayed_frees() -> None:
    """vLLM steps without a forward pass while a request waits for blocks held by delayed frees:
    such a step waits (bounded) for the copies that hold them, instead of spinning."""
    w = _Fake()
    t = Transfers(w, 1 << 20, BPT)
    try:
        w.copy_gate.clear()
        assert t.save(SaveSpec("a", list(range(64)), [1, 2], ""))
        assert w.copying.wait(30)
        t.delay({"a"})
        start = time.monotonic()
        t.wait_loaded(0.2)  # bounded: the copy cannot finish yet
        assert 0.15 < time.monotonic() - start < 5.0
        threading.Timer(0.1, w.copy_gate.set).start()
        start = time.monotonic()
        t.wait_loaded(30)  # returns as soon as the copy is done and "a" can be reported
        assert time.monotonic() - start < 10
        assert t.finished()[0] == {"a"}
        start = time.monotonic()
        t.wait_loaded(5.0)  # nothing in flight: at once
        assert time.monotonic() - start < 1.0
    finally:
        t.shutdown()


def test_a_save_larger_than_the_staging_left_is_cut_to_its_head_not_dropped() -> None:
    """A save names the request's whole prefix: one larger than ``kvdock.save_buffer_mb`` (2048
    tokens of an 8B model by default) must still store the head that fits, or long prompts are
    never cached at all."""

    class Recording(_Fake):
        def __init__(self) -> None:
            super().__init__()
            self.copied: list[list[int]] = []
            self.saved: list[tuple[str, list[int]]] = []

        def copy_out(self, block_ids: list[int], mark: Any) -> torch.Tensor:
            self.copied.append(list(block_ids))
            return super().copy_out(block_ids, mark)

        def store(self, spec: SaveSpec, staged: torch.Tensor) -> int:
            self.saved.append((spec.req_id, list(spec.tokens)))
            return super().store(spec, staged)

    w = Recording()
    t = Transfers(w, 100 * BPT, BPT)  # room for 100 tokens: three blocks of 32
    try:
        assert t.save(SaveSpec("long", list(range(32 * 8)), list(range(10, 18)), ""))
        assert t.drain(30)
        assert w.copied == [[10, 11, 12]] and w.saved == [("long", list(range(96)))]
        assert t.take_stats()["saves_dropped"] == 1  # (cut: counted, so the buffer can be sized)
        w.store_gate.clear()
        assert t.save(SaveSpec("a", list(range(64)), [1, 2], ""))  # 64 of the 100 tokens
        assert t.save(SaveSpec("b", list(range(64)), [3, 4], ""))  # 36 left: one block of it
        assert not t.save(SaveSpec("c", list(range(64)), [5, 6], ""))  # 4 left: no block fits
        w.store_gate.set()
        assert t.drain(30)
        assert w.copied[1:] == [[1, 2], [3]]
        assert w.saved[1:] == [("a", list(range(64))), ("b", list(range(32)))]
    finally:
        t.shutdown()


def test_a_step_with_a_forward_pass_is_never_taken_for_idle_by_either_model_runner() -> None:
    """vLLM's V2 model runner (the default on GPUs) calls start_load_kv outside the forward
    context (a fresh one without attention metadata) and passes the batch as keyword arguments:
    such a step runs requests, and get_finished must not wait there for background transfers."""
    from kvdock.integrations.vllm import KvdockConnector, KvdockMetadata

    class Worker:
        def __init__(self) -> None:
            self.idle: list[bool] = []

        def load(self, meta: Any, idle: bool = False) -> None:
            self.idle.append(idle)

    conn = object.__new__(KvdockConnector)
    worker = Worker()
    conn._worker = worker  # type: ignore[assignment]
    conn._scheduler = None
    conn._connector_metadata = KvdockMetadata()
    no_meta = SimpleNamespace(attn_metadata=None)
    conn.start_load_kv(SimpleNamespace(attn_metadata={"l0": object()}))  # V1, a forward pass
    conn.start_load_kv(no_meta)  # V1, kv_connector_no_forward
    conn.start_load_kv(no_meta, scheduler_output=object(), request_ids=["a"], num_tokens=8)  # V2 forward
    conn.start_load_kv(no_meta, num_tokens=8, request_ids=["a"], attn_metadata={"l0": 1})  # V2 full graph
    conn.start_load_kv(no_meta)  # V2 no_forward: no batch
    assert worker.idle == [False, True, False, False, True]


def test_unregister_kv_caches_waits_for_copies_and_background_loads_in_flight() -> None:
    """Newer vLLMs release the KV caches after unregister_kv_caches (sleep mode): no copy-out or
    background load may still touch them; a store (reads staging only) is not waited for."""
    from kvdock.integrations.vllm import KvdockConnector

    w = _Fake()
    t = Transfers(w, 1 << 20, BPT)
    conn = object.__new__(KvdockConnector)
    conn._worker = SimpleNamespace(transfers=t)  # type: ignore[assignment]
    try:
        w.copy_gate.clear()
        assert t.save(SaveSpec("a", list(range(64)), [1, 2], ""))
        assert w.copying.wait(30)
        done = threading.Event()
        threading.Thread(target=lambda: (conn.unregister_kv_caches(), done.set())).start()
        time.sleep(0.2)
        assert not done.is_set(), "unregister_kv_caches returned while a copy read the pages"
        w.store_gate.clear()  # the store that follows hangs: not waited for
        w.copy_gate.set()
        assert done.wait(30)
        assert t.settle(0.0)
        w.store_gate.set()
    finally:
        t.shutdown()


def test_a_load_that_raises_midway_still_waits_for_its_uploads_before_reporting() -> None:
    """On a GPU the network thread uploads on a side stream; a load that raises midway reports
    its blocks failed and vLLM recomputes them at once: its uploads in flight must be complete
    first, or they would land over the recomputed KV."""
    from kvdock.integrations.vllm.staging import DeviceBridge
    from kvdock.integrations.vllm.worker import WorkerSide
    from kvdock.sharding import Placement

    class Bridge(DeviceBridge):
        synced = 0

        def synchronize(self) -> None:
            Bridge.synced += 1
            super().synchronize()

    class Link:
        def run(self, what: str, fn: Any, miss: Any) -> Any:
            raise RuntimeError("a scatter failed midway")

    ws = object.__new__(WorkerSide)
    ws.block_size, ws.bytes_per_token, ws._faults, ws._load_stream = 32, BPT, set(), None
    ws.recent_loads, ws.group_of, ws.groups = deque(maxlen=4), [], None
    ws.link = Link()  # type: ignore[assignment]
    ws.codec = SimpleNamespace(geometry=SimpleNamespace(global_rank=0))  # type: ignore[assignment]
    ws.placement = Placement(None, None, True)
    ws.bridge = Bridge(torch.device("cpu"), (2, 2, 64, 8), torch.float32)
    ws._connected = lambda strict=False: object()  # type: ignore[method-assign]
    failed, nbytes = ws.fetch(LoadSpec("r", list(range(128)), [7, 8, 9, 10], 64, 128, "", (), True))
    assert (failed, nbytes) == ({9, 10}, 0)
    assert Bridge.synced == 1

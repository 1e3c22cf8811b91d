"""Review of the connector's SupportsHMA change (issue 30; integrations/vllm/groups.py, hybrid.py and
their users): regressions for what a fresh reviewer found.

* A failed load of a layout with a sliding-window group reported block by block (one window group:
  vLLM accepts block ids there) is recomputed from the first failed block, whose window lies in the
  null blocks vLLM padded the table with: attention over no KV, and that KV saved. Such a load's
  failure is now the request's (``failed_recving``: vLLM recomputes it from the start), and
  foreground loads (whose failures are only block-wise) are refused with a sliding-window group.
* A background load of several groups that failed was never counted over: the worker believed a
  load in flight for ever (each step without a forward pass waited 50 ms; ``unregister_kv_caches``
  its whole bound).
* The fingerprint of a group layout named each group's layers, which differ between pipeline
  stages (each stage's config names its own): the stages registered different fingerprints under
  one name, so the second stage was refused.
* The load statistics counted every layer of a loaded block, also the window's layers that have no
  block there.
* Hardening: a plan whose group layout is not the worker's is refused (never one group's block ids
  for another's layers); decode / prefill context parallelism is refused at start.
"""

from __future__ import annotations

import time
from collections import deque
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec

from kvdock.errors import UnsupportedLayoutError
from kvdock.integrations.vllm import check_context_parallel, check_kv_cache_groups
from kvdock.integrations.vllm.groups import NULL_BLOCK, fingerprint_with, map_groups
from kvdock.integrations.vllm.plan import KvdockMetadata, LoadSpec, SaveSpec
from kvdock.integrations.vllm.transfers import Transfers
from kvdock.integrations.vllm.worker import WorkerSide

BS = 32
BPT = 100


def _full() -> FullAttentionSpec:
    return FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=32, dtype=torch.float32)


def _window(window: int = 64) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=BS, num_kv_heads=2, head_size=32, dtype=torch.float32, sliding_window=window)


def _config(names: list[str], *specs: Any) -> Any:
    return SimpleNamespace(kv_cache_groups=[KVCacheGroupSpec([n], s) for n, s in zip(names, specs, strict=True)])


class _Failing:
    """A worker whose background loads all fail (the planned blocks come back unfilled)."""

    hybrid = None

    def mark(self) -> None:
        return None

    def fetch(self, spec: LoadSpec) -> tuple[set[int], int]:
        bs = len(spec.tokens) // len(spec.block_ids)
        return set(spec.block_ids[spec.start // bs : spec.end // bs]) - {NULL_BLOCK}, 0


def _until(cond: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_a_failed_background_load_of_a_window_group_fails_the_request_never_its_blocks() -> None:
    """One sliding-window group (every layer windowed, window 64): a load of 192 tokens has real
    blocks only for tokens 128..191 (4 and 5), the rest is the null block. Reported block-wise,
    vLLM would recompute from token 128 with the window's KV before it gone."""
    t = Transfers(_Failing(), 1 << 20, BPT)
    try:
        ids = [NULL_BLOCK, NULL_BLOCK, NULL_BLOCK, NULL_BLOCK, 4, 5]
        t.load(LoadSpec("r", list(range(192)), ids, 0, 192, "", (), True, (ids,)))
        _until(lambda: t.drain(0.01))
        _, recved, errors = t.finished()
        assert errors == set() and recved == set()  # no block ids: vLLM would rewind to block 4
        assert t.take_failed() == {"r"}  # the request: recomputed from its start
        assert t.take_stats()["loaded_tokens"] == 0
    finally:
        t.shutdown()


def test_a_failed_background_load_of_several_groups_is_over() -> None:
    t = Transfers(_Failing(), 1 << 20, BPT)
    try:
        groups = ([NULL_BLOCK, NULL_BLOCK, 12, 13], [20, 21, 22, 23])
        t.load(LoadSpec("r", list(range(128)), [20, 21, 22, 23], 0, 128, "", (), True, groups))
        _until(lambda: t.drain(0.01))
        assert t.take_failed() == {"r"}
        # nothing reads or writes vLLM's pages any more: settled at once, and a step without a
        # forward pass does not wait for a load in flight
        assert t.settle(0.5)
        start = time.monotonic()
        t.wait_loaded(5.0)
        assert time.monotonic() - start < 2.0
    finally:
        t.shutdown()


def test_foreground_loads_are_refused_with_any_sliding_window_group() -> None:
    with pytest.raises(UnsupportedLayoutError, match=r"sliding-window KV cache group.*kvdock.load_async=true"):
        check_kv_cache_groups(_config(["a"], _window()), BS, load_async=False)
    assert check_kv_cache_groups(_config(["a"], _window()), BS, load_async=True) is not None
    assert check_kv_cache_groups(_config(["a"], _full()), BS, load_async=False) is not None  # as before


def test_every_pipeline_stage_has_the_fingerprint_of_the_group_layout() -> None:
    """Stage 0 of a PP2 engine has layers 0, 1 in its groups, stage 1 layers 2, 3 (the scheduler's
    config is stage 0's): one fingerprint, which still tells another window apart."""
    stage0 = map_groups(_config(["model.layers.0.attn", "model.layers.1.attn"], _window(), _full()), BS)
    stage1 = map_groups(_config(["model.layers.2.attn", "model.layers.3.attn"], _window(), _full()), BS)
    other = map_groups(_config(["model.layers.0.attn", "model.layers.1.attn"], _window(128), _full()), BS)
    assert fingerprint_with("fp", stage0) == fingerprint_with("fp", stage1)
    assert fingerprint_with("fp", other) != fingerprint_with("fp", stage0) != "fp"


class _Link:
    def __init__(self, hit: int) -> None:
        self.hit = hit

    def run(self, name: str, fn: Any, default: Any) -> Any:
        return self.hit  # (the retrieve itself is the SDK's; here: it filled up to ``hit``)


def _worker(hit: int, group_of: list[int]) -> WorkerSide:
    w = WorkerSide.__new__(WorkerSide)
    w.groups = map_groups(_config(["a", "b"], _window(), _full()), BS) if group_of else None
    w.block_size = BS
    w.recent_loads = deque()
    w.group_of = group_of
    w._faults = set()
    w.link = _Link(hit)  # type: ignore[assignment]
    w.codec = SimpleNamespace(geometry=SimpleNamespace(global_rank=0))  # type: ignore[assignment]
    w._connected = lambda strict=False: object()  # type: ignore[method-assign]
    w.placement = SimpleNamespace(dims=None)  # type: ignore[assignment]
    w._load_stream = None
    w.bridge = None
    w.bytes_per_token = 4 * BPT  # four layers of BPT bytes per token
    return w


def test_the_load_bytes_count_only_the_blocks_each_layer_keeps() -> None:
    """Four layers, 0 and 2 sliding-window (group 0, window 64), 1 and 3 full attention: a load of
    192 tokens fills 6 blocks of layers 1, 3 and 2 blocks (4, 5) of layers 0, 2."""
    window = [NULL_BLOCK] * 4 + [14, 15]
    full = [20, 21, 22, 23, 24, 25]
    spec = LoadSpec("r", list(range(192)), full, 0, 192, "", (), True, (window, full))
    failed, nbytes = _worker(192, [0, 1, 0, 1]).fetch(spec)
    assert failed == set()
    assert nbytes == (2 * 6 + 2 * 2) * BS * BPT  # not 4 layers * 192 tokens
    # one full-attention group (no groups in the spec): every layer of every block, as before
    plain = LoadSpec("r", list(range(192)), full, 64, 192, "", (), True)
    assert _worker(192, []).fetch(plain) == (set(), 128 * 4 * BPT)


def test_loaded_tokens_are_tokens_whatever_the_group_layout() -> None:
    class _Fills(_Failing):
        def fetch(self, spec: LoadSpec) -> tuple[set[int], int]:
            return set(), 12345  # bytes of a window layout are not tokens * bytes per token

    t = Transfers(_Fills(), 1 << 20, BPT)
    try:
        ids = [NULL_BLOCK, NULL_BLOCK, 2, 3]
        t.load(LoadSpec("r", list(range(128)), ids, 0, 128, "", (), True, (ids,)))
        _until(lambda: t.drain(0.01))
        stats = t.take_stats()
        assert stats["loaded_tokens"] == 128 and stats["load_bytes"] == 12345
        assert t.finished()[1] == {"r"}
    finally:
        t.shutdown()


@pytest.mark.parametrize("kind", ["mistral", "gemma2"])
def test_a_window_models_load_that_fails_is_recomputed_from_the_start(tmp_path: Path, kind: str) -> None:
    """Real engines: an all-sliding-window model (tiny Mistral, window 64: one group) and a Gemma2
    with interleaved windows (two groups). kvdock's lookups find the prompt, its retrieves find
    nothing. Block-wise (the Mistral before the fix), vLLM recomputed from token 128 over a window
    of null blocks: other tokens than a plain engine's. Now the whole request is recomputed: the
    same tokens; and the engine goes on (the failed load is over: the next prompt runs)."""
    from engines import TINY, Engine, make_tiny_gemma2_model
    from transformers import MistralConfig, MistralForCausalLM

    import kvdock.sdk as kvd
    from kvdock.server.state import FAULT_RETRIEVE_MISS_ENV
    from kvdock.testing import start_server

    torch.manual_seed(0)
    path = tmp_path / kind
    if kind == "mistral":
        config = MistralConfig(**{**TINY, "sliding_window": 64}, torch_dtype="float32")
        MistralForCausalLM(config).eval().save_pretrained(path)
    else:
        make_tiny_gemma2_model(path, layers=4, embed_scale=0.03)
    srv = start_server(
        "--no-disk", chunk_size=64, l1_size="64MiB", log_path=tmp_path / "s.log", env={FAULT_RETRIEVE_MISS_ENV: "1"}
    )
    extra = {"kvdock.url": srv.url, "kvdock.http_url": srv.http_url, "kvdock.model_name": "m"}
    p = [(i * 37) % 500 + 1 for i in range(200)]
    q = [(i * 41) % 500 + 3 for i in range(200)]
    try:
        with Engine(path, "float32", extra, tmp_path / "e.log") as engine:
            first = engine.call(op="generate", prompts=[p], max_tokens=8)  # (a miss: a plain engine's tokens)
            assert first["cached"] == [0]
            with kvd.connect(srv.url, srv.http_url, "m") as ctx:
                assert kvd.lookup(ctx, p) == 192
            assert engine.call(op="reset_prefix_cache")["ok"]
            again = engine.call(op="generate", prompts=[p], max_tokens=8)
            assert again["outputs"] == first["outputs"]
            assert again["cached"] == [0]  # recomputed from the start, not from token 128
            assert len(engine.call(op="generate", prompts=[q], max_tokens=8)["outputs"][0]) == 8
    finally:
        srv.stop()


def test_a_plan_whose_group_layout_is_not_the_workers_never_moves_kv() -> None:
    """The scheduler and the workers map vLLM's groups from their own configs: should they ever
    differ, a load or save naming one layout is refused by a worker of the other (each layer
    would be moved through another group's block ids), never run."""
    window = [NULL_BLOCK] * 4 + [14, 15]
    full = [20, 21, 22, 23, 24, 25]
    flat = LoadSpec("r", list(range(192)), full, 0, 192, "", (), True)  # (no groups: one group's ids)
    assert _worker(192, [0, 1, 0, 1]).fetch(flat) == (set(full), 0)  # all failed: vLLM recomputes
    grouped = LoadSpec("r", list(range(192)), full, 0, 192, "", (), True, (window, full))
    assert _worker(192, []).fetch(grouped)[1] == 0

    class _Queue:
        def __init__(self) -> None:
            self.saves: list[str] = []

        def save(self, spec: Any) -> bool:
            self.saves.append(spec.req_id)
            return True

    for w, spec in (
        (_worker(0, [0, 1, 0, 1]), SaveSpec("flat", list(range(64)), [20, 21], "")),
        (_worker(0, []), SaveSpec("grouped", list(range(64)), [20, 21], "", groups=([14, 15], [20, 21]))),
    ):
        w.transfers = _Queue()  # type: ignore[assignment]
        w.off, w._poisoned, w._loaded_now, w.recent = False, {}, set(), deque()
        w.codec = SimpleNamespace(geometry=SimpleNamespace(pp_size=1))  # type: ignore[assignment]
        w.save(KvdockMetadata(saves=[spec]))
        assert w.transfers.saves == []  # type: ignore[attr-defined]
    ok = _worker(0, [])
    ok.transfers = _Queue()  # type: ignore[assignment]
    ok.off, ok._poisoned, ok._loaded_now, ok.recent = False, {}, set(), deque()
    ok.codec = SimpleNamespace(geometry=SimpleNamespace(pp_size=1))  # type: ignore[assignment]
    ok.save(KvdockMetadata(saves=[SaveSpec("plain", list(range(64)), [20, 21], "")]))
    assert ok.transfers.saves == ["plain"]  # type: ignore[attr-defined]


def test_a_pp2_engine_of_a_hybrid_model_starts_saves_and_loads(tmp_path: Path) -> None:
    """A Gemma2 (sliding-window and full-attention layers interleaved) in two pipeline stages:
    each stage's KV cache config names its own layers; both register one fingerprint, store their
    layers of each chunk, and a repeat loads them with a plain engine's tokens."""
    from engines import Engine, make_tiny_gemma2_model

    import kvdock.sdk as kvd
    from kvdock.testing import start_server

    model = make_tiny_gemma2_model(tmp_path / "gemma2", layers=4, embed_scale=0.03)
    srv = start_server("--no-disk", chunk_size=64, l1_size="64MiB", log_path=tmp_path / "s.log")
    extra = {"kvdock.url": srv.url, "kvdock.http_url": srv.http_url, "kvdock.model_name": "g-pp"}
    pp = {"pipeline_parallel_size": 2, "enforce_eager": False, "compilation_config": {"mode": 2, "backend": "eager"}}
    p = [(i * 37) % 500 + 1 for i in range(200)]
    try:
        with Engine(model, "float32", extra, tmp_path / "e.log", **pp) as e:
            assert e.call(op="kv_cache")["hybrid"] is True
            fresh = e.call(op="generate", prompts=[p], max_tokens=8)
            with kvd.connect(srv.url, srv.http_url, "g-pp", timeout=30) as whole:
                assert whole.shards == 2 and kvd.lookup(whole, p) == 192
            assert e.call(op="reset_prefix_cache")["ok"]
            loaded = e.call(op="generate", prompts=[p], max_tokens=8)
            assert loaded["cached"] == [192] and loaded["outputs"] == fresh["outputs"]
    finally:
        srv.stop()


def test_context_parallelism_is_refused_at_start() -> None:
    """With decode (or prefill) context parallelism a rank's pages hold every n-th token of a block:
    its blocks are not a kvdock chunk's tokens, so the engine does not start with kvdock."""
    check_context_parallel(SimpleNamespace(decode_context_parallel_size=1, prefill_context_parallel_size=1))
    check_context_parallel(SimpleNamespace())  # (older vLLMs: neither field)
    dcp = r"decode_context_parallel_size=2, prefill_context_parallel_size=1\)"
    with pytest.raises(UnsupportedLayoutError, match=dcp):
        check_context_parallel(SimpleNamespace(decode_context_parallel_size=2, prefill_context_parallel_size=1))
    with pytest.raises(UnsupportedLayoutError, match=r"prefill_context_parallel_size=2"):
        check_context_parallel(SimpleNamespace(decode_context_parallel_size=1, prefill_context_parallel_size=2))

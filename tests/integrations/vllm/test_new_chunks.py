"""Saves copy only the chunks that are new since the request's last save (issue 30: a save names
the request's whole prefix, and copying all of it each step was quadratic under chunked prefill),
and a gap in what kvdock holds (a save dropped, cut, cancelled, an earlier store that failed, a
chunk evicted) never leaves orphan chunks: the store writes nothing and the request's next save
copies from the gap."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from engines import CHUNK, Engine, make_tiny_model

import kvdock.sdk as kvd
from kvdock.errors import PrefixMissingError
from kvdock.integrations.vllm.plan import LoadSpec, SaveSpec
from kvdock.integrations.vllm.sources import _Staged
from kvdock.integrations.vllm.transfers import Transfers
from kvdock.testing import ServerProcess

BPT = 100  # bytes per token of the fake model
MODEL = "tiny-vllm-new-chunks"


class Fake:
    """A worker that records each copy-out's blocks and each store's ``first``; ``missing`` makes
    the next stores raise PrefixMissingError at that token (kvdock lacks that chunk)."""

    def __init__(self) -> None:
        self.store_gate = threading.Event()
        self.store_gate.set()
        self.copied: list[list[int]] = []
        self.stored: list[tuple[int, int]] = []  # (first, end) of each store that wrote
        self.missing: int | None = None

    def mark(self) -> None:
        return None

    def copy_out(self, block_ids: list[int], mark: Any) -> torch.Tensor:
        self.copied.append(list(block_ids))
        return torch.tensor(block_ids)

    def store(self, spec: SaveSpec, staged: torch.Tensor) -> int:
        assert self.store_gate.wait(30)
        assert staged.tolist() == spec.block_ids[spec.first // 32 :]  # exactly the blocks from first on
        if self.missing is not None and self.missing < spec.first:
            at, self.missing = self.missing, None
            err = PrefixMissingError("chunk missing")
            err.at = at  # type: ignore[attr-defined]
            raise err
        self.stored.append((spec.first, len(spec.tokens)))
        return (len(spec.tokens) - spec.first) * BPT

    def fetch(self, spec: LoadSpec) -> tuple[set[int], int]:
        return set(), 0


def save(rid: str, nblocks: int, first: int) -> SaveSpec:
    """A save of the request's first ``nblocks`` blocks (ids 100.., 32 tokens each)."""
    return SaveSpec(rid, list(range(32 * nblocks)), list(range(100, 100 + nblocks)), "", first=first)


def drained(t: Transfers) -> Transfers:
    assert t.drain(30)
    return t


def test_each_save_of_a_request_copies_only_its_new_blocks() -> None:
    w = Fake()
    t = Transfers(w, budget_bytes=1 << 20, bytes_per_token=BPT)
    for n in (2, 4, 6):  # chunked prefill: 64 more tokens computed each step
        assert t.save(save("r", n, first=32 * (n - 2)))
        drained(t)
    assert w.copied == [[100, 101], [102, 103], [104, 105]]
    assert w.stored == [(0, 64), (64, 128), (128, 192)]
    stats = t.take_stats()
    assert stats["copy_bytes"] == 192 * BPT == t.copied_bytes and stats["save_bytes"] == 192 * BPT
    # another request's first save starts where the scheduler says (its load ended there)
    assert t.save(save("loaded", 4, first=64))
    assert drained(t) and w.copied[-1] == [102, 103]
    t.shutdown()


def test_a_dropped_or_cut_save_makes_the_next_copy_start_at_the_gap() -> None:
    w = Fake()
    w.store_gate.clear()  # the first store holds its staging
    t = Transfers(w, budget_bytes=64 * BPT, bytes_per_token=BPT)  # room for two blocks
    assert t.save(save("r", 2, first=0))
    assert not t.save(save("r", 4, first=64))  # staging full: dropped (blocks 2, 3 never copied)
    w.store_gate.set()
    drained(t)
    # the scheduler believes 128 tokens are held; this worker staged only 64: copy from there,
    # cut to what fits (two blocks), and the next save goes on from the cut
    assert t.save(save("r", 6, first=128))
    drained(t)
    assert t.save(save("r", 8, first=192))
    drained(t)
    assert w.copied == [[100, 101], [102, 103], [104, 105]]
    assert w.stored == [(0, 64), (64, 128), (128, 192)]
    assert t.take_stats()["saves_dropped"] == 3  # the drop and both cuts
    t.shutdown()


def test_a_store_that_finds_a_chunk_missing_makes_the_next_save_copy_from_that_chunk() -> None:
    w = Fake()
    t = Transfers(w, budget_bytes=1 << 20, bytes_per_token=BPT)
    assert t.save(save("r", 2, first=0))
    drained(t)
    w.missing = 0  # chunk 0 evicted meanwhile: the store of [64, 128) writes nothing
    assert t.save(save("r", 4, first=64))
    drained(t)
    assert t.save(save("r", 6, first=128))
    drained(t)
    assert w.copied == [[100, 101], [102, 103], [100, 101, 102, 103, 104, 105]]
    assert w.stored == [(0, 64), (0, 192)]
    t.shutdown()


def test_a_preempted_request_saves_from_its_start_after_resuming() -> None:
    w = Fake()
    t = Transfers(w, budget_bytes=1 << 20, bytes_per_token=BPT)
    assert t.save(save("r", 2, first=0))
    drained(t)
    t.preempt({"r"})  # (its copies in flight or queued may have been dropped)
    assert t.save(save("r", 4, first=64))
    drained(t)
    t.forget({"r"})  # finished: forgotten
    assert w.copied == [[100, 101], [100, 101, 102, 103]]
    t.shutdown()


# -- the staged source against a real kvdock server ----------------------------------------------


@pytest.fixture(scope="module")
def sdk(server: ServerProcess) -> Iterator[kvd.KVCacheContext]:
    kvd.register_model(server.url, server.http_url, MODEL, num_layers=2, num_kv_heads=2, head_dim=32, dtype="float32")
    with kvd.connect(server.url, server.http_url, MODEL, timeout=30) as ctx:
        yield ctx


def test_a_staged_save_missing_an_earlier_chunk_stores_nothing_not_an_orphan(sdk: kvd.KVCacheContext) -> None:
    toks = [random.Random(1).randrange(512) for _ in range(3 * CHUNK)]
    kv = torch.randn(2, 2, 3 * CHUNK, 64)
    # staged from chunk 1 on; kvdock lacks chunk 0
    with pytest.raises(PrefixMissingError) as err:
        kvd.store_from(sdk, _Staged(kv[:, :, CHUNK:].clone(), CHUNK, CHUNK), toks, conflict_wait_s=0.0)
    assert err.value.at == 0  # type: ignore[attr-defined]
    assert kvd.lookup(sdk, toks) == 0
    # chunk 0 alone (the engine's own KV: edited=False): chunks 1, 2 were not left behind
    kvd.store(sdk, kv[:, :, :CHUNK], toks[:CHUNK], edited=False)
    assert kvd.lookup(sdk, toks) == CHUNK
    # now the chain is intact: the staged chunks 1, 2 are stored, and the prefix reads back whole
    res = kvd.store_from(sdk, _Staged(kv[:, :, CHUNK:].clone(), CHUNK, CHUNK), toks, conflict_wait_s=0.0)
    assert (res.stored_chunks, res.deduped_chunks) == (2, 1)
    back = kvd.retrieve(sdk, toks)
    assert back is not None and torch.equal(back, kv)


# -- a real vLLM engine under chunked prefill --------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


def test_chunked_prefill_copies_each_chunk_once_and_a_repeat_hits_the_whole_prefix(
    server: ServerProcess, model_dir: Path, tmp_path: Path
) -> None:
    extra = {"kvdock.url": server.url, "kvdock.http_url": server.http_url, "kvdock.model_name": "tiny-chunked"}
    llm = {"max_num_batched_tokens": CHUNK, "enable_chunked_prefill": True, "max_model_len": 1024}
    p = [random.Random(7).randrange(512) for _ in range(10 * CHUNK + 10)]
    bytes_per_token = 2 * 2 * 64 * 4  # K and V, 2 layers, 2 heads x 32, float32
    with Engine(model_dir, "float32", extra, tmp_path / "engine.log", **llm) as engine:
        first = engine.call(op="generate", prompts=[p], max_tokens=8)
        assert first["cached"] == [0]
        # ten steps of 64 prompt tokens, ten saves: each chunk copied once (the whole prefix each
        # time would be 64 * (1 + 2 + ... + 10) = 3520 tokens)
        assert engine.call(op="copied") == {"bytes": 10 * CHUNK * bytes_per_token, "copies": 10}
        with kvd.connect(server.url, server.http_url, "tiny-chunked", timeout=30) as ctx:
            assert kvd.lookup(ctx, p) == 10 * CHUNK
        assert engine.call(op="reset_prefix_cache")["ok"]
        start = time.monotonic()
        again = engine.call(op="generate", prompts=[p], max_tokens=8)
        assert time.monotonic() - start < 300
        assert again["cached"] == [10 * CHUNK]  # the whole prefix from kvdock
        assert again["outputs"] == first["outputs"]
        assert engine.call(op="copied") == {"bytes": 10 * CHUNK * bytes_per_token, "copies": 10}  # nothing new

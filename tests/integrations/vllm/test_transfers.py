"""The worker's background transfers against a fake worker whose copies and stores block on
demand: a step's calls never wait for the network, staging is bounded (drops are counted), a
finished request's blocks are reported only once no copy reads them, a preempted request's copies
are finished or dropped before the call returns, and a background load's failed blocks are
reported with it."""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from kvdock.codecs import CodecKey, codec_for
from kvdock.integrations.vllm.plan import LoadSpec, SaveSpec
from kvdock.integrations.vllm.staging import DeviceCopyOut, HostCopyOut
from kvdock.integrations.vllm.transfers import Transfers
from kvdock.layout import KVGeometry

BPT = 100  # bytes per token of the fake model


class Fake:
    """A worker whose copy-outs wait for ``copy_gate`` and stores for ``store_gate``."""

    def __init__(self) -> None:
        self.copy_gate = threading.Event()
        self.store_gate = threading.Event()
        self.copy_gate.set()
        self.store_gate.set()
        self.copying = threading.Event()  # a copy-out has started
        self.copied: list[list[int]] = []
        self.stored: list[str] = []
        self.order: list[str] = []
        self.fail: set[int] = set()

    def mark(self) -> None:
        return None

    def copy_out(self, block_ids: list[int], mark: Any) -> torch.Tensor:
        self.copying.set()
        assert self.copy_gate.wait(30)
        self.copied.append(list(block_ids))
        return torch.tensor(block_ids)

    def store(self, spec: SaveSpec, staged: torch.Tensor) -> int:
        assert self.store_gate.wait(30)
        self.stored.append(spec.req_id)
        self.order.append("store " + spec.req_id)
        return len(spec.tokens) * BPT

    def fetch(self, spec: LoadSpec) -> tuple[set[int], int]:
        self.order.append("load " + spec.req_id)
        bad = self.fail.intersection(spec.block_ids)
        return bad, (len(spec.block_ids) - len(bad)) * 32 * BPT


def save(rid: str, blocks: list[int]) -> SaveSpec:
    return SaveSpec(rid, list(range(32 * len(blocks))), blocks, "")


def load(rid: str, blocks: list[int], is_async: bool = True) -> LoadSpec:
    return LoadSpec(rid, list(range(32 * len(blocks))), blocks, 0, 32 * len(blocks), "", (), is_async)


def until(cond: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_a_stuck_server_never_blocks_a_save_and_staging_is_bounded() -> None:
    w = Fake()
    w.store_gate.clear()  # the server does not answer
    t = Transfers(w, budget_bytes=3 * 64 * BPT, bytes_per_token=BPT)  # three saves of 2 blocks
    start = time.monotonic()
    accepted = [t.save(save(f"r{i}", [2 * i, 2 * i + 1])) for i in range(5)]
    assert time.monotonic() - start < 1.0  # never waited for the store
    # the first store is stuck in the network thread; its staging stays reserved, like the next two
    assert accepted == [True, True, True, False, False]
    stats = t.take_stats()
    assert stats["saves_dropped"] == 2 and stats["saves"] == 0
    until(lambda: len(w.copied) == 3)  # copied out although nothing could be stored
    t.delay({"r0"})  # the copy is done: reported at once, the blocks may be reused
    assert t.finished() == ({"r0"}, set(), set())
    w.store_gate.set()
    assert t.drain(30)
    assert w.stored == ["r0", "r1", "r2"]
    assert t.save(save("r5", [10, 11]))  # room again
    assert t.drain(30) and w.stored[-1] == "r5"
    stats = t.take_stats()
    assert stats["saves"] == 4 and stats["save_bytes"] == 4 * 64 * BPT and stats["saved_tokens"] == 4 * 64
    t.shutdown()


def test_a_finished_request_is_reported_only_once_its_blocks_are_copied_out() -> None:
    w = Fake()
    w.copy_gate.clear()
    t = Transfers(w, budget_bytes=1 << 20, bytes_per_token=BPT)
    assert t.save(save("a", [1, 2]))
    until(w.copying.is_set)
    t.delay({"a", "b"})  # "b" has no save in flight: its blocks are free at once
    assert t.finished() == ({"b"}, set(), set())
    assert t.finished() == (set(), set(), set())  # each reported once; "a" is still being read
    w.copy_gate.set()
    until(lambda: w.copied == [[1, 2]])
    until(lambda: t.finished()[0] == {"a"})
    t.shutdown()


def test_a_preempted_request_copies_finish_or_are_dropped_before_preempt_returns() -> None:
    w = Fake()
    w.copy_gate.clear()
    t = Transfers(w, budget_bytes=1 << 20, bytes_per_token=BPT)
    assert t.save(save("p", [1, 2]))  # being copied when the preemption comes
    until(w.copying.is_set)
    assert t.save(save("p", [3, 4]))  # queued behind it: never copied
    assert t.save(save("q", [5, 6]))
    done = threading.Event()
    th = threading.Thread(target=lambda: (t.preempt({"p"}), done.set()))
    th.start()
    time.sleep(0.2)
    assert not done.is_set()  # waits for the copy in flight (a memory copy, never the network)
    w.copy_gate.set()
    assert done.wait(30)
    th.join()
    assert t.drain(30)
    assert w.copied == [[1, 2], [5, 6]]
    assert w.stored == ["q"]  # what was read of a preempted request's blocks is never stored
    t.shutdown()


def test_a_background_load_is_reported_with_its_failed_blocks_and_foreground_loads_go_first() -> None:
    w = Fake()
    w.fail = {7}
    w.store_gate.clear()
    t = Transfers(w, budget_bytes=1 << 20, bytes_per_token=BPT)
    assert t.save(save("s", [1, 2]))
    until(lambda: w.copied)  # its store now holds the network thread
    assert t.save(save("s2", [3, 4]))
    until(lambda: len(w.copied) == 2)
    t.load(load("bg", [6, 7, 8]))
    got: list[list[set[int]]] = []
    th = threading.Thread(target=lambda: got.append(t.load_now([load("fg", [9, 10], is_async=False)])))
    th.start()
    time.sleep(0.1)
    w.store_gate.set()
    th.join(30)
    assert got == [[set()]]
    assert t.drain(30)
    # the foreground load went before the background one, and both before the queued store
    assert w.order == ["store s", "load fg", "load bg", "store s2"]
    assert t.finished() == (set(), {"bg"}, {7})
    stats = t.take_stats()
    assert stats["loads"] == 2 and stats["load_errors"] == 1 and stats["loaded_tokens"] == 4 * 32
    t.shutdown()


def test_the_device_copy_out_moves_the_same_bytes_as_the_host_one() -> None:
    """DeviceCopyOut's steps (device gather, download, wait) on a CPU stand-in: the bytes the host
    path copies out of real paged tensors."""
    g = KVGeometry(2, 2, 32, "float32")
    pages = [torch.randn(10, 2, 32, 64) for _ in range(2)]
    codec = codec_for(CodecKey("vllm", "FLASH_ATTN", "LBHNC"), pages, g, 32)
    shape = g.chunk_shape(96)
    host = HostCopyOut(codec).copy_out([4, 1, 7], None, shape)
    dev = DeviceCopyOut(codec, torch.device("cpu"))
    assert dev.mark() is None
    out = dev.copy_out([4, 1, 7], None, shape)
    assert torch.equal(out, host) and out.shape == shape
    # block 1 of layer 0's keys: tokens 32..64 of the copy
    want = pages[0][1, :, :, :32].transpose(0, 1).reshape(32, 64)
    assert torch.equal(host[0, 0, 32:64], want)


def test_the_device_copy_out_gathers_through_one_bounded_scratch_in_pieces() -> None:
    """A save larger than the scratch is gathered in pieces through the same buffer, made once:
    no device allocation per save, and the bytes are the host path's (CPU stand-in)."""
    g = KVGeometry(2, 2, 32, "float32")
    pages = [torch.randn(10, 2, 32, 64) for _ in range(2)]
    codec = codec_for(CodecKey("vllm", "FLASH_ATTN", "LBHNC"), pages, g, 32)
    block_bytes = 2 * 2 * 32 * 64 * 4
    dev = DeviceCopyOut(codec, torch.device("cpu"), scratch_bytes=2 * block_bytes + 1)  # two blocks
    host = HostCopyOut(codec)
    for ids in ([4, 1, 7, 9, 0], [3], [2, 5, 6, 8, 1, 4]):
        shape = g.chunk_shape(32 * len(ids))
        assert torch.equal(dev.copy_out(ids, None, shape), host.copy_out(ids, None, shape))
    assert dev.allocations == 1 and dev._scratch is not None and dev._scratch.shape == (2, 2, 64, 64)
    tiny = DeviceCopyOut(codec, torch.device("cpu"), scratch_bytes=1)  # at least one block
    shape = g.chunk_shape(96)
    assert torch.equal(tiny.copy_out([4, 1, 7], None, shape), host.copy_out([4, 1, 7], None, shape))


def test_the_connector_stats_sum_over_workers_and_reduce_for_vllms_log() -> None:
    from kvdock.integrations.vllm import KvdockConnector
    from kvdock.integrations.vllm.stats import KvdockStats

    a = KvdockStats(data={"loads": 2, "load_bytes": 3e6, "saves_dropped": 1})
    b = KvdockConnector.build_kv_connector_stats({"loads": 1, "saved_tokens": 256, "save_s": 0.25})
    assert isinstance(b, KvdockStats) and not b.is_empty() and KvdockStats().is_empty()
    reduced = a.aggregate(b).reduce()
    assert reduced["kvdock loads"] == 3 and reduced["kvdock load MB"] == 3.0
    assert reduced["kvdock dropped saves"] == 1 and reduced["kvdock saved tokens"] == 256
    assert reduced["kvdock save s"] == 0.25
    a.reset()
    assert a.is_empty()


def test_a_step_without_a_forward_pass_waits_a_little_for_a_background_load() -> None:
    w = Fake()
    w.store_gate.clear()
    t = Transfers(w, budget_bytes=1 << 20, bytes_per_token=BPT)
    start = time.monotonic()
    t.wait_loaded(5.0)  # nothing in flight: returns at once
    assert time.monotonic() - start < 1.0
    assert t.save(save("s", [1, 2]))
    until(lambda: w.copied)  # the network thread is stuck in this store
    t.load(load("bg", [6, 7]))
    start = time.monotonic()
    t.wait_loaded(0.2)  # bounded: the load cannot run yet
    assert 0.15 < time.monotonic() - start < 5.0
    threading.Timer(0.1, w.store_gate.set).start()
    t.wait_loaded(30)
    assert t.finished() == (set(), {"bg"}, set())
    t.shutdown()

"""A hybrid model's sliding-window layers are saved without making the step wait (issue 30, the
gap R-VLLM found): on a GPU ``wait_for_save`` only enqueues their copy -- an event on the engine's
stream after the forward pass, the gather and the device -> pinned download on a side stream after
that event, the engine's stream made to wait (on the device) for the gather, so blocks vLLM frees
after the step are read before its next kernels can write them -- and the copier thread waits for
the download. Run on the CPU with stand-in streams and events that log the order of operations
(``DeviceCopyOut``'s ``cuda`` seam); on the CPU proper the window layers are copied in the step."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Any

import torch
from test_groups import BS, _config, _full, _window

from kvdock.codecs import CodecKey, PagedCodec, codec_for
from kvdock.integrations.vllm.groups import map_groups
from kvdock.integrations.vllm.hybrid import GroupCopy
from kvdock.integrations.vllm.plan import SaveSpec
from kvdock.integrations.vllm.staging import DeviceCopyOut, HostCopyOut
from kvdock.integrations.vllm.transfers import Transfers
from kvdock.layout import KVGeometry


class _Stream:
    def __init__(self, cuda: _Cuda, name: str) -> None:
        self.cuda, self.name = cuda, name

    def wait_event(self, event: _Event) -> None:
        self.cuda.log.append(("wait", self.name, event.name))


class _Event:
    def __init__(self, cuda: _Cuda, name: str) -> None:
        self.cuda, self.name = cuda, name
        self.release: threading.Event | None = None  # synchronize blocks until set (when given)

    def record(self, stream: _Stream | None = None) -> None:
        self.cuda.log.append(("record", (stream or self.cuda.current_stream()).name, self.name))

    def synchronize(self) -> None:
        self.cuda.log.append(("sync", threading.current_thread().name, self.name))
        if self.release is not None:
            assert self.release.wait(30)


class _Cuda:
    """torch.cuda's streams and events, as far as DeviceCopyOut uses them: each thread's current
    stream is "engine" until ``stream(...)`` changes it; everything is logged in order."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str, str]] = []
        self.events: list[_Event] = []
        self._local = threading.local()
        self._n = 0

    def Stream(self, device: Any = None) -> _Stream:  # (torch.cuda's name)
        self._n += 1
        return _Stream(self, f"side{self._n}")

    def Event(self) -> _Event:
        event = _Event(self, f"e{len(self.events)}")
        self.events.append(event)
        return event

    def current_stream(self, device: Any = None) -> _Stream:
        return getattr(self._local, "stream", None) or _Stream(self, "engine")

    @contextmanager
    def stream(self, s: _Stream) -> Any:
        before = getattr(self._local, "stream", None)
        self._local.stream = s
        try:
            yield
        finally:
            self._local.stream = before


def _codec(cuda: _Cuda | None) -> tuple[torch.Tensor, PagedCodec]:
    """Two layers sharing one KV tensor (as vLLM's groups do), the pages' gathers logged with the
    stream they run on."""
    shared = torch.randn(8, 2, BS, 64)
    codec = codec_for(CodecKey("vllm", "FLASH_ATTN", "LBHNC"), [shared, shared], KVGeometry(2, 2, 32, "float32"), BS)
    if cuda is not None:
        gather = codec.gather

        def logged(ids: torch.Tensor, dst: torch.Tensor, layers: Any = None) -> None:
            cuda.log.append(("gather", cuda.current_stream().name, str(ids.tolist())))
            gather(ids, dst, layers)

        codec.gather = logged  # type: ignore[method-assign]
    return shared, codec


def _copy(codec: PagedCodec, cuda: _Cuda | None) -> GroupCopy:
    mapped = map_groups(_config(_window(64), _full()), BS)
    assert mapped is not None
    copy = GroupCopy(mapped, [0, 1], codec, HostCopyOut(codec))  # layer 0: the window's; layer 1: full
    one_block = 2 * 2 * BS * 64 * 4  # (the save is gathered in pieces)
    copy.sync_copier = (
        HostCopyOut(codec) if cuda is None else DeviceCopyOut(codec, torch.device("cpu"), one_block, cuda=cuda)
    )
    return copy


SPEC = SaveSpec("r", list(range(4 * BS)), [4, 5, 6, 7], "", first=2 * BS, groups=([0, 1, 2, 3], [4, 5, 6, 7]))


def _want(shared: torch.Tensor, codec: PagedCodec) -> torch.Tensor:
    want = torch.empty(2, 2, 2 * BS, 64)
    codec.gather(torch.tensor([[2, 3], [6, 7]]), want)
    return want


def test_the_window_layers_copy_is_enqueued_after_the_forward_pass_and_the_engine_waits_on_the_device() -> None:
    cuda = _Cuda()
    shared, codec = _codec(cuda)
    want = _want(shared, codec)
    cuda.log.clear()
    copy = _copy(codec, cuda)
    staged, ready = copy.presave(SPEC)  # (model-runner thread, in wait_for_save)
    mark, read, done = (e.name for e in cuda.events)
    assert ready is cuda.events[2]
    assert cuda.log == [
        ("record", "engine", mark),  # after the forward pass, on the engine's stream
        ("wait", "side1", mark),  # the side stream starts after it
        ("gather", "side1", "[[2], [6]]"),  # the window's still-held blocks from `first`, in pieces
        ("gather", "side1", "[[3], [7]]"),
        ("record", "side1", read),  # every read of vLLM's pages is before this
        ("record", "side1", done),  # and every download into pinned staging before this
        ("wait", "engine", read),  # the next step's kernels (writing freed blocks) after the reads
    ]  # and nothing waited on this thread (no sync)
    assert torch.equal(staged[:, 0], want[:, 0])
    # the copier's part: the full-attention layer, through its own blocks
    assert copy.copy_rest(SPEC, 2, None, staged) is staged and torch.equal(staged, want)


class _Worker:
    """The worker as Transfers sees it, its GroupCopy real (stand-in streams for the window)."""

    def __init__(self, copy: GroupCopy) -> None:
        self.hybrid = copy
        self.stored: list[torch.Tensor] = []
        self.done = threading.Event()

    def mark(self) -> None:
        return None

    def copy_out(self, block_ids: list[int], mark: Any) -> torch.Tensor:
        raise AssertionError("a save of several groups goes through presave and copy_rest")

    def store(self, spec: SaveSpec, staged: torch.Tensor) -> int:
        self.stored.append(staged.clone())
        self.done.set()
        return int(staged.numel())

    def fetch(self, spec: Any) -> tuple[set[int], int]:
        return set(), 0


def test_wait_for_save_returns_before_the_window_download_and_the_copier_waits_for_it() -> None:
    cuda = _Cuda()
    shared, codec = _codec(cuda)
    want = _want(shared, codec)
    w = _Worker(_copy(codec, cuda))
    t = Transfers(w, 1 << 24, 2 * 2 * 64 * 4)
    try:
        cuda.log.clear()
        release = threading.Event()
        real = cuda.Event

        def held() -> _Event:  # the downloads' event: "still in flight" until released
            event = real()
            event.release = release
            return event

        cuda.Event = held  # type: ignore[method-assign]
        assert t.save(SPEC)  # wait_for_save: queued, returned while the download is "in flight"
        assert ("wait", "engine", cuda.events[1].name) in cuda.log  # the engine's stream holds the blocks
        assert not any(op == "sync" and who == threading.current_thread().name for op, who, _ in cuda.log)
        shared[[2, 3]] = -1.0  # vLLM reuses the window's blocks after the step: already read
        synced = ("sync", "kvdock-copy", cuda.events[2].name)  # the copier waits for the download
        for _ in range(3000):
            if synced in cuda.log:
                break
            time.sleep(0.01)
        assert synced in cuda.log and not w.done.is_set()  # nothing stored before it is done
        release.set()
        assert w.done.wait(30)
        [stored] = w.stored
        assert torch.equal(stored, want)  # the window's layer as it was, the full layer's blocks too
        assert t.drain(30)
    finally:
        release.set()
        t.shutdown()


def test_on_the_cpu_the_window_layers_are_copied_in_the_step() -> None:
    shared, codec = _codec(None)
    want = _want(shared, codec)
    copy = _copy(codec, None)
    staged, ready = copy.presave(SPEC)
    assert ready is None  # nothing for the copier to wait for
    shared[[2, 3]] = -1.0  # reused after the step: already copied
    assert torch.equal(staged[:, 0], want[:, 0])
    assert torch.equal(copy.copy_rest(SPEC, 2, None, staged), want)

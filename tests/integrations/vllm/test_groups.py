"""vLLM's KV cache groups mapped to kvdock (kvdock.integrations.vllm.groups), with vLLM's own spec
classes: what is mapped, what is refused (naming the group and why), the fingerprint of a group
layout, and the scheduler's and transfers' bookkeeping of blocks a sliding window gave back."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheGroupSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from kvdock.errors import UnsupportedLayoutError
from kvdock.integrations.vllm import check_kv_cache_groups
from kvdock.integrations.vllm.config import ConnectorConfig
from kvdock.integrations.vllm.groups import NULL_BLOCK, fingerprint_with, layer_rows, map_groups
from kvdock.integrations.vllm.plan import SaveSpec
from kvdock.integrations.vllm.scheduler import SchedulerSide, _Request
from kvdock.integrations.vllm.transfers import Transfers

BS = 32


def _config(*specs: Any) -> Any:
    return SimpleNamespace(
        kv_cache_groups=[KVCacheGroupSpec([f"model.layers.{i}.attn"], s) for i, s in enumerate(specs)]
    )


def _full(**kw: Any) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=32, dtype=torch.float32, **kw)


def _window(window: int = 64, block_size: int = BS) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=block_size, num_kv_heads=2, head_size=32, dtype=torch.float32, sliding_window=window
    )


def test_full_attention_and_sliding_window_groups_are_mapped() -> None:
    mapped = map_groups(_config(_window(), _full()), BS)
    assert mapped is not None and mapped.several and mapped.windowed and not mapped.plain
    assert [(g.layers, g.window) for g in mapped.groups] == [
        (("model.layers.0.attn",), 64),
        (("model.layers.1.attn",), 0),
    ]
    assert mapped.main == 1  # the full-attention group's ids carry the bookkeeping
    assert mapped.group_of(["model.layers.1.attn", "model.layers.0.attn"]) == [1, 0]
    # one window group alone (a model whose every layer is sliding-window) is mapped too
    alone = map_groups(_config(_window()), BS)
    assert alone is not None and not alone.several and not alone.plain
    # what was mapped before: full attention (also promoted sliding-window layers), MLA, no config
    mla = MLAAttentionSpec(block_size=BS, num_kv_heads=1, head_size=64, dtype=torch.float32)
    for spec in (_full(), _full(sliding_window=64), mla):
        plain = map_groups(_config(spec), BS)
        assert plain is not None and plain.plain
    assert map_groups(None, BS) is None


def test_groups_that_cannot_be_mapped_are_refused_naming_the_group_and_why() -> None:
    mamba = MambaSpec(block_size=BS, shapes=((4, 8),), dtypes=(torch.float32,))
    with pytest.raises(UnsupportedLayoutError, match=r"group 1 \(MambaSpec, layers \['model.layers.1.attn'\]\).*"
                       r"recurrent state per request"):  # fmt: skip
        check_kv_cache_groups(_config(_full(), mamba), BS)
    local = ChunkedLocalAttentionSpec(
        block_size=BS, num_kv_heads=2, head_size=32, dtype=torch.float32, attention_chunk_size=64
    )
    with pytest.raises(UnsupportedLayoutError, match=r"group 0 \(ChunkedLocalAttentionSpec.*chunk boundaries"):
        check_kv_cache_groups(_config(local, _full()), BS)
    with pytest.raises(UnsupportedLayoutError, match=r"group 1 \(SlidingWindowSpec.*block size 16 is not the engine's"):
        check_kv_cache_groups(_config(_full(), _window(block_size=16)), BS)
    eagle = SimpleNamespace(kv_cache_groups=[KVCacheGroupSpec(["d"], _full(), is_eagle_group=True)])
    with pytest.raises(UnsupportedLayoutError, match=r"group 0 .*EAGLE"):
        check_kv_cache_groups(eagle, BS)
    # several groups take load failures only per request, for background loads
    with pytest.raises(UnsupportedLayoutError, match=r"2 KV cache groups .*kvdock.load_async=true"):
        check_kv_cache_groups(_config(_window(), _full()), BS, load_async=False)
    assert check_kv_cache_groups(_config(_window()), BS, load_async=True) is not None  # (foreground: test_review_hma)


def test_a_group_layout_is_part_of_the_fingerprint() -> None:
    hybrid = map_groups(_config(_window(), _full()), BS)
    other = map_groups(_config(_window(128), _full()), BS)
    plain = map_groups(_config(_full()), BS)
    assert fingerprint_with("fp", None) == "fp" and fingerprint_with("fp", plain) == "fp"  # as before
    assert len({fingerprint_with("fp", hybrid), fingerprint_with("fp", other), "fp"}) == 3
    assert fingerprint_with("fp", hybrid) == fingerprint_with("fp", map_groups(_config(_window(), _full()), BS))


def test_skipped_blocks_and_where_a_save_may_start() -> None:
    mapped = map_groups(_config(_window(64), _full()), BS)
    assert mapped is not None
    window = mapped.groups[0]
    # vLLM's get_num_skipped_tokens: computed - window + 1, in whole blocks
    assert [window.skipped_blocks(n, BS) for n in (0, 64, 95, 96, 127, 128, 192)] == [0, 0, 1, 1, 2, 2, 4]
    ids = [[10, 11, 12, 13, 14], [20, 21, 22, 23, 24]]
    mapped.null_skipped(ids, 127)
    assert ids == [[NULL_BLOCK, NULL_BLOCK, 12, 13, 14], [20, 21, 22, 23, 24]]
    assert mapped.real_from(ids, 5) == 64 and mapped.real_from(ids, 1) == 32
    assert layer_rows([1, 0], ids, 1, 4) == [[21, 22, 23], [-1, 12, 13]]


def test_a_chunk_completed_after_its_window_moved_on_is_never_copied_from_freed_blocks() -> None:
    """Chunks of 128 tokens, a window of 64, the request's KV saved as it decodes: when the chunk
    [0, 128) is complete, vLLM has freed its first two blocks of the sliding-window group (at
    this step's allocation, with 127 tokens processed) and may have given them to another
    request. The save names them as the null block, and starts where every block is real."""
    mapped = map_groups(_config(_window(64), _full()), BS)
    cfg = ConnectorConfig(url="tcp://127.0.0.1:9", http_url="http://127.0.0.1:9", model_name="m", cache_decode=True)
    s = SchedulerSide(cfg, BS, groups=mapped)
    s.chunk_size = 128
    tokens = list(range(1, 101))
    req = SimpleNamespace(request_id="r", prompt_token_ids=tokens, all_token_ids=tokens, cache_salt=None)
    s._reqs["r"] = _Request(req, "", hit=0)
    empty = SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[])
    new = SimpleNamespace(req_id="r", block_ids=([10, 11, 12, 13], [20, 21, 22, 23]), num_computed_tokens=0)

    def step(new_reqs: list[Any], cached: Any, scheduled: int) -> Any:
        so = SimpleNamespace(
            scheduled_new_reqs=new_reqs, scheduled_cached_reqs=cached, num_scheduled_tokens={"r": scheduled},
            preempted_req_ids=None, total_num_scheduled_tokens=scheduled,
        )  # fmt: skip
        return s.plan(so)

    assert step([new], empty, 100).saves == []  # 100 tokens: no whole chunk
    grown = tokens + list(range(500, 528))  # the decoded tokens, up to 128
    req.all_token_ids = grown
    cached = SimpleNamespace(req_ids=["r"], resumed_req_ids=set(), new_block_ids=[None], num_computed_tokens=[127])
    [save] = step([], cached, 1).saves
    assert save.tokens == grown[:128] and save.first == 0
    assert save.groups == ([NULL_BLOCK, NULL_BLOCK, 12, 13], [20, 21, 22, 23])
    assert save.block_ids == [20, 21, 22, 23] and save.real_from == 64
    # a background load that failed with several groups: recomputed from scratch, never offered again
    s._reqs["r"].hit = 128
    s.output(SimpleNamespace(finished_sending=set(), failed_recving={"r"}, invalid_block_ids=set()))
    assert (s._reqs["r"].hit, s._reqs["r"].saved) == (0, 0)
    s.shutdown()


class _Fake:
    """A worker whose pages are a tensor per block; presave fills layer 0, the copier layer 1."""

    def __init__(self) -> None:
        self.hybrid = self  # (the worker's GroupCopy)
        self.presaved: list[tuple[int, int]] = []  # (first, end) of each presave
        self.copied: list[int] = []
        self.stored: list[torch.Tensor] = []
        self.done = threading.Event()

    def mark(self) -> None:
        return None

    def presave(self, spec: SaveSpec) -> tuple[torch.Tensor, None]:
        self.presaved.append((spec.first, len(spec.tokens)))
        staged = torch.zeros(2, 2, len(spec.tokens) - spec.first, 1)
        staged[:, 0] = 1.0
        return staged, None

    def copy_rest(self, spec: SaveSpec, first_block: int, mark: Any, staged: torch.Tensor) -> torch.Tensor:
        self.copied.append(first_block)
        staged[:, 1] = 2.0
        return staged

    def copy_out(self, block_ids: list[int], mark: Any) -> torch.Tensor:
        raise AssertionError("a save of several groups goes through presave and copy_rest")

    def store(self, spec: SaveSpec, staged: torch.Tensor) -> int:
        self.stored.append(staged)
        self.done.set()
        return int(staged.numel())

    def fetch(self, spec: Any) -> tuple[set[int], int]:
        return set(), 0


def test_a_save_of_several_groups_copies_only_from_real_blocks_and_windows_first() -> None:
    w = _Fake()
    t = Transfers(w, 1 << 20, 10)
    try:
        groups = ([NULL_BLOCK, NULL_BLOCK, 12, 13], [20, 21, 22, 23])
        assert t.save(SaveSpec("r", list(range(128)), [20, 21, 22, 23], "", groups=groups, real_from=64))
        assert w.done.wait(30)
        assert w.presaved == [(64, 128)] and w.copied == [2]  # from the first real block, not 0
        [staged] = w.stored
        assert bool((staged[:, 0] == 1).all()) and bool((staged[:, 1] == 2).all())
        # nothing real at all: dropped and counted, never copied
        gone = ([NULL_BLOCK] * 4, [20, 21, 22, 23])
        assert not t.save(SaveSpec("q", list(range(128)), [20, 21, 22, 23], "", groups=gone, real_from=128))
        assert w.presaved == [(64, 128)]
        assert t.take_stats()["saves_dropped"] == 1
    finally:
        t.shutdown()


def test_the_codec_moves_each_layer_through_its_own_blocks_and_skips_the_ones_a_window_gave_back() -> None:
    """Two layers sharing one KV tensor (as vLLM's groups do), each indexing it with its own ids."""
    from kvdock.codecs import CodecKey, codec_for
    from kvdock.layout import KVGeometry

    shared = torch.zeros(8, 2, BS, 64)  # [blocks, heads, block_size, 2 * head_dim]
    codec = codec_for(CodecKey("vllm", "FLASH_ATTN", "LBHNC"), [shared, shared], KVGeometry(2, 2, 32, "float32"), BS)
    src = torch.randn(2, 2, 2 * BS, 64)  # [K/V, layers, tokens, heads * head_dim]: two blocks
    codec.scatter(torch.tensor([[-1, 3], [5, 6]]), src)  # layer 0 keeps only its second block
    out = torch.full_like(src, 7.0)
    codec.gather(torch.tensor([[3, 3], [5, 6]]), out, layers=[1])  # layer 0 untouched
    assert torch.equal(out[:, 1], src[:, 1]) and bool((out[:, 0] == 7.0).all())
    codec.gather(torch.tensor([[2, 3], [5, 6]]), out)
    assert torch.equal(out[:, 0, BS:], src[:, 0, BS:]) and torch.equal(out[:, 1], src[:, 1])
    assert bool((out[:, 0, :BS] == 0).all())  # block 2 (and the null block 0) never written
    assert bool((shared[0] == 0).all()) and bool((shared[2] == 0).all())


def test_a_save_of_two_groups_is_copied_window_layers_first_through_the_device_path_stand_in() -> None:
    """GroupCopy with the GPU copy-out built on the CPU (same steps, no streams), a scratch of one
    block so a save is gathered in pieces: layer 0 (sliding-window group 0) is copied at
    presave, layer 1 (full-attention group 1) by copy_rest, each through its own blocks."""
    from kvdock.codecs import CodecKey, codec_for
    from kvdock.integrations.vllm.hybrid import GroupCopy
    from kvdock.integrations.vllm.staging import DeviceCopyOut
    from kvdock.layout import KVGeometry

    shared = torch.randn(8, 2, BS, 64)
    codec = codec_for(CodecKey("vllm", "FLASH_ATTN", "LBHNC"), [shared, shared], KVGeometry(2, 2, 32, "float32"), BS)
    mapped = map_groups(_config(_window(64), _full()), BS)
    assert mapped is not None
    one_block = 2 * 2 * BS * 64 * 4
    copy = GroupCopy(mapped, [0, 1], codec, DeviceCopyOut(codec, torch.device("cpu"), scratch_bytes=one_block))
    assert copy.sync_copier is not None
    copy.sync_copier = DeviceCopyOut(codec, torch.device("cpu"), scratch_bytes=one_block)
    spec = SaveSpec("r", list(range(4 * BS)), [4, 5, 6, 7], "", first=2 * BS, groups=([0, 1, 2, 3], [4, 5, 6, 7]))
    staged, ready = copy.presave(spec)
    assert ready is None  # (no streams: copied when presave returns)
    want = torch.empty(2, 2, 2 * BS, 64)
    codec.gather(torch.tensor([[2, 3], [6, 7]]), want)
    assert torch.equal(staged[:, 0], want[:, 0])  # the window's layer, now
    done = copy.copy_rest(spec, 2, None, staged)
    assert done is staged and torch.equal(staged, want)
    with pytest.raises(RuntimeError, match="names blocks vLLM does not keep"):
        copy.presave(SaveSpec("q", list(range(2 * BS)), [4, 5], "", groups=([NULL_BLOCK, 3], [4, 5])))

"""kvdock.sdk.chunks: TensorChunks.add_slots computes every chunk's copies at once; whatever the
tensor's layout, it copies exactly what take() / put() of each chunk would (no other byte of
the tensor's storage moves), or refuses the layout and copies nothing."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from kvdock.sdk.chunks import ShardedChunks, TensorChunks

GUARD = 32  # elements of the storage before the tensor (and after it) that must never change


def _case(rng: random.Random) -> dict:  # type: ignore[type-arg]
    planes, num_layers = rng.choice([1, 2]), rng.randint(1, 4)
    c, d, nchunks = rng.choice([1, 2, 4]), rng.choice([1, 2, 3, 8]), rng.randint(1, 4)
    layers = rng.choice(
        [slice(None), slice(0, 1), slice(1, None), slice(0, num_layers, 2), slice(num_layers - 1, None)]
    )
    picked = range(num_layers)[layers]
    first = rng.randint(0, nchunks - 1)
    tokens = (nchunks - first) * c + rng.choice([0, 0, c, 3])
    size = (planes, len(picked), tokens, d)
    kind = rng.choice(["dense", "layers outer", "padded", "shard", "any"])
    if kind == "dense":
        stride = (len(picked) * tokens * d, tokens * d, d, 1)
    elif kind == "shard":  # one shard's heads of a whole-model tensor: rows of d elements, wider apart
        wide = d * rng.choice([2, 3, 4])
        stride = (len(picked) * tokens * wide, tokens * wide, wide, 1)
    elif kind == "layers outer":
        stride = (tokens * d, planes * tokens * d, d, 1)
    elif kind == "padded":
        pad = rng.randint(0, 5)
        stride = (len(picked) * (tokens * d + pad) + rng.randint(0, 3), tokens * d + pad, d, 1)
    else:  # anything, overlapping layouts included
        stride = tuple(rng.randint(0, 40) for _ in range(4))
    return dict(planes=planes, L=num_layers, c=c, d=d, n=nchunks, layers=layers, first=first, size=size, stride=stride)


@pytest.mark.parametrize("taking", [True, False], ids=["retrieve", "store"])
def test_copies_computed_at_once_equal_the_chunk_by_chunk_ones_or_nothing(taking: bool) -> None:
    rng = random.Random(7 + taking)
    accepted = refused = 0
    for _ in range(1500):
        k = _case(rng)
        planes, num_layers, c, d, n, first = k["planes"], k["L"], k["c"], k["d"], k["n"], k["first"]
        slots = torch.arange(n * planes * num_layers * c * d, dtype=torch.float32).reshape(n, planes, num_layers, c, d)
        slots += 1000
        extent = 1 + sum((m - 1) * s for m, s in zip(k["size"], k["stride"], strict=True))
        storage = torch.arange(extent + 2 * GUARD, dtype=torch.float32) * -1.0
        tensor = storage.as_strided(k["size"], k["stride"], storage_offset=GUARD)
        before_storage, before_slots = storage.clone(), slots.clone()
        end = TensorChunks(tensor, c, first)
        chunks = np.arange(first, n)
        addrs = np.array([slots[i].data_ptr() for i in range(n)], dtype=np.int64)[first:]
        if not end.add_slots(taking, chunks, addrs, (planes, num_layers, c, d), k["layers"], torch.float32):
            refused += 1
            assert torch.equal(storage, before_storage) and torch.equal(slots, before_slots), k
            continue
        end.finish()
        accepted += 1
        want_storage, want_slots = before_storage.clone(), before_slots.clone()
        want = want_storage.as_strided(k["size"], k["stride"], storage_offset=GUARD)
        for j in chunks.tolist():  # what take() / put() of each chunk copy
            span = slice((j - first) * c, (j - first + 1) * c)
            if taking:
                want[:, :, span] = want_slots[j][:, k["layers"]]
            else:
                want_slots[j][:, k["layers"]] = want[:, :, span]
        assert torch.equal(storage, want_storage) and torch.equal(slots, want_slots), k
    assert accepted > 500 and refused > 100  # both kinds of layout were seen


@pytest.mark.parametrize("taking", [True, False], ids=["retrieve", "store"])
@pytest.mark.parametrize("plain", [True, False], ids=["tensor", "staged"])
def test_sharded_chunks_move_each_shard_heads(taking: bool, plain: bool) -> None:
    """Position j of a transfer of a model stored in 3 shards is heads [s*w, (s+1)*w) of chunk
    j // 3 (s = j % 3), through native runs over a tensor or staging for any other end."""
    shards, c, d, n = 3, 4, 6, 3
    w = d // shards
    kv = torch.arange(2 * 2 * n * c * d, dtype=torch.float32).reshape(2, 2, n * c, d)
    work = kv.clone() if not taking else torch.zeros_like(kv)
    slots = torch.arange(n * shards * 2 * 2 * c * w, dtype=torch.float32).reshape(n * shards, 2, 2, c, w) + 0.5
    if not taking:
        slots.zero_()
    inner = TensorChunks(work, c)

    class Other:  # any end that is not a plain tensor
        def put(self, index: int, dst: torch.Tensor) -> None:
            inner.put(index, dst)

        def take(self, index: int, src: torch.Tensor) -> None:
            inner.take(index, src)

        def finish(self) -> None:
            inner.finish()

    end = ShardedChunks(inner if plain else Other(), shards, (2, 2, c, d), torch.float32)
    positions = np.arange(n * shards)
    addrs = np.array([slots[j].data_ptr() for j in positions], dtype=np.int64)
    if not end.add_slots(taking, positions, addrs, (2, 2, c, w), slice(None), torch.float32):
        assert not plain
        for j in positions.tolist():
            end.take(j, slots[j]) if taking else end.put(j, slots[j])
    end.finish()
    for j in positions.tolist():
        i, s = divmod(j, shards)
        heads = (work if taking else kv)[:, :, i * c : (i + 1) * c, s * w : (s + 1) * w]
        assert torch.equal(heads, slots[j]), j


def test_a_tensor_of_another_dtype_or_one_that_needs_grad_is_refused() -> None:
    slot = torch.zeros(2, 1, 4, 8)
    addr = np.array([slot.data_ptr()], dtype=np.int64)
    for tensor, taking in (
        (torch.zeros(2, 1, 4, 8, dtype=torch.float64), True),
        (torch.zeros(2, 1, 4, 8, requires_grad=True), True),
    ):
        end = TensorChunks(tensor, 4)
        assert not end.add_slots(taking, np.arange(1), addr, (2, 1, 4, 8), slice(None), torch.float32)
    source = TensorChunks(torch.ones(2, 1, 4, 8, requires_grad=True), 4)  # a store only reads it
    assert source.add_slots(False, np.arange(1), addr, (2, 1, 4, 8), slice(None), torch.float32)
    source.finish()
    assert (slot == 1).all()


@pytest.mark.parametrize("plain", [True, False], ids=["tensor", "staged"])
def test_sharded_chunks_of_pipeline_stages_hold_their_layer_blocks(plain: bool) -> None:
    """2 stages x 2 head blocks: shard s = stage * 2 + block holds layers [2 * stage, 2 * stage + 2)
    and values [3 * block, 3 * block + 3) of each chunk (an engine's sink: through staging)."""
    p, layers, c, d = 2, 4, 8, 6
    kv = torch.randn(p, layers, c, d)
    got: dict[int, torch.Tensor] = {}
    out = torch.zeros_like(kv)

    class Sink:
        def take(self, index: int, src: torch.Tensor) -> None:
            got[index] = src.clone()

    end = ShardedChunks(TensorChunks(out, c) if plain else Sink(), 4, (p, layers, c, d), torch.float32, stages=2)
    for s in range(4):
        stage, block = divmod(s, 2)
        end.take(s, kv[:, 2 * stage : 2 * stage + 2, :, 3 * block : 3 * block + 3].contiguous())
    end.finish()
    assert torch.equal(out if plain else got[0], kv)

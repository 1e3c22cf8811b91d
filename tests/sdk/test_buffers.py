"""The buffer pool behind retrieve's fresh tensors: a block is reused only once every tensor on it
is gone, the bound holds, free blocks go least recently used first, and a retrieve's tensor from
a reused block holds exactly the new bytes."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

import kvdock.sdk as kvd
from helpers import CHUNK, MODEL, make_kv, make_tokens
from kvdock.sdk.buffers import GRAIN, MIN_POOLED, BufferPool

MIB = 1 << 20


def test_a_block_comes_back_only_when_its_last_tensor_is_gone() -> None:
    pool = BufferPool(64 * MIB)
    t = pool.empty((4 * MIB,), torch.uint8)
    ptr = t.data_ptr()
    part = t[MIB:]  # a view keeps the block in use
    del t
    gc.collect()
    assert pool.stats().free_bytes == 0
    other = pool.empty((4 * MIB,), torch.uint8)
    assert other.data_ptr() != ptr  # not handed out twice
    del part
    gc.collect()
    again = pool.empty((2 * MIB, 2), torch.uint8)
    assert again.data_ptr() == ptr and again.shape == (2 * MIB, 2)
    s = pool.stats()
    assert (s.held_bytes, s.reused, s.mapped, s.unpooled) == (8 * MIB, 1, 2, 0)
    assert pool.check_integrity() == []
    del other, again


def test_the_bound_holds_and_free_blocks_go_least_recently_used_first() -> None:
    pool = BufferPool(8 * MIB)
    a = pool.empty((4 * MIB,), torch.uint8)
    b = pool.empty((4 * MIB,), torch.uint8)
    c = pool.empty((4 * MIB,), torch.uint8)  # the bound is full of blocks in use
    assert pool.stats().unpooled == 1 and pool.stats().held_bytes == 8 * MIB
    ptr_b = b.data_ptr()
    del a
    gc.collect()
    del b
    gc.collect()  # free: a (older), then b
    big = pool.empty((6 * MIB,), torch.uint8)  # needs room: a goes, then b
    assert pool.stats().held_bytes == 6 * MIB and big.data_ptr() != ptr_b
    assert pool.empty((32 * MIB,), torch.uint8).numel() == 32 * MIB  # over the bound: unpooled
    assert pool.empty((MIN_POOLED - 1,), torch.uint8).numel() == MIN_POOLED - 1  # small: unpooled
    assert pool.stats().unpooled == 3 and pool.check_integrity() == []
    del big, c


def test_a_block_is_reused_for_sizes_between_half_and_all_of_it() -> None:
    pool = BufferPool(64 * MIB)
    t = pool.empty((8 * MIB,), torch.uint8)
    ptr = t.data_ptr()
    del t
    gc.collect()
    small = pool.empty((2 * MIB,), torch.uint8)  # a quarter: a new block rather than waste 6 MiB
    assert small.data_ptr() != ptr
    half = pool.empty((4 * MIB,), torch.float32).view(-1)  # 16 MiB > 8: new block too
    assert half.data_ptr() != ptr
    fits = pool.empty((5 * MIB,), torch.uint8)
    assert fits.data_ptr() == ptr
    assert pool.stats().held_bytes == (8 + 2 + 16) * MIB and pool.stats().held_bytes % GRAIN == 0
    del small, half, fits


def test_resize_trim_and_blocks_freed_from_other_threads() -> None:
    pool = BufferPool(64 * MIB)
    tensors = [pool.empty((2 * MIB,), torch.uint8) for _ in range(4)]
    threads = [threading.Thread(target=tensors.pop) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    gc.collect()
    assert pool.stats().free_bytes == 8 * MIB and pool.check_integrity() == []
    pool.resize(4 * MIB)
    assert pool.stats().held_bytes == 4 * MIB
    kept = pool.empty((2 * MIB,), torch.uint8)
    pool.resize(0)  # the block in use goes when it comes back
    del kept
    gc.collect()
    assert pool.stats().held_bytes == 0
    pool.resize(8 * MIB)
    t = pool.empty((2 * MIB,), torch.uint8)
    del t
    gc.collect()
    pool.trim()
    assert pool.stats().held_bytes == 0 and pool.check_integrity() == []
    with pytest.raises(ValueError, match="whole number of bytes"):
        pool.resize(-1)


def test_retrieve_draws_from_the_pool_and_a_reused_block_holds_only_the_new_bytes(make_server) -> None:
    srv = make_server(l1_size="16MiB")  # both objects below (12 MiB)
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as ctx:
        _retrieve_draws_from_the_pool(ctx)


def _retrieve_draws_from_the_pool(ctx: kvd.KVCacheContext) -> None:
    pool = kvd.buffer_pool()
    pool.resize(256 * MIB)
    n = 2048 * CHUNK  # 2048 chunks of 3 KiB: 6 MiB per retrieve
    a, b = make_tokens(n), make_tokens(n, start=10**6)
    kv_a, kv_b = make_kv(n, seed=1), make_kv(n, seed=2)
    assert kvd.store(ctx, kv_a, a) and kvd.store(ctx, kv_b, b)
    got = kvd.retrieve(ctx, a)
    assert got is not None and torch.equal(got, kv_a)
    ptr = got.data_ptr()
    before = pool.stats()
    del got
    gc.collect()
    got = kvd.retrieve(ctx, b)
    assert got is not None and got.data_ptr() == ptr and torch.equal(got, kv_b)
    assert pool.stats().reused == before.reused + 1
    assert pool.check_integrity() == []

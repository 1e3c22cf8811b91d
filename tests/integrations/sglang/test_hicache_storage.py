"""kvdock as SGLang's HiCache storage backend, against SGLang 0.5.23's own host pools, storage
config, factory and page hash: what SGLang stores, the SDK reads by token ids, and what the SDK
stores, SGLang loads."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.storage import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_hash_str, storage_namespace_seed

import kvdock.sdk as kvd
from conftest import (
    DTYPE,
    HEAD_DIM,
    HEADS,
    LAYERS,
    LAYOUTS,
    PAGE,
    extra,
    fill,
    host_pool,
    pages_kv,
    prompt,
    storage_config,
)
from kvdock.errors import PrefixMissingError
from kvdock.integrations.sglang import KvdockHiCacheStorage
from kvdock.keying import key_tokens, sglang_namespace_seed, sglang_page_hashes
from kvdock.testing import ServerProcess, start_server

Make = Callable[..., KvdockHiCacheStorage]


# -- SGLang's page hash, byte for byte -------------------------------------------------------------


@pytest.mark.parametrize("namespace", [(None, None), (None, "alice"), ("lora-7", None), ("", ""), ("k", "ü")])
def test_page_hashes_are_sglangs_own(namespace: tuple[str | None, str | None]) -> None:
    seed = storage_namespace_seed(*namespace)
    assert sglang_namespace_seed(*namespace) == seed
    tokens = prompt(7, seed=1, tail=3)
    tokens[5] = 2**32 - 1  # the largest id kvdock takes
    theirs = get_hash_str(tokens.tolist(), seed, page_size=PAGE)
    assert sglang_page_hashes(tokens, PAGE, seed) == theirs[:7]  # (SGLang also hashes the partial tail)
    # chained from the previous page's hash (a call's prefix), too
    assert sglang_page_hashes(tokens[3 * PAGE :], PAGE, theirs[2]) == theirs[3:7]


def test_key_tokens_hold_each_hash_and_refuse_what_is_not_one() -> None:
    keys = sglang_page_hashes(prompt(2, seed=2), PAGE)
    kt = key_tokens(keys, PAGE).reshape(2, PAGE)
    assert kt[:, :8].tobytes() == bytes.fromhex(keys[0]) + bytes.fromhex(keys[1])
    assert not kt[:, 8:].any()
    with pytest.raises(ValueError, match="sha256 hex digests"):
        key_tokens(["abc"], PAGE)
    with pytest.raises(ValueError, match="at least 8"):
        key_tokens(keys, 4)


def test_key_tokens_refuse_keys_with_whitespace_or_of_other_types() -> None:
    """The keys are read in one ``bytes.fromhex``, which skips whitespace between digit pairs: a
    64-character key holding any is refused, as before, and so is one that is no str."""
    keys = sglang_page_hashes(prompt(3, seed=3), PAGE)
    for bad in (keys[1][:62] + " a", keys[1][:31] + " " + keys[1][32:], keys[1].encode(), 7):
        with pytest.raises(ValueError, match="sha256 hex digests"):
            key_tokens([keys[0], bad, keys[2]], PAGE)  # type: ignore[list-item]
    assert key_tokens(keys, PAGE).tobytes() == b"".join(bytes.fromhex(k) + bytes(4 * (PAGE - 8)) for k in keys)


# -- SGLang stores, the SDK reads by token ids, and back ------------------------------------------


@pytest.mark.parametrize(
    ("mla", "layout"),
    [(False, layout) for layout in (*LAYOUTS, "page_head", "page_unified")]
    + [(True, layout) for layout in (*LAYOUTS, "page_unified")],
    ids=lambda v: {False: "mha", True: "mla"}.get(v, v) if isinstance(v, bool) else v,
)
def test_sglang_stores_the_sdk_reads_edits_and_sglang_loads_the_edit(
    sgl_server: ServerProcess, backend: Make, layout: str, mla: bool
) -> None:
    name = f"sgl-{'mla' if mla else 'mha'}-{layout}"
    pool = host_pool(mla, layout)
    b = backend(storage_config(sgl_server, mla=mla, **{"kvdock.model_name": name}), pool)
    fill(pool, seed=3)
    tokens = prompt(4, seed=4)
    keys = sglang_page_hashes(tokens, PAGE)
    idx = pool.alloc(4 * PAGE)
    # two calls, the second chained after the first's pages (SGLang's prefix_keys)
    assert b.batch_set_v1(keys[:1], idx[:PAGE], extra([])) == [True]
    assert b.batch_set_v1(keys[1:], idx[PAGE:], extra(keys[:1])) == [True] * 3

    with kvd.connect(sgl_server.url, sgl_server.http_url, name) as ctx:
        assert ctx.layout.engine.name == "sglang"
        kv = kvd.retrieve(ctx, tokens)
        assert kv is not None and kv.dtype == DTYPE
        assert kv.shape == ((1, LAYERS, 4 * PAGE, 80) if mla else (2, LAYERS, 4 * PAGE, HEADS * HEAD_DIM))
        assert torch.equal(kv, pages_kv(b, idx))
        assert kvd.lookup(ctx, tokens[: 3 * PAGE + 1]) == 3 * PAGE

        # the remap: the edited KV stored under other tokens...
        edited = kv.clone()
        edited[:, :, :PAGE] *= -1
        other = prompt(4, seed=5)
        assert kvd.store(ctx, edited, other)

    other_keys = sglang_page_hashes(other, PAGE)
    # ... is what SGLang finds and loads for them, into other host pages
    assert b.batch_exists(other_keys, extra([])) == 4
    dst = pool.alloc(4 * PAGE)
    assert b.batch_get_v1(other_keys, dst, extra([])) == [True] * 4
    assert torch.equal(pages_kv(b, dst), edited)
    # from a prefix on, only the call's pages are copied
    dst2 = pool.alloc(2 * PAGE)
    assert b.batch_get_v1(other_keys[2:], dst2, extra(other_keys[:2])) == [True, True]
    assert torch.equal(pages_kv(b, dst2), edited[:, :, 2 * PAGE :])
    assert b.stats["pages_loaded"] == 6


def test_tensor_parallel_ranks_store_their_heads_as_shards(sgl_server: ServerProcess, backend: Make) -> None:
    name = "sgl-tp2"
    ranks = []
    for r in range(2):
        pool = host_pool(False, "page_first", heads=HEADS // 2)
        b = backend(storage_config(sgl_server, tp_rank=r, tp_size=2, **{"kvdock.model_name": name}), pool)
        fill(pool, seed=10 + r)
        ranks.append(b)
    tokens = prompt(3, seed=6)
    keys = sglang_page_hashes(tokens, PAGE)
    idx = [b.mem_pool_host.alloc(3 * PAGE) for b in ranks]
    for b, i in zip(ranks, idx, strict=True):
        assert b.batch_set_v1(keys, i, extra([])) == [True] * 3
    with kvd.connect(sgl_server.url, sgl_server.http_url, name) as ctx:
        assert ctx.layout.geometry.world_size == 2 and ctx.shards == 2
        kv = kvd.retrieve(ctx, tokens)  # the whole model: both ranks' heads
        assert kv is not None
        assert torch.equal(kv, torch.cat([pages_kv(b, i) for b, i in zip(ranks, idx, strict=True)], dim=3))
        other = prompt(3, seed=7)
        kvd.store(ctx, kv.flip(3), other)  # split into the two shards
    other_keys = sglang_page_hashes(other, PAGE)
    for b in ranks:  # every rank's exists first (SGLang all-reduces its hit count), then the gets
        assert b.batch_exists(other_keys, extra([])) == 3
    for r, b in enumerate(ranks):
        dst = b.mem_pool_host.alloc(3 * PAGE)
        assert b.batch_get_v1(other_keys, dst, extra([])) == [True] * 3
        half = HEADS // 2 * HEAD_DIM
        assert torch.equal(pages_kv(b, dst), kv.flip(3)[..., r * half : (r + 1) * half])


def test_salt_namespaces_are_kept_apart(sgl_server: ServerProcess, backend: Make) -> None:
    name = "sgl-salts"
    pool = host_pool(False, "layer_first")
    b = backend(storage_config(sgl_server, **{"kvdock.model_name": name}), pool)
    fill(pool, seed=8)
    tokens = prompt(2, seed=9)
    alice = sglang_page_hashes(tokens, PAGE, storage_namespace_seed(None, "alice"))
    idx = pool.alloc(2 * PAGE)
    assert b.batch_set_v1(alice, idx, extra([])) == [True, True]
    with kvd.connect(sgl_server.url, sgl_server.http_url, name) as ctx:
        assert kvd.retrieve(ctx, tokens) is None  # no salt: another namespace
        assert kvd.retrieve(ctx, tokens, cache_salt="bob") is None
        kv = kvd.retrieve(ctx, tokens, cache_salt="alice")
        assert kv is not None and torch.equal(kv, pages_kv(b, idx))
        kvd.store(ctx, kv, tokens, cache_salt="bob")
    assert b.batch_exists(sglang_page_hashes(tokens, PAGE), extra([])) == 0
    assert b.batch_exists(sglang_page_hashes(tokens, PAGE, storage_namespace_seed(None, "bob")), extra([])) == 2


def test_batch_exists_counts_only_a_consecutive_prefix(sgl_server: ServerProcess, backend: Make) -> None:
    pool = host_pool(False, "page_first_direct")
    b = backend(storage_config(sgl_server, **{"kvdock.model_name": "sgl-prefix"}), pool)
    fill(pool, seed=11)
    keys = sglang_page_hashes(prompt(4, seed=12), PAGE)
    idx = pool.alloc(4 * PAGE)
    assert b.batch_set_v1(keys[:2], idx[: 2 * PAGE], extra([])) == [True, True]
    assert b.batch_exists(keys, extra([])) == 2
    assert b.batch_exists(keys[1:], extra(keys[:1])) == 1
    assert b.batch_exists(keys[2:], extra(keys[:2])) == 0
    # pages after a hole are never stored (kvdock holds prefixes), and say so
    assert b.batch_set_v1(keys[3:], idx[3 * PAGE :], extra(keys[:3])) == [False]
    assert b.stats["set_prefix_missing"] == 1
    assert b.batch_exists(keys, extra([])) == 2
    got = b.batch_get_v1(keys, pool.alloc(4 * PAGE), extra([]))
    assert got == [True, True, False, False]


def test_a_load_into_one_host_page_twice_is_a_miss_that_writes_nothing(
    sgl_server: ServerProcess, backend: Make
) -> None:
    """Review R-CLI: a batch_get_v1 whose host indices name one page twice copied two chunks
    into it at once, on two copy threads: the page could end a mix of both (torn pages seen with
    32 pages of 4 KiB runs). It is now refused before any copy: a miss, counted, the pool as it was."""
    pool = host_pool(False, "layer_first")
    b = backend(storage_config(sgl_server, **{"kvdock.model_name": "sgl-twice"}), pool)
    fill(pool, seed=13)
    keys = sglang_page_hashes(prompt(2, seed=14), PAGE)
    assert b.batch_set_v1(keys, pool.alloc(2 * PAGE), extra([])) == [True, True]
    dst = pool.alloc(PAGE)
    before = pool.kv_buffer.clone()
    assert b.batch_get_v1(keys, torch.cat([dst, dst]), extra([])) == [False, False]
    assert b.stats["get_failed"] == 1
    assert torch.equal(pool.kv_buffer.view(torch.int16), before.view(torch.int16))
    other = pool.alloc(2 * PAGE)  # the same pages into two distinct pages load as ever
    assert b.batch_get_v1(keys, other, extra([])) == [True, True]


def test_a_dead_server_gives_misses_never_an_exception(
    backend: Make, tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    srv = start_server("--no-disk", chunk_size=PAGE, l1_size="64MiB", log_path=tmp_path / "s.log")
    pool = host_pool(False, "layer_first")
    settings = {"kvdock.model_name": "sgl-dead", "kvdock.timeout": 2, "kvdock.retry_s": 0}
    b = backend(storage_config(srv, **settings), pool)
    fill(pool, seed=13)
    keys = sglang_page_hashes(prompt(2, seed=14), PAGE)
    idx = pool.alloc(2 * PAGE)
    assert b.batch_set_v1(keys, idx, extra([])) == [True, True]
    srv.stop()
    with caplog.at_level(logging.WARNING, logger="kvdock.sglang"):
        assert b.batch_exists(keys, extra([])) == 0
        assert b.batch_get_v1(keys, pool.alloc(2 * PAGE), extra([])) == [False, False]
        assert b.batch_set_v1(keys, idx, extra([])) == [False, False]
        assert b.get(keys[0], pool.get_dummy_flat_data_page()) is None
        assert b.set(keys[0], pool.get_data_page(int(idx[0]))) is False
    failed = sum(v for k, v in b.stats.items() if k.endswith(("_failed", "_unavailable")))
    assert failed >= 5
    assert "kvdock" in caplog.text


def test_a_chunk_size_other_than_the_page_size_turns_kvdock_off(backend: Make, tmp_path: Any) -> None:
    srv = start_server("--no-disk", chunk_size=2 * PAGE, l1_size="64MiB", log_path=tmp_path / "s.log")
    try:
        pool = host_pool(False, "layer_first")
        b = backend(storage_config(srv, **{"kvdock.model_name": "sgl-chunk"}), pool)
        assert "not SGLang's page size" in b.off
        keys = sglang_page_hashes(prompt(2, seed=15), 2 * PAGE)[:1]
        assert b.batch_set_v1(keys, pool.alloc(PAGE), extra([])) == [False]
        assert b.batch_exists(keys, extra([])) == 0
    finally:
        srv.stop()


def test_the_generic_path_round_trips_each_page(sgl_server: ServerProcess, backend: Make) -> None:
    for layout in LAYOUTS:
        pool = host_pool(True, layout)
        b = backend(storage_config(sgl_server, mla=True, v1=False, **{"kvdock.model_name": f"sgl-gen-{layout}"}), pool)
        fill(pool, seed=16)
        keys = sglang_page_hashes(prompt(3, seed=17), PAGE)
        idx = pool.alloc(3 * PAGE)
        assert b.batch_set(keys[:2], [pool.get_data_page(int(i)) for i in idx[: 2 * PAGE : PAGE]])
        assert b.batch_exists(keys) == 2 and b.exists(keys[0]) and not b.exists(keys[2])
        got = b.batch_get(keys, [pool.get_dummy_flat_data_page() for _ in keys])
        assert got[2] is None
        for j in range(2):
            assert torch.equal(got[j], pool.get_data_page(int(idx[j * PAGE])))


def test_sglangs_factory_builds_the_backend_from_its_extra_config(sgl_server: ServerProcess) -> None:
    cfg = storage_config(sgl_server, **{"kvdock.model_name": "sgl-factory"})
    pool = host_pool(False, "page_first")
    b = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    try:
        assert isinstance(b, KvdockHiCacheStorage) and b.config.interface_v1
        b.register_mem_pool_host(pool)
        assert b.off == "" and b._ctx is not None
    finally:
        b.close()


def test_mla_tensor_parallel_ranks_share_one_latent_that_rank_0_writes(
    sgl_server: ServerProcess, backend: Make
) -> None:
    name = "sgl-mla-tp2"
    pools = [host_pool(True, "page_first") for _ in range(2)]
    ranks = [
        backend(storage_config(sgl_server, mla=True, tp_rank=r, tp_size=2, **{"kvdock.model_name": name}), pools[r])
        for r in range(2)
    ]
    fill(pools[0], seed=18)
    fill(pools[1], seed=19)  # (a rank's replica: never written, rank 0 is the writer)
    keys = sglang_page_hashes(prompt(2, seed=20), PAGE)
    idx = [p.alloc(2 * PAGE) for p in pools]
    assert ranks[1].batch_set_v1(keys, idx[1], extra([])) == [True, True]  # SGLang skips it; harmless
    assert ranks[1].batch_exists(keys, extra([])) == 0  # nothing written by rank 1
    assert ranks[0].batch_set_v1(keys, idx[0], extra([])) == [True, True]
    dst = pools[1].alloc(2 * PAGE)
    assert ranks[1].batch_get_v1(keys, dst, extra([])) == [False, False]  # no exists saw them: a miss
    assert ranks[1].stats["get_unvouched"] == 1
    assert ranks[1].batch_exists(keys, extra([])) == 2
    assert ranks[1].batch_get_v1(keys, dst, extra([])) == [True, True]
    assert torch.equal(pages_kv(ranks[1], dst), pages_kv(ranks[0], idx[0]))
    with kvd.connect(sgl_server.url, sgl_server.http_url, name) as ctx:
        assert ctx.shards == 1
        kv = kvd.retrieve(ctx, prompt(2, seed=20))
        assert kv is not None and torch.equal(kv, pages_kv(ranks[0], idx[0]))


def test_the_sdks_batch_view_and_inspection_calls_key_an_sglang_model_its_way(
    sgl_server: ServerProcess, backend: Make
) -> None:
    name = "sgl-sdk-calls"
    pool = host_pool(False, "layer_first")
    b = backend(storage_config(sgl_server, **{"kvdock.model_name": name}), pool)
    fill(pool, seed=21)
    a, c = prompt(2, seed=22), prompt(3, seed=23)
    for tokens, salt in ((a, None), (c, "carol")):
        n = len(tokens) // PAGE
        idx = pool.alloc(n * PAGE)
        keys = sglang_page_hashes(tokens, PAGE, storage_namespace_seed(None, salt))
        assert b.batch_set_v1(keys, idx, extra([])) == [True] * n
        with kvd.connect(sgl_server.url, sgl_server.http_url, name) as ctx:
            assert torch.equal(kvd.retrieve(ctx, tokens, cache_salt=salt or ""), pages_kv(b, idx))
    with kvd.connect(sgl_server.url, sgl_server.http_url, name) as ctx:
        assert kvd.lookup_many(ctx, [a, c], cache_salt=["", "carol"]) == [2 * PAGE, 3 * PAGE]
        assert kvd.lookup_many(ctx, [a, c]) == [2 * PAGE, 0]
        many = kvd.retrieve_many(ctx, [a, c], cache_salt=["", "carol"])
        assert torch.equal(many[0], kvd.retrieve(ctx, a)) and torch.equal(many[1], kvd.retrieve(ctx, c, "carol"))
        with kvd.view(ctx, c, cache_salt="carol") as v:
            assert torch.equal(v.tensor(), many[1])
        seen = kvd.inspect_prefix(ctx, a)
        assert seen.hit_tokens == 2 * PAGE
        assert [[s.tier for s in chunk.stored] for chunk in seen.chunks] == [["l1"], ["l1"]]


def test_a_hybrid_models_extra_pools_are_misses_never_an_exception(sgl_server: ServerProcess, backend: Make) -> None:
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    pool = host_pool(False, "page_first")
    b = backend(storage_config(sgl_server, **{"kvdock.model_name": "sgl-hybrid"}), pool)
    keys = sglang_page_hashes(prompt(2, seed=24), PAGE)
    mamba = PoolTransfer(name=PoolName.MAMBA, host_indices=pool.alloc(2 * PAGE), keys=keys)
    assert b.batch_exists_v2(keys, [mamba], extra([])).kv_hit_pages == 0
    assert b.batch_get_v2([mamba], extra([])) == {PoolName.MAMBA: [False, False]}
    assert b.batch_set_v2([mamba], extra([])) == {PoolName.MAMBA: [False, False]}
    assert b.stats["batch_set_v2_unsupported"] == 1


def test_a_name_another_engine_registered_first_keeps_its_keys_and_chunk_keys_picks_sglangs(
    sgl_server: ServerProcess, backend: Make
) -> None:
    name = "sgl-shared-name"
    kvd.register_model(  # as vLLM or the SDK would: the same geometry, kvdock's own keys
        sgl_server.url, sgl_server.http_url, name, num_layers=LAYERS, num_kv_heads=HEADS, head_dim=HEAD_DIM,
        dtype=DTYPE, tokens_per_block=PAGE,
    )  # fmt: skip
    pool = host_pool(False, "page_first")
    b = backend(storage_config(sgl_server, **{"kvdock.model_name": name}), pool)
    fill(pool, seed=25)
    tokens = prompt(2, seed=26)
    idx = pool.alloc(2 * PAGE)
    assert b.batch_set_v1(sglang_page_hashes(tokens, PAGE), idx, extra([])) == [True, True]
    with kvd.connect(sgl_server.url, sgl_server.http_url, name) as ctx:
        assert ctx.layout.engine.name != "sglang"
        assert kvd.retrieve(ctx, tokens) is None  # kvdock's keys: SGLang's pages are not under them
        kvd.store(ctx, pages_kv(b, idx).neg(), tokens)  # another engine's KV of the same tokens
        ctx.chunk_keys = "sglang"  # type: ignore[attr-defined]
        kv = kvd.retrieve(ctx, tokens)
        assert kv is not None and torch.equal(kv, pages_kv(b, idx))
        ctx.chunk_keys = "kvdock"  # type: ignore[attr-defined]
        assert torch.equal(kvd.retrieve(ctx, tokens), pages_kv(b, idx).neg())


@pytest.mark.parametrize(
    ("mla", "layout", "heads", "planned"),
    [
        (False, "page_first", HEADS, True),
        (False, "page_head", HEADS, False),  # (runs of one head_dim: too short)
        (False, "page_first", 1, False),
        (True, "layer_first", 1, True),
        (True, "page_first", 1, False),
        (False, "page_unified", HEADS, True),
        (True, "page_unified", 1, True),
    ],
)
def test_pages_copy_in_one_planned_step_or_page_by_page(mla: bool, layout: str, heads: int, planned: bool) -> None:
    """A batch's pages move between slots and the pool as one vectorized plan of runs when a page
    reduces to runs (one plan per pool), page by page otherwise: the same bytes either way, both
    ways, whichever order the transfer hands the pages in."""
    from kvdock.integrations.sglang.ends import Pages
    from kvdock.integrations.sglang.pools import HostPages

    pool = host_pool(mla, layout, heads=heads)
    fill(pool, seed=30)
    pages = HostPages(pool)
    slots = torch.randn(5, *pages.shape).to(DTYPE)  # five kvdock slots
    assert (pages.plan(slots[0]) is not None) == planned
    assert pages.plan(slots[1]) is pages.plan(slots[0])  # (made once)
    starts = [int(i) for i in pool.alloc(5 * PAGE)[::PAGE]]
    put = Pages(pages, starts, first=2)  # chunks 0, 1: a prefix, never copied
    for j in (4, 2, 3, 6, 5):
        put.put(j, slots[j - 2])
    put.finish()
    for j in range(5):
        assert torch.equal(pages.page(starts[j]).flatten(3), slots[j])
    loaded = torch.randn_like(slots, dtype=torch.float32).to(DTYPE)  # what kvdock hands back
    take = Pages(pages, starts[:4], first=1)
    for j in (5, 1, 4, 0, 3, 2):  # chunk 0 (the prefix) and 5 (past the call's pages) are skipped
        take.take(j, loaded[j - 1] if j else loaded[4])
    take.finish()
    for j in range(4):
        assert torch.equal(pages.page(starts[j]).flatten(3), loaded[j])
    assert torch.equal(pages.page(starts[4]).flatten(3), slots[4])  # untouched
    with pytest.raises(PrefixMissingError):
        put.put(1, slots[0])
    with pytest.raises(ValueError, match="not the start of a page"):
        bad = Pages(pages, [starts[0] + 1], first=0)
        bad.put(0, slots[0])
        bad.finish()

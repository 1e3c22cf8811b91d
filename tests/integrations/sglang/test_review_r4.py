"""Review R4 of the SGLang HiCache backend (issue 26): adversarial cases, against SGLang 0.5.23's
own storage config and host pools."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, HiCacheStorageExtraInfo
from sglang.srt.mem_cache.pool_host.mha_mxfp8 import MHATokenToKVPoolMXFP8Host

from conftest import HEADS, LAYOUTS, PAGE, fill, host_pool, storage_config
from kvdock.errors import UnsupportedLayoutError
from kvdock.integrations.sglang import KvdockHiCacheStorage
from kvdock.keying import sglang_page_hashes
from kvdock.keys import normalize_tokens
from kvdock.testing import ServerProcess, start_server

Make = Callable[..., KvdockHiCacheStorage]


def _tokens(n_pages: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return normalize_tokens(rng.integers(0, 50_000, n_pages * PAGE).tolist())


def _pages(b: KvdockHiCacheStorage, idx: torch.Tensor) -> torch.Tensor:
    assert b.pages is not None
    return torch.cat([b.pages.page(int(i)).flatten(3) for i in idx[::PAGE]], dim=2)


def _config(srv: ServerProcess, name: str, **fields: Any) -> HiCacheStorageConfig:
    """SGLang's storage config with some of its own fields replaced (attn_cp, DCP)."""
    base = storage_config(srv, mla=bool(fields.get("is_mla_model")), **{"kvdock.model_name": name})
    kw = {f: getattr(base, f) for f in base.__dataclass_fields__}
    kw.update(fields)
    return HiCacheStorageConfig(**kw)


def _two_ranks_never_share_pages(srv: ServerProcess, backend: Make, mla: bool, configs: list[Any]) -> None:
    """Two ranks whose pages of the same page hashes hold different KV (SGLang's own ``file``
    backend keys them apart): each rank loads its own bytes or misses, never the other's."""
    ranks = []
    for r, cfg in enumerate(configs):
        pool = host_pool(mla, "page_first")
        fill(pool, seed=100 + r)
        ranks.append(backend(cfg, pool))
    keys = sglang_page_hashes(_tokens(2, seed=77), PAGE)
    info = HiCacheStorageExtraInfo(prefix_keys=[])
    srcs = [b.mem_pool_host.alloc(2 * PAGE) for b in ranks]
    for b, src in zip(ranks, srcs, strict=True):
        b.batch_set_v1(keys, src, info)
    for b, src in zip(ranks, srcs, strict=True):
        dst = b.mem_pool_host.alloc(2 * PAGE)
        got = b.batch_get_v1(keys, dst, info)
        loaded = sum(got)
        assert got == [True] * loaded + [False] * (2 - loaded)
        assert torch.equal(_pages(b, dst)[:, :, : loaded * PAGE], _pages(b, src)[:, :, : loaded * PAGE])
    # kvdock keeps no shard per context-parallel rank: it is off for them, every page a miss
    for b in ranks:
        assert "context parallelism" in b.off and b.batch_exists(keys, info) == 0


def test_attention_context_parallel_ranks_never_load_each_others_pages(
    sgl_server: ServerProcess, backend: Make
) -> None:
    cfgs = [_config(sgl_server, "r4-cp", attn_cp_rank=r, attn_cp_size=2) for r in range(2)]
    _two_ranks_never_share_pages(sgl_server, backend, False, cfgs)


def test_decode_context_parallel_mla_ranks_never_load_each_others_pages(
    sgl_server: ServerProcess, backend: Make
) -> None:
    dcp = {"is_mla_model": True, "tp_size": 2, "dcp_size": 2, "logical_page_size": 2 * PAGE}
    cfgs = [_config(sgl_server, "r4-dcp", tp_rank=r, dcp_rank=r, **dcp) for r in range(2)]
    assert all(c.is_storage_writer for c in cfgs)  # SGLang: each DCP rank writes its own shard
    _two_ranks_never_share_pages(sgl_server, backend, True, cfgs)


@pytest.mark.parametrize(
    ("mla", "layout"),
    [(False, layout) for layout in (*LAYOUTS, "page_head")] + [(True, layout) for layout in LAYOUTS],
)
def test_the_generic_and_zero_copy_paths_agree_on_every_layout(
    sgl_server: ServerProcess, backend: Make, mla: bool, layout: str
) -> None:
    """A chain's first page is one kvdock chunk whichever path stored it (an engine with
    ``interface_v1`` and one without share it): SGLang's flat data page and the host page must be
    the same chunk, or one path loads the other's bytes transposed."""
    pool = host_pool(mla, layout)
    name = f"r4-paths-{'mla' if mla else 'mha'}-{layout}"
    b = backend(storage_config(sgl_server, mla=mla, v1=False, **{"kvdock.model_name": name}), pool)
    fill(pool, seed=21)
    k = [sglang_page_hashes(_tokens(1, seed=s), PAGE)[0] for s in (31, 32)]
    src = pool.alloc(2 * PAGE)
    # generic set, zero-copy get
    assert b.set(k[0], pool.get_data_page(int(src[0])))
    dst = pool.alloc(PAGE)
    assert b.batch_get_v1(k[:1], dst, HiCacheStorageExtraInfo(prefix_keys=[])) == [True]
    assert torch.equal(_pages(b, dst), _pages(b, src[:PAGE]))
    # zero-copy set, generic get (into SGLang's dummy page, then SGLang's own set_from_flat_data_page)
    assert b.batch_set_v1(k[1:], src[PAGE:], HiCacheStorageExtraInfo(prefix_keys=[])) == [True]
    flat = b.get(k[1], pool.get_dummy_flat_data_page())
    assert flat is not None
    dst2 = pool.alloc(PAGE)
    pool.set_from_flat_data_page(int(dst2[0]), flat)
    assert torch.equal(_pages(b, dst2), _pages(b, src[PAGE:]))


def test_a_host_pool_with_state_outside_its_kv_buffer_is_refused(sgl_server: ServerProcess, backend: Make) -> None:
    """SGLang's MXFP8 MHA host pool keeps each page's block scales outside ``kv_buffer`` (its own
    L3 page methods refuse: "a page's UE8M0 scales live outside kv_buffer"); kvdock moving only
    ``kv_buffer`` would load pages with another page's scales. The pool needs CUDA to build, so
    this is a real page_first MHA pool given that class (its own ``get_size_per_token``)."""
    pool = host_pool(False, "page_first")
    pool.__class__ = MHATokenToKVPoolMXFP8Host
    pool.k_sf_page_bytes = pool.v_sf_page_bytes = 4 * pool.layer_num * PAGE  # (one UE8M0 byte per 32)
    assert pool.get_size_per_token() > 2 * pool.layer_num * pool.head_num * pool.head_dim * pool.dtype.itemsize
    b = KvdockHiCacheStorage(_config(sgl_server, "r4-mxfp8"), {})
    with pytest.raises(UnsupportedLayoutError, match="outside"):
        b.register_mem_pool_host(pool)


def test_sglangs_prefetch_and_backup_threads_share_one_backend(sgl_server: ServerProcess, backend: Make) -> None:
    """SGLang's backup thread stores while its prefetch thread looks up and loads, on one backend:
    every page reported loaded holds exactly the bytes stored under its key, and nothing raises."""
    pool = host_pool(False, "page_first_direct", pages=64)
    b = backend(storage_config(sgl_server, **{"kvdock.model_name": "r4-threads"}), pool)
    fill(pool, seed=41)
    prompts = [sglang_page_hashes(_tokens(2, seed=500 + i), PAGE) for i in range(12)]
    srcs = [pool.alloc(2 * PAGE) for _ in prompts]
    info = HiCacheStorageExtraInfo(prefix_keys=[])
    errors: list[BaseException] = []

    def backup() -> None:
        try:
            for keys, src in zip(prompts, srcs, strict=True):
                b.batch_set_v1(keys, src, info)
        except BaseException as e:  # pragma: no cover - the failure is asserted below
            errors.append(e)

    def prefetch() -> None:
        try:
            for _ in range(3):
                for keys, src in zip(prompts, srcs, strict=True):
                    n = b.batch_exists(keys, info)
                    dst = pool.alloc(2 * PAGE)
                    got = b.batch_get_v1(keys[:n], dst[: n * PAGE], info) if n else []
                    k = sum(got)
                    assert got == [True] * k + [False] * (n - k)
                    if k:
                        assert torch.equal(_pages(b, dst[: k * PAGE]), _pages(b, src[: k * PAGE]))
                    pool.free(dst)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=backup), threading.Thread(target=prefetch)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert all(not t.is_alive() for t in threads)
    # afterwards every prompt loads whole
    for keys, src in zip(prompts, srcs, strict=True):
        dst = pool.alloc(2 * PAGE)
        assert b.batch_get_v1(keys, dst, info) == [True, True]
        assert torch.equal(_pages(b, dst), _pages(b, src))
        pool.free(dst)


def test_a_kvdock_restart_between_calls_re_registers_and_never_serves_stale_pages(backend: Make, tmp_path: Any) -> None:
    """The server restarts (same ports, empty, the model forgotten) between SGLang's calls: the
    pages stored before are misses, the backend registers again, and what it stores then is what
    it loads."""
    srv = start_server("--no-disk", chunk_size=PAGE, l1_size="64MiB", log_path=tmp_path / "a.log")
    pool = host_pool(False, "layer_first")
    settings = {"kvdock.model_name": "r4-restart", "kvdock.timeout": 5, "kvdock.retry_s": 0}
    b = backend(storage_config(srv, **settings), pool)
    fill(pool, seed=51)
    keys = sglang_page_hashes(_tokens(2, seed=52), PAGE)
    info = HiCacheStorageExtraInfo(prefix_keys=[])
    src = pool.alloc(2 * PAGE)
    assert b.batch_set_v1(keys, src, info) == [True, True]
    srv.stop()
    srv = start_server(
        "--no-disk", chunk_size=PAGE, l1_size="64MiB", log_path=tmp_path / "b.log", port=srv.port,
        http_port=srv.http_port,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while b.batch_exists(keys, info) != 0 or b.batch_set_v1(keys, src, info) != [True, True]:
            assert time.monotonic() < deadline, dict(b.stats)
            time.sleep(0.2)
        dst = pool.alloc(2 * PAGE)
        assert b.batch_get_v1(keys, dst, info) == [True, True]
        assert torch.equal(_pages(b, dst), _pages(b, src))
    finally:
        srv.stop()


def test_an_engine_of_another_tensor_parallel_degree_loads_the_heads_in_order(
    sgl_server: ServerProcess, backend: Make
) -> None:
    """Two TP ranks store their heads as shards; a TP=1 engine of the same model (all heads)
    loads each page as rank 0's heads then rank 1's, and what it stores the ranks load back."""
    name = "r4-tp-degrees"
    ranks = []
    for r in range(2):
        pool = host_pool(False, "page_head", heads=HEADS // 2)
        fill(pool, seed=60 + r)
        ranks.append(backend(storage_config(sgl_server, tp_rank=r, tp_size=2, **{"kvdock.model_name": name}), pool))
    one_pool = host_pool(False, "page_first")
    one = backend(storage_config(sgl_server, **{"kvdock.model_name": name}), one_pool)
    info = HiCacheStorageExtraInfo(prefix_keys=[])
    keys = sglang_page_hashes(_tokens(2, seed=61), PAGE)
    src = [b.mem_pool_host.alloc(2 * PAGE) for b in ranks]
    for b, s in zip(ranks, src, strict=True):
        assert b.batch_set_v1(keys, s, info) == [True, True]
    dst = one_pool.alloc(2 * PAGE)
    assert one.batch_get_v1(keys, dst, info) == [True, True]
    whole = torch.cat([_pages(b, s) for b, s in zip(ranks, src, strict=True)], dim=3)
    assert torch.equal(_pages(one, dst), whole)
    # the other way: the TP=1 engine stores, each rank loads its heads
    fill(one_pool, seed=62)
    keys2 = sglang_page_hashes(_tokens(2, seed=63), PAGE)
    src1 = one_pool.alloc(2 * PAGE)
    assert one.batch_set_v1(keys2, src1, info) == [True, True]
    d = _pages(one, src1).shape[3] // 2
    for b in ranks:  # every rank's exists first (SGLang all-reduces its hit count), then the gets
        assert b.batch_exists(keys2, info) == 2
    for r, b in enumerate(ranks):
        got = b.mem_pool_host.alloc(2 * PAGE)
        assert b.batch_get_v1(keys2, got, info) == [True, True]
        assert torch.equal(_pages(b, got), _pages(one, src1)[..., r * d : (r + 1) * d])

"""Review R4 of the SGLang HiCache backend (issue 26): adversarial cases, against SGLang 0.5.23's
own storage config and host pools."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, HiCacheStorageExtraInfo

from conftest import PAGE, host_pool, storage_config
from kvdock.integrations.sglang import KvdockHiCacheStorage
from kvdock.keying import sglang_page_hashes
from kvdock.keys import normalize_tokens
from kvdock.testing import ServerProcess

Make = Callable[..., KvdockHiCacheStorage]


def _tokens(n_pages: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return normalize_tokens(rng.integers(0, 50_000, n_pages * PAGE).tolist())


def _fill(pool: Any, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=g).to(pool.kv_buffer.dtype))


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
        _fill(pool, seed=100 + r)
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

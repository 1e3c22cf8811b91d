"""Tests that need SGLang (0.5.23, ``scripts/sglang-venv``). They run in their own virtual
environment (``.ci/run`` makes it), never in the main one, which has no SGLang: the real host
pools, ``HiCacheStorageConfig``, the storage factory and SGLang's own page hash."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, HiCacheStorageExtraInfo
from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import _mha_host_inputs
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

from kvdock.integrations.sglang import KvdockHiCacheStorage
from kvdock.keys import normalize_tokens
from kvdock.testing import ServerProcess, start_server

PAGE = 16  # SGLang's page size = kvdock's chunk size in these tests
MODEL = "sgl-tiny"
LAYERS = 3
HEADS = 4  # KV heads of the whole model
HEAD_DIM = 32
LATENT = 64 + 16  # kv_lora_rank + qk_rope_head_dim
DTYPE = torch.bfloat16
LAYOUTS = ("layer_first", "page_first", "page_first_direct")


def prompt(n_pages: int, seed: int, tail: int = 5) -> np.ndarray:
    """``n_pages`` whole pages of random token ids (``seed``) and ``tail`` more (a partial page)."""
    return normalize_tokens(np.random.default_rng(seed).integers(0, 50_000, n_pages * PAGE + tail).tolist())


def fill(pool: Any, seed: int) -> None:
    """Random KV (``seed``) in every page of the host pool ``pool``."""
    g = torch.Generator().manual_seed(seed)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=g).to(pool.kv_buffer.dtype))


def pages_kv(b: KvdockHiCacheStorage, idx: torch.Tensor) -> torch.Tensor:
    """The host pool's pages at ``idx`` (one index per token) as ``[planes, L, T, D]``."""
    assert b.pages is not None
    return torch.cat([b.pages.page(int(i)).flatten(3) for i in idx[::PAGE]], dim=2)


def extra(prefix: list[str]) -> HiCacheStorageExtraInfo:
    """SGLang's extra info of a call whose keys are chained after ``prefix`` (its prefix_keys)."""
    return HiCacheStorageExtraInfo(prefix_keys=prefix)


def host_pool(mla: bool, layout: str, heads: int = HEADS, pages: int = 32, groups: int = 1) -> Any:
    """A real SGLang host pool on CPU (its device pool on "cpu", no pinning), ``pages`` pages
    (an MHA ``page_unified`` pool: ``groups`` head groups, SGLang's ``head_group_num``).
    (Booked against a budget of 8 GiB: SGLang otherwise refuses a host pool while the machine
    has less than 10 GiB available, its reserve for everything else.)"""
    with host_memory_budget_scope(8 << 30):
        return _host_pool(mla, layout, heads, pages, groups)


def _host_pool(mla: bool, layout: str, heads: int, pages: int, groups: int = 1) -> Any:
    size = pages * PAGE // 2
    if mla:
        dev = MLATokenToKVPool(
            size=size, page_size=PAGE, dtype=DTYPE, kv_lora_rank=64, qk_rope_head_dim=16, layer_num=LAYERS,
            device="cpu", enable_memory_saver=False,
        )  # fmt: skip
        info = dev.get_device_pool_infos()[0].buffer_info
        return MLATokenToKVPoolHost(
            info, host_to_device_ratio=2.0, host_size=0, page_size=PAGE, layout=layout, pin_memory=False,
            device="cpu", device_capacity_tokens=dev.size, start_layer=dev.start_layer, end_layer=dev.end_layer,
            target_layer_num=dev.layer_num, override_kv_cache_dim=dev.kv_cache_dim,
        )  # fmt: skip
    dev = MHATokenToKVPool(
        size=size, page_size=PAGE, dtype=DTYPE, head_num=heads, head_dim=HEAD_DIM, layer_num=LAYERS,
        device="cpu", enable_memory_saver=False,
    )  # fmt: skip
    cls, info, kw = _mha_host_inputs(dev)
    if groups != 1:
        kw["head_group_num"] = groups
    return cls(
        info, host_to_device_ratio=2.0, host_size=0, page_size=PAGE, layout=layout, pin_memory=False, device="cpu", **kw
    )


def storage_config(
    srv: Any, *, mla: bool = False, tp_rank: int = 0, tp_size: int = 1, v1: bool = True, **extra: Any
) -> HiCacheStorageConfig:
    """SGLang's storage config for a ``dynamic`` kvdock backend of server ``srv``."""
    cfg: dict[str, Any] = {
        "backend_name": "kvdock",
        "module_path": "kvdock.integrations.sglang",
        "class_name": "KvdockHiCacheStorage",
        "interface_v1": int(v1),
        "kvdock.url": srv.url,
        "kvdock.http_url": srv.http_url,
        "kvdock.timeout": 10,
    }
    cfg.update(extra)
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=mla,
        enable_storage_metrics=False, is_page_first_layout=False, model_name=MODEL, extra_config=cfg,
    )  # fmt: skip


@pytest.fixture(scope="module")
def sgl_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A kvdock server for a test file (chunks of PAGE tokens, no L2)."""
    log = tmp_path_factory.mktemp("srv") / "server.log"
    srv = start_server("--no-disk", chunk_size=PAGE, l1_size="128MiB", log_path=log)
    yield srv
    srv.stop()


@pytest.fixture
def backend() -> Iterator[Callable[..., KvdockHiCacheStorage]]:
    """Factory: a KvdockHiCacheStorage over a host pool (closed at teardown)."""
    made: list[KvdockHiCacheStorage] = []

    def make(config: HiCacheStorageConfig, pool: Any) -> KvdockHiCacheStorage:
        b = KvdockHiCacheStorage(config, {})
        b.register_mem_pool_host(pool)
        made.append(b)
        return b

    yield make
    for b in made:
        b.close()

"""Test-only import hook for SGLang's HiCache on a CPU-only torch (the engine tests put this
directory on the engine processes' ``PYTHONPATH``; never installed).

SGLang's host KV pool pins its buffers with CUDA and moves pages between the host pool and the
device pool with CUDA/Triton kernels. On CPU the "device" pool is host memory too, so this hook
(after ``sglang.srt.mem_cache.pool_host.*`` is imported) allocates the host buffers unpinned and
replaces the host pool's two transfer methods by torch indexing: a load of one layer and a
backup of every layer, for the MHA pool in the ``layer_first`` and ``page_first`` layouts (the
per-layer views ``k_data_refs`` / ``v_data_refs``). It also lowers SGLang's host memory reserve
(10 GiB kept free) to 1 GiB."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any

_TARGETS = (
    "sglang.srt.mem_cache.pool_host.base",
    "sglang.srt.mem_cache.pool_host.common",
    "sglang.srt.mem_cache.pool_host.mha",
)


def _unpinned(dims: Any, dtype: Any, device: Any, pin_memory: bool, *args: Any, **kwargs: Any) -> Any:
    import torch

    return torch.empty(dims, dtype=dtype, device=device)


def _load_one_layer(self: Any, device_pool: Any, host_indices: Any, device_indices: Any, layer_id: int,
                    io_backend: Any, *, is_draft: bool = False) -> None:  # fmt: skip
    if not is_draft and not 0 <= layer_id < self.target_layer_num:
        return
    h, d = host_indices.long(), device_indices.long()
    self.device_k_buffers[layer_id][d] = self.k_data_refs[layer_id][h]
    self.device_v_buffers[layer_id][d] = self.v_data_refs[layer_id][h]


def _backup_all_layers(self: Any, device_pool: Any, host_indices: Any, device_indices: Any, io_backend: Any) -> None:
    h, d = host_indices.long(), device_indices.long()
    for layer in range(self.layer_num):
        self.k_data_refs[layer][h] = self.device_k_buffers[layer][d]
        self.v_data_refs[layer][h] = self.device_v_buffers[layer][d]


def _patch(module: ModuleType) -> None:
    if module.__name__.endswith(".base"):
        # SGLang keeps 10 GiB of host memory free for everything else: more than a test VM
        # has available while other jobs run; the tests' host pools are a few MiB
        module.HICACHE_HOST_MEMORY_RESERVE_BYTES = 1 << 30  # type: ignore[attr-defined]
    elif module.__name__.endswith(".common"):
        module.ALLOC_MEMORY_FUNCS.default_factory = lambda: _unpinned  # type: ignore[attr-defined]
        module.ALLOC_MEMORY_FUNCS.clear()  # type: ignore[attr-defined]
    else:
        cls = module.MHATokenToKVPoolHost  # type: ignore[attr-defined]
        cls.load_to_device_per_layer = _load_one_layer
        cls.backup_from_device_all_layer = _backup_all_layers


class _Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _TARGETS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        loader = spec.loader
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            _patch(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


sys.meta_path.insert(0, _Hook())

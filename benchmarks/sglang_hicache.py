"""Throughput of kvdock as SGLang's HiCache storage backend (run in ``.venv-sglang``).

``batch_set_v1`` (host pool pages -> kvdock) and ``batch_get_v1`` (kvdock -> other host pages)
of one batch of pages, against a plain multi-threaded memcpy of the same bytes
(:func:`kvdock.memcpy.copy` of one contiguous buffer) and against SGLang's own ``file`` backend
(its generic ``batch_set`` / ``batch_get`` of flat pages, as SGLang's cache controller calls
them, files under ``--file-dir``: by default a tmpfs, so the page cache is not the difference)::

    .venv-sglang/bin/python benchmarks/sglang_hicache.py [--layers 16 --heads 8 --page 64 --pages 32]

Every set stores pages kvdock does not hold yet (new keys each round); every get loads all of
them. Prints one table row per layout: GB/s and the ratio to memcpy.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from typing import Any

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "integrations", "sglang"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page", type=int, default=64)
    p.add_argument("--pages", type=int, default=32, help="pages per batch")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--file-dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    args = p.parse_args()

    import conftest as sg  # the tests' host pools and storage config
    from kvdock.memcpy import copy
    from kvdock.testing import start_server

    sg.PAGE, sg.LAYERS, sg.HEAD_DIM = args.page, args.layers, args.head_dim
    n = args.pages
    page_bytes = 2 * args.layers * args.page * args.heads * args.head_dim * 2
    total = n * page_bytes
    print(f"{n} pages of {page_bytes / 2**20:.1f} MiB ({total / 2**20:.0f} MiB a batch), bfloat16, "
          f"{torch.get_num_threads()} torch threads, {os.cpu_count()} CPUs")  # fmt: skip

    src = torch.empty(total, dtype=torch.uint8)
    dst = torch.empty(total, dtype=torch.uint8)
    src.random_(0, 255)
    copy(dst, src)
    memcpy = best(lambda: copy(dst, src), args.rounds)
    print(f"memcpy (kvdock.memcpy, contiguous): {total / memcpy / 1e9:.2f} GB/s")
    print(f"{'layout':<18} {'set GB/s':>9} {'x memcpy':>9} {'get GB/s':>9} {'x memcpy':>9}   "
          f"{'file set':>9} {'file get':>9}")  # fmt: skip
    l1 = f"{max(2 * args.rounds + 4, 8) * total // 2**20 + 256}MiB"
    srv = start_server("--no-disk", chunk_size=args.page, l1_size=l1)
    try:
        for layout in sg.LAYOUTS:
            pool = sg.host_pool(False, layout, heads=args.heads, pages=4 * n)
            pool.kv_buffer.view(torch.int16).random_(-1000, 1000)
            src_idx, dst_idx = pool.alloc(n * args.page), pool.alloc(n * args.page)
            t_set, t_get = kvdock_backend(sg, srv, layout, pool, src_idx, dst_idx, n, args.rounds)
            f_set, f_get = file_backend(sg, pool, src_idx, dst_idx, n, args)
            print(f"{layout:<18} {total / t_set / 1e9:>9.2f} {memcpy / t_set:>9.2f} {total / t_get / 1e9:>9.2f} "
                  f"{memcpy / t_get:>9.2f}   {total / f_set / 1e9:>9.2f} {total / f_get / 1e9:>9.2f}")  # fmt: skip
    finally:
        srv.stop()


def kvdock_backend(
    sg: Any, srv: Any, layout: str, pool: Any, src_idx: torch.Tensor, dst_idx: torch.Tensor, n: int, rounds: int
) -> tuple[float, float]:
    """kvdock's backend on its zero-copy path, as SGLang's cache controller calls it."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

    from kvdock.integrations.sglang import KvdockHiCacheStorage

    cfg = sg.storage_config(srv, **{"kvdock.model_name": f"bench-{layout}", "kvdock.timeout": 60})
    b = KvdockHiCacheStorage(cfg, {})
    b.register_mem_pool_host(pool)
    counter = iter(range(10**6))
    none = HiCacheStorageExtraInfo(prefix_keys=[])

    def put() -> list[str]:
        keys = [f"{next(counter):064x}" for _ in range(n)]
        assert all(b.batch_set_v1(keys, src_idx, none)), b.stats
        return keys

    def get() -> None:
        assert all(b.batch_get_v1(keys, dst_idx, none)), b.stats

    try:
        t_set = best(put, rounds)
        keys = put()
        t_get = best(get, rounds)
        assert b.pages is not None
        got, want = (b.pages.page(int(i[0])).view(torch.int16) for i in (dst_idx, src_idx))  # (bits: NaNs too)
        assert torch.equal(got, want)
        return t_set, t_get
    finally:
        b.close()


def file_backend(
    sg: Any, pool: Any, src_idx: torch.Tensor, dst_idx: torch.Tensor, n: int, args: Any
) -> tuple[float, float]:
    """SGLang's ``file`` backend, driven as its cache controller's generic path drives it."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile

    root = tempfile.mkdtemp(prefix="hicache-bench-", dir=args.file_dir)
    try:
        cfg = sg.storage_config(_NoServer(), v1=False, file_storage_path=root)
        f = HiCacheFile(cfg, file_path=root)
        P = args.page
        rounds = iter(range(10**6))

        def put() -> list[str]:
            keys = [f"{next(rounds):064x}" for _ in range(n)]
            assert f.batch_set(keys, [pool.get_data_page(int(src_idx[i * P])) for i in range(n)])
            return keys

        t_set = best(put, args.rounds)
        keys = put()

        def get() -> None:
            pages = f.batch_get(keys, [pool.get_dummy_flat_data_page() for _ in keys])
            for i, data in enumerate(pages):
                pool.set_from_flat_data_page(int(dst_idx[i * P]), data)

        return t_set, best(get, args.rounds)
    finally:
        shutil.rmtree(root, ignore_errors=True)


class _NoServer:
    url = "tcp://127.0.0.1:1"
    http_url = "http://127.0.0.1:1"


def best(fn: Any, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.min(times))


if __name__ == "__main__":
    main()

"""Throughput of kvdock as SGLang's HiCache storage backend (run in ``.venv-sglang``).

``batch_set_v1`` (host pool pages -> kvdock) and ``batch_get_v1`` (kvdock -> other host pages)
of one batch of pages, against two copies of the same bytes between two contiguous buffers --
``memcpy``: kvdock's own (:func:`kvdock.memcpy.copy`: streaming stores, two threads here), the
fastest copy this machine does; ``glibc``: a plain glibc ``memmove``, a part of the bytes on each
of as many threads (kept waiting: no thread start timed) -- and against SGLang's own ``file`` backend
(its generic ``batch_set`` / ``batch_get`` of flat pages, as SGLang's cache controller calls
them, files under ``--file-dir``: by default a tmpfs, so the page cache is not the difference)::

    .venv-sglang/bin/python benchmarks/sglang_hicache.py [--layers 16 --heads 8 --page 64 --pages 32]

Every set stores pages kvdock does not hold yet (new keys each round; one kvdock server per
layout, whose L1 holds them all: no eviction); every get loads all of them, and the server has
handled the report of its reads (untimed) before the next round (else that report, the get's own
server work, rode on the next set's first request). Each round starts once the backend's mapping
of kvdock's pool is prefaulted (the steady state of an engine). Prints one table row per layout:
GB/s and the ratios to both copies. The server has no L2 tier (``--no-disk``) unless ``--l2-dir`` is
given: then each set's pages are also written down to disk behind it, while the next rounds run.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import os
import shutil
import sys
import tempfile
import time
from typing import Any

import numpy as np
import torch

from kvdock.protocol.requests import Ping

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
    p.add_argument("--l2-dir", help="give the kvdock server an L2 disk tier in a new directory under this one "
                   "(default: none, --no-disk): every set is then written down to disk behind it")  # fmt: skip
    args = p.parse_args()

    import conftest as sg  # the tests' host pools and storage config
    from kvdock.memcpy import copy, default_threads
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
    glibc = Glibc(default_threads())
    print("memcpy: kvdock.memcpy.copy of one contiguous buffer of the batch's bytes, timed in each round right")
    print("before the set and the get it is compared with (medians of the ratios: they hold under load); glibc:")
    print("glibc memmove of the buffer in parts on as many threads, in rounds of its own (ratios of the medians)")
    print(f"{'layout':<18} {'memcpy':>7} {'glibc':>6} {'set GB/s':>9} {'x memcpy':>9} {'x glibc':>8} {'get GB/s':>9} "
          f"{'x memcpy':>9} {'x glibc':>8}   {'file set':>9} {'file get':>9}")  # fmt: skip
    # a server per layout, whose L1 holds every round's pages: each row is timed without eviction
    # (one server for all three evicted during the last layout's rounds, which then paid for it)
    l1 = f"{(args.rounds + 4) * total // 2**20 + 256}MiB"
    for layout in sg.LAYOUTS:
        tier = ["--no-disk"]
        if args.l2_dir:
            tier = ["--disk-dir", tempfile.mkdtemp(prefix="kvdock-l2-", dir=args.l2_dir), "--disk-size", l1]
        srv = start_server(*tier, chunk_size=args.page, l1_size=l1)
        try:
            pool = sg.host_pool(False, layout, heads=args.heads, pages=4 * n)
            pool.kv_buffer.view(torch.int16).random_(-1000, 1000)
            src_idx, dst_idx = pool.alloc(n * args.page), pool.alloc(n * args.page)
            baselines = (lambda: copy(dst, src), lambda: glibc(dst.data_ptr(), src.data_ptr(), total))
            r = kvdock_backend(sg, srv, layout, pool, src_idx, dst_idx, n, args.rounds, baselines)
        finally:
            srv.stop()
            if args.l2_dir:
                shutil.rmtree(tier[1], ignore_errors=True)
        f_set, f_get = file_backend(sg, pool, src_idx, dst_idx, n, args)
        gb = [total / t / 1e9 for t in (r["memcpy"], r["glibc"], r["set"], r["get"], f_set, f_get)]
        print(f"{layout:<18} {gb[0]:>7.2f} {gb[1]:>6.2f} {gb[2]:>9.2f} {r['x_set']:>9.2f} {r['g_set']:>8.2f} "
              f"{gb[3]:>9.2f} {r['x_get']:>9.2f} {r['g_get']:>8.2f}   {gb[4]:>9.2f} {gb[5]:>9.2f}",
              flush=True)  # fmt: skip


def kvdock_backend(
    sg: Any, srv: Any, layout: str, pool: Any, src_idx: torch.Tensor, dst_idx: torch.Tensor, n: int, rounds: int,
    baselines: tuple[Any, Any],
) -> dict[str, float]:  # fmt: skip
    """kvdock's backend on its zero-copy path, as SGLang's cache controller calls it: the median
    time of a set, a get and each baseline copy (kvdock's memcpy, glibc's); the median ratios to
    the memcpy timed right before each, and the ratios of the medians to glibc's."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

    from kvdock.integrations.sglang import KvdockHiCacheStorage

    cfg = sg.storage_config(srv, **{"kvdock.model_name": f"bench-{layout}", "kvdock.timeout": 60})
    b = KvdockHiCacheStorage(cfg, {})
    b.register_mem_pool_host(pool)
    prefaulted(b)
    none = HiCacheStorageExtraInfo(prefix_keys=[])
    memcpy, glibc = baselines
    # glibc's copy in rounds of its own first: timed between the set and the memcpy before it, it
    # slowed the sets (the server then idle longer before each), so only the medians are compared
    g = float(np.median([timed(glibc) for _ in range(rounds + 1)][1:]))
    rows: list[tuple[float, float, float, float]] = []
    try:
        for r in range(rounds + 1):  # (round 0 warms up)
            keys = [f"{r:032x}{i:032x}" for i in range(n)]  # new pages every round
            m1 = timed(memcpy)
            t_set = timed(lambda k=keys: all(b.batch_set_v1(k, src_idx, none)) or fail(b.stats))
            m2 = timed(memcpy)
            t_get = timed(lambda k=keys: all(b.batch_get_v1(k, dst_idx, none)) or fail(b.stats))
            settled(b)  # (untimed: the get's reads reported, their server work done before the next round)
            if r:
                rows.append((m1, t_set, m2, t_get))
        assert b.pages is not None
        for j in range(n):  # every page arrived, bit for bit (NaNs too)
            got, want = (b.pages.page(int(i[j * sg.PAGE])).view(torch.int16) for i in (dst_idx, src_idx))
            assert torch.equal(got, want), j
    finally:
        b.close()
    a = np.array(rows)
    return {
        "memcpy": float(np.median(np.concatenate([a[:, 0], a[:, 2]]))),
        "set": float(np.median(a[:, 1])),
        "get": float(np.median(a[:, 3])),
        "x_set": float(np.median(a[:, 0] / a[:, 1])),
        "x_get": float(np.median(a[:, 2] / a[:, 3])),
        "glibc": g,
        "g_set": g / float(np.median(a[:, 1])),
        "g_get": g / float(np.median(a[:, 3])),
    }


class Glibc:
    """glibc ``memmove`` (through ctypes, which releases the GIL) of ``n`` bytes in ``threads``
    parts, one on the calling thread and one on each of the others, which wait for them (started
    once, so no thread start is timed): as many threads as kvdock's copy uses."""

    def __init__(self, threads: int) -> None:
        self.threads = max(1, threads)
        self.pool = concurrent.futures.ThreadPoolExecutor(self.threads - 1) if self.threads > 1 else None

    def __call__(self, dst: int, src: int, n: int) -> None:
        part = -(-n // self.threads)
        parts = [(dst + at, src + at, min(part, n - at)) for at in range(0, n, part)]
        others = [self.pool.submit(ctypes.memmove, *p) for p in parts[1:]] if self.pool else []
        ctypes.memmove(*parts[0])
        for f in others:
            f.result()


def settled(b: Any) -> None:
    """Wait until the server has handled what the last get left it: a get answered from the pool
    directory (no round trip) reports its reads later (``FastReads``: the LRU touches of its
    pages, ~7 us a page of server work), sent before the context's next request. Unsettled, the
    next set's PrepareStore carried that report (the get's server work timed as the set's). A
    Ping, untimed, flushes it: each call is timed as SGLang's thread sees it, and no call's
    background work lands in another's (or a memcpy's) timing."""
    ctx = b._context()
    assert ctx is not None, b.stats
    ctx.ask(Ping())


def prefaulted(b: Any, timeout: float = 60.0) -> None:
    """Wait until the backend's mapping of kvdock's pool has its page tables filled (the
    background prefault a connect starts: an engine's first second; before it, each copy first
    faults its slots in itself), so the rounds time the steady state."""
    ctx = b._context()
    assert ctx is not None, b.stats
    deadline = time.monotonic() + timeout
    with ctx.transfer() as t:
        while not getattr(getattr(t, "_prefault", None), "done", True) and time.monotonic() < deadline:
            time.sleep(0.02)


def timed(fn: Any) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def fail(why: object) -> bool:
    raise AssertionError(why)


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

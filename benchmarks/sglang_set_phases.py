"""Where one SGLang ``batch_set_v1`` spends its time (run in ``.venv-sglang``), beside a memcpy.

Each round times a memcpy of the batch's bytes (:func:`kvdock.memcpy.copy`, as
``benchmarks/sglang_hicache.py``) and then a set of new pages through kvdock's backend, with its
phases timed by wrapping the SDK's calls in this process: the PrepareStore and CommitStore round
trips (``KVCacheContext.ask`` / ``ask_frames``) and the copy into the pool (``ShmTransfer.write``);
the rest is the backend's and the SDK's Python. Then the round trip of a Ping to the same server
back to back, after 2 ms of the client spinning, and after 6 ms of the client sleeping: what a
request pays when the processes were idle (on a VM, an idle vCPU halts and waking it costs)::

    .venv-sglang/bin/python benchmarks/sglang_set_phases.py [--rounds 12] [--layouts page_first,...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict
from typing import Any

import torch

from kvdock.protocol.requests import Ping

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "integrations", "sglang"))

PHASES: list[tuple[str, float]] = []


def _timed_calls() -> None:
    """Wrap the SDK's request calls and the shared-memory copy so that each records its time."""
    from kvdock.sdk import _transfer, context

    def wrap(fn: Any, name: Any) -> Any:
        def timed(*args: Any, **kw: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                PHASES.append((name(args), time.perf_counter() - t))

        return timed

    ctx_cls = context.KVCacheContext
    ctx_cls.ask = wrap(ctx_cls.ask, lambda a: type(a[1]).__name__)  # type: ignore[method-assign]
    ctx_cls.ask_frames = wrap(ctx_cls.ask_frames, lambda a: type(a[1]).__name__)  # type: ignore[method-assign]
    _transfer.ShmTransfer.write = wrap(_transfer.ShmTransfer.write, lambda a: "copy")  # type: ignore[method-assign]


def ms(xs: list[float]) -> float:
    return statistics.median(xs) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--pages", type=int, default=32)
    p.add_argument("--layouts", default="layer_first,page_first,page_first_direct")
    args = p.parse_args()

    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

    import conftest as sg  # the tests' host pools and storage config
    from kvdock.integrations.sglang import KvdockHiCacheStorage
    from kvdock.memcpy import copy
    from kvdock.testing import start_server
    from sglang_hicache import prefaulted  # (this directory: the throughput benchmark's)

    _timed_calls()
    sg.PAGE, sg.LAYERS, sg.HEAD_DIM = 64, 16, 128
    n = args.pages
    total = n * 2 * sg.LAYERS * sg.PAGE * 8 * sg.HEAD_DIM * 2
    src, dst = torch.empty(total, dtype=torch.uint8), torch.empty(total, dtype=torch.uint8)
    src.random_(0, 255)
    copy(dst, src)
    print(f"{n} pages of {total / n / 2**20:.1f} MiB; load average {os.getloadavg()[0]:.2f}")
    for layout in args.layouts.split(","):
        srv = start_server("--no-disk", chunk_size=sg.PAGE, l1_size=f"{(args.rounds + 4) * total // 2**20 + 256}MiB")
        try:
            pool = sg.host_pool(False, layout, heads=8, pages=4 * n)
            pool.kv_buffer.view(torch.int16).random_(-1000, 1000)
            src_idx = pool.alloc(n * sg.PAGE)
            b = KvdockHiCacheStorage(sg.storage_config(srv, **{"kvdock.model_name": f"phases-{layout}"}), {})
            b.register_mem_pool_host(pool)
            prefaulted(b)  # (the steady state: the backend's mapping of the pool populated)
            ctx = b._context()
            assert ctx is not None, b.stats
            none = HiCacheStorageExtraInfo(prefix_keys=[])
            memcpy, sets, phases = [], [], defaultdict(list)
            for r in range(args.rounds + 1):  # (round 0 warms up)
                t = time.perf_counter()
                copy(dst, src)
                m = time.perf_counter() - t
                ctx.ask(Ping())
                PHASES.clear()
                keys = [f"{r:016x}{i:048x}" for i in range(n)]
                t = time.perf_counter()
                assert all(b.batch_set_v1(keys, src_idx, none)), b.stats
                s = time.perf_counter() - t
                if r:
                    memcpy.append(m)
                    sets.append(s)
                    for name, d in PHASES:
                        phases[name].append(d)
                    phases["rest"].append(s - sum(d for _, d in PHASES))
            print(f"{layout}: memcpy {ms(memcpy):.2f} ms, set {ms(sets):.2f} ms ({ms(memcpy) / ms(sets):.2f}x memcpy)")
            print("   " + ", ".join(f"{k} {ms(v):.2f}" for k, v in sorted(phases.items())) + " (ms, medians)")
            print("   Ping: " + ", ".join(f"{k} {v * 1e6:.0f} us" for k, v in pings(ctx).items()))
            b.close()
        finally:
            srv.stop()


def pings(ctx: Any) -> dict[str, float]:
    """A Ping's round trip (medians of 200): back to back, after the client spun 2 ms, and after
    it slept 6 ms (about a batch's copy)."""
    out: dict[str, list[float]] = defaultdict(list)
    for label, spin, sleep in (
        ("back to back", 0.0, 0.0),
        ("after 2 ms spinning", 0.002, 0.0),
        ("after 6 ms asleep", 0.0, 0.006),
    ):
        for _ in range(200):
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < spin:
                pass
            if sleep:
                time.sleep(sleep)
            t = time.perf_counter()
            ctx.ask(Ping())
            out[label].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in out.items()}


if __name__ == "__main__":
    main()

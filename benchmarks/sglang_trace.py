"""Sustained throughput of kvdock as SGLang's HiCache storage backend on a real request trace
(run in ``.venv-sglang``): the calls SGLang's cache controller makes for the first
``--requests`` requests of a Mooncake trace (``../shared/traces``), with the sizes they have there.

Each request is a prompt of whole 512-token blocks (``benchmarks/trace.py``: block ``b`` is the
token ids ``b * 512 + j``), keyed as SGLang keys it (``get_hash_str``'s page-hash chain, pages of
``--page`` tokens). As the cache controller does, per request: ``batch_exists`` of the prompt's
pages (its storage hit query), ``batch_get_v1`` of the pages found (its prefetch) and
``batch_set_v1`` of the rest (its backup), each in calls of at most ``STORAGE_BATCH_SIZE`` (128)
pages, each call's keys chained after the ones before it (``prefix_keys``). The server's L1
(``--l1``) holds a few dozen requests' pages: it evicts, as a real one does.

Every get and set is paired with two copies of the same number of bytes between two contiguous
buffers, just before it, in turns (each right before the call every other call): kvdock's memcpy
(kvdock.memcpy.copy: streaming stores, its threads; the fastest copy this machine does) and
glibc's ``memmove`` (the bytes in parts on as many threads). The ratios are of the sums: bytes
moved over the time the calls took, against the same bytes copied -- the throughput the trace's
mix of call sizes sees, small calls and their fixed cost included. Before the copies, the read
report the last get left is sent (timed, added to that get: in SGLang the next request pays it)
and an untimed Ping waits until the server has handled it, so that the copies share the CPUs
with nothing; the server's seconds on the reports (its ``/metrics``) are added to the gets.
``batch_exists`` moves no bytes and is reported beside. Each stored page carries a stamp of its
own (written untimed before its set) and each page a get fills is first stamped as no stored
page is: every page a get returns is checked byte for byte against the page it was stored from;
every set must write all its pages (none deduplicated) and every get load all of its.

Not modelled: SGLang's device and host caches (every request's storage query starts at its
first page, where SGLang's starts past what its radix caches hold: a real engine's calls start
later in the prompt), the backup of output tokens, a pinned host pool; and the server has no L2
(``--no-disk``: nothing is written down behind the sets)::

    .venv-sglang/bin/python benchmarks/sglang_trace.py [--requests 150 --layout page_first_direct]
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / ".." / "tests" / "integrations" / "sglang"))
sys.path.insert(0, str(HERE))

from trace import BLOCK, Request, load  # noqa: E402

from sglang_hicache import Glibc, prefaulted  # noqa: E402

BATCH = 128  # sglang.srt.mem_cache.hicache_storage.STORAGE_BATCH_SIZE (checked in main)


class Call(NamedTuple):
    kind: str  # "get", "set" or "exists"
    pages: int  # (0 for exists)
    seconds: float
    memcpy_s: float  # kvdock's memcpy of the same bytes, just before (0 for exists)
    glibc_s: float  # glibc's memmove of them, just before (0 for exists)


SIZES = ((1, 8), (9, 32), (33, 64), (65, 127), (128, 128))  # pages per call, for the table by size


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    traces = HERE / ".." / ".." / "shared" / "traces"
    p.add_argument("--trace", default=str(traces / "mooncake_conversation_trace.jsonl"))
    p.add_argument("--requests", type=int, default=150)
    p.add_argument("--layout", action="append", help="host pool layout (repeatable; default: all three)")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page", type=int, default=64)
    p.add_argument("--l1", default="8GiB", help="the kvdock server's L1 size")
    args = p.parse_args()
    from sglang.srt.mem_cache.hicache_storage import STORAGE_BATCH_SIZE

    import conftest as sg  # the tests' host pools and storage config
    from kvdock.memcpy import copy
    from kvdock.testing import start_server

    assert STORAGE_BATCH_SIZE == BATCH, STORAGE_BATCH_SIZE
    assert BLOCK % args.page == 0, "a block is whole pages"
    sg.PAGE, sg.LAYERS, sg.HEAD_DIM = args.page, args.layers, args.head_dim
    page_bytes = 2 * args.layers * args.page * args.heads * args.head_dim * 2
    reqs = load(Path(args.trace), args.requests)
    load_now = os.getloadavg()[0]
    print(f"{len(reqs)} requests of {Path(args.trace).name}, pages of {args.page} tokens "
          f"({page_bytes / 2**20:.1f} MiB), L1 {args.l1}, {os.cpu_count()} CPUs, load {load_now:.2f}")  # fmt: skip
    src = torch.empty(BATCH * page_bytes, dtype=torch.uint8).random_(0, 255)
    dst = torch.empty_like(src)
    copy(dst, src)  # (its pages faulted in before any copy is timed)
    for layout in args.layout or sg.LAYOUTS:
        srv = start_server("--no-disk", chunk_size=args.page, l1_size=args.l1)
        try:
            pool = sg.host_pool(False, layout, heads=args.heads, pages=2 * BATCH)
            pool.kv_buffer.view(torch.int16).random_(-1000, 1000)
            before = server_seconds(srv, "FastReads")
            calls = replay(sg, srv, layout, pool, reqs, args.page, page_bytes, src, dst)
            reports = server_seconds(srv, "FastReads") - before
        finally:
            srv.stop()
        report(layout, calls, reports, page_bytes)


def replay(
    sg: Any, srv: Any, layout: str, pool: Any, reqs: list[Request], P: int, page_bytes: int,
    src: torch.Tensor, dst: torch.Tensor,
) -> list[Call]:  # fmt: skip
    """The trace's calls through the backend, a :class:`Call` each."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo
    from sglang.srt.mem_cache.utils import get_hash_str

    from kvdock.integrations.sglang import KvdockHiCacheStorage
    from kvdock.memcpy import copy, default_threads
    from kvdock.protocol.requests import Ping

    cfg = sg.storage_config(srv, **{"kvdock.model_name": f"trace-{layout}", "kvdock.timeout": 60})
    b = KvdockHiCacheStorage(cfg, {})
    b.register_mem_pool_host(pool)
    prefaulted(b)
    pages = b.pages
    assert pages is not None
    src_idx, dst_idx = pool.alloc(BATCH * P), pool.alloc(BATCH * P)
    origin: dict[str, tuple[int, int]] = {}  # key -> (the host page of src_idx it was stored from, its stamp)
    calls: list[Call] = []
    ctx = b._context()
    assert ctx is not None, b.stats
    glibc = Glibc(default_threads())

    def stamp(host: int, value: int) -> None:
        """Write ``value`` into the first 8 bytes of host page ``host`` (untimed): every stored
        page has bytes of its own, so a get that copied nothing (or another page) fails the check."""
        v = pages.page(host).view(torch.int16)
        v[(0,) * (v.dim() - 1)][:4] = torch.from_numpy(np.array([value], np.int64).view(np.int16))

    def settle() -> None:
        """Before the baselines of a call: send the read report the last get left (the client's
        cost of it, timed and added to that get: in SGLang the next request pays it), then wait,
        untimed, until the server has handled it (its handler seconds are added to the gets from
        ``/metrics``), so that the copies after share the CPUs with nothing. (After a set the Ping
        waits for no server work: nothing is done past a CommitStore's reply without an L2.)"""
        t = time.perf_counter()
        ctx.reporter.flush()
        sent = time.perf_counter() - t
        if calls and calls[-1].kind == "get":
            calls[-1] = calls[-1]._replace(seconds=calls[-1].seconds + sent)
        ctx.ask(Ping())

    def call(kind: str, fn: Any, n: int) -> Any:
        """``fn()`` timed, after kvdock's memcpy and glibc's memmove of its bytes (in turns, each
        right before it every other call)."""
        nb = n * page_bytes
        settle()
        baselines: dict[str, Callable[[], None]] = {
            "memcpy": lambda: copy(dst[:nb], src[:nb]),
            "glibc": lambda: glibc(dst.data_ptr(), src.data_ptr(), nb),
        }
        timed: dict[str, float] = {}
        for base in ("memcpy", "glibc") if len(calls) % 2 else ("glibc", "memcpy"):  # (each last in turn)
            t = time.perf_counter()
            baselines[base]()
            timed[base] = time.perf_counter() - t
        t = time.perf_counter()
        out = fn()
        calls.append(Call(kind, n, time.perf_counter() - t, timed["memcpy"], timed["glibc"]))
        return out

    stamps = itertools.count(1)
    try:
        for req in reqs:
            tokens = [blk * BLOCK + j for blk in req.blocks for j in range(BLOCK)]
            keys: list[str] = get_hash_str(tokens, None, page_size=P)  # type: ignore[assignment]
            hit = 0  # the storage hit query: batch by batch, up to the first batch not found whole
            while hit < len(keys):
                batch, info = keys[hit : hit + BATCH], HiCacheStorageExtraInfo(prefix_keys=keys[:hit])
                t = time.perf_counter()
                found = b.batch_exists(batch, info)
                calls.append(Call("exists", 0, time.perf_counter() - t, 0.0, 0.0))
                hit += found
                if found < len(batch):
                    break
            for at in range(0, hit, BATCH):  # the prefetch
                batch, info = keys[at : min(hit, at + BATCH)], HiCacheStorageExtraInfo(prefix_keys=keys[:at])
                idx = dst_idx[: len(batch) * P]
                for j in range(len(batch)):
                    stamp(int(idx[j * P]), -1)  # (no stored page's)
                got = call("get", lambda k=batch, i=idx, e=info: b.batch_get_v1(k, i, e), len(batch))
                assert all(got), (got, b.stats)
                for j, k in enumerate(batch):  # each page as it was stored (untimed)
                    host, value = origin[k]
                    stamp(int(src_idx[host * P]), value)
                    want = pages.page(int(src_idx[host * P])).view(torch.int16)
                    assert torch.equal(pages.page(int(idx[j * P])).view(torch.int16), want), (layout, k)
            for at in range(hit, len(keys), BATCH):  # the backup
                batch, info = keys[at : at + BATCH], HiCacheStorageExtraInfo(prefix_keys=keys[:at])
                for j, k in enumerate(batch):
                    origin[k] = (j, next(stamps))
                    stamp(int(src_idx[j * P]), origin[k][1])
                done = call("set", lambda k=batch, e=info: b.batch_set_v1(k, src_idx[: len(k) * P], e), len(batch))
                assert all(done), (done, b.stats)
        settle()
        # every set wrote all its pages (none deduplicated: no byte counted that was not moved)
        assert b.stats["pages_stored"] == sum(c.pages for c in calls if c.kind == "set"), b.stats
        assert b.stats["pages_loaded"] == sum(c.pages for c in calls if c.kind == "get"), b.stats
    finally:
        b.close()
    return calls


def server_seconds(srv: Any, request: str) -> float:
    """The seconds the server spent handling ``request`` messages so far (its
    ``kvdock_request_duration_seconds`` sum, from ``/metrics``)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{srv.http_url}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "kvdock_request_duration_seconds_sum" and s.labels.get("request") == request
    )


def report(layout: str, calls: list[Call], reports: float, page_bytes: int) -> None:
    """Bytes, GB/s and the ratios of the sums to both baselines, for gets (``reports``: the
    server's seconds on their read reports, added), sets, all of them (``batch_exists`` time
    added too) and sets by size."""
    a = np.array([(c.pages, c.seconds, c.memcpy_s, c.glibc_s) for c in calls])
    kinds = np.array([c.kind for c in calls])
    exists_s = float(a[kinds == "exists", 1].sum())
    print(f"{layout}: {int((kinds == 'exists').sum())} batch_exists calls, {exists_s * 1e3:.0f} ms in all; "
          f"the gets' read reports {reports * 1e3:.0f} ms of server work")  # fmt: skip
    print(f"  {'calls':<22} {'n':>5} {'GiB':>7} {'GB/s':>7} {'memcpy':>7} {'glibc':>7} {'x memcpy':>9} {'x glibc':>8}")
    rows = [("get (+ reports)", kinds == "get", reports), ("set", kinds == "set", 0.0)]
    rows.append(("all (+ exists)", kinds != "exists", exists_s + reports))
    rows += [(f"set of {lo}-{hi} pages", (kinds == "set") & (a[:, 0] >= lo) & (a[:, 0] <= hi), 0.0) for lo, hi in SIZES]
    for name, sel, extra in rows:
        if not sel.any():
            continue
        nb = float(a[sel, 0].sum()) * page_bytes
        t, m, g = float(a[sel, 1].sum()) + extra, float(a[sel, 2].sum()), float(a[sel, 3].sum())
        print(f"  {name:<22} {int(sel.sum()):>5} {nb / 2**30:>7.1f} {nb / t / 1e9:>7.2f} {nb / m / 1e9:>7.2f} "
              f"{nb / g / 1e9:>7.2f} {m / t:>9.2f} {g / t:>8.2f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()

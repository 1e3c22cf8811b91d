#!/usr/bin/env python
"""Batch and asyncio benchmark: many small prompts, one call each versus one call for all.

Starts a real ``kvdock serve`` per transport (shared memory, and ``--no-shm``: inline frames),
stores ``--prompts`` prompts of ``--chunks`` chunks each (a 32-layer, 8-head, 128-dim bf16 model,
chunks of ``--chunk-size`` tokens: 2 MiB a chunk at the default 16), then times, in the same run and interleaved:

* ``lookup`` of every prompt in a loop vs one ``lookup_many``;
* ``retrieve`` of every prompt in a loop vs one ``retrieve_many`` vs ``asyncio.gather`` of
  ``kvdock.sdk.aio.retrieve`` on one context;
* as a floor, a plain ``torch`` copy of the same bytes into fresh tensors (what the retrieves must
  at least do).

Each figure is the median of ``--reps`` runs; ratios are against the loop of single calls.

    python benchmarks/batch.py              # 64 prompts of 1 chunk of 16 tokens
    python benchmarks/batch.py --quick
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import kvdock.sdk as kvd
import kvdock.sdk.aio as kva
from kvdock.testing import start_server

sys.path.insert(0, str(Path(__file__).parent))
from common import cpu_busy_s

MODEL = "bench-batch"
GEO = {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128}
CHUNK_NBYTES_PER_TOKEN = 2 * GEO["num_layers"] * GEO["num_kv_heads"] * GEO["head_dim"] * 2


def median_ms(fn: Callable[[], Any], reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def run(transport: str, prompts: int, chunks: int, chunk: int, reps: int) -> list[tuple[str, float]]:
    nbytes = prompts * chunks * chunk * CHUNK_NBYTES_PER_TOKEN
    pool = f"{max(256, 2 * nbytes >> 20)}MiB"
    inline = ["--no-shm"] if transport == "inline" else []
    srv = start_server("--no-disk", *inline, l1_size=pool, chunk_size=chunk)
    try:
        kvd.register_model(srv.url, srv.http_url, MODEL, dtype="bfloat16", **GEO, timeout=30)
        toks = [list(range(i * 1_000_000, i * 1_000_000 + chunks * chunk)) for i in range(prompts)]
        with kvd.connect(srv.url, srv.http_url, MODEL, timeout=60) as ctx:
            kv = torch.randn(2, GEO["num_layers"], chunks * chunk, 8 * 128).to(torch.bfloat16)
            for t in toks:
                kvd.store(ctx, kv, t)
            src = [kv.clone() for _ in range(prompts)]

            async def gather(actx: kva.AsyncKVCacheContext) -> None:
                await asyncio.gather(*(kva.retrieve(actx, t) for t in toks))

            loop = asyncio.new_event_loop()
            actx = loop.run_until_complete(kva.connect(srv.url, srv.http_url, MODEL, timeout=60))
            rows = [
                ("lookup, one call per prompt", lambda: [kvd.lookup(ctx, t) for t in toks]),
                ("lookup_many", lambda: kvd.lookup_many(ctx, toks)),
                ("retrieve, one call per prompt", lambda: [kvd.retrieve(ctx, t) for t in toks]),
                ("retrieve_many", lambda: kvd.retrieve_many(ctx, toks)),
                ("aio.retrieve x N, gathered", lambda: loop.run_until_complete(gather(actx))),
                ("floor: torch copy into fresh tensors", lambda: [torch.empty_like(s).copy_(s) for s in src]),
            ]
            results = {name: [] for name, _ in rows}  # type: dict[str, list[float]]
            for _ in range(reps):  # interleaved, so that load on the machine hits every row alike
                for name, fn in rows:
                    results[name].append(median_ms(fn, 1))
            loop.run_until_complete(actx.close())
            loop.close()
        return [(name, statistics.median(v)) for name, v in results.items()]
    finally:
        srv.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--chunks", type=int, default=1, help="chunks per prompt")
    ap.add_argument("--chunk-size", type=int, default=16, help="tokens per chunk (the server's)")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--quick", action="store_true", help="8 prompts, 3 reps")
    args = ap.parse_args()
    if args.quick:
        args.prompts, args.reps = 8, 3
    cpu0, wall0 = cpu_busy_s(), time.monotonic()
    mib = args.chunk_size * CHUNK_NBYTES_PER_TOKEN / (1 << 20)
    print(
        f"{args.prompts} prompts of {args.chunks} chunk(s) of {args.chunk_size} tokens ({mib:g} MiB a chunk), "
        f"median of {args.reps}"
    )
    for transport in ("shm", "inline"):
        rows = run(transport, args.prompts, args.chunks, args.chunk_size, args.reps)
        base = {"lookup": rows[0][1], "retrieve": rows[2][1]}
        print(f"\n{transport}:\n{'':38}{'ms':>10}  {'x loop':>8}")
        for name, ms in rows:
            ref = base["lookup"] if name.startswith("lookup") else base["retrieve"]
            print(f"  {name:<36}{ms:>10.2f}  {ref / ms:>8.2f}")
    busy = (cpu_busy_s() - cpu0) / (time.monotonic() - wall0)
    print(f"\nmachine: {os.cpu_count()} CPUs, {busy:.2f} of them busy on average during the run (all processes)")


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Sharded-model benchmark: what a model stored in shards (tensor parallelism) costs the SDK.

Starts one real ``kvdock serve`` (shared memory) and registers the same model twice: stored in one
shard (``world_size`` 1) and in ``--shards`` shards (one per rank of a TP engine). Measures through
the public SDK, warm (median of ``--reps``, interleaved):

* whole-model store (``overwrite=True``: every chunk written again) and retrieve into ``out=``
  of a ``[2, L, T, D]`` tensor, for the one-shard and the sharded model: the sharded one copies
  each shard's heads of every token as its own run (``ShardedChunks``), and the server runs each
  request once per shard;
* one rank's retrieve (``kv_rank=0``: ``[2, L, T, D / shards]``, dense runs), and a store of as
  many bytes (a one-shard model of ``D / shards``: one rank's shard cannot be overwritten alone);
* the baseline: a two-thread memmove of the same bytes as the SDK's whole-model copy (the runs
  a one-shard copy makes), measured in this process in the same run.

GB = 1e9 bytes.

    python benchmarks/shards.py            # 32 layers x 8 KV heads x 128, bf16, 4096 tokens, 2 shards
    python benchmarks/shards.py --quick
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

import kvdock.sdk as kvd
from kvdock.testing import start_server

sys.path.insert(0, str(Path(__file__).parent))
from baselines import chunk_runs, memmove2
from common import gbps, timed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8, help="KV heads of the whole model")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.layers, args.tokens, args.reps = 4, 1024, 3
    heads, hd, s = args.kv_heads, args.head_dim, args.shards
    nbytes = 2 * args.layers * args.tokens * heads * hd * 2
    with start_server("--no-disk", l1_size=f"{max(4 * nbytes >> 20, 256)}MiB", chunk_size=args.chunk) as srv:
        common = {"num_layers": args.layers, "head_dim": hd, "dtype": "bfloat16", "timeout": 60}
        kvd.register_model(srv.url, srv.http_url, "one", num_kv_heads=heads, **common)
        kvd.register_model(srv.url, srv.http_url, "sharded", num_kv_heads=heads // s, world_size=s, **common)
        kvd.register_model(srv.url, srv.http_url, "narrow", num_kv_heads=heads // s, **common)
        one = kvd.connect(srv.url, srv.http_url, "one", timeout=60)
        whole = kvd.connect(srv.url, srv.http_url, "sharded", timeout=60)
        rank0 = kvd.connect(srv.url, srv.http_url, "sharded", timeout=60, kv_rank=0)
        narrow = kvd.connect(srv.url, srv.http_url, "narrow", timeout=60)
        tokens = np.arange(args.tokens, dtype=np.uint32)
        kv = torch.randn(2, args.layers, args.tokens, heads * hd).to(torch.bfloat16)
        part = kv[..., : heads * hd // s].contiguous()
        out, out_part = torch.empty_like(kv), torch.empty_like(part)
        c = args.chunk
        bufs = [torch.empty(2, args.layers, c, heads * hd, dtype=torch.bfloat16) for _ in range(args.tokens // c)]
        runs = chunk_runs(kv, bufs, c)
        memmove2(runs, True)  # touch the buffers
        for ctx, t in ((one, kv), (whole, kv), (narrow, part)):
            kvd.store(ctx, t, tokens)
        ops = {
            "memmove2 (baseline)": (lambda: memmove2(runs, False), nbytes),
            "store, one shard": (lambda: kvd.store(one, kv, tokens, overwrite=True), nbytes),
            f"store, {s} shards": (lambda: kvd.store(whole, kv, tokens, overwrite=True), nbytes),
            "store, one rank's bytes": (lambda: kvd.store(narrow, part, tokens, overwrite=True), nbytes // s),
            "retrieve out=, one shard": (lambda: kvd.retrieve(one, tokens, out=out), nbytes),
            f"retrieve out=, {s} shards": (lambda: kvd.retrieve(whole, tokens, out=out), nbytes),
            "retrieve out=, one rank": (lambda: kvd.retrieve(rank0, tokens, out=out_part), nbytes // s),
        }
        times: dict[str, list[float]] = {name: [] for name in ops}
        for _ in range(args.reps):
            for name, (fn, _n) in ops.items():
                times[name].append(timed(fn)[0])
        assert torch.equal(kvd.retrieve(whole, tokens), kv)  # (the sharded reads are the bytes)
        base = statistics.median(times["memmove2 (baseline)"])
        print(f"model {args.layers} layers x {heads} KV heads x {hd}, bf16, {args.tokens} tokens "
              f"({nbytes / 1e6:.0f} MB), chunk {c}, {s} shards; load {os.getloadavg()[0]:.2f}")  # fmt: skip
        print("| op | GB/s | x memmove2 |\n|---|---|---|")
        for name, (_fn, n) in ops.items():
            sec = statistics.median(times[name])
            print(f"| {name} | {gbps(n, sec):.2f} | {gbps(n, sec) / gbps(nbytes, base):.2f} |")
        for ctx in (one, whole, rank0, narrow):
            ctx.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

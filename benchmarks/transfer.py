#!/usr/bin/env python
"""Transfer benchmark: SDK store/retrieve throughput and one-chunk latency on both transports.

Starts two real ``kvdock serve`` subprocesses on free loopback ports -- one with the shared-memory
transport, one with ``--no-shm`` (inline ZMQ frames) -- registers a model on each, and measures
through the public SDK (``kvdock.sdk``):

* store and retrieve throughput of a whole ``[2, L, T, D]`` tensor, cold (first call against the
  fresh server) and warm (median of ``--reps`` calls; warm stores use ``overwrite=True`` on the
  same tokens, so every chunk really is written again);
* beside each, a physical baseline over the same bytes, measured in this process in the same run:

  - store baseline: ``dst.copy_(src)`` chunk by chunk from the same strided ``[2, L, c, D]`` views
    of the source tensor that store copies, into already-allocated, already-touched contiguous
    chunk buffers;
  - retrieve baseline: a fresh ``torch.empty([2, L, T, D])`` filled chunk by chunk from contiguous
    chunk buffers (what returning a fresh tensor costs: allocation + page faults + copy);

  cold baseline = first run, warm = median of ``--reps`` (warm SDK and baseline runs interleave);
  every cold measurement, SDK and baseline alike, follows ``--cold-pause`` seconds of idle so that
  both start from the same memory state (see the flag's help);
* p50/p99 latency of a one-chunk (512 KiB) retrieve and lookup, answered from the pool
  directory (fast reads, shared memory only) and asked of the server (``*_rtt``: one control
  round trip each), of a one-chunk store (``overwrite=True``) and view, and the bare round trips
  of the two control channels (raw pyzmq, raw UNIX socket) for reference.

GB = 1e9 bytes. The servers are stopped with SIGTERM at the end, also on error or Ctrl-C.

    python benchmarks/transfer.py                 # default: 32 layers x 8 heads x 128, bf16, 4096 tokens
    python benchmarks/transfer.py --quick         # smoke test, a few seconds
    python benchmarks/transfer.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

import kvdock
import kvdock.sdk as kvd
from kvdock.sdk._handshake import TORCH_DTYPES
from kvdock.testing import ServerProcess, launch_server

sys.path.insert(0, str(Path(__file__).parent))
from common import cpu_busy_s, own_cpu_s
from transfer_measure import LAT_GEOMETRY, LAT_MODEL, MODEL, bench_latency, bench_throughput, make_kv

# --------------------------------------------------------------------------- servers


@contextmanager
def servers(transports: list[str], l1_size: str, chunk_size: int) -> Iterator[dict[str, ServerProcess]]:
    """Start one server per transport (in parallel: each pre-faults its pool); SIGTERM them on exit."""
    with tempfile.TemporaryDirectory(prefix="kvdock-bench-") as tmp:
        started: dict[str, ServerProcess] = {}
        try:
            for t in transports:
                extra = ["--no-disk", *(["--no-shm"] if t == "inline" else [])]  # L1 only: no write-down
                log_path = Path(tmp) / f"server-{t}.log"
                started[t] = launch_server(
                    *extra, "--log-level", "WARNING", l1_size=l1_size, chunk_size=chunk_size, log_path=log_path
                )
            for srv in started.values():
                srv.wait_ready()
            yield started
        finally:
            for name, srv in started.items():
                rc = srv.stop()
                if rc not in (0, None):
                    print(f"warning: {name} server exited with {rc}; log:\n{srv.log()}", file=sys.stderr)


# --------------------------------------------------------------------------- output


def print_table(rows: list[dict[str, Any]], lat: list[dict[str, Any]], nbytes: int) -> None:
    print()
    print(f"Throughput over {nbytes / 1e9:.3f} GB ({nbytes / 2**30:.3f} GiB) per call; GB = 1e9 bytes.")
    print("Warm store = median of overwrite=True stores of the same tokens (every chunk rewritten).")
    print("ratio = SDK GB/s / baseline GB/s (1.00 = as fast as the bare copy).")
    print("mm2 = two-thread glibc memmove of the same runs between touched buffers; zmq = raw pyzmq")
    print("send/recv of the same bytes over loopback TCP (inline only); ratio x = baseline time / SDK time.")
    hdr = (
        "transport",
        "op",
        "cold GB/s",
        "warm GB/s",
        "copy_ warm",
        "mm2 warm",
        "zmq warm",
        "x copy_",
        "x mm2",
        "x zmq",
    )

    def num(r: dict[str, Any], key: str) -> str:
        return f"{r[key]:.2f}" if key in r else "-"

    lines = [hdr] + [
        (
            r["transport"],
            r["op"],
            num(r, "cold_gbps"),
            num(r, "warm_gbps"),
            num(r, "baseline_warm_gbps"),
            num(r, "memmove2_warm_gbps"),
            num(r, "zmq_warm_gbps"),
            num(r, "ratio_warm"),
            num(r, "ratio_memmove2"),
            num(r, "ratio_zmq"),
        )
        for r in rows
    ]
    _print_md(lines)
    print()
    for r in rows:
        if "connect_ms" in r:
            c = r["connect_ms"]
            print(f"{r['transport']}: connect() p50 {c['p50_ms']:.2f} ms (min {c['min_ms']:.2f}), pool of {r['pool']}")
        if "view_ms" in r:
            v = r["view_ms"]
            print(f"{r['transport']}: view() of the whole {v['bytes'] / 2**20:.0f} MiB prefix, opened and closed: "
                  f"p50 {v['p50_ms']:.3f} ms, p99 {v['p99_ms']:.3f} ms")  # fmt: skip
    if lat:
        print()
        print(
            f"One-chunk latency ({lat[0]['chunk_bytes'] // 1024} KiB, {lat[0]['iters']} iterations; "
            "store uses overwrite=True; lookup / retrieve = answered from the pool directory (fast reads: "
            "no round trip); lookup_rtt / retrieve_rtt = the same asked of the server (one control round "
            "trip); view = open + close; raw_zmq_rtt / raw_unix_rtt = a bare pyzmq / UNIX-socket round trip "
            "between two Python processes, the floors of the two control channels):"
        )
        lines = [("transport", "op", "p50 ms", "p99 ms", "mean ms")]
        for r in lat:
            lines.append((r["transport"], f"(control channel: {r['channel']})", "", "", ""))
            for op in LAT_OPS:
                if op in r:
                    s = r[op]
                    lines.append(
                        (r["transport"], op, f"{s['p50_ms']:.3f}", f"{s['p99_ms']:.3f}", f"{s['mean_ms']:.3f}")
                    )
        _print_md(lines)


LAT_OPS = ("lookup", "retrieve", "lookup_rtt", "retrieve_rtt", "store", "view", "raw_zmq_rtt", "raw_unix_rtt")


def _print_md(lines: list[tuple[str, ...]]) -> None:
    widths = [max(len(row[i]) for row in lines) for i in range(len(lines[0]))]
    fmt = lambda row: "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"  # noqa: E731
    print(fmt(lines[0]))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in lines[1:]:
        print(fmt(row))


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="kvdock transfer benchmark: SDK store/retrieve GB/s vs a bare torch copy, on the "
        "shared-memory and the inline (--no-shm) transports, plus one-chunk latency.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--num-layers", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=sorted(TORCH_DTYPES))
    p.add_argument("--tokens", type=int, default=4096, help="tokens per throughput transfer (whole chunks count)")
    p.add_argument("--chunk-size", type=int, default=256, help="server chunk size in tokens")
    p.add_argument("--l1-size", default="4GiB", help="L1 pool of each server")
    p.add_argument("--reps", type=int, default=5, help="warm repetitions (median reported)")
    p.add_argument("--lat-iters", type=int, default=500, help="iterations per latency series (0 = skip)")
    p.add_argument(
        "--cold-pause",
        type=float,
        default=3.0,
        help="seconds of idle before each cold measurement (SDK and baseline alike), so both start from "
        "the same memory state: on VMs with free page reporting the kernel hands freed memory back to the "
        "host after ~2 s, and touching it again costs ~8x more per page fault",
    )
    p.add_argument("--transports", default="shm,inline", help="comma-separated subset of shm,inline")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch.set_num_threads for this process (default: leave torch's default)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: defaults become 2 layers, 1024 tokens, 256MiB pools, 3 reps, 100 latency "
        "iterations, no cold pause (flags given explicitly still win); 8 MiB transfers sit in cache and "
        "per-call round trips dominate, so its ratios mean little",
    )
    p.add_argument("--json", metavar="PATH", help="also write all results as JSON to PATH")
    if p.parse_known_args(argv)[0].quick:
        p.set_defaults(num_layers=2, tokens=1024, l1_size="256MiB", reps=3, lat_iters=100, cold_pause=0.0)
    args = p.parse_args(argv)
    args.transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    if not args.transports or set(args.transports) - {"shm", "inline"}:
        p.error("--transports must be a comma-separated subset of shm,inline")
    if args.tokens < args.chunk_size:
        p.error("--tokens must be at least one chunk")
    if args.reps < 1:
        p.error("--reps must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    # SIGTERM to the benchmark: unwind through the finally blocks so the servers are stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    dtype = TORCH_DTYPES[args.dtype]
    hidden = args.num_kv_heads * args.head_dim
    tokens = args.tokens // args.chunk_size * args.chunk_size
    shape = (2, args.num_layers, tokens, hidden)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    env: dict[str, Any] = {
        "kvdock": kvdock.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "kernel": platform.release(),
    }
    print(
        f"kvdock transfer benchmark: KV {list(shape)} {args.dtype} = {nbytes / 2**20:.0f} MiB, "
        f"chunk {args.chunk_size} tokens = {nbytes // (tokens // args.chunk_size) / 2**20:.2f} MiB, "
        f"{args.reps} warm reps; torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{os.cpu_count()} CPUs",
        flush=True,
    )

    t0, busy0, own0 = time.perf_counter(), cpu_busy_s(), own_cpu_s()
    kv = make_kv(shape, dtype, seed=1)
    rows: list[dict[str, Any]] = []
    lat: list[dict[str, Any]] = []
    with servers(args.transports, args.l1_size, args.chunk_size) as srvs:
        print(f"servers up: {', '.join(f'{t} {s.url}' for t, s in srvs.items())}", flush=True)
        for srv in srvs.values():
            kvd.register_model(
                srv.url,
                srv.http_url,
                MODEL,
                num_layers=args.num_layers,
                num_kv_heads=args.num_kv_heads,
                head_dim=args.head_dim,
                dtype=args.dtype,
            )
            kvd.register_model(srv.url, srv.http_url, LAT_MODEL, **LAT_GEOMETRY)  # type: ignore[arg-type]
        for t, srv in srvs.items():
            print(f"[{t}] throughput ...", flush=True)
            rows += bench_throughput(srv, t, kv, args.chunk_size, args.reps, args.cold_pause, args.l1_size)
            print(f"[{t}] correctness: retrieved == stored (torch.equal): OK", flush=True)
            if args.lat_iters > 0:
                print(f"[{t}] latency ...", flush=True)
                lat.append(bench_latency(srv, t, args.chunk_size, args.lat_iters))

    elapsed = time.perf_counter() - t0
    # CPU time used on this machine by processes other than the benchmark and its servers
    foreign = max(0.0, (cpu_busy_s() - busy0) - (own_cpu_s() - own0))
    env["foreign_cpu_s"] = foreign
    env["foreign_cpu_share"] = foreign / (elapsed * (os.cpu_count() or 1))
    print_table(rows, lat, nbytes)
    print(
        f"\ntotal {elapsed:.1f}s; other processes used {foreign:.1f} CPU-s "
        f"({100 * env['foreign_cpu_share']:.0f}% of the machine) meanwhile"
    )
    if env["foreign_cpu_share"] > 0.05:
        print(
            "WARNING: the machine was not quiet; multi-threaded copies suffer most from that "
            "(try --threads 1, or rerun on an idle machine)"
        )
    if args.json:
        doc = {
            "config": {k: v for k, v in vars(args).items() if k != "json"} | {"shape": list(shape), "bytes": nbytes},
            "env": env,
            "throughput": rows,
            "latency": lat,
            "elapsed_s": elapsed,
        }
        Path(args.json).write_text(json.dumps(doc, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

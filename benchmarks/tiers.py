#!/usr/bin/env python
"""Tier benchmark: SDK retrieve throughput when the prefix is in L1, only on disk (L2), or only
in Redis (L3), in one run.

Starts a redis-server and two ``kvdock serve`` processes on loopback: server A with an L2
directory and L3, server B with L3 only. Stores a ``[2, L, T, D]`` KV through A, waits until it is
written down to both tiers, then times ``kvdock.sdk.retrieve`` of the whole prefix:

* L1: A holds it in its pool (median of ``--reps``);
* L2: A's L1 emptied (``POST /admin/clear?tier=l1``) and the files dropped from the page cache
  (``posix_fadvise(DONTNEED)``; also ``/proc/sys/vm/drop_caches`` when writable), before each rep;
* L3: B's L1 emptied before each rep, so every chunk comes from Redis;
* L3 cluster: server C on a local Redis Cluster (3 masters + 3 replicas, ``kvdock.testing.
  RedisCluster``) stores the same KV, and its L1 is emptied before each rep, so every chunk comes
  from the cluster's shards.

Each retrieve is checked byte-exact (torch.equal). Also reported: how long the write-down to L2
and L3 took after the store returned, a plain in-process copy of the same bytes as a baseline,
and the L3 read rate on the server side: the bytes servers B and C read from Redis into their L1
slots over the time their L3 lane spent reading them (the tier counters of /status), which leaves
out the SDK's own copy and the round trips of the retrieve.

    python benchmarks/tiers.py                # 32 layers x 8 heads x 128, bf16, 2048 tokens
    python benchmarks/tiers.py --quick        # smoke test
    python benchmarks/tiers.py --tiers L3,L3-cluster --reps 5   # only the L3 reads
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch

import kvdock
import kvdock.sdk as kvd
from kvdock.testing import RedisCluster, ServerProcess, cluster_ports, free_port, launch_server

sys.path.insert(0, str(Path(__file__).parent))
from common import gbps, timed

MODEL = "bench-tiers"
TIERS = ("L1", "L2", "L3", "L3-cluster")


def status(srv: ServerProcess) -> dict:
    with urllib.request.urlopen(srv.http_url + "/status", timeout=10) as r:
        return json.loads(r.read())


def clear_l1(srv: ServerProcess) -> None:
    req = urllib.request.Request(srv.http_url + "/admin/clear?tier=l1", method="POST")
    urllib.request.urlopen(req, timeout=10).read()


def wait_written(srv: ServerProcess, tier: str, n: int, timeout: float = 300) -> float:
    t0 = time.perf_counter()
    while True:
        st = status(srv)["tiers"]
        if st[tier]["writes"] >= n and st["writeback_backlog_bytes"] == 0:
            return time.perf_counter() - t0
        if time.perf_counter() - t0 > timeout:
            raise RuntimeError(f"write-down to {tier} did not finish: {st}")
        time.sleep(0.01)


def drop_page_cache(disk: Path) -> str:
    """Evict the L2 files from the page cache; says how."""
    for path in disk.glob("*/*.kv"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        return "fadvise(DONTNEED) + drop_caches"
    except OSError:
        return "fadvise(DONTNEED) only"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--l1-size", default="2GiB")
    p.add_argument("--quick", action="store_true", help="2 layers, 1024 tokens, 2 reps")
    p.add_argument("--tiers", default=",".join(TIERS), help=f"which to time, of {','.join(TIERS)} (default: all)")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    timed_tiers = [t.strip() for t in args.tiers.split(",") if t.strip()]
    if not timed_tiers or set(timed_tiers) - set(TIERS):
        p.error(f"--tiers takes a comma-separated list of {', '.join(TIERS)}")
    if args.quick:
        args.layers, args.tokens, args.reps, args.l1_size = 2, 1024, 2, "256MiB"
    shape = (2, args.layers, args.tokens, args.kv_heads * args.head_dim)
    kv = torch.randn(shape).to(torch.bfloat16)
    tokens = list(range(args.tokens))
    nbytes = kv.numel() * kv.element_size()
    chunks = args.tokens // args.chunk_size
    print(
        f"kvdock tier benchmark: KV {list(shape)} bfloat16 = {nbytes / 2**20:.0f} MiB, {chunks} chunks, "
        f"{args.reps} reps, {os.cpu_count()} CPUs, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}, "
        f"kvdock from {Path(kvdock.__file__).parent}"
    )

    with tempfile.TemporaryDirectory(prefix="kvdock-tiers-") as tmp:
        rport = free_port()
        redis = subprocess.Popen(
            ["redis-server", "--port", str(rport), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
        )
        disk = Path(tmp) / "l2"
        url = f"redis://127.0.0.1:{rport}/0"
        common = ["--log-level", "WARNING", "--redis-url", url]
        (Path(tmp) / "cluster").mkdir()
        cluster = RedisCluster(cluster_ports(6), Path(tmp) / "cluster").start()
        a = launch_server(*common, "--disk-dir", str(disk), l1_size=args.l1_size, chunk_size=args.chunk_size)
        b = launch_server(*common, "--no-disk", l1_size=args.l1_size, chunk_size=args.chunk_size)
        on_cluster = ["--log-level", "WARNING", "--redis-url", cluster.url, "--no-disk"]
        c = launch_server(*on_cluster, l1_size=args.l1_size, chunk_size=args.chunk_size)
        try:
            for srv in (a, b, c):
                srv.wait_ready()
                kvd.register_model(
                    srv.url,
                    srv.http_url,
                    MODEL,
                    num_layers=args.layers,
                    num_kv_heads=args.kv_heads,
                    head_dim=args.head_dim,
                    dtype="bfloat16",
                )
            ca = kvd.connect(a.url, a.http_url, MODEL)
            cb = kvd.connect(b.url, b.http_url, MODEL)
            cc = kvd.connect(c.url, c.http_url, MODEL)
            t_store, _ = timed(lambda: kvd.store(ca, kv, tokens))
            t_l2 = wait_written(a, "l2", chunks)
            t_l3 = wait_written(a, "l3", chunks)
            t_cluster_store, _ = timed(lambda: kvd.store(cc, kv, tokens))
            t_cluster = wait_written(c, "l3", chunks)
            results: dict[str, list[float]] = {t: [] for t in TIERS if t in timed_tiers}
            how = ""
            for _ in range(args.reps):
                for tier, ctx, srv in (("L1", ca, None), ("L2", ca, a), ("L3", cb, b), ("L3-cluster", cc, c)):
                    if tier not in results:
                        continue
                    if srv is not None:
                        clear_l1(srv)
                        if tier == "L2":
                            how = drop_page_cache(disk)
                    t, out = timed(lambda c=ctx: kvd.retrieve(c, tokens))
                    if out is None or not torch.equal(out, kv):
                        raise RuntimeError(f"{tier} retrieve returned wrong data")
                    results[tier].append(t)
                    del out
            base = [timed(lambda: torch.empty_like(kv).copy_(kv))[0] for _ in range(args.reps)]
            ca.close()
            cb.close()
            cc.close()
            tiers_a, tiers_b, tiers_c = (status(s)["tiers"] for s in (a, b, c))
        finally:
            for srv in (a, b, c):
                srv.stop()
            redis.kill()
            redis.wait()
            cluster.stop()

    print(
        f"\nstore returned after {t_store * 1e3:.1f} ms; the write-down (both tiers in parallel) was done "
        f"{t_l2 * 1e3:.0f} ms later for L2 ({gbps(nbytes, t_l2 + t_store):.2f} GB/s incl. checksum and fsync) "
        f"and {(t_l2 + t_l3) * 1e3:.0f} ms later for L3; on the cluster, the write-down was done "
        f"{t_cluster * 1e3:.0f} ms after its store returned ({gbps(nbytes, t_cluster + t_cluster_store):.2f} GB/s)"
    )
    print(f"L2 page cache before each L2 rep: {how}\n")
    rows = [("source", "retrieve GB/s (median)", "best", "seconds (median)")]
    for tier, ts in results.items():
        med = statistics.median(ts)
        rows.append((tier, f"{gbps(nbytes, med):.2f}", f"{gbps(nbytes, min(ts)):.2f}", f"{med:.3f}"))
    med = statistics.median(base)
    rows.append(("baseline: alloc + copy", f"{gbps(nbytes, med):.2f}", f"{gbps(nbytes, min(base)):.2f}", f"{med:.3f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for i, r in enumerate(rows):
        print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |")
        if i == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    if "L2" in results:
        print(
            f"\nL2 read latency per chunk (server side): "
            f"{tiers_a['l2']['read_seconds'] / max(1, tiers_a['l2']['hits']) * 1e3:.1f} ms"
        )
    l3_read: dict[str, float] = {}
    for tier, st in (("L3", tiers_b["l3"]), ("L3-cluster", tiers_c["l3"])):
        if tier in results and st["hits"]:
            l3_read[tier] = gbps(st["bytes_read"], st["read_seconds"])
            per_chunk_ms, chunk_mib = st["read_seconds"] / st["hits"] * 1e3, st["bytes_read"] / st["hits"] / 2**20
            print(
                f"{tier} read, Redis -> L1 slot (server side, {st['hits']} chunks): {l3_read[tier]:.2f} GB/s, "
                f"{per_chunk_ms:.1f} ms per {chunk_mib:.0f} MiB chunk"
            )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "nbytes": nbytes,
                    "results": results,
                    "baseline": base,
                    "store_s": t_store,
                    "writedown_l2_s": t_l2,
                    "writedown_l3_s": t_l3,
                    "writedown_cluster_s": t_cluster,
                    "page_cache": how,
                    "l3_read_gbps_server_side": l3_read,
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""CURVE benchmark: what authenticated encryption costs the inline transport, and what a tenant's
own shared-memory pool gives back (issue 13).

Starts three real ``kvdock serve`` subprocesses on free loopback ports: two with ``--no-shm``,
one plain and one with ``--curve-secret-key`` (keys from ``kvdock keygen``), and a third with
CURVE and a tenants file whose one tenant (the client's key) has an ``l1`` quota, so that its
client maps the tenant's own pool (a memfd handed over at the pool door) and only the control
messages cross CURVE. It registers a model on each and measures through the public SDK, on the
same tensor, in the same run:

* warm store (``overwrite=True``) and retrieve throughput of a whole ``[2, L, T, D]`` tensor
  (median of ``--reps``, the plain and CURVE runs interleaved so that both see the same machine);
* p50 latency of a one-chunk retrieve and of a lookup (one control round trip each);
* the baseline: one ``memmove`` of the same bytes in this process (``bytes(...)`` of the tensor's
  buffer into a fresh buffer), so the table shows how far each transport is from a plain copy.

The "CURVE/plain" and "pool/plain" columns are ratios to the plain inline transport: below 1,
slower. GB = 1e9 bytes.

    python benchmarks/curve.py              # 32 layers x 8 heads x 128, bf16, 1024 tokens (134 MB)
    python benchmarks/curve.py --quick      # a few seconds
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import kvdock.sdk as kvd
from kvdock.testing import ServerProcess, start_server
from kvdock.transport.curve import keygen

sys.path.insert(0, str(Path(__file__).parent))
from common import gbps, timed

SALT = "bench"  # (the tenant's namespace)


def _median(fn, reps: int) -> float:  # type: ignore[no-untyped-def]
    return statistics.median(timed(fn)[0] for _ in range(reps))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    if args.quick:
        args.layers, args.tokens, args.reps = 4, 512, 3
    d = args.heads * args.head_dim
    kv = torch.randn(2, args.layers, args.tokens, d).to(torch.bfloat16)
    tokens = list(range(args.tokens))
    nbytes = kv.numel() * kv.element_size()
    tmp = Path(tempfile.mkdtemp(prefix="kvdock-curve-bench-"))
    keygen(tmp, "server")
    keygen(tmp, "client")
    auth = tmp / "authorized"
    auth.mkdir()
    (auth / "client.key").write_bytes((tmp / "client.key").read_bytes())
    keys = {"server_key": str(tmp / "server.key"), "client_key": str(tmp / "client.key_secret")}
    size = f"{max(4 * nbytes // 2**20, 256)}MiB"
    flags = ("--no-shm", "--no-disk")
    geo = {"num_layers": args.layers, "num_kv_heads": args.heads, "head_dim": args.head_dim, "dtype": "bfloat16"}
    servers: dict[str, ServerProcess] = {}
    try:
        servers["plain"] = start_server(*flags, l1_size=size, chunk_size=args.chunk)
        curve = ("--curve-secret-key", str(tmp / "server.key_secret"))
        servers["curve"] = start_server(
            *flags, *curve, "--curve-authorized-dir", str(auth), l1_size=size, chunk_size=args.chunk
        )
        tenants = tmp / "tenants.toml"
        tenants.write_text(
            f'[tenants.bench]\nkeys = ["{tmp / "client.key"}"]\nmodels = ["bench"]\nsalts = ["bench"]\nl1 = "{size}"\n'
        )
        servers["pool"] = start_server(
            "--no-disk", *curve, "--tenants", str(tenants), l1_size=size, chunk_size=args.chunk
        )
        ctxs = {}
        for name, srv in servers.items():
            k = keys if name != "plain" else {}
            kvd.register_model(srv.url, srv.http_url, "bench", **geo, timeout=30, **k)  # type: ignore[arg-type]
            ctxs[name] = kvd.connect(srv.url, srv.http_url, "bench", 60, **k)
            assert ctxs[name].transport == ("shm" if name == "pool" else "inline")
            kvd.store(ctxs[name], kv, tokens, SALT)  # cold store and first retrieve: not measured
            assert torch.equal(kvd.retrieve(ctxs[name], tokens, SALT), kv)
        one = tokens[: args.chunk]
        results: dict[str, dict[str, float]] = {name: {} for name in ctxs}
        samples: dict[tuple[str, str], list[float]] = {}
        for _ in range(args.reps):  # interleaved: both see the same machine
            for name, ctx in ctxs.items():
                for what, fn in (
                    ("store", lambda c=ctx: kvd.store_chunks(c, kv, tokens, SALT, overwrite=True)),
                    ("retrieve", lambda c=ctx: kvd.retrieve(c, tokens, SALT)),
                ):
                    samples.setdefault((name, what), []).append(timed(fn)[0])
        for name, ctx in ctxs.items():
            for what in ("store", "retrieve"):
                results[name][what] = gbps(nbytes, statistics.median(samples[(name, what)]))
            lat = [timed(lambda c=ctx: kvd.retrieve(c, one, SALT))[0] for _ in range(200)]
            results[name]["chunk_ms"] = statistics.median(lat) * 1e3
            lat = [timed(lambda c=ctx: kvd.lookup(c, one, SALT))[0] for _ in range(200)]
            results[name]["lookup_ms"] = statistics.median(lat) * 1e3
        raw = memoryview(kv.view(torch.uint8).numpy()).cast("B")
        base = gbps(nbytes, _median(lambda: bytes(raw), args.reps))
        for ctx in ctxs.values():
            kvd.close(ctx)
    finally:
        for srv in servers.values():
            srv.stop()
    load = os.getloadavg()
    print(
        f"CURVE on the inline transport, and a tenant's own pool: {nbytes / 1e6:.0f} MB "
        f"([2, {args.layers}, {args.tokens}, {d}] bf16), chunk {args.chunk}, median of {args.reps}; "
        f"load {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; {time.strftime('%Y-%m-%d %H:%M')}"
    )
    print(f"{'':18}{'plain':>10}{'CURVE':>10}{'pool':>10}{'CURVE/plain':>13}{'pool/plain':>12}{'memcpy':>10}")
    for what, unit in (("store", "GB/s"), ("retrieve", "GB/s"), ("chunk_ms", "ms"), ("lookup_ms", "ms")):
        a, b, c = results["plain"][what], results["curve"][what], results["pool"][what]
        ratios = (b / a, c / a) if unit == "GB/s" else (a / b, a / c)  # below 1: slower than plain
        ref = f"{base:>10.2f}" if unit == "GB/s" else f"{'':>10}"
        print(f"{what + ' (' + unit + ')':18}{a:>10.3f}{b:>10.3f}{c:>10.3f}{ratios[0]:>13.2f}{ratios[1]:>12.2f}{ref}")


if __name__ == "__main__":
    main()

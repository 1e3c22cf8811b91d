#!/usr/bin/env python
"""Fleet coherence soak: servers sharing one Redis Cluster L3 while prefixes are overwritten.

Starts a local Redis Cluster (3 masters, 3 replicas: ``kvdock.testing.RedisCluster``) and
``--servers`` (3) real ``kvdock serve`` processes on it (small L1, an L2 directory each unless
``--no-disk``, ``--l3-coherence-ms`` = ``--bound-ms``), one model of chunk 16 tokens. Then, for
``--seconds``:

* a writer process overwrites (``store_chunks(..., overwrite=True)``) one of ``--prompts`` prompts
  (2 or 3 chunks) through a random server, version after version. Every chunk's bytes name
  their (prompt, version, chunk) in a header of exact bfloat16 integers, the rest is a pattern
  derived from the three, so a reader recognises any chunk it gets, byte for byte;
* on every server two reader processes (one with fast reads from the pool directory, one
  through the server) retrieve random prompts in a loop, half of the time one of the last three
  overwritten, and classify every result;
* at ``--kill-at`` of the run one cluster master is SIGKILLed (``--kill stream``: the one holding
  the invalidation stream, ``other``: another, ``none``), and its replica takes over; at
  ``--rejoin-at`` the killed node is started again (empty) and becomes the new master's replica.

Every read is checked afterwards against the writer's acknowledgements (monotonic clock, one for
every process on the host):

* **mixed**: the chunks of one result are not all of one version;
* **foreign**: a chunk of another prompt or position, of no version at all, or of a version whose
  store had not been sent when the read ended;
* **stale after the bound**: a chunk older than a version acknowledged at least the bound before
  the read *started* (the guarantee of ``kvdock.storage.coherence``).

An overwrite counts as *acked* when every chunk was stored, *partial* when the store returned
without storing them all (``StoreResult``), *refused* when it raised. Partial and refused versions
set no bound (only acked ones do).

The *invalidation window* of an overwrite on a server: from its acknowledgement to the start of
the first read of that prompt there after which the server served no older version (resolution:
the gap between two reads, reported). Results are split by phase (of a read's start, of an
overwrite's acknowledgement): before the kill; failover (until the cluster is whole again and every
server vouches); L3 down (until every server's L3 tier is up again: its probes back off); after
(a shard without a replica); rejoined. Exits 1 when any read is mixed, foreign or stale after the
bound.

    python benchmarks/fleet.py                       # 90 s, 3 servers, kill the stream's master
    python benchmarks/fleet.py --seconds 20 --kill none
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import multiprocessing as mp
import os
import pickle
import random
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

import kvdock.sdk as kvd
from kvdock.errors import KVDockError
from kvdock.storage.coherence import STREAM_KEY
from kvdock.testing import RedisCluster, ServerProcess, cluster_ports, start_server

sys.path.insert(0, str(Path(__file__).parent))
from fleet_analysis import analyze, pct

MODEL = "fleet"
GEOMETRY: dict[str, Any] = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 16}
CHUNK = 16
MARK = 165  # the header's last value (every integer 0..256 is exact in bfloat16)
SHAPE = (2, GEOMETRY["num_layers"], CHUNK, GEOMETRY["num_kv_heads"] * GEOMETRY["head_dim"])

# --- the bytes of a version ---------------------------------------------------------------------


def n_chunks(p: int) -> int:
    return 2 + p % 2


def tokens_of(p: int) -> list[int]:
    return list(range(1_000 + p * 10_000, 1_000 + p * 10_000 + n_chunks(p) * CHUNK))


@functools.lru_cache(maxsize=8192)
def chunk_kv(p: int, v: int, i: int) -> torch.Tensor:
    """Chunk ``i`` of version ``v`` of prompt ``p``: header [p, v low, v high, i, MARK] at the
    first token of layer 0's K, integers 0..255 from a seeded generator elsewhere."""
    g = torch.Generator().manual_seed((p * 1_000_003 + v) * 131 + i)
    t = torch.randint(0, 256, SHAPE, generator=g, dtype=torch.int32)
    t[0, 0, 0, :5] = torch.tensor([p, v & 255, v >> 8, i, MARK])
    return t.to(torch.bfloat16)


def prompt_kv(p: int, v: int) -> torch.Tensor:
    return torch.cat([chunk_kv(p, v, i) for i in range(n_chunks(p))], dim=2)


def classify(got: torch.Tensor | None, p: int) -> tuple[int | str, ...] | None:
    """None for a miss, else per chunk its version, or a string saying what else it is."""
    if got is None:
        return None
    out: list[int | str] = []
    for j in range(got.shape[2] // CHUNK):
        c = got[:, :, j * CHUNK : (j + 1) * CHUNK]
        h = [int(x) for x in c[0, 0, 0, :5].float().tolist()]
        ok = h[4] == MARK and all(0 <= x < 256 for x in h) and h[0] < 256 and h[2] < 256
        if not ok or not torch.equal(c, chunk_kv(h[0], h[1] | h[2] << 8, h[3])):
            out.append("garbage")
        elif h[0] != p or h[3] != j:
            out.append(f"foreign p{h[0]} v{h[1] | h[2] << 8} c{h[3]}")
        else:
            out.append(h[1] | h[2] << 8)
    return tuple(out)


# --- child processes ----------------------------------------------------------------------------


def _wait_go(go: Any) -> tuple[float, float]:
    while go[0] == 0.0 or time.monotonic() < go[0]:
        time.sleep(0.005)
    return go[0], go[1]


def reader(server: int, kind: str, url: str, http_url: str, prompts: int, hot: Any, ready: Any, go: Any,
           pause_s: float, seed: int, out: str) -> None:  # fmt: skip
    """Retrieve prompts from one server until the deadline; records (t0, t1, prompt, result)."""
    ctx = kvd.connect(url, http_url, MODEL, timeout=10)
    ctx.fast_reads = kind == "fast"
    rng = random.Random(seed)
    toks = [tokens_of(p) for p in range(prompts)]
    recs: list[tuple[float, float, int, Any]] = []
    ready.release()
    _, deadline = _wait_go(go)
    while (t0 := time.monotonic()) < deadline:
        p = hot[rng.randrange(3)] if rng.random() < 0.5 else rng.randrange(prompts)
        res: Any
        try:
            res = classify(kvd.retrieve(ctx, toks[p]), p)
        except KVDockError as e:
            res = f"error {type(e).__name__}: {e}"
        recs.append((t0, time.monotonic(), p, res))
        if pause_s:
            time.sleep(pause_s)
    kvd.close(ctx)
    Path(out).write_bytes(pickle.dumps((server, kind, recs)))


def writer(urls: list[tuple[str, str]], prompts: int, hot: Any, ready: Any, go: Any, pause_s: float, seed: int,
           out: str) -> None:  # fmt: skip
    """Overwrite random prompts through random servers; records (p, v, server, sent, done, outcome)."""
    ctxs = [kvd.connect(u, h, MODEL, timeout=10) for u, h in urls]
    rng = random.Random(seed)
    version = [1] * prompts
    recs: list[tuple[int, int, int, float, float, str]] = []
    ready.release()
    _, deadline = _wait_go(go)
    while time.monotonic() < deadline:
        p, s = rng.randrange(prompts), rng.randrange(len(ctxs))
        v, version[p] = version[p], version[p] + 1
        kv = prompt_kv(p, v)
        hot[len(recs) % 3] = p
        t0 = time.monotonic()
        try:
            r = kvd.store_chunks(ctxs[s], kv, tokens_of(p), overwrite=True)
            outcome = "ok" if r.stored_chunks == n_chunks(p) else f"partial {r}"
        except KVDockError as e:
            outcome = f"refused {type(e).__name__}: {e}"
        recs.append((p, v, s, t0, time.monotonic(), outcome))
        time.sleep(pause_s)
    for c in ctxs:
        kvd.close(c)
    Path(out).write_bytes(pickle.dumps(recs))


# --- the run ------------------------------------------------------------------------------------


def stream_master(cluster: RedisCluster, kill: str) -> int:
    """The port of the master holding the invalidation stream's slot (``stream``) or of another."""
    slot = int(cluster.cli(cluster.ports[0], "cluster", "keyslot", STREAM_KEY.decode()).strip())
    ranges = json.loads(cluster.cli(cluster.ports[0], "--json", "cluster", "slots"))
    owner = next(int(r[2][1]) for r in ranges if r[0] <= slot <= r[1])
    masters = sorted({int(r[2][1]) for r in ranges})
    return owner if kill == "stream" else next(m for m in masters if m != owner)


def fleet_is(servers: list[ServerProcess], what: str) -> bool:
    """Whether every server's L3 is ``"vouched"`` (coherence polls answered) or ``"up"`` (the tier)."""
    try:
        st = [s.get("/status", timeout=2)["tiers"]["l3"] for s in servers]
    except OSError:
        return False
    if what == "up":
        return all(t["up"] for t in st)
    return all(t["coherence"]["vouched"] and not t["coherence"]["failing"] for t in st)


def run(args: argparse.Namespace, tmp: Path) -> tuple[list, dict[int, list], dict[str, float], list[dict]]:
    (tmp / "cluster").mkdir()
    cluster = RedisCluster(cluster_ports(6), tmp / "cluster").start()
    servers: list[ServerProcess] = []
    marks: dict[str, float] = {}
    try:
        for i in range(args.servers):
            extra = ["--log-level", "WARNING", "--redis-url", cluster.url, "--l3-coherence-ms", str(args.bound_ms)]
            extra += ["--no-disk"] if args.no_disk else ["--disk-dir", str(tmp / f"l2-{i}")]
            servers.append(start_server(*extra, l1_size=args.l1_size, chunk_size=CHUNK, log_path=tmp / f"s{i}.log"))
            kvd.register_model(servers[i].url, servers[i].http_url, MODEL, dtype="bfloat16", **GEOMETRY, timeout=10)
        RedisCluster._wait(lambda: fleet_is(servers, "up") and fleet_is(servers, "vouched"), "the servers", 60)
        writes: list[tuple] = []
        with kvd.connect(servers[0].url, servers[0].http_url, MODEL, timeout=10) as c:
            for p in range(args.prompts):  # version 0 of every prompt, acknowledged before the run
                t0 = time.monotonic()
                kvd.store(c, prompt_kv(p, 0), tokens_of(p))
                writes.append((p, 0, 0, t0, time.monotonic(), "ok"))
        sp = mp.get_context("spawn")
        hot, go, ready = sp.Array("i", 3, lock=False), sp.Array("d", 2, lock=False), sp.Semaphore(0)
        pause_r, pause_w = args.read_pause_ms / 1e3, args.write_pause_ms / 1e3
        procs = [sp.Process(target=writer, args=([(s.url, s.http_url) for s in servers], args.prompts, hot, ready,
                                                 go, pause_w, args.seed, str(tmp / "w.pkl")))]  # fmt: skip
        for i, s in enumerate(servers):
            for kind in ("fast", "server"):
                procs.append(sp.Process(target=reader, args=(i, kind, s.url, s.http_url, args.prompts, hot, ready, go,
                                                             pause_r, args.seed * 100 + len(procs),
                                                             str(tmp / f"r{len(procs)}.pkl"))))  # fmt: skip
        for pr in procs:
            pr.start()
        for _ in procs:
            if not ready.acquire(timeout=120):
                raise RuntimeError("a client process did not connect within 120 s")
        marks["start"] = time.monotonic() + 0.2
        go[1], go[0] = marks["start"] + args.seconds, marks["start"]
        if args.kill != "none":
            victim = stream_master(cluster, args.kill)
            time.sleep(max(0.0, marks["start"] + args.seconds * args.kill_at - time.monotonic()))
            marks["kill"] = time.monotonic()
            cluster.kill(victim)
            cluster.wait_ok(timeout=60)
            marks["cluster_ok"] = time.monotonic()
            RedisCluster._wait(lambda: fleet_is(servers, "vouched"), "every server to vouch after the failover", 60)
            marks["vouched"] = time.monotonic()
            rejoin = marks["start"] + args.seconds * (args.rejoin_at if args.rejoin_at is not None else 1)
            with contextlib.suppress(RuntimeError):  # (the run may end first: its tier probes back off)
                RedisCluster._wait(lambda: fleet_is(servers, "up"), "L3 up", rejoin - time.monotonic())
                marks["l3_up"] = time.monotonic()
            if args.rejoin_at is not None:  # the killed node again, empty: it becomes the new master's replica
                time.sleep(max(0.0, rejoin - time.monotonic()))
                marks["restart"] = time.monotonic()
                cluster.start_node(victim)
                cluster.wait_ok(timeout=60)
                marks["rejoined"] = time.monotonic()
        for pr in procs:
            pr.join(timeout=args.seconds + 120)
            if pr.exitcode != 0:
                raise RuntimeError(f"client process {pr.name} ended with {pr.exitcode}")
        writes += pickle.loads((tmp / "w.pkl").read_bytes())
        reads: dict[int, list] = defaultdict(list)
        for f in sorted(tmp.glob("r*.pkl")):
            s, kind, recs = pickle.loads(f.read_bytes())
            reads[s] += [(*r, kind) for r in recs]
        statuses = [s.get("/status")["tiers"] for s in servers]
        return writes, reads, marks, statuses
    finally:
        for i, s in enumerate(servers):
            if s.stop() != 0:
                print(f"server {i} exited with {s.proc.returncode}:\n{s.log()[-3000:]}", file=sys.stderr)
        cluster.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=90.0)
    ap.add_argument("--servers", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--bound-ms", type=float, default=100.0, help="--l3-coherence-ms of every server")
    ap.add_argument("--l1-size", default="256KiB")
    ap.add_argument("--no-disk", action="store_true", help="no L2 (default: a directory per server)")
    ap.add_argument("--kill", choices=("stream", "other", "none"), default="stream")
    ap.add_argument("--kill-at", type=float, default=0.3, help="fraction of the run")
    ap.add_argument("--rejoin-at", type=float, default=0.65, help="restart the killed node then (fraction of the run)")
    ap.add_argument("--no-rejoin", dest="rejoin_at", action="store_const", const=None)
    ap.add_argument("--read-pause-ms", type=float, default=2.0)
    ap.add_argument("--write-pause-ms", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", type=Path, help="write the table and marks here")
    ap.add_argument("--raw", type=Path, help="keep every write and read here (pickle) ...")
    ap.add_argument("--from-raw", type=Path, help="... and analyze such a file again instead of running")
    args = ap.parse_args(argv)
    if args.from_raw:
        args, loads, (writes, reads, marks, statuses) = pickle.loads(args.from_raw.read_bytes())
        load0, load1 = loads
    else:
        load0 = os.getloadavg()
        with tempfile.TemporaryDirectory(prefix="kvdock-fleet-") as tmp:
            writes, reads, marks, statuses = run(args, Path(tmp))
        load1 = os.getloadavg()
        if args.raw:
            args.raw.write_bytes(pickle.dumps((args, (load0, load1), (writes, reads, marks, statuses))))
    inf = float("inf")
    kill, vouched, up, rejoined = (marks.get(k, inf) for k in ("kill", "vouched", "l3_up", "rejoined"))

    def phase_of(t: float) -> str:
        if t < kill or t < vouched:
            return "before" if t < kill else "failover"
        return "rejoined" if t >= rejoined else "L3 down" if t < up else "after"

    res = analyze(writes, reads, args.bound_ms / 1e3, phase_of)
    print(f"{args.servers} servers, Redis Cluster 3+3, bound {args.bound_ms:g} ms, {args.seconds:g} s, "
          f"L1 {args.l1_size}, {'no L2' if args.no_disk else 'L2 on'}, {args.prompts} prompts; "
          f"{os.cpu_count()} CPUs, load average {' '.join(f'{x:.2f}' for x in load0)} before, "
          f"{' '.join(f'{x:.2f}' for x in load1)} after")  # fmt: skip
    if "kill" in marks:

        def later(t: float) -> str:
            return f"{t - kill:.1f} s later" if t < inf else "not within the run"

        print(f"killed the {args.kill} master at {kill - marks['start']:.1f} s; "
              f"cluster ok {later(marks['cluster_ok'])}, "
              f"every server vouching {later(vouched)}, L3 up on every server {later(up)}")  # fmt: skip
    if "restart" in marks:
        print(f"restarted the killed node {later(marks['restart'])}: the promoted master's replica "
              f"{later(rejoined)}")  # fmt: skip
    cols = ["reads", "hits", "misses", "errors", "mixed", "foreign", "stale_after_bound", "stale_within_bound",
            "refused_served", "acked", "refused", "partial"]  # fmt: skip
    print("| phase | server | " + " | ".join(cols) + " | overwrite p50 ms | window p50 ms | p99 ms | max ms |")
    print("|---" * (len(cols) + 6) + "|")
    table = []
    for ph in ("before", "failover", "L3 down", "after", "rejoined"):
        for s in [*range(args.servers), "all"]:
            r = res["rows"].get((ph, s))
            if r is None:
                continue
            w = [x * 1e3 for x in res["windows"].get((ph, s), [])]
            lat = pct([x * 1e3 for x in res["latency"].get((ph, s), [])], 0.5)
            table.append({"phase": ph, "server": s, **{c: r[c] for c in cols}, "overwrite_p50_ms": lat,
                          "window_p50_ms": pct(w, 0.5), "window_p99_ms": pct(w, 0.99),
                          "window_max_ms": max(w, default=0)})  # fmt: skip
            print(f"| {ph} | {s} | " + " | ".join(str(r[c]) for c in cols) +
                  f" | {lat:.1f} | {pct(w, 0.5):.1f} | {pct(w, 0.99):.1f} | {max(w, default=0):.1f} |")  # fmt: skip
    if res["gap_p50_ms"] is not None:
        n = len(res["windows"].get(("before", "all"), []))
        total = sum(len(w) for k, w in res["windows"].items() if k[1] == "all")
        print(f"windows measured: {n} before the kill, {total} in all; resolution (median gap between the reads "
              f"that close one): {res['gap_p50_ms']:.1f} ms")  # fmt: skip
    if res["refusals"]:
        print("overwrites not acknowledged: " + "; ".join(res["refusals"]))
    for i, t in enumerate(statuses):
        co = t["l3"]["coherence"]
        print(f"server {i}: coherence entries {co['entries_applied']}, l1 dropped {co['l1_dropped']}, lapses "
              f"{co['lapses']}, poll errors {co['poll_errors']}, full drops {co['full_drops']}; "
              f"l2 hits {t['l2'].get('hits', 0)}, l3 hits {t['l3']['hits']}")  # fmt: skip
    for line in res["bad"][:20]:
        print("VIOLATION " + line)
    if args.json:
        args.json.write_text(json.dumps({"marks": marks, "table": table, "violations": res["bad"]}, indent=1))
    return 1 if res["bad"] else 0


if __name__ == "__main__":
    sys.exit(main())

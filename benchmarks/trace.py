"""Trace replay (issue 28): the prefix hit rate of kvdock's eviction policies on request traces.

Each trace line is a request: ``hash_ids`` (its prompt's prefix blocks of 512 tokens; equal ids
at the start of two requests are a shared prefix) and ``input_length``; only whole blocks count
(``../shared/traces/README.md``). Block ``b`` becomes the 512 token ids ``b * 512 + j``.

For each trace and L1 capacity (tokens) it prints the prefix hit rate (hit tokens / input tokens)
of:

- ``infinite``: every block ever stored stays (the maximum);
- ``belady``: an offline cache of the same capacity that evicts the block used again farthest
  in the future (Belady's MIN on the trace's block accesses: the bound);
- each policy, simulated over kvdock's own :class:`~kvdock.storage.memory.L1Store` in this
  process (``sim``): the requests go through it as the server's manager drives it (a retrieve
  pins the cached run and releases it, a store pins the chunks it dedups, reserves the rest,
  commits them, releases the pins);
- with ``--server``, each policy replayed through a real ``kvdock serve`` (L1 alone, and with
  ``--l2`` also L1 + an L2 disk of the whole trace's size): per request a lookup, a retrieve of
  the cached prefix, a store of the whole prompt (as an engine would), with the server's own
  counters and the replay's throughput (requests/s: policy cost included). ``--dirty-limit``
  (repeatable) replays L1 + L2 once per ``--writeback-dirty-limit`` given (default: 1, off);
- with ``--admission`` only, the offline table of L2 admission rules (:func:`admission`).

Usage (``--limit`` the first N requests of each trace)::

    python benchmarks/trace.py --trace ../shared/traces/mooncake_conversation_trace.jsonl \\
        --capacity 1M --capacity 3M [--server --limit 2000 --l2 --dirty-limit 1 --dirty-limit 0.5]
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

BLOCK = 512
SLOT_NBYTES = 2 * 1 * BLOCK * 4 * 2  # the replay's model: 1 layer, 1 KV head of 4, bf16: 8 KiB a chunk
GEOMETRY = {"num_layers": 1, "num_kv_heads": 1, "head_dim": 4}
RULES = ("none", "all", "ghost", "reused")  # L2 admission rules (admission())


@dataclass(frozen=True)
class Request:
    blocks: tuple[int, ...]  # the whole blocks of its prompt

    @property
    def tokens(self) -> int:
        return len(self.blocks) * BLOCK


def load(path: Path, limit: int = 0) -> list[Request]:
    out = []
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            out.append(Request(tuple(r["hash_ids"][: r["input_length"] // BLOCK])))
            if limit and len(out) >= limit:
                break
    return out


def synthetic(kind: str, n: int = 6000, seed: int = 0) -> list[Request]:
    """Traces of other patterns, made here (deterministic): ``scan``: 200 hot prompts of 6
    blocks read with a Zipf-like skew, every third request a one-off prompt of 40 blocks (a scan
    that LRU lets flush the hot set); ``agent``: 64 sessions re-reading one long system prompt
    (24 blocks) and growing their own context a block or two per turn, up to 40 blocks, then
    starting anew (agents, multi-turn)."""
    import random

    rng = random.Random(seed)
    fresh = iter(range(10**6, 10**9))
    out: list[Request] = []
    if kind == "scan":
        hot = [tuple(next(fresh) for _ in range(6)) for _ in range(200)]
        weights = [1 / (i + 1) for i in range(len(hot))]
        for i in range(n):
            if i % 3 == 2:
                out.append(Request(tuple(next(fresh) for _ in range(40))))
            else:
                out.append(Request(rng.choices(hot, weights)[0]))
    elif kind == "agent":
        system = tuple(next(fresh) for _ in range(24))
        sessions: list[tuple[int, ...]] = [() for _ in range(64)]
        for _ in range(n):
            s = rng.randrange(len(sessions))
            if len(sessions[s]) >= 40:  # a new conversation (block ids name a prefix: never shifted)
                sessions[s] = ()
            sessions[s] += tuple(next(fresh) for _ in range(rng.randint(1, 2)))
            out.append(Request(system + sessions[s]))
    else:
        raise ValueError(f"unknown synthetic trace {kind!r}: scan or agent")
    return out


def input_tokens(reqs: list[Request]) -> int:
    return sum(r.tokens for r in reqs)


def infinite(reqs: list[Request]) -> float:
    seen: set[int] = set()
    hit = 0
    for r in reqs:
        n = 0
        while n < len(r.blocks) and r.blocks[n] in seen:
            n += 1
        hit += n
        seen.update(r.blocks)
    return hit * BLOCK / input_tokens(reqs)


def belady(reqs: list[Request], capacity: int) -> float:
    """Belady's MIN over the block accesses (a request uses all its blocks): the prefix hit rate
    of a cache of ``capacity`` blocks that knows the future."""
    never = len(reqs) + 1
    nxt: list[list[int]] = [[] for _ in reqs]
    last: dict[int, int] = {}
    for t in range(len(reqs) - 1, -1, -1):
        nxt[t] = [last.get(b, never) for b in reqs[t].blocks]
        for b in reqs[t].blocks:
            last[b] = t
    cache: dict[int, int] = {}  # block -> its next use
    heap: list[tuple[int, int]] = []  # (-next use, block), lazy
    hit = 0
    for t, r in enumerate(reqs):
        n = 0
        while n < len(r.blocks) and r.blocks[n] in cache:
            n += 1
        hit += n
        for b, use in zip(r.blocks, nxt[t], strict=True):
            cache[b] = use
            heapq.heappush(heap, (-use, b))
        while len(cache) > capacity:
            use, b = heapq.heappop(heap)
            if cache.get(b) == -use:
                del cache[b]
    return hit * BLOCK / input_tokens(reqs)


def simulate(reqs: list[Request], capacity: int, policy: str) -> float:
    """The prefix hit rate of an L1Store of ``capacity`` slots under ``policy``, driven as the
    server's manager drives it (see the module docstring)."""
    from kvdock.keys import ObjectKey
    from kvdock.shm.slots import ALIGN, SlotAllocator
    from kvdock.storage.memory import L1Store

    l1 = L1Store(SlotAllocator(ALIGN, capacity * ALIGN), policy=policy)
    version = hit = 0
    for r in reqs:
        keys = [ObjectKey("m", 0, "", b.to_bytes(32, "little")) for b in r.blocks]
        run, parent = [], 0
        for key in keys:
            obj = l1.get(key)
            if obj is None or obj.parent != parent:
                break
            run.append(obj)
            parent = obj.version
        hit += len(run)
        for obj in run:  # the retrieve's session: pinned, then released
            l1.pin(obj)
        for obj in run:
            l1.unpin(obj)
        for obj in run:  # the store dedups them: pinned until its commit
            l1.pin(obj)
        made = []
        for key in keys[len(run) :]:
            obj = l1.reserve(key, 100)
            if obj is None:
                break
            version += 1
            obj.version, obj.parent = version, parent
            parent = version
            made.append(obj)
        for obj in made:
            l1.commit(obj)
        for obj in run:
            l1.unpin(obj)
    l1.check_integrity()
    return hit * BLOCK / input_tokens(reqs)


@contextmanager
def server(capacity: int, policy: str, l2_bytes: int, dirty_limit: float = 1.0) -> Iterator[object]:
    from kvdock.testing import start_server

    with tempfile.TemporaryDirectory() as tmp:
        disk = ["--disk-dir", tmp, "--disk-size", str(l2_bytes)] if l2_bytes else ["--no-disk"]
        disk += ["--writeback-dirty-limit", str(dirty_limit)] if l2_bytes else []
        srv = start_server(*disk, "--eviction-policy", policy, l1_size=str(capacity * SLOT_NBYTES), chunk_size=BLOCK)
        try:
            yield srv
        finally:
            srv.stop()


def replay(
    reqs: list[Request], capacity: int, policy: str, l2_bytes: int = 0, dirty_limit: float = 1.0
) -> dict[str, object]:
    """Replay ``reqs`` through a real server (see the module docstring); its numbers."""
    import torch

    import kvdock.sdk as kvd

    longest = max(len(r.blocks) for r in reqs) * BLOCK
    kv = torch.randn(2, 1, longest, 4).to(torch.bfloat16)
    with server(capacity, policy, l2_bytes, dirty_limit) as srv:
        kvd.register_model(
            srv.url,  # type: ignore[attr-defined]
            srv.http_url,  # type: ignore[attr-defined]
            "trace",
            dtype="bfloat16",
            num_layers=GEOMETRY["num_layers"],
            num_kv_heads=GEOMETRY["num_kv_heads"],
            head_dim=GEOMETRY["head_dim"],
            timeout=60,
        )
        status = srv.get("/status")  # type: ignore[attr-defined]
        slots = status["l1"]["capacity_bytes"] // SLOT_NBYTES
        hit = 0
        t0 = time.perf_counter()
        with kvd.connect(srv.url, srv.http_url, "trace", timeout=120) as ctx:  # type: ignore[attr-defined]
            for r in reqs:
                tokens = [b * BLOCK + j for b in r.blocks for j in range(BLOCK)]
                if not tokens:
                    continue
                if kvd.lookup(ctx, tokens):
                    got = kvd.retrieve(ctx, tokens)
                    hit += got.shape[2] if got is not None else 0
                kvd.store_chunks(ctx, kv[:, :, : len(tokens)], tokens, edited=False)  # an engine's save
        seconds = time.perf_counter() - t0
        status = srv.get("/status")  # type: ignore[attr-defined]
    l1 = status["l1"]
    return {
        "hit": hit / input_tokens(reqs),
        "rps": len(reqs) / seconds,
        "slots": slots,
        "evictions": l1["evictions"],
        "l2_hits": status["tiers"].get("l2", {}).get("hits", 0),
        "l2_writes": status["tiers"].get("l2", {}).get("writes", 0),
        "evicted_dirty": l1["eviction"]["evicted_dirty"],
        "throttle_s": l1["eviction"]["throttle_seconds"],
    }


def admission(reqs: list[Request], capacity: int, rule: str) -> tuple[float, int]:
    """(prefix hit rate, chunks written to L2) of an s3fifo L1Store of ``capacity`` slots over an
    L2 that is infinitely fast and never full, when L2 takes: ``all`` chunks stored (kvdock), only
    a chunk stored a second time (``ghost``: after L1 lost it), only a chunk read in L1
    (``reused``), or nothing (``none``). Reads past L1 are promoted from L2 (offline; W-EVICT)."""
    from kvdock.keys import ObjectKey
    from kvdock.shm.slots import ALIGN, SlotAllocator
    from kvdock.storage.memory import L1Store

    l1 = L1Store(SlotAllocator(ALIGN, capacity * ALIGN), policy="s3fifo")
    l2: set[int] = set()
    seen: set[int] = set()
    hit = 0
    for r in reqs:
        run = []
        for b in r.blocks:
            key = ObjectKey("m", 0, "", b.to_bytes(32, "little"))
            obj = l1.get(key)
            if obj is None and b in l2 and (obj := l1.reserve(key, 100)) is not None:
                l1.commit(obj)  # promoted
            elif obj is not None and rule == "reused":
                l2.add(b)
            if obj is None:
                break
            l1.pin(obj)
            run.append(obj)
        hit += len(run)
        made = []
        for b in r.blocks[len(run) :]:
            obj = l1.reserve(ObjectKey("m", 0, "", b.to_bytes(32, "little")), 100)
            if obj is None:
                break
            made.append((b, obj))
        for b, obj in made:
            l1.commit(obj)
            if rule == "all" or (rule == "ghost" and b in seen):
                l2.add(b)
            seen.add(b)
        for obj in run:
            l1.unpin(obj)
    return hit * BLOCK / input_tokens(reqs), len(l2)


def tokens_arg(text: str) -> int:
    mult = {"K": 1_000, "M": 1_000_000}.get(text[-1:].upper(), 1)
    return int(float(text.rstrip("kKmM")) * mult)


def main() -> None:
    from kvdock.storage.policy import POLICIES

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", action="append", type=Path, default=[])
    ap.add_argument("--synthetic", action="append", choices=["scan", "agent"], default=[])
    ap.add_argument("--capacity", action="append", type=tokens_arg, help="L1 capacity in tokens (e.g. 1M)")
    ap.add_argument("--policy", action="append", choices=sorted(POLICIES))
    ap.add_argument("--limit", type=int, default=0, help="only the first N requests of each trace")
    ap.add_argument("--server", action="store_true", help="also replay through a real server")
    ap.add_argument("--l2", action="store_true", help="with --server: also L1 + an L2 disk")
    ap.add_argument("--dirty-limit", action="append", type=float, help="with --l2: --writeback-dirty-limit values")
    ap.add_argument("--admission", action="store_true", help="only the offline L2 admission table (admission())")
    args = ap.parse_args()
    capacities = args.capacity or [1_000_000, 3_000_000]
    policies = args.policy or sorted(POLICIES)
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; load: {os.getloadavg()}", flush=True)
    limits = args.dirty_limit or [1.0]
    traces: list[tuple[str, Path | str]] = [(p.stem.removeprefix("mooncake_"), p) for p in args.trace]
    traces += [(k, k) for k in args.synthetic]
    if args.admission:
        print("| trace | requests | L1 tokens | infinite | " + " | ".join(f"L2 admits {r}" for r in RULES) + " |")
        print("|---" * (4 + len(RULES)) + "|")
        for name, source in traces:
            reqs = load(source, args.limit) if isinstance(source, Path) else synthetic(source)[: args.limit or None]
            for cap in capacities:
                got = [admission(reqs, cap // BLOCK, rule) for rule in RULES]
                cells = [f"{h:.1%} ({n} writes)" for h, n in got]
                print(f"| {name} | {len(reqs)} | {cap / 1e6:g}M | {infinite(reqs):.1%} | " + " | ".join(cells) + " |")
        return
    print(
        "| trace | requests | L1 tokens | infinite | belady | policy | sim hit | sim/lru | sim req/s | server hit | "
        "server req/s | dirty limit | L1+L2 hit | L1+L2 req/s | L2 promotions / writes / dirty evictions | "
        "store waits (s) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, source in traces:
        reqs = load(source, args.limit) if isinstance(source, Path) else synthetic(source)[: args.limit or None]
        inf = infinite(reqs)
        for cap in capacities:
            blocks = cap // BLOCK
            bel = belady(reqs, blocks)
            sims, speed = {}, {}
            for p in policies:
                t0 = time.perf_counter()
                sims[p] = simulate(reqs, blocks, p)
                speed[p] = len(reqs) / (time.perf_counter() - t0)
            for p in policies:
                ratio = f"{sims[p] / sims['lru']:.2f}x" if "lru" in sims else "-"
                row = [name, str(len(reqs)), f"{cap / 1e6:g}M", f"{inf:.1%}", f"{bel:.1%}", p, f"{sims[p]:.1%}", ratio]
                row.append(f"{speed[p]:.0f}")
                if not args.server:
                    print("| " + " | ".join(row + ["-"] * 7) + " |", flush=True)
                    continue
                one = replay(reqs, blocks, p)
                row += [f"{one['hit']:.1%}", f"{one['rps']:.0f}"]
                if not args.l2:
                    print("| " + " | ".join(row + ["-"] * 5) + " |", flush=True)
                    continue
                l2_bytes = 4 * sum(len(r.blocks) for r in reqs) * SLOT_NBYTES
                for limit in limits:
                    two = replay(reqs, blocks, p, l2_bytes, limit)
                    counts = f"{two['l2_hits']} / {two['l2_writes']} / {two['evicted_dirty']}"
                    more = [f"{limit:g}", f"{two['hit']:.1%}", f"{two['rps']:.0f}", counts, f"{two['throttle_s']:.0f}"]
                    print("| " + " | ".join(row + more) + " |", flush=True)


if __name__ == "__main__":
    main()

"""The server's own work of a store: its PrepareStore and CommitStore handlers, timed in this
process (no sockets, no client, no copy), for issue 26's set path::

    PYTHONPATH=src .venv/bin/python benchmarks/store_handlers.py [--pages 32 --rounds 400 --evict --profile]

A server state as ``kvdock serve --no-disk`` builds it (shared-memory pool, pool directory, the
default eviction policy), one model of small slots (the slot size does not change the handlers'
work), one shared-memory client (this process), and ``--rounds`` plain stores of ``--pages`` new
chunks each: PrepareStore then CommitStore of every reserved slot, through
:func:`kvdock.server.dispatch.handle` as the event loop calls it (both answer in one step: no
lower tier). ``--evict``: the pool holds 4 batches, so in the steady state every reservation
evicts one object. Prints the median and the minimum of each handler's time (the minimum is the
steadier on a busy machine) and, with ``--profile``, cProfile's top functions. For an A/B, run two
source trees alternately (``PYTHONPATH=old/src``, ``PYTHONPATH=src``) in the same minute.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import time

import numpy as np

from kvdock.config import ServerConfig
from kvdock.protocol import messages as m
from kvdock.sdk.registration import make_layout
from kvdock.server import dispatch
from kvdock.server.build import build_state
from kvdock.shm.processes import proc_start_time

WARMUP = 10  # rounds not timed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pages", type=int, default=32, help="chunks a store (default 32, as SGLang's batch)")
    p.add_argument("--chunk", type=int, default=64, help="tokens a chunk (default 64)")
    p.add_argument("--rounds", type=int, default=400)
    p.add_argument("--evict", action="store_true", help="a pool of 4 batches: every reservation evicts")
    p.add_argument("--profile", action="store_true", help="cProfile both handlers (slower)")
    p.add_argument("--top", type=int, default=30, help="functions --profile prints")
    args = p.parse_args()

    geo = {"num_layers": 2, "num_kv_heads": 1, "head_dim": 16}
    slot = 2 * geo["num_layers"] * geo["num_kv_heads"] * geo["head_dim"] * 2 * args.chunk
    batches = 4 if args.evict else args.rounds + 1
    state = build_state(ServerConfig(chunk_size=args.chunk, l1_size=slot * args.pages * batches + 2**20, no_disk=True))
    try:
        state.registry.register_model(make_layout("bench", dtype="bfloat16", **geo))
        segment = state.pool.segment_of(None)
        assert segment is not None
        me, start = os.getpid(), proc_start_time(os.getpid()) or 0
        register = m.RegisterClient(m.PROTOCOL_VERSION, "bench", "bench", 0, segment.nonce, me, start)
        registered = dispatch.handle(state, register, []).message
        assert isinstance(registered, m.ClientRegistered) and registered.transport == "shm", registered
        client = registered.client_id
        rng = np.random.default_rng(0)
        prepare: list[float] = []
        commit: list[float] = []
        profile = cProfile.Profile() if args.profile else None
        for r in range(args.rounds):
            tokens = rng.integers(0, 2**31, args.pages * args.chunk, dtype=np.uint32).tobytes()
            t0 = time.perf_counter()
            if profile is not None:
                profile.enable()
            prepared = dispatch.handle(state, m.PrepareStore(client, f"s{r}", tokens), []).message
            t1 = time.perf_counter()
            assert isinstance(prepared, m.StorePrepared) and len(prepared.slots) == args.pages, prepared
            chunks = [ref.index for ref in prepared.slots]
            t2 = time.perf_counter()
            committed = dispatch.handle(state, m.CommitStore(client, f"s{r}", chunks), []).message
            t3 = time.perf_counter()
            if profile is not None:
                profile.disable()
            assert committed == m.StoreCommitted(args.pages), committed
            if r >= WARMUP:
                prepare.append(t1 - t0)
                commit.append(t3 - t2)
        state.manager.check_integrity()
        for name, times in (("PrepareStore", prepare), ("CommitStore", commit)):
            med, low = statistics.median(times) * 1e6, min(times) * 1e6
            print(f"{name:12s} median {med:6.0f} us ({med / args.pages:4.1f} a page), min {low:6.0f} us")
        print(f"{args.pages} pages a store, {len(prepare)} stores timed, L1 evictions {state.manager.l1.evictions}")
        if profile is not None:
            pstats.Stats(profile).sort_stats("tottime").print_stats(args.top)
    finally:
        state.manager.close()
        state.copier.shutdown(wait=True)
        state.pool.close()


if __name__ == "__main__":
    main()

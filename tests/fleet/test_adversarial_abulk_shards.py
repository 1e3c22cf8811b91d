"""Adversarial A-BULK (item 1, sharded): a tensor-parallel model (2 shards) whose whole-model
stores commit every chunk of every shard in one bulk commit (chunk-major across the shards'
sessions), overwritten through two servers of a fleet sharing one real redis-server, whole
prompts and prefixes of them, while whole-model and per-rank readers on both servers read. Every
store is one value throughout (float32: versions past 256 stay exact), so a read that is not a miss
is one value (no shard or chunk of another version), of a store covering that many chunks, not
replaced by an overwrite acknowledged more than the coherence bound before the read began."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch
from tests.fleet.test_adversarial_abulk_fleet import Book, settle, toks
from tests.helpers import CHUNK, l3_coherence, run_for, wait_for

import kvdock.sdk as kvd

pytestmark = pytest.mark.subprocess_server

TP, N = "tp", 12
LAYERS, HEADS, HEAD_DIM = 3, 2, 8  # per rank


def test_sharded_bulk_overwrites_across_a_fleet(make_server, redis_server, tmp_path) -> None:
    servers = []
    for i in range(2):
        s = make_server("--redis-url", redis_server.url, "--disk-dir", str(tmp_path / f"l2-{i}"), register=None)
        kvd.register_model(s.url, s.http_url, TP, num_layers=LAYERS, num_kv_heads=HEADS, head_dim=HEAD_DIM,
                           dtype="float32", world_size=2, rank=1, timeout=10)  # fmt: skip
        wait_for(lambda s=s: l3_coherence(s)["vouched"], "vouching", 30)
        servers.append(s)
    book = Book()
    stop = threading.Event()
    counts = {"overwrites": 0, "conflicts": 0, "rank_reads": 0}

    def overwriter(srv, seed: int) -> None:
        rng = random.Random(seed)
        with kvd.connect(srv.url, srv.http_url, TP, timeout=30) as c:
            assert c.shards == 2
            while not stop.is_set():
                k = N if rng.random() < 0.6 else rng.randint(1, N - 1)
                shape = c.geometry.chunk_shape(k * CHUNK)
                book.overwrite(c, 1, k, lambda v, shape=shape: torch.full(shape, float(v), dtype=torch.float32), counts)

    def reader(srv, i: int, rank: int | None, seed: int) -> None:
        rng = random.Random(seed)
        with kvd.connect(srv.url, srv.http_url, TP, timeout=30, kv_rank=rank) as c:
            while not stop.is_set():
                k = rng.randint(1, N)
                start = time.monotonic()
                got = kvd.retrieve(c, toks(1, k))
                if rank is not None:
                    counts["rank_reads"] += 1
                if got is None:
                    book.check(i, 1, start, [])
                    continue
                vals = got.unique()
                if len(vals) != 1 or got.shape[2] % CHUNK:
                    with book.lock:
                        book.errors.append(f"server {i} rank {rank}: a read of {k} chunks holds {vals.tolist()[:8]}")
                    continue
                book.check(i, 1, start, [int(vals[0].item())] * (got.shape[2] // CHUNK))

    threads = [threading.Thread(target=overwriter, args=(servers[i], i)) for i in range(2)]
    threads += [
        threading.Thread(target=reader, args=(servers[i], i, rank, 10 * i + j))
        for i in range(2)
        for j, rank in enumerate((None, None, 0, 1))
    ]
    run_for(threads, stop, 5, join_s=60)
    settle(servers)
    with kvd.connect(servers[0].url, servers[0].http_url, TP, timeout=30) as c:
        w = book.new(1, N)
        w.ok = kvd.store(c, torch.full(c.geometry.chunk_shape(N * CHUNK), float(w.version), dtype=torch.float32),
                         toks(1), overwrite=True)  # fmt: skip
        w.end = time.monotonic()
        assert w.ok is True
    settle(servers)
    for i, s in enumerate(servers):
        for rank in (None, 0, 1):
            with kvd.connect(s.url, s.http_url, TP, timeout=30, kv_rank=rank) as c:
                got = kvd.retrieve(c, toks(1))
                assert got is None or set(got.unique().tolist()) == {float(w.version)}, (i, rank)
                assert kvd.check_server_integrity(c) == []
    print(f"\nA-BULK shards: {counts}, checked reads {book.reads} (hits {book.hits})")
    assert book.errors == [], f"{len(book.errors)} problems:\n" + "\n".join(book.errors[:20])
    assert book.hits > 50 and counts["overwrites"] > 20, (book.hits, counts)

"""Adversarial A-BULK (item 4): bulk store commits (16-chunk chains, 12-chunk overwrites) into a
server whose L2 is a 2 MiB tmpfs under a 64 MiB --disk-size (ENOSPC mid-write) and whose L1 is
small enough that dirty chunks wait on the write-downs and clean ones are evicted to the full disk.
Every read is the exact bytes or a miss, the overwritten prefix one version never older than the
last acknowledged overwrite, also after L1 is cleared (everything then comes from the full L2);
the skipped writes are counted and integrity stays clean."""

from __future__ import annotations

import random
import threading
import time
import urllib.request
from pathlib import Path

import torch
from tests.fleet.test_adversarial_abulk_fleet import Book, toks
from tests.fleet.test_adversarial_r8_fleet import decode, pattern
from tests.server.test_disk_full import tmpfs

import kvdock.sdk as kvd
from helpers import CHUNK, GEOMETRY, MODEL, backlog, make_kv, run_for, start_server, tier, wait_for

N = 12
BIG = 16


def chain(p: int) -> tuple[torch.Tensor, list[int]]:
    return make_kv(BIG * CHUNK, seed=500 + p), list(range(80_000_000 + p * 1000, 80_000_000 + p * 1000 + BIG * CHUNK))


def test_bulk_commits_into_a_full_l2(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "small", "2m") as fs:
        srv = start_server(tmp_path, "--disk-dir", str(fs / "l2"), "--disk-size", "64MiB", l1_size="1MiB")
        try:
            kvd.register_model(srv.url, srv.http_url, MODEL, dtype="bfloat16", **GEOMETRY, timeout=10)
            book = Book()
            acked: list[int] = []
            nxt = [0]
            stop = threading.Event()
            errors: list[str] = []
            counts = {"plain": 0, "overwrites": 0, "reads": 0, "plain_hits": 0, "refused": 0}

            def storer() -> None:
                with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as c:
                    while not stop.is_set():
                        p = nxt[0]
                        nxt[0] += 1
                        kv, t = chain(p)
                        try:
                            if kvd.store(c, kv, t):
                                acked.append(p)
                        except kvd.KVCacheSDKError:  # a full pool of dirty chunks: refused, not lost
                            counts["refused"] += 1
                        counts["plain"] += 1

            def overwriter() -> None:
                with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as c:
                    while not stop.is_set():
                        w = book.new(1, N)
                        try:
                            w.ok = kvd.store(c, pattern(w.version, 1, N), toks(1), overwrite=True)
                        except kvd.KVCacheSDKError as e:
                            w.ok = repr(e)
                        finally:
                            w.end = time.monotonic()
                        counts["overwrites"] += 1

            def reader(seed: int) -> None:
                rng = random.Random(seed)
                with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as c:
                    while not stop.is_set():
                        counts["reads"] += 1
                        if rng.random() < 0.5 and nxt[0]:
                            p = rng.randrange(nxt[0])
                            kv, t = chain(p)
                            got = kvd.retrieve(c, t)
                            if got is not None:
                                counts["plain_hits"] += 1
                                if not torch.equal(got, kv[:, :, : got.shape[2]]):
                                    errors.append(f"chain {p}: wrong bytes ({got.shape[2]} tokens)")
                            continue
                        start = time.monotonic()
                        try:
                            versions = decode(kvd.retrieve(c, toks(1)), 1)
                        except AssertionError as e:
                            errors.append(str(e))
                            continue
                        book.check(0, 1, start, versions)

            threads = [threading.Thread(target=f, args=a) for f, a in ((storer, ()), (storer, ()), (overwriter, ()))]
            threads += [threading.Thread(target=reader, args=(i,)) for i in range(2)]
            run_for(threads, stop, 5, join_s=30)
            wait_for(lambda: backlog(srv) == 0, "the write-downs", 60)
            l2 = tier(srv, "l2")
            # the disk filled (ENOSPC cut L2's capacity under its 64 MiB budget). Whether it is
            # still full now is a race: once writes evicted older files, a re-probe finds room and
            # clears disk_full (storage.diskspace), the capacity staying bounded by the disk's size
            assert l2["capacity_bytes"] < 64 << 20 and l2["writes_skipped"] > 0, l2
            with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as c:
                assert kvd.check_server_integrity(c) == []
                clear = urllib.request.Request(srv.http_url + "/admin/clear?tier=l1", method="POST")
                urllib.request.urlopen(clear, timeout=10).read()
                back = 0
                for p in range(nxt[0]):  # everything now comes from the full L2 (or is a miss)
                    kv, t = chain(p)
                    got = kvd.retrieve(c, t)
                    if got is not None:
                        back += 1
                        assert torch.equal(got, kv[:, :, : got.shape[2]]), f"chain {p} from L2: wrong bytes"
                book.check(0, 1, time.monotonic(), decode(kvd.retrieve(c, toks(1)), 1))
                assert kvd.check_server_integrity(c) == []
            print(
                f"\nA-BULK disk full: {counts}, acked {len(acked)} chains, {back} back from L2, l2 {l2}, "
                f"reads checked {book.reads} (hits {book.hits})"
            )
            assert errors == [] and book.errors == [], (errors[:10], book.errors[:10])
            assert counts["plain_hits"] > 20 and book.hits > 10, counts
        finally:
            assert srv.stop() == 0, srv.log()

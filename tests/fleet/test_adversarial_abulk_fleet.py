"""Adversarial A-BULK (items 1-2): the bulk store commit (a store's chunks in one L1Store.commit,
new keys published in one native call) in a fleet of real ``kvdock serve`` processes sharing one
real redis-server as L3. Writers overwrite long chains (many chunks per store, and prefixes of
them, which leave the old tail unchained) through one server while readers on every server
(fast reads on the writer's own) read whole prompts and prefixes of them; plain stores of chains
that are prefixes of each other (content a function of the tokens alone) race them; a server is
SIGKILLed mid bulk commits and restarted on its L2.

Every chunk of an overwrite holds its version and its position (tests.fleet.test_adversarial_r8_fleet
``pattern``), so a read that is not a miss must be one version throughout, of a store that covered
that many chunks, and not one an overwrite acknowledged more than the coherence bound before the
read began had replaced."""

from __future__ import annotations

import contextlib
import random
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from tests.fleet.test_adversarial_r8_fleet import BOUND_S, decode, pattern
from tests.helpers import CHUNK, GEOMETRY, MODEL, backlog, l3_coherence, make_kv, run_for, wait_for

import kvdock.sdk as kvd

pytestmark = pytest.mark.subprocess_server

N = 12  # chunks of a long chain: one overwrite commits 12 chunks in one call


def toks(prefix: int, chunks: int = N) -> list[int]:
    return list(range(50_000_000 + prefix * 100_000, 50_000_000 + prefix * 100_000 + chunks * CHUNK))


def plain_kv(prefix: int, chunks: int) -> torch.Tensor:
    """The KV of a plain chain: a function of its tokens alone, so any prefix of it is the same bytes."""
    return make_kv(64 * CHUNK, seed=prefix)[:, :, : chunks * CHUNK]


@dataclass
class W:
    version: int
    prefix: int
    chunks: int
    start: float
    end: float = float("inf")
    ok: object = None


@dataclass
class Book:
    writes: dict[int, W] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    reads: int = 0
    hits: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    _next: int = 1

    def new(self, prefix: int, chunks: int) -> W:
        with self.lock:
            v = self._next
            self._next += 1
            w = self.writes[v] = W(v, prefix, chunks, time.monotonic())
            return w

    def overwrite(self, c: kvd.KVCacheContext, prefix: int, k: int, kv_of, counts: dict) -> None:
        """One logged overwrite of ``k`` chunks of chain ``prefix`` with ``kv_of(version)``: its
        result (or the conflict that refused it) and when it was acknowledged."""
        w = self.new(prefix, k)
        try:
            w.ok = kvd.store(c, kv_of(w.version), toks(prefix, k), overwrite=True)
        except kvd.StoreConflictError as e:
            w.ok = repr(e)
            counts["conflicts"] += 1
        finally:
            w.end = time.monotonic()
        counts["overwrites"] += 1

    def check(self, server: int, prefix: int, start: float, versions: list[int]) -> None:
        """One version, of a write that covered that many chunks, that no overwrite acknowledged
        more than BOUND_S before ``start`` (and begun after it was acknowledged) replaced."""
        with self.lock:
            self.reads += 1
            if not versions:
                return
            self.hits += 1
            where = f"server {server} prefix {prefix} at {start:.3f}: {len(versions)} chunks"
            if len(set(versions)) != 1:
                self.errors.append(f"{where}: mixed versions {versions}")
                return
            w = self.writes.get(versions[0])
            if w is None or w.prefix != prefix:
                self.errors.append(f"{where}: version {versions[0]} never written to this prefix ({w})")
                return
            if w.chunks < len(versions):
                self.errors.append(f"{where}: version {w.version} wrote {w.chunks} chunks only")
            if w.ok is False:
                self.errors.append(f"{where}: version {w.version} of an overwrite that returned False")
            for o in self.writes.values():
                if o.prefix == prefix and o.ok is True and o.start > w.end and o.end + BOUND_S < start:
                    self.errors.append(
                        f"{where}: serves {w.version} (acked {w.end:.3f}) {start - o.end:.3f} s after overwrite "
                        f"{o.version} ({o.chunks} chunks, {o.start:.3f}-{o.end:.3f}) replaced it"
                    )
                    break


def serve(make_server, redis_url: str, tmp_path: Path, i: int, *extra: str, disk: bool = True, **kw: object):
    flags = ["--disk-dir", str(tmp_path / f"l2-{i}"), "--disk-size", "64MiB"] if disk else ["--no-disk"]
    srv = make_server("--redis-url", redis_url, *flags, *extra, **kw)
    wait_for(lambda: l3_coherence(srv)["vouched"], "the server to vouch", 30)
    assert l3_coherence(srv)["bound_ms"] == BOUND_S * 1000
    return srv


def overwriter(srv, book: Book, prefixes: list[int], stop: threading.Event, seed: int, counts: dict) -> None:
    rng = random.Random(seed)
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=30) as c:
        while not stop.is_set():
            prefix = rng.choice(prefixes)
            k = N if rng.random() < 0.6 else rng.randint(1, N - 1)  # the whole chain or a prefix of it
            book.overwrite(c, prefix, k, lambda v, p=prefix, k=k: pattern(v, p, N)[:, :, : k * CHUNK], counts)


def plain_storer(srv, book: Book, stop: threading.Event, seed: int, counts: dict) -> None:
    """Plain stores of chains that are prefixes of each other (1..N chunks of prefixes 10..13):
    each commit mixes chunks already there (skipped) with new ones."""
    rng = random.Random(seed)
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=30) as c:
        while not stop.is_set():
            prefix, k = rng.randint(10, 21), rng.randint(1, N)
            try:
                kvd.store(c, plain_kv(prefix, k), toks(prefix, k))
            except kvd.StoreConflictError:
                counts["conflicts"] += 1
            counts["plain"] += 1


def reader(srv, server: int, book: Book, prefixes: list[int], stop: threading.Event, seed: int, counts: dict) -> None:
    rng = random.Random(seed)
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=30) as c:
        while not stop.is_set():
            counts[f"reads{server}"] = counts.get(f"reads{server}", 0) + 1
            if rng.random() < 0.3:  # a plain chain: exactly its bytes, any length
                prefix, k = rng.randint(10, 21), rng.randint(1, N)
                got = kvd.retrieve(c, toks(prefix, k))
                counts["plain_reads"] += 1
                if got is not None and not torch.equal(got, plain_kv(prefix, k)[:, :, : got.shape[2]]):
                    with book.lock:
                        book.errors.append(f"server {server}: plain chain {prefix} ({k} chunks): wrong bytes")
                continue
            prefix = rng.choice(prefixes)
            k = N if rng.random() < 0.5 else rng.randint(1, N)
            start = time.monotonic()
            got = kvd.retrieve(c, toks(prefix, k))
            try:
                versions = decode(got, prefix)
            except AssertionError as e:
                with book.lock:
                    book.errors.append(f"server {server} prefix {prefix}: {e}")
                continue
            book.check(server, prefix, start, versions)


def settle(servers: list) -> None:
    for s in servers:
        wait_for(lambda s=s: l3_coherence(s)["vouched"], "vouching", 60)
        wait_for(lambda s=s: backlog(s) == 0, "write-downs", 60)
    time.sleep(3 * BOUND_S)


@pytest.mark.parametrize(
    ("policy", "l1", "second"),
    [("lru", "8MiB", 0), ("s3fifo", "384KiB", 0), ("prefix-lru", "384KiB", 0), ("lru", "8MiB", 1)],
)  # a small L1: evictions (of dirty chunks too) between and inside the bulk commits; ``second``: the
# server of the second overwriter (1: the two race each other's overwrites across the fleet)
def test_bulk_overwrites_of_long_chains_read_across_a_fleet(
    make_server, redis_server, tmp_path, policy, l1, second
) -> None:
    servers = [
        serve(make_server, redis_server.url, tmp_path, i, "--eviction-policy", policy, l1_size=l1) for i in range(3)
    ]
    book = Book()
    counts = {"overwrites": 0, "conflicts": 0, "plain": 0, "plain_reads": 0}
    prefixes = [1, 2]
    stop = threading.Event()
    threads = [
        threading.Thread(target=overwriter, args=(servers[0], book, prefixes, stop, 1, counts)),
        threading.Thread(target=overwriter, args=(servers[second], book, prefixes, stop, 2, counts)),
        threading.Thread(target=plain_storer, args=(servers[1], book, stop, 3, counts)),
        threading.Thread(target=plain_storer, args=(servers[2], book, stop, 4, counts)),
        threading.Thread(target=plain_storer, args=(servers[1], book, stop, 5, counts)),  # in flight on one server
        *[
            threading.Thread(target=reader, args=(servers[i], i, book, prefixes, stop, 10 + i, counts))
            for i in range(3)
        ],
    ]
    run_for(threads, stop, 6, join_s=60)
    settle(servers)
    # quiescent: every server serves one version, the same; then after one overwrite alone (two
    # overlapping ones may end in either order) every server serves it, or misses
    for prefix in prefixes:
        served = set()
        for s in servers:
            with kvd.connect(s.url, s.http_url, MODEL, timeout=30) as c:
                served |= set(decode(kvd.retrieve(c, toks(prefix)), prefix))
        assert len(served) <= 1, f"prefix {prefix}: the servers serve versions {served}"
    with kvd.connect(servers[second].url, servers[second].http_url, MODEL, timeout=30) as c:
        for prefix in prefixes:
            w = book.new(prefix, N)
            w.ok = kvd.store(c, pattern(w.version, prefix, N), toks(prefix), overwrite=True)
            w.end = time.monotonic()
            assert w.ok is True
    settle(servers)
    for prefix in prefixes:
        last = max((w for w in book.writes.values() if w.prefix == prefix and w.ok is True), key=lambda w: w.end)
        for i, s in enumerate(servers):
            with kvd.connect(s.url, s.http_url, MODEL, timeout=30) as c:
                versions = decode(kvd.retrieve(c, toks(prefix)), prefix)
                assert set(versions) <= {last.version}, f"server {i} serves {versions} after {last}"
                book.check(i, prefix, time.monotonic(), versions)
    fresh = serve(make_server, redis_server.url, tmp_path, 9, disk=False)
    with kvd.connect(fresh.url, fresh.http_url, MODEL, timeout=30) as c:
        for prefix in prefixes:
            book.check(9, prefix, time.monotonic(), decode(kvd.retrieve(c, toks(prefix)), prefix))
        for prefix in range(10, 22):
            got = kvd.retrieve(c, toks(prefix))
            assert got is None or torch.equal(got, plain_kv(prefix, N)[:, :, : got.shape[2]])
    for s in [*servers, fresh]:
        with kvd.connect(s.url, s.http_url, MODEL, timeout=30) as c:
            assert kvd.check_server_integrity(c) == []
    evictions = [s.get("/status")["l1"]["evictions"] for s in servers]
    slow = [s.metric('kvdock_requests_total{op="PrepareRetrieve"}', 0.0) for s in servers]
    print(f"reads per server {[counts.get(f'reads{i}') for i in range(3)]}, PrepareRetrieve per server {slow}")
    assert slow[0] < counts["reads0"], "no fast read on the writer's server"
    print(
        f"\nA-BULK fleet {policy} second writer on {second}: {counts}, checked reads {book.reads} "
        f"(hits {book.hits}), evictions {evictions}"
    )
    assert book.errors == [], f"{len(book.errors)} problems ({counts}):\n" + "\n".join(book.errors[:20])
    assert book.hits > 50 and counts["overwrites"] > 20, (book.hits, counts)


def restart(make_server, redis_url: str, tmp_path: Path, old, i: int):
    """SIGKILL ``old`` and start server ``i`` again on its L2 dir and its ports."""
    old.proc.send_signal(signal.SIGKILL)
    old.proc.wait()
    srv = serve(make_server, redis_url, tmp_path, i, register=None, port=old.port, http_port=old.http_port)
    with contextlib.suppress(kvd.KVCacheSDKError):  # L2 brought the model back, or not
        kvd.register_model(srv.url, srv.http_url, MODEL, dtype="bfloat16", **GEOMETRY, timeout=10)
    return srv


def test_sigkill_mid_bulk_commits_then_restart_on_l2(make_server, redis_server, tmp_path) -> None:
    """Server 0 takes 32-chunk plain stores from two clients (each chain its own tokens, bytes a
    function of them) and overwrites of prefix 1 (12 chunks or a prefix of them) from a third, and
    is SIGKILLed at a random moment, three times, restarted on its L2 each time; server 1 reads
    throughout. After each restart, on it, on server 1 (L3) and on a fresh server: every chain is
    its exact bytes or a miss, prefix 1 one version not older than the last acknowledged
    overwrite. (Acknowledged chains not yet written down when killed are misses: the documented
    crash loss, docs/architecture.md; they are counted, not asserted.)"""
    rng = random.Random(7)
    s0 = serve(make_server, redis_server.url, tmp_path, 0)
    s1 = serve(make_server, redis_server.url, tmp_path, 1)
    book = Book()
    big = 32
    acked: dict[int, float] = {}  # chain -> when its store was acknowledged
    kill_at: list[float] = []
    missing: list[str] = []
    stats = {"kills": 0, "acked_chains": 0, "present_whole": 0, "present_part": 0, "missing": 0, "overwrites": 0}

    def chain_kv(p: int) -> torch.Tensor:
        return make_kv(big * CHUNK, seed=1000 + p)

    def chain_toks(p: int) -> list[int]:
        return list(range(70_000_000 + p * 1000, 70_000_000 + p * 1000 + big * CHUNK))

    next_chain = [0]

    def storer(srv, stop: threading.Event) -> None:
        with contextlib.suppress(Exception), kvd.connect(srv.url, srv.http_url, MODEL, timeout=5) as c:
            while not stop.is_set():
                p = next_chain[0]
                next_chain[0] += 1
                if kvd.store(c, chain_kv(p), chain_toks(p)):
                    acked[p] = time.monotonic()

    def over(srv, stop: threading.Event) -> None:
        with contextlib.suppress(Exception), kvd.connect(srv.url, srv.http_url, MODEL, timeout=5) as c:
            orng = random.Random(11)
            while not stop.is_set():
                k = N if orng.random() < 0.6 else orng.randint(1, N - 1)  # a prefix: the old tail unchained
                w = book.new(1, k)
                try:
                    w.ok = kvd.store(c, pattern(w.version, 1, N)[:, :, : k * CHUNK], toks(1, k), overwrite=True)
                finally:
                    w.end = time.monotonic()
                stats["overwrites"] += 1

    def check_all(where: str) -> None:
        fresh = serve(make_server, redis_server.url, tmp_path, 50 + stats["kills"], disk=False)
        try:
            for i, s in enumerate([s0, s1, fresh]):
                with kvd.connect(s.url, s.http_url, MODEL, timeout=30) as c:
                    for p in range(next_chain[0]):
                        got = kvd.retrieve(c, chain_toks(p))
                        if got is not None:
                            assert torch.equal(got, chain_kv(p)[:, :, : got.shape[2]]), f"{where}: chain {p} on {i}"
                        if p in acked:
                            n = 0 if got is None else got.shape[2] // CHUNK
                            if i == 0:
                                stats["present_whole" if n == big else "present_part" if n else "missing"] += 1
                            if n < big:
                                before = kill_at[-1] - acked[p]
                                missing.append(
                                    f"{where}: server {i} chain {p}: {n}/{big} chunks, acked {before:.3f} s before kill"
                                )
                    book.check(i, 1, time.monotonic(), decode(kvd.retrieve(c, toks(1)), 1))
                    assert kvd.check_server_integrity(c) == [], f"{where}: server {i}"
        finally:
            fresh.stop()

    def watcher(stop: threading.Event) -> None:  # server 1 reads throughout (L3, through the kills)
        rng = random.Random(9)
        with kvd.connect(s1.url, s1.http_url, MODEL, timeout=30) as c:
            while not stop.is_set():
                if next_chain[0] and rng.random() < 0.5:
                    p = rng.randrange(next_chain[0])
                    got = kvd.retrieve(c, chain_toks(p))
                    stats["s1_chain_reads"] += 1
                    if got is not None and not torch.equal(got, chain_kv(p)[:, :, : got.shape[2]]):
                        with book.lock:
                            book.errors.append(f"server 1 during the kills: chain {p}: wrong bytes")
                    continue
                start = time.monotonic()
                try:
                    versions = decode(kvd.retrieve(c, toks(1, rng.randint(1, N))), 1)
                except AssertionError as e:
                    with book.lock:
                        book.errors.append(f"server 1 during the kills: {e}")
                    continue
                book.check(1, 1, start, versions)

    stats["s1_chain_reads"] = 0
    watching = threading.Event()
    watch = threading.Thread(target=watcher, args=(watching,))
    watch.start()
    for round_ in range(3):
        # a version written down to L2 and L3 first: the overwrites after it must keep it from coming back
        with kvd.connect(s0.url, s0.http_url, MODEL, timeout=30) as c:
            w = book.new(1, N)
            w.ok = kvd.store(c, pattern(w.version, 1, N), toks(1), overwrite=True)
            w.end = time.monotonic()
            assert w.ok is True
        wait_for(lambda s=s0: backlog(s) == 0, "the first version written down", 30)
        stop, stop_over = threading.Event(), threading.Event()
        ts = [threading.Thread(target=f, args=(s0, e)) for f, e in ((storer, stop), (storer, stop), (over, stop_over))]
        for t in ts:
            t.start()
        time.sleep(rng.uniform(0.5, 1.2))
        if round_ == 1:  # the plain stores stop first: overwrites alone (a short backlog) until the kill
            stop.set()
            ts[0].join(30)
            ts[1].join(30)
            time.sleep(0.4)
        if round_ == 2:  # the overwrites stop first: the last acknowledged one must survive (or be a miss)
            stop_over.set()
            ts[2].join(30)
            time.sleep(0.2)
        kill_at.append(time.monotonic())
        s0 = restart(make_server, redis_server.url, tmp_path, s0, 0)  # SIGKILL mid-commits
        stats["kills"] += 1
        stop.set()
        stop_over.set()
        for t in ts:
            t.join(30)
        settle([s0, s1])
        check_all(f"after kill {round_}")
    watching.set()
    watch.join(30)
    stats["acked_chains"] = len(acked)
    print(f"\nA-BULK kill: {stats}, reads checked {book.reads} (hits {book.hits})")
    print("\n".join(missing[:40]))
    assert book.errors == [], "\n".join(book.errors[:20])
    assert stats["acked_chains"] > 10, stats

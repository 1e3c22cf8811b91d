"""Overwrites with real server processes: an acknowledged overwrite is final in every tier,
before and after a crash, and never leaves a prefix of mixed versions (a miss is fine, stale or
mixed KV never is)."""

from __future__ import annotations

import random
import signal
import threading
import time
from pathlib import Path

import torch

import kvdock.sdk as kvd
from helpers import CHUNK, GEOMETRY, MODEL, make_kv, make_tokens, miss_or, start_server
from kvdock.keys import normalize_tokens
from kvdock.protocol import messages as m

# every L2 write or delete sleeps first: a slow disk (a prompt's 16 chunks take 0.16 s to write down)
SLOW_DISK = {"KVDOCK_FAULT_L2_WRITE_DELAY_S": "0.01"}


def wait_for(cond, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def l2(srv) -> dict:
    return srv.get("/status")["tiers"]["l2"]


def versions_of(got: torch.Tensor | None, candidates: dict[int, torch.Tensor]) -> list[int]:
    """Which version each retrieved chunk is (AssertionError for bytes of no version at all)."""
    if got is None:
        return []
    out = []
    for i in range(got.shape[2] // CHUNK):
        span = slice(i * CHUNK, (i + 1) * CHUNK)
        match = [v for v, kv in candidates.items() if torch.equal(got[:, :, span], kv[:, :, span])]
        assert len(match) == 1, f"chunk {i} matches versions {match}"
        out.append(match[0])
    return out


def test_overwrite_under_pool_pressure_never_leaves_a_mixed_prefix(make_server) -> None:
    srv = make_server(l1_size="48KiB")  # 12 slots
    tokens = make_tokens(8 * CHUNK)
    old, new = make_kv(8 * CHUNK, seed=1), make_kv(8 * CHUNK, seed=2)
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=5) as c:
        assert kvd.store(c, old, tokens)
        raw = normalize_tokens(tokens).tobytes()
        c.call(m.Lookup(c.client_id, raw, prefetch=True, session_id="pin"))  # a reader pins all 8 old chunks
        assert kvd.store_chunks(c, new, tokens, overwrite=True) == kvd.StoreResult(4, 0, 4, 0)
        assert kvd.lookup(c, tokens) == 4 * CHUNK  # the 4 chunks that could not be rewritten are gone
        assert versions_of(kvd.retrieve(c, tokens), {1: old, 2: new}) == [2, 2, 2, 2]
        c.call(m.EndSession(c.client_id, "pin"))
        assert kvd.lookup(c, tokens) == 4 * CHUNK
        assert kvd.check_server_integrity(c) == []


def test_an_acknowledged_overwrite_survives_sigkill_never_stale(tmp_path: Path) -> None:
    disk = tmp_path / "l2"
    rng = random.Random(7)
    srv = start_server(tmp_path, "--disk-dir", str(disk), env=SLOW_DISK)
    kvd.register_model(srv.url, srv.http_url, MODEL, dtype="bfloat16", **GEOMETRY, timeout=10)
    try:
        for trial in range(10):
            tokens = make_tokens(16 * CHUNK, start=trial * 100_000)
            old, new = make_kv(16 * CHUNK, seed=10 + trial), make_kv(16 * CHUNK, seed=50 + trial)
            with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as c:
                want = l2(srv)["writes"] + 16
                assert kvd.store(c, old, tokens)
                wait_for(lambda s=srv, n=want: l2(s)["writes"] == n, "the old version on disk")
                assert kvd.store(c, new, tokens, overwrite=True)  # acknowledged
            # (the context closed first, while its server answers: closed after the kill, it
            # would wait 0.5 s for its goodbye to leave)
            time.sleep(rng.uniform(0, 0.12))  # somewhere in the new version's write-down (0.16 s)
            srv.stop(signal.SIGKILL)
            srv = start_server(tmp_path, "--disk-dir", str(disk), env=SLOW_DISK)
            with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as c:
                got = versions_of(kvd.retrieve(c, tokens), {1: old, 2: new})
                assert set(got) <= {2}, f"trial {trial}: versions {got} after an acknowledged overwrite"
                assert kvd.check_server_integrity(c) == []
    finally:
        srv.stop()


def test_an_overwrite_whose_write_down_is_skipped_never_comes_back_old(tmp_path: Path) -> None:
    disk = tmp_path / "l2"
    slow = {"KVDOCK_FAULT_L2_WRITE_DELAY_S": "0.15"}
    # 8 slots; stores never wait for write-downs (--writeback-wait-s 0): unwritten objects are evicted
    srv = start_server(tmp_path, "--disk-dir", str(disk), "--writeback-wait-s", "0", l1_size="32KiB", env=slow)
    kvd.register_model(srv.url, srv.http_url, MODEL, dtype="bfloat16", **GEOMETRY, timeout=10)
    tokens, others = make_tokens(4 * CHUNK), make_tokens(8 * CHUNK, start=70_000)
    old, new = make_kv(4 * CHUNK, seed=1), make_kv(4 * CHUNK, seed=2)
    try:
        with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as c:
            assert kvd.store(c, old, tokens)
            wait_for(lambda: l2(srv)["writes"] == 4, "the old version on disk")
            assert kvd.store(c, new, tokens, overwrite=True)
            kvd.store_chunks(c, make_kv(8 * CHUNK, seed=3), others)  # evicts the new version before its turn
            wait_for(lambda: srv.get("/status")["tiers"]["writeback_backlog_bytes"] == 0, "the write-down queue")
            assert l2(srv)["writes_skipped"] >= 1 and l2(srv)["deletes"] == 4
        srv.stop(signal.SIGKILL)
        srv = start_server(tmp_path, "--disk-dir", str(disk), l1_size="32KiB")
        with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as c:
            assert set(versions_of(kvd.retrieve(c, tokens), {1: old, 2: new})) <= {2}
    finally:
        srv.stop()


def test_overwrite_is_refused_while_redis_is_down(make_server, redis_server) -> None:
    srv = make_server("--redis-url", redis_server.url)
    tokens = make_tokens(4 * CHUNK)
    old, new = make_kv(4 * CHUNK, seed=1), make_kv(4 * CHUNK, seed=2)
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as c:
        assert kvd.store(c, old, tokens)
        wait_for(lambda: srv.get("/status")["tiers"]["l3"]["writes"] == 4, "the old version in Redis")
        redis_server.stop()
        wait_for(lambda: not srv.get("/status")["tiers"]["l3"]["up"] or _l3_probe(c, tokens), "L3 marked down")
        try:
            kvd.store(c, new, tokens, overwrite=True)
            raise AssertionError("the overwrite was accepted although Redis could not delete the old version")
        except kvd.ServerError as e:
            assert e.code == "tier_unavailable" and "overwrite refused: l3" in e.message, e
        # nothing was lost either: L1 still holds the old version; a read gets it, or a miss once the
        # server, cut off from the fleet's invalidations, no longer vouches for its L1 (by design:
        # docs/scale-out.md; under load the wait above can pass that bound), never the new bytes
        status = srv.get("/status")["l1"]
        assert (status["objects"], status["evictions"]) == (4, 0), status
        miss_or(kvd.retrieve(c, tokens), old, new, "the server after the refused overwrite")
        assert kvd.check_server_integrity(c) == []


def _l3_probe(c, tokens) -> bool:
    kvd.lookup(c, make_tokens(4 * CHUNK, start=900_000))  # an L1 miss asks L3, which fails and marks it down
    return False


def test_crash_consistency_under_concurrent_overwrites(tmp_path: Path) -> None:
    """>= 10 SIGKILLs at random moments while two clients store and overwrite; after each restart
    every prefix is one version, never older than its last acknowledged overwrite."""
    disk = tmp_path / "l2"
    env = {"KVDOCK_FAULT_L2_WRITE_DELAY_S": "0.01"}
    rng = random.Random(11)
    prefixes = {p: make_tokens(6 * CHUNK, start=p * 1_000_000) for p in range(4)}
    acked = dict.fromkeys(prefixes, 0)  # last acknowledged version (0: none)
    tried = dict.fromkeys(prefixes, 0)  # last version sent
    kvs: dict[tuple[int, int], torch.Tensor] = {}

    def kv_of(p: int, v: int) -> torch.Tensor:
        if (p, v) not in kvs:
            kvs[(p, v)] = make_kv(6 * CHUNK, seed=p * 10_000 + v)
        return kvs[(p, v)]

    srv = start_server(tmp_path, "--disk-dir", str(disk), env=env)
    port, http_port = srv.port, srv.http_port
    kvd.register_model(srv.url, srv.http_url, MODEL, dtype="bfloat16", **GEOMETRY, timeout=10)
    kills = found = 0
    try:
        # ten kills, and more (up to 25) while fewer than 5 restarts found data on disk to check: on
        # a loaded machine the write-downs of the first ten may not have landed before their kills
        while kills < 10 or (found < 5 and kills < 25):
            stop = threading.Event()

            def writer(url: str, http_url: str, stop: threading.Event, mine: list[int]) -> None:
                try:
                    with kvd.connect(url, http_url, MODEL, timeout=2) as c:
                        while not stop.is_set():
                            p = rng.choice(mine)
                            v = tried[p] = tried[p] + 1
                            if kvd.store(c, kv_of(p, v), prefixes[p], overwrite=True):
                                acked[p] = v
                            time.sleep(rng.uniform(0.02, 0.15))  # let write-downs land between versions
                except kvd.KVCacheSDKError:
                    pass  # the server was killed under us

            threads = [
                threading.Thread(target=writer, args=(srv.url, srv.http_url, stop, mine)) for mine in ([0, 1], [2, 3])
            ]
            for t in threads:
                t.start()
            time.sleep(rng.uniform(0.2, 0.8))
            srv.stop(signal.SIGKILL)
            kills += 1
            stop.set()
            for t in threads:
                t.join(30)
                assert not t.is_alive()
            srv = start_server(tmp_path, "--disk-dir", str(disk), env=env, port=port, http_port=http_port)
            with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as c:
                for p, tokens in prefixes.items():
                    candidates = {v: kv_of(p, v) for v in range(1, tried[p] + 1)}
                    got = versions_of(kvd.retrieve(c, tokens), candidates)
                    assert len(set(got)) <= 1, f"kill {kills}: prefix {p} mixes versions {got}"
                    assert not got or got[0] >= acked[p], f"kill {kills}: prefix {p} is v{got[0]} < acked v{acked[p]}"
                    found += bool(got)
                assert kvd.check_server_integrity(c) == []
        assert sum(acked.values()) > 10  # the overwrites really ran between the kills
        assert found >= 5  # and restarts found data on disk to check
    finally:
        srv.stop()


def test_prepare_retrieve_of_a_prefetch_session_never_returns_an_overwritten_version(make_server) -> None:
    srv = make_server()
    tokens = make_tokens(2 * CHUNK)
    whole = normalize_tokens(tokens).tobytes()
    old, new = make_kv(2 * CHUNK, seed=1), make_kv(2 * CHUNK, seed=2)
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=5) as ctx:
        assert ctx.transport == "shm"
        assert kvd.store(ctx, old, tokens)
        assert ctx.call(m.Lookup(ctx.client_id, whole, "", True, "p")).reply.hit_tokens == 2 * CHUNK
        assert kvd.store(ctx, new, tokens, overwrite=True)  # acknowledged
        resp = ctx.call(m.PrepareRetrieve(ctx.client_id, "p", whole))  # sent after the acknowledgement
        slots = resp.reply.slots
        hit = len(slots) * CHUNK
        out = torch.empty_like(new)
        with ctx.transfer() as t:
            t.read(slots, resp.frames, out[:, :, :hit])
        ctx.notify(m.CommitRetrieve(ctx.client_id, "p"))
        assert hit == 0 or torch.equal(out[:, :, :hit], new[:, :, :hit]), "the overwritten version came back"


def _clear_l1(srv) -> None:
    import urllib.request

    urllib.request.urlopen(urllib.request.Request(srv.http_url + "/admin/clear?tier=l1", method="POST")).read()


def test_overwriting_a_prefix_leaves_no_longer_prefix_of_mixed_versions(make_server) -> None:
    """The chunks that extend an overwritten prefix were computed attending over its older
    version: a longer prompt must not retrieve the new chunk 0 followed by them."""
    srv = make_server()
    tokens = make_tokens(3 * CHUNK)
    old, new = make_kv(3 * CHUNK, seed=1), make_kv(3 * CHUNK, seed=2)
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as c:
        assert kvd.store(c, old, tokens)
        assert kvd.store(c, new[:, :, :CHUNK], tokens[:CHUNK], overwrite=True)  # an edit of chunk 0
        got = versions_of(kvd.retrieve(c, tokens), {1: old, 2: new})
        assert kvd.check_server_integrity(c) == []
        assert len(set(got)) <= 1, f"versions {got}: new chunk 0, then chunks computed over the old one"


def test_a_plain_store_never_replaces_a_chunk_that_only_l2_holds(make_server, tmp_path: Path) -> None:
    srv = make_server("--disk-dir", str(tmp_path / "l2"))
    tokens = make_tokens(2 * CHUNK)
    old, new = make_kv(2 * CHUNK, seed=1), make_kv(2 * CHUNK, seed=2)
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as c:
        assert kvd.store(c, old, tokens)
        assert kvd.store(c, new, tokens, overwrite=True)  # acknowledged
        wait_for(lambda: l2(srv)["writes"] >= 2 and srv.get("/status")["tiers"]["writeback_backlog_bytes"] == 0, "L2")
        _clear_l1(srv)
        assert versions_of(kvd.retrieve(c, tokens[:CHUNK]), {1: old, 2: new}) == [2]  # chunk 0 back in L1
        assert kvd.lookup(c, tokens) == 2 * CHUNK  # chunk 1: in L2, counted as cached
        stored = kvd.store(c, old, tokens)  # an engine saving KV it computed before the overwrite
        got = versions_of(kvd.retrieve(c, tokens), {1: old, 2: new})
        assert kvd.check_server_integrity(c) == []
        assert (stored, got) == (False, [2, 2]), f"store returned {stored}; versions now {got}"


def test_an_overwrite_is_not_undone_by_another_servers_queued_write_down(make_server, redis_server) -> None:
    s1 = make_server("--redis-url", redis_server.url)
    s2 = make_server("--redis-url", redis_server.url)
    tokens = make_tokens(2 * CHUNK, start=5_000_000)
    old, new = make_kv(2 * CHUNK, seed=1), make_kv(2 * CHUNK, seed=2)
    with (
        kvd.connect(s1.url, s1.http_url, MODEL, timeout=30) as c1,
        kvd.connect(s2.url, s2.http_url, MODEL, timeout=30) as c2,
    ):
        backlog = make_tokens(8000 * CHUNK, start=10_000_000)
        assert kvd.store(c2, make_kv(8000 * CHUNK, seed=3), backlog)  # S2's L3 write-downs queue up
        assert kvd.store(c2, old, tokens)  # acknowledged on S2; its write-down is last in the queue
        assert kvd.store(c1, new, tokens, overwrite=True)  # acknowledged on S1
        assert s2.get("/status")["tiers"]["l3"]["backlog_bytes"] > 0  # S2's old version not written yet
        for s in (s1, s2):
            wait_for(lambda s=s: s.get("/status")["tiers"]["writeback_backlog_bytes"] == 0, "L3 write-downs", 60)
        _clear_l1(s1)
        got = versions_of(kvd.retrieve(c1, tokens), {1: old, 2: new})
        assert kvd.check_server_integrity(c1) == [] and kvd.check_server_integrity(c2) == []
        assert set(got) <= {2}, f"S1 returns versions {got} after its acknowledged overwrite"


def test_a_plain_store_never_replaces_a_chunk_that_only_l3_holds(make_server, redis_server) -> None:
    srv = make_server("--redis-url", redis_server.url)  # no L2
    tokens = make_tokens(2 * CHUNK)
    old, new = make_kv(2 * CHUNK, seed=1), make_kv(2 * CHUNK, seed=2)
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as c:
        assert kvd.store(c, old, tokens)
        assert kvd.store(c, new, tokens, overwrite=True)  # acknowledged
        wait_for(lambda: srv.get("/status")["tiers"]["l3"]["writes"] >= 2, "the new version in Redis")
        wait_for(lambda: srv.get("/status")["tiers"]["writeback_backlog_bytes"] == 0, "the write-downs")
        # the server applied its own overwrite's invalidations (else a load racing them is dropped:
        # a miss, as a loaded machine made it once)
        wait_for(lambda: srv.get("/status")["tiers"]["l3"]["coherence"]["entries_applied"] >= 2, "the invalidations")
        _clear_l1(srv)
        assert versions_of(kvd.retrieve(c, tokens[:CHUNK]), {1: old, 2: new}) == [2]  # chunk 0 back in L1
        assert kvd.lookup(c, tokens) == 2 * CHUNK  # chunk 1: in L3, counted as cached
        stored = kvd.store(c, old, tokens)  # an engine saving KV it computed before the overwrite
        got = versions_of(kvd.retrieve(c, tokens), {1: old, 2: new})
        assert kvd.check_server_integrity(c) == []
        assert (stored, got) == (False, [2, 2]), f"store returned {stored}; versions now {got}"


def test_a_plain_store_of_kv_computed_before_an_overwrite_never_extends_the_new_version(make_server) -> None:
    srv = make_server(l1_size="32KiB")  # 8 slots, no lower tier
    tokens = make_tokens(2 * CHUNK)
    old, new = make_kv(2 * CHUNK, seed=1), make_kv(2 * CHUNK, seed=2)
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as c:
        assert kvd.store(c, old, tokens)  # an engine's KV
        assert kvd.store(c, new, tokens, overwrite=True)  # an edit, acknowledged
        assert versions_of(kvd.retrieve(c, tokens[:CHUNK]), {1: old, 2: new}) == [2]  # chunk 0: most recent
        for k in range(7):  # fill the pool: LRU evicts chunk 1 (only)
            assert kvd.store(c, make_kv(CHUNK, seed=100 + k), make_tokens(CHUNK, start=10**6 + k * 1000))
        assert kvd.lookup(c, tokens) == CHUNK
        kvd.store(c, old, tokens)  # the engine saves the KV it computed before the edit
        got = versions_of(kvd.retrieve(c, tokens), {1: old, 2: new})
        assert kvd.check_server_integrity(c) == []
        assert len(set(got)) <= 1, f"versions {got}: the new chunk 0, then a chunk computed over the old one"


def test_a_prefetch_waiting_on_another_load_never_mixes_in_a_version_committed_meanwhile(
    make_server, tmp_path: Path
) -> None:
    """Regression (found with real processes): retrieve B pinned chunk 0 (old) and waited on
    retrieve A's disk read of chunk 1; an overwrite of both chunks was acknowledged meanwhile; when
    A's read ended, B took the new chunk 1 from L1 and returned old chunk 0 + new chunk 1. A FIFO
    in place of chunk 1's file stands for a disk read that stalls."""
    import os
    import urllib.request

    from kvdock.keys import ObjectKey, chunk_hashes
    from kvdock.storage.disk import object_name

    disk = tmp_path / "l2"
    srv = make_server("--disk-dir", str(disk))
    tokens = make_tokens(2 * CHUNK)
    old, new = make_kv(2 * CHUNK, seed=1), make_kv(2 * CHUNK, seed=2)
    name = object_name(ObjectKey(MODEL, 0, "", chunk_hashes(normalize_tokens(tokens), CHUNK)[1]))
    path, handle = disk / name[:2] / f"{name}.kv", disk / "fifo-handle"
    got: dict[str, torch.Tensor | None] = {}
    with (
        kvd.connect(srv.url, srv.http_url, MODEL, timeout=20) as a,
        kvd.connect(srv.url, srv.http_url, MODEL, timeout=20) as b,
        kvd.connect(srv.url, srv.http_url, MODEL, timeout=20) as c,
    ):
        assert kvd.store(c, old, tokens)
        wait_for(lambda: l2(srv)["writes"] == 2 and srv.get("/status")["tiers"]["writeback_backlog_bytes"] == 0, "L2")
        urllib.request.urlopen(urllib.request.Request(srv.http_url + "/admin/clear?tier=l1", method="POST")).read()
        assert versions_of(kvd.retrieve(c, tokens[:CHUNK]), {1: old}) == [1]  # chunk 0 in L1, chunk 1 on disk
        path.unlink()
        os.mkfifo(path)  # reading chunk 1 now blocks in open() until a writer comes
        os.link(path, handle)
        readers = [
            threading.Thread(target=lambda k=k, x=x: got.__setitem__(k, kvd.retrieve(x, tokens)))
            for k, x in (("a", a), ("b", b))
        ]
        try:
            readers[0].start()
            wait_for(lambda: srv.get("/status")["sessions"] == 1, "A's retrieve")
            time.sleep(0.3)  # A's read of chunk 1 is stuck
            readers[1].start()  # B pins chunk 0 and waits for A's load of chunk 1
            wait_for(lambda: srv.get("/status")["sessions"] == 2, "B's retrieve")
            time.sleep(0.3)
            assert kvd.store(c, new, tokens, overwrite=True)  # acknowledged while both wait
        finally:
            os.close(os.open(handle, os.O_WRONLY | os.O_NONBLOCK))  # A's read ends (with an error)
            for t in readers:
                t.join(20)
        assert kvd.check_server_integrity(c) == []
        for k in ("a", "b"):
            versions = versions_of(got[k], {1: old, 2: new})
            assert len(set(versions)) <= 1, f"retrieve {k} returned versions {versions}"

"""L2 disk and L3 Redis with real processes: restarts, corruption, two servers on one Redis,
Redis going away and coming back, and an L1 smaller than the working set."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import kvdock.sdk as kvd
from helpers import CHUNK, MODEL, ServerProc, make_kv, make_tokens, tier, wait_for, wait_written
from kvdock.keys import ObjectKey, chunk_hashes
from kvdock.protocol import messages as m
from kvdock.storage.disk import object_name


def chunk_file(disk: Path, tokens: list[int], i: int, salt: str = "") -> Path:
    h = chunk_hashes(np.array(tokens, dtype="<u4"), CHUNK)[i]
    name = object_name(ObjectKey(MODEL, 0, salt, h))
    return disk / name[:2] / f"{name}.kv"


def test_disk_survives_sigkill_and_restart(make_server, tmp_path) -> None:
    disk = tmp_path / "l2"
    srv = make_server("--disk-dir", str(disk))
    kv, tokens = make_kv(4 * CHUNK, seed=1), make_tokens(4 * CHUNK)
    salted = make_kv(2 * CHUNK, seed=2)
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=5) as c:
        assert kvd.store(c, kv, tokens)
        assert kvd.store(c, salted, tokens[: 2 * CHUNK], cache_salt="s")
    wait_written(srv, "l2", 6)
    srv.stop(signal.SIGKILL)
    again = make_server("--disk-dir", str(disk), register=None)  # the registration is restored from disk
    assert "L2 disk" in again.log() and "6 object(s) found" in again.log()
    with kvd.connect(again.url, again.http_url, MODEL, timeout=5) as c:
        assert again.get("/status")["l1"]["objects"] == 0
        assert kvd.lookup(c, tokens) == 4 * CHUNK
        out = kvd.retrieve(c, tokens)
        assert out is not None and torch.equal(out, kv)
        assert torch.equal(kvd.retrieve(c, tokens[: 2 * CHUNK], cache_salt="s"), salted)
        assert kvd.retrieve(c, tokens, cache_salt="other") is None
        assert kvd.check_server_integrity(c) == []
    t = tier(again, "l2")
    assert (t["hits"], t["objects"], t["corrupted"]) == (6, 6, 0)
    assert again.get("/status")["l1"]["objects"] == 6  # promoted into L1


def test_corrupted_and_torn_files_are_detected_never_returned(make_server, tmp_path) -> None:
    disk = tmp_path / "l2"
    srv = make_server("--disk-dir", str(disk))
    kv, tokens = make_kv(4 * CHUNK, seed=3), make_tokens(4 * CHUNK, start=100)
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=5) as c:
        assert kvd.store(c, kv, tokens)
    wait_written(srv, "l2", 4)
    srv.stop(signal.SIGKILL)
    bad = chunk_file(disk, tokens, 2)
    data = bytearray(bad.read_bytes())
    data[-100] ^= 0xFF  # flip a payload byte
    bad.write_bytes(bytes(data))
    torn = chunk_file(disk, tokens, 3)
    torn.write_bytes(torn.read_bytes()[:-10])
    again = make_server("--disk-dir", str(disk), register=None)
    assert "3 object(s) found" in again.log() and "1 torn file(s)" in again.log()
    assert not torn.exists()
    with kvd.connect(again.url, again.http_url, MODEL, timeout=5) as c:
        out = kvd.retrieve(c, tokens)
        assert out is not None and out.shape[2] == 2 * CHUNK  # the prefix before the corrupted chunk
        assert torch.equal(out, kv[:, :, : 2 * CHUNK])
        assert not bad.exists()
        assert kvd.lookup(c, tokens) == 2 * CHUNK
        assert kvd.check_server_integrity(c) == []
        # storing again repairs it
        assert kvd.store_chunks(c, kv, tokens).stored_chunks == 2
        assert torch.equal(kvd.retrieve(c, tokens), kv)
    assert tier(again, "l2")["corrupted"] == 2  # one torn (found at start-up), one failing its checksum
    assert 'kvdock_tier_corrupted_total{tier="l2"} 2.0' in again.text("/metrics")


@pytest.mark.valkey  # also on valkey-server (conftest)
def test_two_servers_share_one_redis(make_server, redis_server) -> None:
    a = make_server("--redis-url", redis_server.url)
    b = make_server("--redis-url", redis_server.url)
    kv, tokens = make_kv(3 * CHUNK, seed=4), make_tokens(3 * CHUNK, start=7)
    with kvd.connect(a.url, a.http_url, MODEL, timeout=5) as ca:
        assert kvd.store(ca, kv, tokens)
        assert kvd.store(ca, make_kv(CHUNK, seed=5), tokens[:CHUNK], cache_salt="x")
    wait_written(a, "l3", 4)
    with kvd.connect(b.url, b.http_url, MODEL, timeout=5) as cb:
        assert b.get("/status")["l1"]["objects"] == 0
        assert kvd.lookup(cb, tokens) == 3 * CHUNK
        assert kvd.lookup(cb, tokens, cache_salt="y") == 0
        out = kvd.retrieve(cb, tokens)
        assert out is not None and torch.equal(out, kv)
        assert torch.equal(kvd.retrieve(cb, tokens[:CHUNK], cache_salt="x"), make_kv(CHUNK, seed=5))
        assert kvd.check_server_integrity(cb) == []
    t = tier(b, "l3")
    assert t["up"] is True and t["hits"] == 4 and t["bytes_read"] == 4 * 3072
    metrics = b.text("/metrics")
    assert 'kvdock_tier_up{tier="l3"} 1.0' in metrics and 'kvdock_tier_hits_total{tier="l3"} 4.0' in metrics


@pytest.mark.valkey  # also on valkey-server (conftest)
def test_redis_going_away_degrades_to_l1_l2_and_comes_back(make_server, redis_server, tmp_path) -> None:
    srv = make_server("--redis-url", redis_server.url, "--disk-dir", str(tmp_path / "l2"))
    other = make_server("--redis-url", redis_server.url)
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=5) as c:
        first, tok1 = make_kv(2 * CHUNK, seed=6), make_tokens(2 * CHUNK, start=1)
        assert kvd.store(c, first, tok1)
        wait_written(srv, "l3", 2)
        redis_server.stop()
        second, tok2 = make_kv(2 * CHUNK, seed=7), make_tokens(2 * CHUNK, start=2)
        assert kvd.store(c, second, tok2)  # stores keep succeeding
        wait_for(lambda: tier(srv, "l3")["up"] is False, "L3 marked down")
        assert tier(srv, "l3")["last_error"]
        # cut off from L3, the server cannot learn of other servers' overwrites: once its last
        # poll is older than the bound it serves neither L1 nor L2, which still hold the chunks
        # (docs/scale-out.md); a read is a miss at once, not an error
        wait_for(lambda: not tier(srv, "l3")["coherence"]["vouched"], "the server to stop vouching")
        assert kvd.retrieve(c, tok1) is None
        kvd.store(c, make_kv(2 * CHUNK, seed=8), make_tokens(2 * CHUNK, start=3))
        assert kvd.lookup(c, make_tokens(2 * CHUNK, start=99)) == 0  # a miss answers, without L3
        wait_written(srv, "l2", 3 * 2)
        redis_server.start()
        wait_for(lambda: tier(srv, "l3")["up"] is True, "L3 back up", timeout=40)
        # Redis lost its invalidation stream: each server sees a new incarnation (a gap: it drops
        # L1 and clears L2) and writes under it from then on; a write-down issued before it
        # noticed goes where no reader looks (a miss, never stale bytes)
        wait_for(
            lambda: all(
                tier(s, "l3")["coherence"]["full_drops"] >= 1
                and tier(s, "l3")["coherence"]["vouched"]
                and tier(s, "l3")["up"]  # (the idle one's tier, marked down by its polls' failure)
                for s in (srv, other)
            ),
            "both servers to follow the new stream, their L3 tiers up",
            timeout=40,
        )
        third, tok3 = make_kv(2 * CHUNK, seed=9), make_tokens(2 * CHUNK, start=4)
        assert kvd.store(c, third, tok3)
        wait_written(srv, "l3", 4)
        assert kvd.check_server_integrity(c) == []
    assert srv.log().count("is down") == 1 and "is back" in srv.log()
    with kvd.connect(other.url, other.http_url, MODEL, timeout=5) as co:
        assert torch.equal(kvd.retrieve(co, tok3), third)  # written after Redis came back
        assert kvd.retrieve(co, tok1) is None  # lost with Redis's memory (no persistence)


def test_l1_smaller_than_working_set_retrieves_via_l2(make_server, tmp_path) -> None:
    srv = make_server("--disk-dir", str(tmp_path / "l2"), l1_size="16KiB")  # four slots
    batches = [(make_kv(2 * CHUNK, seed=20 + i), make_tokens(2 * CHUNK, start=1000 * (i + 1))) for i in range(6)]
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=5) as c:
        for i, (kv, tokens) in enumerate(batches):
            assert kvd.store(c, kv, tokens)
            wait_written(srv, "l2", 2 * (i + 1))
        assert srv.get("/status")["l1"]["objects"] == 4
        for _ in range(2):
            for kv, tokens in batches:
                out = kvd.retrieve(c, tokens)
                assert out is not None and torch.equal(out, kv)
        assert kvd.check_server_integrity(c) == []
    status = srv.get("/status")
    assert status["l1"]["evictions"] > 0 and status["tiers"]["l2"]["hits"] >= 8
    assert status["sessions"] == 0


def test_lookup_prefetch_and_status_ops(make_server, tmp_path) -> None:
    from kvdock.keys import normalize_tokens
    from kvdock.protocol import messages as m

    disk = tmp_path / "l2"
    srv = make_server("--disk-dir", str(disk))
    kv, tokens = make_kv(3 * CHUNK, seed=30), make_tokens(3 * CHUNK)
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=5) as c:
        assert kvd.store(c, kv, tokens)
        wait_written(srv, "l2", 3)
    srv.stop(signal.SIGKILL)
    srv = make_server("--disk-dir", str(disk), register=None)
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=5) as c:
        raw = normalize_tokens(tokens).tobytes()
        r = c.call(m.Lookup(c.client_id, raw, prefetch=True, session_id="p")).reply
        assert r.hit_tokens == 3 * CHUNK
        done = c.call(m.WaitPrefetch(c.client_id, "p", 10.0)).reply
        assert done == m.PrefetchStatus(True, 3 * CHUNK)
        assert c.call(m.QueryPrefetchStatus(c.client_id, "p")).reply == done  # idempotent
        assert c.call(m.QueryPrefetchStatus(c.client_id, "p")).reply == done
        prep = c.call(m.PrepareRetrieve(c.client_id, "p", raw)).reply
        assert len(prep.slots) == 3
        c.call(m.CommitRetrieve(c.client_id, "p"))
        with pytest.raises(kvd.LeaseExpiredError, match=r"no open session 'p'"):
            c.call(m.QueryPrefetchStatus(c.client_id, "p"))
        assert kvd.check_server_integrity(c) == []


@pytest.mark.valkey  # also on valkey-server (conftest)
def test_redis_with_password_and_unreachable_redis_at_start(make_server, tmp_path, l3_server: str) -> None:
    from helpers import RedisProc, free_port

    secured = RedisProc(free_port(), password="s3cret pass@word", server=l3_server).start()
    try:
        wrong = secured.url.replace("s3cret", "wrong")
        good = make_server("--redis-url", secured.url)
        bad = make_server("--redis-url", wrong)
        dead = make_server("--redis-url", f"redis://127.0.0.1:{free_port()}/0")
        kv, tokens = make_kv(2 * CHUNK, seed=40), make_tokens(2 * CHUNK, start=40)
        with kvd.connect(good.url, good.http_url, MODEL, timeout=5) as c:
            assert kvd.store(c, kv, tokens)
        wait_written(good, "l3", 2)
        assert tier(good, "l3")["url"] == f"redis://***@127.0.0.1:{secured.port}/0"  # no password shown
        for srv in (bad, dead):
            wait_for(lambda s=srv: tier(s, "l3")["up"] is False, "L3 down")
            with kvd.connect(srv.url, srv.http_url, MODEL, timeout=5) as c:
                assert kvd.retrieve(c, tokens) is None  # L3 unusable: a miss, not an error
                assert kvd.store(c, kv, tokens)  # L1 takes the store ...
                # ... but serves nothing while the server cannot follow the fleet's overwrites
                # (tests/fleet/test_fleet_coherence.py: the coherence bound)
                assert kvd.retrieve(c, tokens) is None and kvd.lookup(c, tokens) == 0
                assert tier(srv, "l3")["coherence"]["vouched"] is False
            assert "wrong" not in srv.get("/status")["tiers"]["l3"]["url"]
        assert tier(bad, "l3")["last_error"].startswith("AuthenticationError: invalid username-password pair")
        assert "ConnectionError" in tier(dead, "l3")["last_error"]
        assert 'kvdock_tier_up{tier="l3"} 0.0' in dead.text("/metrics")
    finally:
        secured.stop()


def test_a_slow_disk_never_fails_a_store(make_server, tmp_path: Path) -> None:
    """Queued write-downs hold no pin: with a 16-slot L1 and a disk far slower than the stores,
    every store succeeds whole; the stores wait (up to --writeback-wait-s, 2 s) for write-downs to
    free clean room, so nothing is evicted before its turn (clean before dirty, issue 28)."""
    srv = make_server(
        "--disk-dir", str(tmp_path / "l2"), l1_size="64KiB", env={"KVDOCK_FAULT_L2_WRITE_DELAY_S": "0.02"}
    )  # (80 ms to write a prompt down, a few ms to store one)
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as c:
        for i in range(40):
            kv = make_kv(4 * CHUNK, seed=i)
            assert kvd.store_chunks(c, kv, make_tokens(4 * CHUNK, start=i * 10_000)) == kvd.StoreResult(4, 0, 0, 0)
        last = make_tokens(4 * CHUNK, start=39 * 10_000)
        assert torch.equal(kvd.retrieve(c, last), make_kv(4 * CHUNK, seed=39))
        wait_for(lambda: srv.get("/status")["tiers"]["writeback_backlog_bytes"] == 0, "the write-down queue")
        l2 = tier(srv, "l2")
        assert l2["writes_skipped"] == 0 and l2["writes"] == 160, l2
        l1 = srv.get("/status")["l1"]["eviction"]
        assert l1["evicted_dirty"] == 0 and l1["throttled_stores"] > 0, l1
        assert kvd.check_server_integrity(c) == []


def test_a_hung_redis_never_delays_lease_expiry(make_server, redis_server) -> None:
    """Probing a down Redis runs apart from the lease reaper: with Redis stopped (every probe hangs
    until its 5 s socket timeout), a dead client's pins are still released after its 1 s lease."""
    srv = make_server("--session-ttl", "1", "--redis-url", redis_server.url)
    tokens = make_tokens(4 * CHUNK)
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=30) as c:
        assert kvd.store(c, make_kv(4 * CHUNK, seed=1), tokens)
        assert redis_server.proc is not None
        redis_server.proc.send_signal(signal.SIGSTOP)
        try:
            assert kvd.lookup(c, make_tokens(CHUNK, start=50_000)) == 0  # asks L3: times out, marks it down
            wait_for(lambda: not tier(srv, "l3")["up"], "L3 marked down")
            raw = np.array(tokens, dtype="<u4").tobytes()
            c.call(m.Lookup(c.client_id, raw, prefetch=True, session_id="held"))  # pins, then goes silent
            assert srv.get("/status")["sessions"] == 1
            t0 = time.monotonic()
            wait_for(lambda: srv.get("/status")["sessions"] == 0, "the lease to expire", timeout=10)
            assert time.monotonic() - t0 < 3.0, "lease expiry waited for a hung Redis probe"
        finally:
            redis_server.proc.send_signal(signal.SIGCONT)
        assert kvd.check_server_integrity(c) == []


def test_lookups_queued_while_redis_hangs_wait_one_timeout_not_one_each(make_server, redis_server) -> None:
    import threading

    # a bound longer than the test: the server keeps vouching for its L1 while Redis hangs (with
    # the default bound it stops within 100 ms: tests/fleet/test_fleet_coherence.py)
    # (a Redis timeout of 3 s: one wait for all three is 3 s, one each would be 9 s, past the 8 s allowed)
    srv = make_server("--redis-url", redis_server.url, "--l3-coherence-ms", "60000", "--redis-timeout-s", "3")
    ctxs = [kvd.connect(srv.url, srv.http_url, MODEL, timeout=60) for _ in range(3)]
    took: dict[int, float] = {}

    def lookup(i: int) -> None:
        t0 = time.monotonic()
        assert kvd.lookup(ctxs[i], make_tokens(2 * CHUNK, start=100_000 * (i + 1))) == 0  # L1 misses
        took[i] = time.monotonic() - t0

    try:
        assert kvd.store(ctxs[0], make_kv(2 * CHUNK), make_tokens(2 * CHUNK))
        wait_written(srv, "l3", 2)
        assert redis_server.proc is not None
        redis_server.proc.send_signal(signal.SIGSTOP)
        try:
            threads = [threading.Thread(target=lookup, args=(i,)) for i in range(3)]
            for t in threads:
                t.start()
            time.sleep(0.3)
            t0 = time.monotonic()
            assert kvd.lookup(ctxs[0], make_tokens(2 * CHUNK)) == 2 * CHUNK  # L1 hits never wait
            assert time.monotonic() - t0 < 1.0
            for t in threads:
                t.join(40)
        finally:
            redis_server.proc.send_signal(signal.SIGCONT)
        assert len(took) == 3
        assert kvd.check_server_integrity(ctxs[0]) == []
        assert max(took.values()) < 8.0, f"lookup latencies with Redis stopped: {sorted(took.values())}"
    finally:
        for c in ctxs:
            c.close()


def _idle_http_connections(srv: ServerProc, n: int) -> list:
    import socket

    return [socket.create_connection(("127.0.0.1", srv.http_port), timeout=5) for _ in range(n)]


def test_running_out_of_file_descriptors_never_deletes_good_l2_files(make_server, tmp_path: Path) -> None:
    import os
    import resource

    disk = tmp_path / "l2"
    srv = make_server("--disk-dir", str(disk))
    tokens, kv = make_tokens(2 * CHUNK), make_kv(2 * CHUNK, seed=1)
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as c:
        assert kvd.store(c, kv, tokens)
        wait_written(srv, "l2", 2)
        import urllib.request

        urllib.request.urlopen(urllib.request.Request(srv.http_url + "/admin/clear?tier=l1", method="POST")).read()
        assert len(list(disk.glob("*/*.kv"))) == 2  # only L2 holds the prefix now
        limits = resource.prlimit(srv.proc.pid, resource.RLIMIT_NOFILE)
        fds = f"/proc/{srv.proc.pid}/fd"
        resource.prlimit(srv.proc.pid, resource.RLIMIT_NOFILE, (len(os.listdir(fds)) + 20, limits[1]))
        socks = _idle_http_connections(srv, 60)  # the server accepts them until it has no descriptor left
        try:
            time.sleep(0.5)
            in_use = {int(fd) for fd in os.listdir(fds)}
            lowest_free = min(set(range(max(in_use) + 2)) - in_use)
            resource.prlimit(srv.proc.pid, resource.RLIMIT_NOFILE, (lowest_free, limits[1]))  # none left, surely
            kvd.retrieve(c, tokens)  # its L2 reads fail (a miss is fine)
        finally:
            for s in socks:
                s.close()
            resource.prlimit(srv.proc.pid, resource.RLIMIT_NOFILE, limits)
        time.sleep(1.5)  # the server accepts again (asyncio retries accept after 1 s)
        assert kvd.check_server_integrity(c) == []
        assert len(list(disk.glob("*/*.kv"))) == 2, "good L2 files were deleted"
        got = kvd.retrieve(c, tokens)
        assert got is not None and torch.equal(got, kv)


def test_an_absurd_cache_salt_is_refused_not_written_into_every_chunk(make_server, tmp_path: Path) -> None:
    srv = make_server("--disk-dir", str(tmp_path / "l2"))
    tokens, kv = make_tokens(64 * CHUNK), make_kv(64 * CHUNK)
    salt = "s" * 2**20
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=30) as c:
        try:
            kvd.store(c, kv, tokens, cache_salt=salt)
        except kvd.InvalidInputError:
            return  # refused at once: fine
        wait_for(lambda: srv.get("/status")["tiers"]["writeback_backlog_bytes"] == 0, "the write-downs")
        assert kvd.check_server_integrity(c) == []
        written = tier(srv, "l2")["bytes_written"]
        payload = 64 * c.geometry.chunk_nbytes(CHUNK)
        assert written < payload + 64 * 64 * 1024, f"{written / 2**20:.1f} MiB on disk for {payload // 1024} KiB of KV"


def test_a_batch_waiting_on_l3_hands_out_every_prompt_with_a_whole_lease(make_server) -> None:
    """A batch's reply waits for its slowest prompt (one loading from a stalled L3); a prompt L1
    held from the start must not have used up its lease by then (it once expired meanwhile)."""
    import threading

    import redis

    from helpers import RedisProc, free_port

    r = RedisProc(free_port(), extra=("--enable-debug-command", "local")).start()
    try:
        first = make_server("--redis-url", r.url)
        a, b = make_tokens(2 * CHUNK, start=10_000), make_tokens(2 * CHUNK, start=20_000)
        with kvd.connect(first.url, first.http_url, MODEL, timeout=10) as c:
            kvd.store(c, make_kv(len(a), seed=1), a)
            kvd.store(c, make_kv(len(b), seed=2), b)
        wait_written(first, "l3", 4)
        # (a bound longer than the stall: the server keeps vouching for its L1 meanwhile)
        srv = make_server("--redis-url", r.url, "--session-ttl", "1", "--l3-coherence-ms", "60000")
        with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as c:
            assert kvd.retrieve(c, a) is not None  # a is in this server's L1 now, b only in L3
            expired = srv.metric("kvdock_expired_sessions_total")
            stall = threading.Thread(target=redis.Redis(port=r.port).execute_command, args=("DEBUG", "SLEEP", "3"))
            stall.start()
            time.sleep(0.2)
            t0 = time.monotonic()
            got_a, got_b = kvd.retrieve_many(c, [a, b])
            assert time.monotonic() - t0 > 2  # the reply did wait for the stalled L3
            stall.join()
            assert got_a is not None and torch.equal(got_a, make_kv(len(a), seed=1))
            assert got_b is not None and torch.equal(got_b, make_kv(len(b), seed=2)), srv.log()[-3000:]
            assert srv.metric("kvdock_expired_sessions_total") == expired
            assert "outlived its lease" not in srv.log()
            assert kvd.check_server_integrity(c) == []
    finally:
        r.stop()

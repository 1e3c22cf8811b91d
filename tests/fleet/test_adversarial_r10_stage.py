"""A-STAGE (round 10): adversarial tests of 7be2b81's staged L3 write-downs
(storage/_redisstage.py): a plain write-down lands under a staged key, then its server checks the
invalidation stream and commits it (renames it onto the object's key) unless an overwrite named
the key since the write-down's position.

Real servers (tests' make_server) share one real redis-server / Valkey / Redis Cluster; a
write-down is held at a chosen step (after its stage, after its check) in the writer thread of
its server, as a SIGSTOPped server or a slow link would hold it; meanwhile another server
overwrites, Redis loses keys (DEL as an eviction would, FLUSHALL, a master killed), and then the
write is let go. What must hold (docs/scale-out.md): no server ever serves the replaced version
(a miss is fine), and the fleet's L3 takes write-downs again afterwards."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import redis as redis_py
import torch
from tests.helpers import (
    CHUNK,
    MODEL,
    RedisProc,
    SlowLink,
    backlog,
    free_port,
    l3_coherence,
    make_kv,
    make_tokens,
    miss_or,
    vouching,
    wait_for,
)

import kvdock.sdk as kvd
from kvdock.errors import TierUnavailableError

STREAM = b"kvdock:v2:{invalidations}"


def _l3(srv: Any) -> dict:
    return srv.get("/status")["tiers"]["l3"]


def _tier(srv: Any) -> Any:
    return next(lane.tier for lane in srv.state.manager.lanes if lane.name == "l3")


class _Hold:
    """Hold server ``srv``'s L3 writer thread at ``step`` of its next batch: "settle" (every write
    of the batch staged, its check not sent) or "commit" (checked, COMMIT_SCRIPT not sent), until
    :meth:`release` (as SIGSTOP would, without stopping the rest of the server)."""

    def __init__(self, srv: Any, step: str) -> None:
        self.tier = _tier(srv)
        self.attr = {"settle": "settle", "commit": "_commit"}[step]
        self.real = getattr(self.tier, self.attr)
        self.go, self.waiting = threading.Event(), threading.Event()

        def held(*args: Any, **kw: Any) -> Any:
            self.waiting.set()
            self.go.wait(60)
            return self.real(*args, **kw)

        setattr(self.tier, self.attr, held)

    def release(self) -> None:
        self.go.set()
        setattr(self.tier, self.attr, self.real)


def _fresh_read(make_server: Any, url: str, tokens: list[int]) -> torch.Tensor | None:
    c = vouching(make_server, url)
    with kvd.connect(c.url, c.http_url, MODEL, timeout=10) as cc:
        return kvd.retrieve(cc, tokens)


def _objects(raw: redis_py.Redis) -> list[bytes]:
    """The L3 keys of objects, their floors and staged writes (not the stream's, not the models')."""
    return [k for k in raw.keys("kvdock:v2:{*") if b"{invalidations}" not in k]


def _floors_and_values(raw: redis_py.Redis) -> list[bytes]:
    """What an eviction of the overwrite's floors and values deletes (staged writes stay)."""
    keys = [k for k in _objects(raw) if not k.endswith((b":s", b":n"))]
    assert any(k.endswith(b":f") for k in keys) and any(k.endswith(b"}") for k in keys), keys
    return keys


@pytest.mark.valkey
@pytest.mark.parametrize("step", ["settle", "commit"])
def test_an_overwrite_while_a_write_down_is_held_between_its_stage_and_its_commit(
    make_server, redis_server, step: str
) -> None:
    """B stores v1; its write-down is staged and held (before its check, or after it: the check
    passed, the commit not sent yet). A overwrites with v2 (acknowledged, written down), then
    Redis loses the overwrite's floors and values (evicted: DEL), then B's write goes on. Every
    server misses or serves v2, never v1."""
    url = redis_server.url
    a, b = vouching(make_server, url), vouching(make_server, url)
    tokens = make_tokens(2 * CHUNK, start=101_000_000)
    v1, v2 = make_kv(2 * CHUNK, seed=101), make_kv(2 * CHUNK, seed=102)
    hold = _Hold(b, step)
    raw = redis_py.Redis.from_url(url)
    ca = kvd.connect(a.url, a.http_url, MODEL, timeout=10)
    cb = kvd.connect(b.url, b.http_url, MODEL, timeout=10)
    try:
        assert kvd.store(cb, v1, tokens)
        assert hold.waiting.wait(30), "B's write-down did not reach its hold"
        assert kvd.store(ca, v2, tokens, overwrite=True)
        wait_for(lambda: backlog(a) == 0, "A's write-down of v2")
        raw.delete(*_floors_and_values(raw))
        hold.release()
        wait_for(lambda: backlog(b) == 0, "B's write-down")
        miss_or(_fresh_read(make_server, url, tokens), v2, v1, "a fresh server")
        miss_or(kvd.retrieve(cb, tokens), v2, v1, "B")
        miss_or(kvd.retrieve(ca, tokens), v2, v1, "A")
    finally:
        hold.release()
        raw.close()
        kvd.close(ca)
        kvd.close(cb)


@pytest.mark.parametrize("loss", ["flushall", "del-stream", "xtrim"])
def test_l3_losing_the_stream_while_a_write_down_is_staged_then_takes_write_downs_again(
    make_server, redis_server, loss: str
) -> None:
    """B's write-down of v1 is staged and held before its check; A overwrites with v2; then L3
    loses the stream (FLUSHALL, DEL, XTRIM MAXLEN 0) and B's check goes on: nothing replaced may
    be served; and a prefix stored afterwards (through B) must reach L3 (a fresh server reads it)
    within 15 s."""
    url = redis_server.url
    a, b = vouching(make_server, url), vouching(make_server, url)
    tokens = make_tokens(2 * CHUNK, start=102_000_000)
    v1, v2 = make_kv(2 * CHUNK, seed=103), make_kv(2 * CHUNK, seed=104)
    hold = _Hold(b, "settle")
    raw = redis_py.Redis.from_url(url)
    ca = kvd.connect(a.url, a.http_url, MODEL, timeout=10)
    cb = kvd.connect(b.url, b.http_url, MODEL, timeout=10)
    try:
        assert kvd.store(cb, v1, tokens)
        assert hold.waiting.wait(30)
        assert kvd.store(ca, v2, tokens, overwrite=True)
        wait_for(lambda: backlog(a) == 0, "A's write-down of v2")
        if loss == "flushall":
            raw.flushall()
        elif loss == "del-stream":
            raw.delete(STREAM)
            raw.delete(*_floors_and_values(raw))
        else:
            raw.xtrim(STREAM, maxlen=0, approximate=False)
            raw.delete(*_floors_and_values(raw))
        hold.release()
        wait_for(lambda: backlog(b) == 0, "B's write-down")
        miss_or(_fresh_read(make_server, url, tokens), v2, v1, "a fresh server")
        miss_or(kvd.retrieve(cb, tokens), v2, v1, "B")
        # liveness: L3 takes B's write-downs again
        later, v3 = make_tokens(2 * CHUNK, start=102_500_000), make_kv(2 * CHUNK, seed=105)
        deadline = time.monotonic() + 15
        while True:
            wait_for(lambda: l3_coherence(b)["vouched"], "B to vouch again", 15)
            kvd.store(cb, v3, later)
            wait_for(lambda: backlog(b) == 0, "B's write-down of v3")
            got = _fresh_read(make_server, url, later)
            if got is not None and torch.equal(got, v3):
                break
            assert got is None or torch.equal(got, v3[:, :, : got.shape[2]])
            assert time.monotonic() < deadline, f"B's write-downs do not land in L3 any more: {_l3(b)}"
            time.sleep(0.5)
    finally:
        hold.release()
        raw.close()
        kvd.close(ca)
        kvd.close(cb)


def _stream_master(cluster: Any) -> int:
    """The port of the master that serves the stream's hash slot."""
    slot = int(cluster.cli(cluster.live()[0], "cluster", "keyslot", STREAM.decode()).strip())
    for port, role in cluster.roles().items():
        if role != "master":
            continue
        for line in cluster.cli(port, "cluster", "nodes").splitlines():
            parts = line.split()
            if "myself" not in parts[2]:
                continue
            for rng in parts[8:]:
                lo, _, hi = rng.partition("-")
                if lo.isdigit() and int(lo) <= slot <= int(hi or lo):
                    return port
    raise AssertionError("no master serves the stream's slot")


@pytest.mark.valkey
def test_the_streams_master_killed_between_a_stage_and_its_check(make_server, redis_cluster) -> None:
    """On a Redis Cluster: B's write-down of v1 is staged and held before its check; the master
    of the stream's slot is killed (its replica takes over); A overwrites with v2 once the
    cluster is ok; B's check goes on. Nothing replaced is served; B's write-downs land again
    within 20 s (a fresh server reads what B stores then)."""
    url = redis_cluster.url
    a, b = vouching(make_server, url), vouching(make_server, url)
    tokens = make_tokens(2 * CHUNK, start=103_000_000)
    v1, v2 = make_kv(2 * CHUNK, seed=106), make_kv(2 * CHUNK, seed=107)
    hold = _Hold(b, "settle")
    ca = kvd.connect(a.url, a.http_url, MODEL, timeout=10)
    cb = kvd.connect(b.url, b.http_url, MODEL, timeout=10)
    try:
        assert kvd.store(cb, v1, tokens)
        assert hold.waiting.wait(30)
        redis_cluster.kill(_stream_master(redis_cluster))
        redis_cluster.wait_ok(30)
        deadline = time.monotonic() + 20
        while True:
            try:
                if kvd.store(ca, v2, tokens, overwrite=True):
                    break
            except TierUnavailableError:  # (L3 down for A until its probe: retry)
                pass
            assert time.monotonic() < deadline, "A's overwrite is refused after the failover"
            time.sleep(0.5)
        wait_for(lambda: backlog(a) == 0, "A's write-down of v2", 20)
        hold.release()
        wait_for(lambda: backlog(b) == 0, "B's write-down", 20)
        miss_or(_fresh_read(make_server, url, tokens), v2, v1, "a fresh server")
        miss_or(kvd.retrieve(cb, tokens), v2, v1, "B")
        later, v3 = make_tokens(2 * CHUNK, start=103_500_000), make_kv(2 * CHUNK, seed=108)
        deadline = time.monotonic() + 20
        while True:
            if l3_coherence(b)["vouched"] and _l3(b)["up"]:
                kvd.store(cb, v3, later)
                wait_for(lambda: backlog(b) == 0, "B's write-down of v3", 20)
                got = _fresh_read(make_server, url, later)
                if got is not None and torch.equal(got, v3):
                    break
            assert time.monotonic() < deadline, f"B's write-downs do not land in L3 any more: {_l3(b)}"
            time.sleep(0.5)
    finally:
        hold.release()
        kvd.close(ca)
        kvd.close(cb)


def test_staging_under_noeviction_oom_stores_nothing_wrong_and_recovers(make_server) -> None:
    """maxmemory so small, with noeviction, that B's staging hits OOM: B stays up, serves what it
    stored from L1, nothing wrong is read from L3; once Redis has room again (another
    application's keys deleted), B's write-downs land within 15 s."""
    proc = RedisProc(free_port(), extra=("--maxmemory", "3mb", "--maxmemory-policy", "noeviction")).start()
    raw = redis_py.Redis.from_url(proc.url)
    try:
        b = vouching(make_server, proc.url)
        blob = b"x" * 64 * 1024
        n = 0
        while True:
            try:
                raw.set(f"other-app:{n}", blob)
                n += 1
            except redis_py.exceptions.OutOfMemoryError:
                break
            except redis_py.exceptions.ResponseError as e:
                assert "OOM" in str(e)
                break
        tokens = make_tokens(8 * CHUNK, start=104_000_000)
        v1 = make_kv(8 * CHUNK, seed=109)
        with kvd.connect(b.url, b.http_url, MODEL, timeout=10) as cb:
            assert kvd.store(cb, v1, tokens)
            wait_for(lambda: backlog(b) == 0, "B's write-down (refused: OOM)", 15)
            got = kvd.retrieve(cb, tokens)
            assert got is not None and torch.equal(got, v1)
            got = _fresh_read(make_server, proc.url, tokens)
            assert got is None or torch.equal(got, v1[:, :, : got.shape[2]])
            raw.delete(*(f"other-app:{i}" for i in range(n)))
            later, v2 = make_tokens(2 * CHUNK, start=104_500_000), make_kv(2 * CHUNK, seed=110)
            deadline = time.monotonic() + 15
            while True:
                if l3_coherence(b)["vouched"] and _l3(b)["up"]:
                    kvd.store(cb, v2, later)
                    wait_for(lambda: backlog(b) == 0, "B's write-down of v2", 15)
                    got = _fresh_read(make_server, proc.url, later)
                    if got is not None and torch.equal(got, v2):
                        break
                assert time.monotonic() < deadline, f"B's write-downs do not land in L3 any more: {_l3(b)}"
                time.sleep(0.5)
    finally:
        raw.close()
        proc.stop()


def test_a_stream_made_again_with_a_first_id_not_past_an_older_position_commits_nothing_issued_before(
    make_server, redis_server
) -> None:
    """B's write-down of v1 is issued (its position: the stream's tip X) and held on a slow link;
    A overwrites with v2 (E1, E2 after X). Redis then evicts the stream, the floors and the values
    (allkeys-lru) and a poll makes the stream again (POLL_SCRIPT: XADD * naming a new incarnation).
    The id Redis gives that first entry is its clock's millisecond: emulated here as X's
    millisecond (the loss and the new entry in the same millisecond as X, or Redis' clock stepped
    back by NTP), in one transaction so that no poll comes between. B's write goes on: it must not
    land (the stream cannot show what came after X). Was a strict xfail while b5d875b made the
    stream again under the same incarnation (CHECK_SCRIPT took 'first entry past the position' as
    proof); a lost stream starts a new incarnation again, and B's write, issued under the old one,
    is never committed."""
    url = redis_server.url
    a, b = vouching(make_server, url), vouching(make_server, url)
    tokens = make_tokens(2 * CHUNK, start=105_000_000)
    v1, v2 = make_kv(2 * CHUNK, seed=111), make_kv(2 * CHUNK, seed=112)
    raw = redis_py.Redis.from_url(url)
    link = SlowLink(b)
    ca = kvd.connect(a.url, a.http_url, MODEL, timeout=10)
    cb = kvd.connect(b.url, b.http_url, MODEL, timeout=10)
    try:
        tip = raw.xrevrange(STREAM, count=1)[0][0]
        assert kvd.store(cb, v1, tokens)
        assert link.waiting.wait(30), "B's write-down did not start"
        assert raw.xrevrange(STREAM, count=1)[0][0] == tip  # B's position is the tip (nothing since)
        assert kvd.store(ca, v2, tokens, overwrite=True)
        wait_for(lambda: backlog(a) == 0, "A's write-down of v2")
        inc = b"%032x" % 0x5EED  # (what POLL_SCRIPT does on a lost stream, with Redis' clock stepped back)
        assert raw.get(STREAM + b":incarnation") != inc
        first = tip.split(b"-")[0] + b"-0"  # (the same millisecond as B's position)
        with raw.pipeline(transaction=True) as tx:
            tx.delete(STREAM, *_floors_and_values(raw))
            tx.set(STREAM + b":incarnation", inc)
            tx.xadd(STREAM, {b"k": b"\x90", b"i": inc}, id=first)
            tx.execute()
        link.release()
        wait_for(lambda: backlog(b) == 0, "B's write-down")
        miss_or(_fresh_read(make_server, url, tokens), v2, v1, "a fresh server")
    finally:
        link.release()
        raw.close()
        kvd.close(ca)
        kvd.close(cb)


def test_two_servers_writing_down_one_prefix_while_a_third_overwrites_it(make_server, redis_server) -> None:
    """A and B store the same v1 (plain). A's write-down is staged and held before its check; B's
    is issued and held before its stage (a slow link). C overwrites with v2 (acknowledged,
    written down); Redis evicts the floors and values; B's stage then lands (nothing refuses it
    there) and both go on. No server serves v1; L3 holds v2 or nothing."""
    url = redis_server.url
    a, b, c = (vouching(make_server, url) for _ in range(3))
    tokens = make_tokens(2 * CHUNK, start=106_000_000)
    v1, v2 = make_kv(2 * CHUNK, seed=113), make_kv(2 * CHUNK, seed=114)
    raw = redis_py.Redis.from_url(url)
    hold, link = _Hold(a, "settle"), SlowLink(b)
    ctxs = [kvd.connect(s.url, s.http_url, MODEL, timeout=10) for s in (a, b, c)]
    try:
        assert kvd.store(ctxs[0], v1, tokens)
        assert hold.waiting.wait(30), "A's write-down did not reach its check"
        assert kvd.store(ctxs[1], v1, tokens)
        assert link.waiting.wait(30), "B's write-down did not start"
        assert kvd.store(ctxs[2], v2, tokens, overwrite=True)
        wait_for(lambda: backlog(c) == 0, "C's write-down of v2")
        raw.delete(*_floors_and_values(raw))
        link.release()
        wait_for(lambda: any(k.endswith(b":s") for k in _objects(raw)) or backlog(b) == 0, "B's stage")
        hold.release()
        wait_for(lambda: backlog(a) == 0 and backlog(b) == 0, "A's and B's write-downs")
        assert not [k for k in _objects(raw) if k.endswith(b"}")], "L3 holds a value of the replaced version"
        miss_or(_fresh_read(make_server, url, tokens), v2, v1, "a fresh server")
        for who, ctx in zip("ABC", ctxs, strict=True):
            miss_or(kvd.retrieve(ctx, tokens), v2, v1, who)
    finally:
        hold.release()
        link.release()
        raw.close()
        for ctx in ctxs:
            kvd.close(ctx)

"""Staged write-downs of plain versions to a shared L3 (storage._redisstage), on one real Redis
with in-process hosts (tierworld): a staged write is invisible until its check of the stream
commits it, and nothing an overwrite replaced is committed, whatever Redis lost meanwhile."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import redis as redis_py

from helpers import RedisProc
from kvdock.errors import WriteFenced, WriteLate
from kvdock.storage import objfile
from kvdock.storage._coherence_lua import INCARNATION_KEY, OBJECT_TTL_MS, STAGED_TTL_MS
from kvdock.storage._redisstage import staged_keys
from kvdock.storage.coherence import STREAM_KEY
from kvdock.storage.redis import floor_key
from kvdock.storage.stream import Fence, decode_keys
from tierworld import CHUNK, GEO, SHAPE, World, payload
from tierworld import K as WK

A, B = WK(1), WK(2)


def _plain(version: int) -> tuple[bytes, memoryview]:
    data = memoryview(payload(A, version))
    return objfile.encode_header(A, "float32", SHAPE, data, version + 10, 0, GEO.digest(CHUNK)), data


def _two_hosts(
    tmp_path: Path, redis_server: RedisProc, body: Callable[[World, World, redis_py.Redis], Awaitable[None]]
) -> None:
    async def main() -> None:
        h1 = World(tmp_path / "h1", redis_url=redis_server.url, coherent=True)
        h2 = World(tmp_path / "h2", redis_url=redis_server.url, coherent=True)
        raw = redis_py.Redis.from_url(redis_server.url)
        try:
            await h1.sync()
            await h2.sync()
            await body(h1, h2, raw)
        finally:
            h1.mgr.close()
            h2.mgr.close()
            raw.close()

    asyncio.run(main())


def _stage(w: World, version: int = 1, position: int | None = None) -> tuple[bytes, Fence]:
    """Host ``w`` stages a plain version of A (as its lane does); A's L3 key and the fence."""
    assert w.redis is not None and w.coherence is not None
    fence = w.coherence.fence(w.coherence.position)
    if position is not None:
        fence = fence._replace(position=position)
    header, data = _plain(version)
    assert w.redis.write_from(A, header, data, fence) > 0
    return w.redis._key(A), fence


def test_a_staged_write_is_invisible_until_its_check_commits_it(tmp_path: Path, redis_server: RedisProc) -> None:
    async def body(h1: World, h2: World, raw: redis_py.Redis) -> None:
        final, _ = _stage(h1)
        staged, nonce = staged_keys(final)
        assert raw.get(final) is None and raw.exists(staged, nonce) == 2
        assert 0 < raw.pttl(staged) <= STAGED_TTL_MS and 0 < raw.pttl(nonce) <= STAGED_TTL_MS
        header, data = _plain(1)
        assert h1.redis is not None and h1.redis.settle() == {}
        assert raw.get(final) == header + bytes(data)
        assert raw.exists(staged, nonce) == 0
        assert STAGED_TTL_MS < raw.pttl(final) <= OBJECT_TTL_MS  # (the staged TTL replaced: volatile-* policies)
        assert h1.redis.settle() == {}  # nothing staged since

    _two_hosts(tmp_path, redis_server, body)


def test_an_overwrite_after_the_stage_deletes_it_and_nothing_lands(tmp_path: Path, redis_server: RedisProc) -> None:
    """The overwrite's deletion (DELETE_SCRIPT) takes the staged write with it, and its entries
    (after the write's position) refuse it (WriteFenced). A staged write or nonce Redis lost
    before the commit is a write that did not land (WriteLate: skipped)."""

    async def body(h1: World, h2: World, raw: redis_py.Redis) -> None:
        final, _ = _stage(h1)
        assert h2.redis is not None
        epoch = h2.redis.delete_keys([A])
        assert raw.exists(*staged_keys(final)) == 0
        assert h1.redis is not None
        refused = h1.redis.settle()
        assert list(refused) == [A] and type(refused[A]) is WriteFenced and "stale" in str(refused[A])
        assert raw.get(final) is None
        for lost in staged_keys(final):
            _stage(h1, position=epoch)
            raw.delete(lost)  # (evicted)
            refused = h1.redis.settle()
            assert list(refused) == [A] and type(refused[A]) is WriteLate and "gone" in str(refused[A])
            assert raw.get(final) is None

    _two_hosts(tmp_path, redis_server, body)


@pytest.mark.parametrize("lost", ["floor", "floor-and-value"])
def test_an_overwrite_before_the_stage_whose_floor_redis_lost_is_refused_by_the_stream(
    tmp_path: Path, redis_server: RedisProc, lost: str
) -> None:
    """h1's write-down was issued before h2's overwrite (its position is older) and lands after
    it; Redis lost the overwrite's floor (and its value: allkeys-lru), so the stage itself passes.
    The check of the stream finds h2's entries after h1's position: dropped (WriteFenced: h1
    drops its copy too), and A's value is what it was before the commit (h2's version, or none)."""

    async def body(h1: World, h2: World, raw: redis_py.Redis) -> None:
        assert h1.coherence is not None and h2.redis is not None
        old = h1.coherence.position
        epoch = h2.redis.delete_keys([A])
        final = h2.redis._key(A)
        newer = b"h2's version"
        raw.set(final, newer)
        raw.delete(floor_key(final))
        if lost == "floor-and-value":
            raw.delete(final)
        _stage(h1, position=old)
        assert h1.redis is not None
        refused = h1.redis.settle()
        assert list(refused) == [A] and type(refused[A]) is WriteFenced and "stale" in str(refused[A])
        assert raw.get(final) == (None if lost == "floor-and-value" else newer)
        assert raw.exists(*staged_keys(final)) == 0
        # a write issued after the overwrite (its position past E2) is committed
        _stage(h1, version=2, position=epoch)
        assert h1.redis.settle() == {}
        header, data = _plain(2)
        assert raw.get(final) == header + bytes(data)

    _two_hosts(tmp_path, redis_server, body)


@pytest.mark.parametrize("how", ["deleted", "trimmed"])
def test_a_stream_that_cannot_show_every_entry_since_the_position_commits_nothing(
    tmp_path: Path, redis_server: RedisProc, how: str
) -> None:
    async def body(h1: World, h2: World, raw: redis_py.Redis) -> None:
        assert h2.redis is not None and h1.coherence is not None
        old = h1.coherence.position
        h2.redis.delete_keys([B])  # entries after h1's position
        if how == "deleted":
            raw.delete(STREAM_KEY)
        else:
            raw.xtrim(STREAM_KEY, maxlen=1, approximate=False)
        final, _ = _stage(h1, position=old)
        assert h1.redis is not None
        refused = h1.redis.settle()
        assert list(refused) == [A] and type(refused[A]) is WriteLate and "unproven" in str(refused[A])
        assert raw.get(final) is None and raw.exists(*staged_keys(final)) == 0

    _two_hosts(tmp_path, redis_server, body)


def test_of_two_hosts_staging_one_key_only_the_last_stager_commits(tmp_path: Path, redis_server: RedisProc) -> None:
    """A nonce names the staged write: h1's commit never commits h2's (whose check is h2's own)."""

    async def body(h1: World, h2: World, raw: redis_py.Redis) -> None:
        final, _ = _stage(h1, version=1)
        _stage(h2, version=2)
        assert h1.redis is not None and h2.redis is not None
        refused = h1.redis.settle()
        assert list(refused) == [A] and "gone" in str(refused[A])
        assert raw.get(final) is None
        assert h2.redis.settle() == {}
        header, data = _plain(2)
        assert raw.get(final) == header + bytes(data)

    _two_hosts(tmp_path, redis_server, body)


def test_a_lost_stream_starts_a_new_incarnation_at_once_that_names_itself(
    tmp_path: Path, redis_server: RedisProc
) -> None:
    """The stream always exists while its incarnation does: a fresh L3 gets a first entry (no
    keys) naming the incarnation; a stream deleted (or evicted) while its incarnation key stays
    starts a new incarnation with such an entry at the next poll (a gap for every server), never an
    "empty" stream, nor one under the old incarnation whose first id could be before positions of
    the lost one: a write staged before the loss is never committed."""

    async def body(h1: World, h2: World, raw: redis_py.Redis) -> None:
        first = raw.xrange(STREAM_KEY)
        inc = raw.get(INCARNATION_KEY)
        assert len(first) == 1 and first[0][1] == {b"k": b"\x90", b"i": inc}
        assert decode_keys(first[0][1][b"k"]) == []
        assert h1.coherence is not None
        old = h1.coherence.position
        final, _ = _stage(h2, position=old)  # issued before the loss, settled after it
        raw.delete(STREAM_KEY)
        result = await h1.sync()
        new = h1.coherence.incarnation
        assert result.lost and raw.get(INCARNATION_KEY) == new != inc
        again = raw.xrange(STREAM_KEY)
        assert len(again) == 1 and again[0][1] == {b"k": b"\x90", b"i": new}
        assert h2.redis is not None
        refused = h2.redis.settle()
        assert list(refused) == [A] and "unproven" in str(refused[A]) and raw.get(final) is None

    _two_hosts(tmp_path, redis_server, body)


def test_the_lane_drops_a_copy_whose_staged_write_an_overwrite_made_stale(
    tmp_path: Path, redis_server: RedisProc
) -> None:
    """End to end through h1's lane: its write-down is held after its fence was read, h2
    overwrites A meanwhile and Redis loses the floor and the value; h1's write is staged, its
    check refuses it, the lane counts it fenced and h1 stops serving its copy."""

    async def body(h1: World, h2: World, raw: redis_py.Redis) -> None:
        gate = h1.block("l3")
        h1.store([A], version=1)
        await asyncio.sleep(0)
        assert h2.redis is not None
        h2.redis.delete_keys([A])
        final = h2.redis._key(A)
        raw.delete(final, floor_key(final))
        gate.set()
        await h1.drain()
        lane = h1.lanes["l3"]
        assert lane.counters.fenced == 1 and lane.counters.writes == 0
        assert raw.get(final) is None and raw.exists(*staged_keys(final)) == 0
        assert h1.l1.get(A) is None

    _two_hosts(tmp_path, redis_server, body)

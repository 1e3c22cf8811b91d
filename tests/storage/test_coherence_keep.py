"""Holding an overwrite's version across a fleet (storage.keeping) against one real Redis: the KEEP
script's answers, a write-down of an overwrite's version once its floor is gone, loads of a
marked object, keeping rounds (drops, repairs) and the lease, on an injected clock."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import redis as redis_py

from helpers import RedisProc
from kvdock.errors import WriteFenced
from kvdock.keys import ObjectKey
from kvdock.storage import objfile
from kvdock.storage.coherence import KEEP_SCRIPT
from kvdock.storage.redis import floor_key
from kvdock.storage.stream import pos_int
from tierworld import CHUNK, GEO, SHAPE, World, payload
from tierworld import K as WK

A, B = WK(1), WK(2)
E2 = "1796331648926-3"
TTL = 60_000


def block(key: ObjectKey, version: int, overwrite: str, data: bytes, parent: int = 0) -> bytes:
    """A value as L3 holds it: header (an overwrite's version when ``overwrite``) + payload."""
    digest = GEO.digest(CHUNK)
    return objfile.encode_header(key, "float32", SHAPE, memoryview(data), version, parent, digest, overwrite) + data


def keep(raw: redis_py.Redis, value: bytes, floor: bytes, mark: bytes, e2: str = E2, ttl: int = TTL) -> int:
    return int(raw.eval(KEEP_SCRIPT, 2, value, floor, e2, mark, ttl))


@pytest.mark.valkey  # also on valkey-server (conftest)
def test_the_keep_script_answers(redis_server: RedisProc) -> None:
    raw = redis_py.Redis.from_url(redis_server.url)
    value, floor = b"kvdock:test:{x}", b"kvdock:test:{x}:f"
    mine = objfile.mark(7, 0, GEO.digest(CHUNK), E2)
    ours, theirs = block(A, 7, E2, payload(A, 1)), block(A, 9, E2, payload(A, 2))
    try:
        # floor at E2: refreshed; 1 for our version, 0 when the value is gone, -1 for another
        raw.set(value, ours)
        raw.set(floor, E2, px=1_000)
        assert keep(raw, value, floor, mine) == 1 and raw.pttl(floor) > 50_000
        raw.delete(value)
        raw.pexpire(floor, 1_000)
        assert keep(raw, value, floor, mine) == 0 and raw.pttl(floor) > 50_000 and raw.get(floor) == E2.encode()
        raw.set(value, theirs)
        assert keep(raw, value, floor, mine) == -1
        raw.set(value, b"garbage that is no header at all")
        assert keep(raw, value, floor, mine) == -1
        raw.set(value, block(A, 7, "", payload(A, 1)))  # the same version number, as a plain store's
        assert keep(raw, value, floor, mine) == -1
        # floor raised by another overwrite (or not a position): drop, and nothing changes
        raw.set(value, ours)
        raw.set(floor, "1796331648999-0")
        assert keep(raw, value, floor, mine) == -1 and raw.get(floor) == b"1796331648999-0"
        raw.set(floor, "garbage")
        assert keep(raw, value, floor, mine) == -1 and raw.get(floor) == b"garbage"
        # floor gone: set again while the value is still our version; else drop, floor stays gone
        raw.delete(floor)
        assert keep(raw, value, floor, mine) == 1 and raw.get(floor) == E2.encode() and raw.pttl(floor) > 50_000
        raw.delete(floor)
        raw.set(value, theirs)
        assert keep(raw, value, floor, mine) == -1 and raw.get(floor) is None
        raw.delete(value)
        assert keep(raw, value, floor, mine) == -1 and raw.get(floor) is None
        raw.set(value, ours)
        assert keep(raw, value, floor, b"") == -1 and raw.get(floor) is None  # an empty mark is nobody's
    finally:
        raw.close()


def hosts(tmp_path: Path, redis_server: RedisProc, n: int = 2, disk: bool = True) -> list[World]:
    return [World(tmp_path / f"h{i}", redis_url=redis_server.url, disk=disk, coherent=True) for i in range(n)]


def raw_of(w: World) -> tuple[Any, Callable[[ObjectKey], bytes]]:
    assert w.redis is not None
    redis = w.redis
    return redis._redis, redis._key


def run_on(loop: asyncio.AbstractEventLoop) -> Callable[..., Awaitable[Any]]:
    return lambda fn, *args: loop.run_in_executor(None, fn, *args)


async def overwrite(w: World, keys: list[ObjectKey], version: int) -> None:
    assert await w.store_async(keys, version=version, overwrite=True) == len(keys)
    await w.drain()


def test_a_write_down_of_an_overwrites_version_lands_only_while_its_floor_lives(
    tmp_path: Path, redis_server: RedisProc
) -> None:
    async def main() -> None:
        (w,) = hosts(tmp_path, redis_server, 1, disk=False)
        try:
            await w.sync()
            await overwrite(w, [A], 1)
            obj = w.l1.get(A)
            assert obj is not None and obj.overwrite > 0
            e2 = objfile.decode_header(w.redis._redis.get(w.redis._key(A)))[0].overwrite  # type: ignore[union-attr]
            assert pos_int(e2) == obj.overwrite  # written down marked with its E2
            raw, key_of = raw_of(w)
            assert w.coherence is not None and w.redis is not None
            value = block(A, obj.version, e2, payload(A, 1))
            header, data = value[: objfile.ALIGN], memoryview(value[objfile.ALIGN :])
            fence = w.coherence.fence(obj.overwrite)
            raw.delete(key_of(A))
            w.redis.write_from(A, header, data, fence)  # floor live at E2: lands
            assert raw.get(key_of(A)) == value
            raw.delete(key_of(A), floor_key(key_of(A)))  # the floor expired
            with pytest.raises(WriteFenced):
                w.redis.write_from(A, header, data, fence)
            raw.set(floor_key(key_of(A)), "1796331648999-0")  # another overwrite raised it
            with pytest.raises(WriteFenced):
                w.redis.write_from(A, header, data, fence)
            assert raw.get(key_of(A)) is None
            plain = objfile.encode_header(A, "float32", SHAPE, data, 5, 0, GEO.digest(CHUNK))
            raw.delete(floor_key(key_of(A)))
            w.redis.write_from(A, plain, data, fence)  # a plain version: today's rule (no floor: lands)
            assert w.redis.settle() == {}  # (staged, then committed: storage._redisstage)
            assert raw.get(key_of(A)) == plain + bytes(data)
        finally:
            w.mgr.close()

    asyncio.run(main())


def test_a_load_of_an_overwrites_version_runs_keep_first(tmp_path: Path, redis_server: RedisProc) -> None:
    """From L2, the floor kept: held. From L2 while L3 holds another version (a plain store made
    past the floor elsewhere): a miss, and the L2 copy goes. Fails without the KEEP on loads
    (the L2 copy is served)."""

    async def main() -> None:
        (w,) = hosts(tmp_path, redis_server, 1)
        try:
            await w.sync()
            await overwrite(w, [A], 1)
            assert w.mgr.holdings is not None and len(w.mgr.holdings) == 1
            raw, key_of = raw_of(w)
            raw.delete(key_of(A))  # L3 lost it; the floor lives
            w.evict_l1([A])
            session = await w.prefetch("r1", [A])
            assert [bytes(w.l1.view(o)) for o in session.pinned] == [payload(A, 1)]
            w.mgr.end_session("c", "r1")
            assert w.coherence is not None and w.coherence.counters.keep_repaired == 1
            await w.drain()
            assert raw.get(key_of(A)) is not None  # written again from the copy loaded
            obj = w.l1.get(A)
            assert obj is not None and obj.overwrite > 0 and len(w.mgr.holdings) == 1
            raw.delete(floor_key(key_of(A)))
            foreign = block(A, 99, "", payload(A, 3), parent=77)  # a plain store elsewhere, past the floor
            raw.set(key_of(A), foreign)  # (of another chain than the one asked: not served either)
            w.evict_l1([A])
            session = await w.prefetch("r2", [A])
            assert session.pinned == []  # a miss: never L2's copy of the overwrite
            w.mgr.end_session("c", "r2")
            await w.drain()
            assert w.disk is not None and w.disk.knows(A) is None and w.coherence.counters.keep_dropped == 1
            raw.set(key_of(A), block(A, 99, "", payload(A, 3)))  # the plain version that chains: the truth
            session = await w.prefetch("r3", [A])
            assert [bytes(w.l1.view(o)) for o in session.pinned] == [payload(A, 3)]
            w.mgr.end_session("c", "r3")
        finally:
            w.mgr.close()

    asyncio.run(main())


def test_a_round_keeps_repairs_and_drops_and_the_lease_runs_from_its_sending(
    tmp_path: Path, redis_server: RedisProc
) -> None:
    async def main() -> None:
        (w,) = hosts(tmp_path, redis_server, 1)
        loop = asyncio.get_running_loop()
        try:
            await w.sync()
            coh, held = w.coherence, w.mgr.holdings
            assert coh is not None and held is not None
            w.store([B], version=0)  # a plain version: never held
            await overwrite(w, [A], 1)
            assert len(held) == 1 and coh.held == 1 and coh.kept_until == w.now + coh.lease_s
            raw, key_of = raw_of(w)
            raw.delete(key_of(A))  # evicted by L3; the floor lives
            await held.round(run_on(loop))
            await w.drain()
            assert raw.get(key_of(A)) is not None and coh.counters.keep_repaired == 1
            assert raw.pttl(floor_key(key_of(A))) > 50_000
            # the lease: past it without a round, nothing is served; a round sent now renews it
            w.now = coh.lease_s + 0.05
            await w.sync()  # (the poll vouches again)
            assert not w.mgr.vouched() and w.mgr.lookup_l1([B]) == 0
            await held.round(run_on(loop))
            assert w.mgr.vouched() and w.mgr.lookup_l1([A]) == 1 and coh.counters.keep_rounds == 2
            # the floor gone and L3 holding another version: dropped from L1 and L2
            raw.delete(floor_key(key_of(A)))
            raw.set(key_of(A), block(A, 99, "", payload(A, 3)))
            await held.round(run_on(loop))
            assert w.l1.get(A) is None and coh.counters.keep_dropped == 1 and len(held) == 0 and coh.held == 0
            await w.drain()
            assert w.disk is not None and w.disk.knows(A) is None
            w.now += 10 * coh.lease_s  # nothing held: no lease
            await w.sync()
            assert w.mgr.vouched() and w.mgr.lookup_l1([B]) == 1
        finally:
            w.mgr.close()

    asyncio.run(main())


@pytest.mark.valkey  # also on a Valkey cluster (conftest)
def test_keep_is_pipelined_over_a_clusters_nodes(redis_cluster: Any) -> None:
    """One round for keys on every shard (redis-py's cluster pipeline refuses ``eval``)."""
    from kvdock.storage.coherence import Coherence
    from kvdock.storage.redis import RedisTier

    tier = RedisTier(redis_cluster.url, timeout=5.0)
    tier.probe()
    try:
        assert tier.up()
        tier.coherence = Coherence(lambda: tier._redis)
        keys = [WK(i) for i in range(1, 31)]
        for key in keys[:10]:  # floors at E2, values gone: keep and repair
            tier._redis.set(floor_key(tier._key(key)), E2)
        assert tier.keep([(k, E2, b"m") for k in keys]) == [0] * 10 + [-1] * 20  # (EVAL: no node has it yet)
        assert all(tier._redis.pttl(floor_key(tier._key(k))) > 50_000 for k in keys[:10])
        calls = lambda: sum(  # noqa: E731
            int(tier._redis.info("commandstats", target_nodes=n).get("cmdstat_evalsha", {}).get("calls", 0))
            for n in tier._redis.get_primaries()
        )
        before = calls()
        assert tier.keep([(k, E2, b"m") for k in keys]) == [0] * 10 + [-1] * 20
        assert calls() - before == 30  # by its digest once every node has it
    finally:
        tier.close()


def test_a_version_loaded_before_its_own_overwrites_entries_are_applied_stays(
    tmp_path: Path, redis_server: RedisProc
) -> None:
    """Host 1 loads host 2's overwrite from L3 before its poll brings that overwrite's entries:
    KEEP vouched for the bytes, so the entries (not later than its E2) leave it readable; a later
    overwrite's entries still drop it."""

    async def main() -> None:
        host1, host2 = hosts(tmp_path, redis_server, disk=False)
        try:
            await host1.sync()
            await host2.sync()
            await overwrite(host2, [A], 1)
            session = await host1.prefetch("r", [A])  # (host 1 has not polled since)
            assert [bytes(host1.l1.view(o)) for o in session.pinned] == [payload(A, 1)]
            host1.mgr.end_session("c", "r")
            await host1.sync()
            assert host1.l1_bytes(A) == payload(A, 1) and host1.mgr.lookup_l1([A]) == 1
            await overwrite(host2, [A], 2)
            await host1.sync()
            assert host1.l1.get(A) is None
        finally:
            host1.mgr.close()
            host2.mgr.close()

    asyncio.run(main())


def test_a_plain_write_down_issued_before_an_overwrite_never_lands_on_its_version_once_the_floor_is_evicted(
    tmp_path: Path, redis_server: RedisProc
) -> None:
    """allkeys-lru evicted the overwrite's floor (A-FLEET r9): a plain write-down issued before the
    overwrite (its fence's position below E2) still finds the overwrite's version, which names its
    E2 in its header, and is refused; one issued after it lands (a plain store's ordinary rule)."""

    async def main() -> None:
        (w,) = hosts(tmp_path, redis_server, 1, disk=False)
        try:
            await w.sync()
            await overwrite(w, [A], 1)
            obj = w.l1.get(A)
            assert obj is not None and w.coherence is not None and w.redis is not None
            raw, key_of = raw_of(w)
            raw.delete(floor_key(key_of(A)))  # evicted
            data = memoryview(payload(A, 0))
            plain = objfile.encode_header(A, "float32", SHAPE, data, 5, 0, GEO.digest(CHUNK))
            fence = w.coherence.fence(0)
            with pytest.raises(WriteFenced):
                w.redis.write_from(A, plain, data, fence._replace(position=obj.overwrite - 1))
            assert objfile.decode_header(raw.get(key_of(A)))[0].version == obj.version
            w.redis.write_from(A, plain, data, fence._replace(position=obj.overwrite))
            assert w.redis.settle() == {}
            assert objfile.decode_header(raw.get(key_of(A)))[0].version == 5
        finally:
            w.mgr.close()

    asyncio.run(main())


def test_an_incarnation_key_evicted_alone_is_restored_from_the_stream(tmp_path: Path, redis_server: RedisProc) -> None:
    """allkeys-lru evicts the stream's small incarnation key while the stream stays (A-FLEET r9):
    the next poll restores it from the stream's last entry, no gap, nothing dropped; with the
    stream gone too, a new incarnation and a gap (everything dropped), as before."""
    from kvdock.storage.coherence import INCARNATION_KEY, STREAM_KEY

    async def main() -> None:
        (w,) = hosts(tmp_path, redis_server, 1, disk=False)
        try:
            await w.sync()
            await overwrite(w, [A], 1)
            await w.sync()
            raw, _ = raw_of(w)
            assert w.coherence is not None
            known = w.coherence.incarnation
            raw.delete(INCARNATION_KEY)
            result = await w.sync()
            assert not result.lost and w.coherence.incarnation == known and raw.get(INCARNATION_KEY) == known
            assert w.l1.get(A) is not None
            raw.delete(INCARNATION_KEY, STREAM_KEY)
            result = await w.sync()
            assert result.lost and w.coherence.incarnation != known and w.l1.get(A) is None
        finally:
            w.mgr.close()

    asyncio.run(main())

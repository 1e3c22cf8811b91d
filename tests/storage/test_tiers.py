"""kvdock.storage.tiers: write-down L1 → L2/L3, cross-tier counting, prefetch L2/L3 → L1, in-process
over a real L1Store, StorageManager, DiskStore and (where used) a real redis-server."""

from __future__ import annotations

import asyncio
from pathlib import Path

from helpers import RedisProc
from kvdock.shm.slots import ALIGN
from kvdock.storage import disk as diskmod
from tierworld import FILE, NB, SHAPE, K, World, payload, run, until

KEYS = [K(i) for i in range(1, 4)]


# ---------------------------------------------------------------- write-down


def test_commit_writes_down_to_disk(tmp_path: Path) -> None:
    async def body(w: World) -> None:
        w.store(KEYS)
        await w.drain()
        assert len(w.disk) == 3 and w.disk.used_bytes == 3 * FILE and w.disk.pending_bytes == 0
        c = w.tiers.counters["l2"]
        assert (c.writes, c.bytes_written, c.write_errors, c.writes_skipped) == (3, 3 * FILE, 0, 0)
        for k in KEYS:
            out = memoryview(bytearray(NB))
            header = diskmod.read_object(w.disk.path_for(k), out)
            assert bytes(out) == payload(k) and header.key == k
            assert header.dtype == "float32" and list(header.shape) == SHAPE
        assert w.l1.lru_keys() == KEYS  # unpinned again once written

    run(tmp_path, body)


def test_background_pins_keep_objects_until_written(tmp_path: Path) -> None:
    async def body(w: World) -> None:
        gate = w.block("l2", 0)
        try:
            objs = w.store(KEYS)
            assert w.mgr.background_pins == 3 and [o.pins for o in objs] == [1, 1, 1]
            assert w.l1.lru_keys() == [] and w.tiers.backlog_bytes == 3 * NB
            assert w.disk.pending_bytes == 3 * FILE and len(w.disk) == 0
            plan = w.mgr.prepare_store("c", "more", [K(9)], NB)  # L1 is full of unwritten objects
            assert plan.slots == [] and plan.pool_full == 1
            assert all(w.l1.get(k) is not None for k in KEYS)
            w.check()
        finally:
            gate.set()
        await w.drain()
        assert len(w.disk) == 3 and w.l1.lru_keys() == KEYS
        w.store([K(9)])  # now the least recently used written object makes room
        assert w.l1.get(K(1)) is None and w.l1.evictions == 1
        assert all(w.l1.get(k) is not None for k in [K(2), K(3), K(9)])

    run(tmp_path, body, slots=3)


# ---------------------------------------------------------------- count and prefetch


def test_prefetch_promotes_from_l2_after_l1_eviction(tmp_path: Path) -> None:
    async def body(w: World) -> None:
        w.store(KEYS)
        await w.drain()
        w.store([K(7), K(8), K(9)])  # evicts KEYS from the 3-slot L1
        assert w.l1.evictions == 3 and all(w.l1.get(k) is None for k in KEYS)
        await w.drain()
        assert await w.tiers.count(KEYS, 0) == 3
        assert await w.tiers.count([*KEYS, K(50), K(9)], 0) == 3
        session = await w.prefetch("r", KEYS)
        assert [o.key for o in session.pinned] == KEYS and all(o.pins == 1 for o in session.pinned)
        for k in KEYS:
            assert w.l1_bytes(k) == payload(k)
        c = w.tiers.counters["l2"]
        assert (c.hits, c.bytes_read, c.corrupted) == (3, 3 * NB, 0)
        assert w.l1.reserved_count() == 0 and w.l1.lru_keys() == []
        w.mgr.commit_retrieve("c", "r")
        assert w.l1.lru_keys() == KEYS

    run(tmp_path, body, slots=3)


def test_prefetch_stops_at_the_first_miss(tmp_path: Path) -> None:
    async def body(w: World) -> None:
        w.store([K(1), K(2), K(4)])
        await w.drain()
        w.evict_l1([K(1), K(2), K(4)])
        keys = [K(1), K(2), K(3), K(4)]
        assert await w.tiers.count(keys, 0) == 2
        session = await w.prefetch("r", keys)
        assert [o.key for o in session.pinned] == [K(1), K(2)]
        assert w.l1.get(K(4)) is None and w.tiers.counters["l2"].hits == 2
        w.mgr.end_session("c", "r")

    run(tmp_path, body)


def test_prefetch_continues_after_the_l1_run(tmp_path: Path) -> None:
    async def body(w: World) -> None:
        w.store(KEYS)
        await w.drain()
        w.evict_l1(KEYS[1:])
        assert await w.tiers.count(KEYS, 1) == 3
        session = await w.prefetch("r", KEYS)
        assert [o.key for o in session.pinned] == KEYS
        assert w.tiers.counters["l2"].hits == 2  # the first was already in L1
        w.mgr.commit_retrieve("c", "r")

    run(tmp_path, body)


def test_prefetch_from_l3_where_l2_lacks(tmp_path: Path, redis_server: RedisProc) -> None:
    async def body(w: World) -> None:
        keys = [*KEYS, K(4)]
        w.store(keys)
        await w.drain()
        assert w.tiers.counters["l3"].writes == 4 and w.tiers.counters["l2"].writes == 4
        for k in keys[1:3]:
            entry = w.disk.remove(k)
            assert entry is not None
            entry.path.unlink()
        w.evict_l1(keys)
        assert await w.tiers.count(keys, 0) == 4
        assert await w.tiers.count([*keys, K(5)], 0) == 4
        session = await w.prefetch("r", keys)
        assert [o.key for o in session.pinned] == keys
        for k in keys:
            assert w.l1_bytes(k) == payload(k)
        l2, l3 = w.tiers.counters["l2"], w.tiers.counters["l3"]
        assert (l2.hits, l3.hits, l3.bytes_read, l3.corrupted) == (2, 2, 2 * NB, 0)
        w.mgr.commit_retrieve("c", "r")

    run(tmp_path, body, redis_url=redis_server.url)


def test_redis_outage_degrades_to_l2(tmp_path: Path, redis_server: RedisProc) -> None:
    async def body(w: World) -> None:
        assert w.redis is not None
        redis_server.stop()
        w.store(KEYS)  # queued to both tiers while L3 still counts as up
        await w.drain()
        l2, l3 = w.tiers.counters["l2"], w.tiers.counters["l3"]
        assert (l2.writes, l3.writes, l3.write_errors) == (3, 0, 3)
        assert not w.redis.up and w.redis.last_error
        w.store([K(4)])
        await w.drain()
        assert (l2.writes, l3.writes, l3.writes_skipped) == (4, 0, 1)
        w.evict_l1([*KEYS, K(4)])
        keys = [*KEYS, K(4), K(5)]
        assert await w.tiers.count(keys, 0) == 4  # from L2, without asking the down L3
        session = await w.prefetch("r", keys)
        assert [o.key for o in session.pinned] == keys[:4] and l2.hits == 4 and l3.hits == 0
        w.mgr.commit_retrieve("c", "r")
        redis_server.start()
        w.redis._retry_at = 0
        await w.tiers.probe()
        assert w.redis.up
        w.store([K(5)])
        await w.drain()
        assert l3.writes == 1 and w.redis.count_present([K(5)]) == 1

    run(tmp_path, body, redis_url=redis_server.url)


def test_corrupt_disk_file_is_deleted_and_stops_the_prefetch(tmp_path: Path) -> None:
    async def body(w: World) -> None:
        w.store(KEYS)
        await w.drain()
        w.evict_l1(KEYS)
        bad = w.disk.path_for(K(2))
        with open(bad, "r+b") as f:
            f.seek(ALIGN + NB - 1)
            last = f.read(1)
            f.seek(ALIGN + NB - 1)
            f.write(bytes([last[0] ^ 0xFF]))
        assert await w.tiers.count(KEYS, 0) == 3  # not known to be bad until read
        session = await w.prefetch("r", KEYS)
        assert [o.key for o in session.pinned] == [K(1)]
        assert w.tiers.counters["l2"].corrupted == 1 and w.tiers.counters["l2"].hits == 1
        assert not bad.exists() and not w.disk.contains(K(2)) and w.disk.contains(K(3))
        assert w.l1.get(K(2)) is None and w.l1.get(K(3)) is None and w.l1.reserved_count() == 0
        assert w.disk.used_bytes == 2 * FILE
        assert await w.tiers.count(KEYS, 1) == 1
        w.mgr.commit_retrieve("c", "r")

    run(tmp_path, body)


def test_concurrent_prefetches_of_one_key_load_it_once(tmp_path: Path) -> None:
    async def body(w: World) -> None:
        w.store([K(1)])
        await w.drain()
        w.evict_l1([K(1)])
        gate = w.block("l2", 1)
        try:
            s1 = w.mgr.open_retrieve("c", "r1", [K(1)])
            s2 = w.mgr.open_retrieve("c", "r2", [K(1)])
            j1 = w.tiers.start_prefetch(s1, [K(1)])
            j2 = w.tiers.start_prefetch(s2, [K(1)])
            await until(lambda: w.l1.reserved_count() == 1 and K(1) in w.tiers._loads)
            await asyncio.sleep(0.02)
            assert w.l1.reserved_count() == 1 and not j1.done.is_set() and not j2.done.is_set()
            w.check()
        finally:
            gate.set()
        await asyncio.wait_for(asyncio.gather(j1.done.wait(), j2.done.wait()), 10)
        obj = w.l1.get(K(1))
        assert obj is not None and obj.pins == 2
        assert s1.pinned == [obj] and s2.pinned == [obj]
        assert w.tiers.counters["l2"].hits == 1 and w.tiers.counters["l2"].bytes_read == NB
        assert bytes(w.l1.view(obj)) == payload(K(1))
        w.check()
        w.mgr.commit_retrieve("c", "r1")
        w.mgr.commit_retrieve("c", "r2")
        assert obj.pins == 0 and w.l1.lru_keys() == [K(1)]

    run(tmp_path, body)


def test_session_end_during_a_load_leaks_nothing(tmp_path: Path) -> None:
    async def body(w: World) -> None:
        w.store(KEYS)
        await w.drain()
        w.evict_l1(KEYS)
        gate = w.block("l2", 1)
        try:
            session = w.mgr.open_retrieve("c", "r", KEYS)
            job = w.tiers.start_prefetch(session, KEYS)
            await until(lambda: w.l1.reserved_count() == 1)
            w.check()
            assert w.mgr.end_session("c", "r") and job.cancelled and not session.open
            w.check()  # the slot being filled is owned by the load, not the ended session
            assert w.l1.reserved_count() == 1
        finally:
            gate.set()
        await asyncio.wait_for(job.done.wait(), 10)
        w.check()
        assert w.l1.reserved_count() == 0 and session.pinned == [] and w.mgr.session_count == 0
        first = w.l1.get(K(1))  # the load that was in flight finished into L1, unpinned
        assert first is not None and first.pins == 0 and w.l1.lru_keys() == [K(1)]
        assert w.l1.get(K(2)) is None and w.tiers.counters["l2"].hits == 1
        used = w.l1.allocator.used_bytes
        assert used == ALIGN  # exactly one slot in use: nothing leaked

    run(tmp_path, body)


# ---------------------------------------------------------------- re-storing a key already on disk


def test_restore_of_a_key_whose_old_file_a_later_write_evicts(tmp_path: Path) -> None:
    """X is on disk (least recently used) but no longer in L1; a commit of [X, Z] queues a new X
    write, then Z's write, whose make_room evicts the *old* X entry. The writer writes X's new file
    and then Z's work unlinks the evicted entry's path, which is the same path: the index then holds
    X with no file behind it (and X is gone from every tier)."""

    async def body(w: World) -> None:
        w.store([K(1)])
        await w.drain()
        w.evict_l1([K(1)])
        w.store([K(1), K(2)])
        await w.drain()
        assert w.disk.contains(K(1)) and w.disk.contains(K(2))
        assert w.disk.path_for(K(1)).exists(), "X is indexed on disk but its file was deleted"
        w.evict_l1([K(1), K(2)])
        session = await w.prefetch("r", [K(1), K(2)])
        assert [o.key for o in session.pinned] == [K(1), K(2)]
        w.mgr.commit_retrieve("c", "r")

    run(tmp_path, body, disk_files=2)

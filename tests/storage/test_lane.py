"""kvdock.storage.lane: a tier's writer/reader threads and its FIFO of write-downs and deletions,
in-process over a real L1Store, StorageManager, DiskTier and (where used) a real redis-server.

What a lane guarantees: the jobs of one tier are applied in the order they were queued (so a
deletion queued for an overwrite lands after every older write of the key), only the write in
flight pins its object (a queued write of an object L1 evicted meanwhile is skipped and
counted), and a tier that is down is skipped, never waited for."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from helpers import RedisProc
from kvdock.storage import disk as diskmod
from kvdock.storage import objfile
from kvdock.storage.lane import _Write
from kvdock.storage.manager import Chain
from kvdock.storage.tier import Head
from tierworld import CHUNK, FILE, GEO, NB, SHAPE, K, World, head, payload, run, until

KEYS = [K(i) for i in range(1, 4)]

NONE_IN_L1 = Chain(0, 0)  # count() from the first key


def disk_bytes(w: World, key: object) -> bytes:
    assert w.disk is not None
    out = memoryview(bytearray(NB))
    diskmod.read_object(w.disk.path_for(key), out)  # type: ignore[arg-type]
    return bytes(out)


# ---------------------------------------------------------------- write-down


def test_commit_writes_down_to_disk(tmp_path: Path) -> None:
    async def body(w: World) -> None:
        assert w.disk is not None
        objs = w.store(KEYS)
        await w.drain()
        assert len(w.disk) == 3 and w.disk.used_bytes == 3 * FILE
        c = w.lanes["l2"].counters
        assert c is w.disk.counters
        assert (c.writes, c.bytes_written, c.write_errors, c.writes_skipped, c.deletes) == (3, 3 * FILE, 0, 0, 0)
        assert c.write_seconds > 0
        for k, obj in zip(KEYS, objs, strict=True):
            out = memoryview(bytearray(NB))
            header = diskmod.read_object(w.disk.path_for(k), out)
            assert bytes(out) == payload(k) and header.key == k
            assert header.dtype == "float32" and list(header.shape) == SHAPE
            # the header carries the object's place in its version chain, and the index took it
            assert Head(header.version, header.parent) == head(obj) == w.disk.knows(k)
        assert [o.parent for o in objs] == [0, objs[0].version, objs[1].version]
        assert w.l1.lru_keys() == KEYS  # unpinned again once written
        assert w.lanes["l2"].idle and w.lanes["l2"].writing == [] and all(o.holds == 0 for o in objs)

    run(tmp_path, body)


def test_only_the_write_in_flight_is_held(tmp_path: Path) -> None:
    # queued write-downs hold nothing (no pin, no hold) (they used to pin every unwritten object, so a slow disk
    # filled L1 with pinned objects and stores got pool_full); an object whose write-down is
    # queued is *dirty*: L1 evicts it only when a store allows it (after its bounded wait,
    # storage.writeback), the newest first, so a prefix's head never goes before its tail
    async def body(w: World) -> None:
        assert w.disk is not None
        lane = w.lanes["l2"]
        gate = w.block("l2", 0)
        try:
            objs = w.store(KEYS)
            # (a batch of one: nothing measured yet; L1Store.hold, not a session's pin)
            assert [o.holds for o in objs] == [1, 0, 0] and lane.writing == [objs[0]]
            assert [o.pins for o in objs] == [0, 0, 0] and [o.dirty for o in objs] == [1, 1, 1]
            assert w.l1.lru_keys() == [K(3), K(2)] and lane.backlog_bytes == 3 * NB  # dirty: newest first
            assert len(w.disk) == 0 and not lane.idle
            assert w.l1.room(K(9), NB) == (0, 2)  # no clean room; two dirty objects could give it
            plan = w.mgr.prepare_store("c", "none", [K(9)], NB)  # a load or a store before its wait
            assert plan.slots == [] and plan.pool_full == 1 and w.l1.evictions == 0
            with w.l1.dirty_eviction():  # the store's wait ran out: the newest unwritten object goes
                plan = w.mgr.prepare_store("c", "more", [K(9)], NB)
            assert len(plan.slots) == 1 and plan.pool_full == 0
            assert w.l1.get(K(3)) is None and w.l1.get(K(2)) is not None and w.l1.evictions == 1
            assert (w.l1.counters.evicted_dirty, w.l1.counters.evicted_dirty_bytes) == (1, NB)
            assert lane.backlog_bytes == 2 * NB  # K3's queued write has no object any more
            w.check()
            w.l1.view(plan.slots[0][1])[:] = payload(K(9))
            w.mgr.commit_store("c", "more", [0])
        finally:
            gate.set()
        await w.drain()
        assert sorted(w.disk._index, key=lambda k: k.chunk) == [K(1), K(2), K(9)]
        c = lane.counters
        assert (c.writes, c.writes_skipped, c.write_errors) == (3, 1, 0)
        assert w.l1.lru_keys() == [K(1), K(2), K(9)]  # clean, in the order their write-downs finished
        assert all(not w.l1.get(k).dirty for k in (K(1), K(2), K(9)))  # type: ignore[union-attr]

    run(tmp_path, body, slots=3)


def test_a_queued_write_of_an_evicted_object_is_skipped_and_counted(tmp_path: Path) -> None:
    async def body(w: World) -> None:
        assert w.disk is not None
        gate = w.block()
        w.store([K(1), K(2)])
        assert w.lanes["l2"].backlog_bytes == 2 * NB
        w.evict_l1([K(2)])  # gone from L1 before its turn (e.g. LRU eviction, /admin/clear)
        assert w.lanes["l2"].backlog_bytes == NB  # only the write in flight
        gate.set()
        await w.drain()
        assert w.disk.knows(K(1)) and not w.disk.knows(K(2))
        assert not w.disk.path_for(K(2)).exists()
        c = w.disk.counters
        assert (c.writes, c.writes_skipped) == (1, 1)

    run(tmp_path, body)


def test_a_slow_lane_holds_one_object_at_a_time(tmp_path: Path) -> None:
    async def body(w: World) -> None:
        assert w.disk is not None
        lane = w.lanes["l2"]
        w.disk.fault_write_delay_s = 0.05  # a slow disk: the writes stay queued a while
        keys = [K(i) for i in range(1, 6)]
        objs = w.store(keys)
        seen: list[object] = []
        while not lane.idle:
            # 50 ms a write: batches of one (lane.BATCH_S), the one being written
            held = [o for o in objs if o.holds]
            assert len(held) <= 1 and not any(o.pins for o in objs), f"{len(held)} objects held by one lane"
            assert held == lane.writing
            if held and (not seen or seen[-1] is not held[0]):
                seen.append(held[0])
            w.check()
            await asyncio.sleep(0.003)
        assert seen == objs[: len(seen)] and len(seen) >= 3  # each in its turn, in commit order
        assert all(o.holds == 0 for o in objs) and w.disk.counters.writes == 5

    run(tmp_path, body)


def test_one_pin_per_lane_with_two_tiers(tmp_path: Path, redis_server: RedisProc) -> None:
    async def body(w: World) -> None:
        gate = w.block("l2")
        objs = w.store(KEYS)
        await until(lambda: w.lanes["l3"].idle)  # L3 wrote everything; L2 still holds its first
        assert [o.holds for o in objs] == [1, 0, 0] and w.lanes["l2"].writing == [objs[0]]
        assert w.lanes["l3"].writing == [] and w.lanes["l3"].counters.writes == 3
        w.check()
        gate.set()

    run(tmp_path, body, redis_url=redis_server.url)


def test_the_header_is_computed_once_for_both_tiers(
    tmp_path: Path, redis_server: RedisProc, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[object] = []
    real = objfile.encode_header

    def counting(*args: object) -> bytes:
        calls.append(args[0])
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(objfile, "encode_header", counting)

    async def body(w: World) -> None:
        assert w.disk is not None and w.redis is not None
        objs = w.store(KEYS)
        await w.drain()
        assert w.lanes["l2"].counters.writes == 3 and w.lanes["l3"].counters.writes == 3
        assert calls == KEYS  # one checksum per object, not one per tier
        # the one header carries the same head to both tiers
        assert w.disk.heads(KEYS) == w.redis.heads(KEYS) == [head(o) for o in objs]

    run(tmp_path, body, redis_url=redis_server.url)


# ---------------------------------------------------------------- one FIFO of writes and deletes


def test_write_delete_write_of_one_key_leaves_the_last_version(tmp_path: Path) -> None:
    async def body(w: World) -> None:
        assert w.disk is not None
        gate = w.block()
        w.store([K(9)])  # K9's write in flight behind the gate
        w.store([K(1)], version=1)  # v1 of K1 queued behind it
        task = asyncio.create_task(w.store_async([K(1)], version=2, overwrite=True))  # delete, then write v2
        await until(lambda: K(1) in w.mgr.deletions)
        assert not task.done()  # the overwrite's commit waits for its deletion
        w.check()
        gate.set()
        assert await asyncio.wait_for(task, 10) == 1
        await w.drain()
        assert disk_bytes(w, K(1)) == payload(K(1), 2)
        c = w.disk.counters
        # v1's queued write-down was cancelled by the deletion (it would have deleted it anyway)
        assert (c.writes, c.deletes, c.writes_skipped, w.lanes["l2"].writes_cancelled) == (2, 1, 0, 1)

    run(tmp_path, body)


@pytest.mark.parametrize("slow", ["queued", "in_flight"])
def test_a_delete_lands_after_the_older_write(tmp_path: Path, slow: str) -> None:
    async def body(w: World) -> None:
        assert w.disk is not None
        lane = w.lanes["l2"]
        gate = None
        if slow == "queued":
            gate = w.block()  # the write of v1 waits in the lane's queue when the delete is queued
            w.store([K(9), K(1)])
        else:
            w.disk.fault_write_delay_s = 0.3  # the write of v1 is in progress when the delete is queued
            w.store([K(1)])
            await until(lambda: w.disk is not None and w.disk.used_bytes > 0)  # its bytes are promised
        deleted = lane.delete([K(1)])
        assert not deleted.done()
        if gate is not None:
            gate.set()
        assert await asyncio.wait_for(deleted, 10) == 0
        assert not w.disk.knows(K(1)) and not w.disk.path_for(K(1)).exists()
        await w.drain()
        assert not w.disk.path_for(K(1)).exists() and not w.disk.knows(K(1))
        c = w.disk.counters
        # a queued write of v1 is cancelled by the deletion; one in flight lands before it
        assert c.deletes == 1 and c.writes == 1 and lane.writes_cancelled == (1 if slow == "queued" else 0)

    run(tmp_path, body)


def test_an_older_write_finishing_late_never_loses_the_overwrite(tmp_path: Path) -> None:
    """Regression: an older write of a key that finished after an overwrite was queued re-indexed
    the path; a later write evicted that entry and unlinked the path, i.e. the overwrite's file.
    Now the older write, the overwrite's deletion and the later writes are one FIFO."""

    async def body(w: World) -> None:
        assert w.disk is not None
        gate1 = w.block()
        w.store([K(1)], version=1)  # W1 (old version) queued behind gate1
        gate2 = w.block()  # hold the writer between W1 and what follows
        task = asyncio.create_task(w.store_async([K(1)], version=2, overwrite=True))  # D1, then W2 at commit
        await until(lambda: K(1) in w.mgr.deletions)
        gate1.set()
        await until(lambda: w.disk is not None and w.disk.knows(K(1)))  # W1 finished: v1 indexed again
        w.store([K(2)])  # W3, queued behind the deletion
        gate2.set()
        assert await asyncio.wait_for(task, 10) == 1
        await w.drain()
        w.check()  # no "indexed file ... is missing"
        assert list(w.disk._index) == [K(2), K(1)]
        w.evict_l1([K(1)])
        session = await w.prefetch("r", [K(1)])
        assert len(session.pinned) == 1, "the overwritten chunk was lost from L2"
        assert bytes(w.l1.view(session.pinned[0])) == payload(K(1), 2)
        w.mgr.commit_retrieve("c", "r")

    run(tmp_path, body, disk_files=2)


# ---------------------------------------------------------------- a tier that is down


def test_delete_on_a_down_redis_resolves_false(
    tmp_path: Path, redis_server: RedisProc, caplog: pytest.LogCaptureFixture
) -> None:
    async def body(w: World) -> None:
        assert w.redis is not None
        lane = w.lanes["l3"]
        w.store([K(1)])
        await w.drain()
        redis_server.stop()
        # the tier still counts as up: the deletion runs, fails, and marks it down
        with caplog.at_level(logging.ERROR, "kvdock.storage.lane"):
            assert await asyncio.wait_for(lane.delete([K(1)]), 10) is None
        assert "l3: delete failed: Error 111 connecting" in caplog.text
        assert not w.redis.up() and lane.counters.deletes == 0
        # known to be down: answered False at its turn, without trying
        assert await asyncio.wait_for(lane.delete([K(2)]), 10) is None
        assert lane.idle and lane.counters.deletes == 0
        w.check()

    run(tmp_path, body, redis_url=redis_server.url, disk=False)


def test_redis_outage_degrades_to_l2(tmp_path: Path, redis_server: RedisProc, caplog: pytest.LogCaptureFixture) -> None:
    async def body(w: World) -> None:
        assert w.redis is not None
        redis_server.stop()
        with caplog.at_level(logging.ERROR, "kvdock.storage.lane"):
            w.store(KEYS)  # queued to both tiers while L3 still counts as up
            await w.drain()
        l2, l3 = w.lanes["l2"].counters, w.lanes["l3"].counters
        # changed on purpose: the first failure marks L3 down and the writes queued behind it are
        # skipped at their turn (they used to fail one by one: write_errors was 3)
        assert (l2.writes, l3.writes, l3.write_errors, l3.writes_skipped) == (3, 0, 1, 2)
        assert "l3: write-down of " + K(1).chunk.hex()[:16] + " failed" in caplog.text
        assert not w.redis.up() and w.redis.last_error
        w.store([*KEYS, K(4)], deduped=3)  # the prefix grows by one chunk
        await w.drain()
        assert (l2.writes, l3.writes, l3.writes_skipped) == (4, 0, 3)
        w.evict_l1([*KEYS, K(4)])
        keys = [*KEYS, K(4), K(5)]
        assert await w.mgr.count(keys, NONE_IN_L1) == 4  # from L2, without asking the down L3
        session = await w.prefetch("r", keys)
        assert [o.key for o in session.pinned] == keys[:4] and l2.hits == 4 and l3.hits == 0
        w.mgr.commit_retrieve("c", "r")
        redis_server.start()
        w.redis._retry_at = 0
        lane = w.lanes["l3"]
        assert lane.tier.probe_due()
        await lane.on_reader(lane.tier.probe, default=None, when_down=True)  # as the server probe loop does
        assert w.redis.up()
        (k5,) = w.store([K(5)])
        await w.drain()
        assert l3.writes == 1 and w.redis.heads([K(5)]) == [head(k5)]

    run(tmp_path, body, redis_url=redis_server.url)


def test_on_reader_errors_mark_the_tier_down_and_give_the_default(tmp_path: Path, redis_server: RedisProc) -> None:
    async def body(w: World) -> None:
        assert w.redis is not None
        lane = w.lanes["l3"]
        (obj,) = w.store([K(1)])
        await w.drain()
        assert await lane.on_reader(lane.tier.heads, [K(1)], default=None) == [head(obj)]
        redis_server.stop()
        assert await lane.on_reader(lane.tier.heads, [K(1)], default=None) is None
        assert not w.redis.up()
        w.evict_l1([K(1)])
        assert await w.mgr.count([K(1)], NONE_IN_L1) == 0  # a down tier is not asked
        assert await lane.read(K(1), memoryview(bytearray(NB)), GEO, CHUNK, 0) is None
        assert lane.counters.hits == 0

    run(tmp_path, body, redis_url=redis_server.url, disk=False)


# ---------------------------------------------------------------- drain and clear


def test_drain_times_out_while_the_writer_is_held(tmp_path: Path) -> None:
    """(The server's shutdown drain has no time limit: tests/storage/test_drain.py.)"""

    async def body(w: World) -> None:
        lane = w.lanes["l2"]
        gate = w.block()
        w.store(KEYS)
        assert await lane.drain(0.05) is False and not lane.idle
        gate.set()
        assert await lane.drain(10) is True and lane.idle

    run(tmp_path, body)


def test_clear_of_l1_and_l2_leaves_nothing_behind(tmp_path: Path) -> None:
    async def body(w: World) -> None:
        assert w.disk is not None
        w.store(KEYS)
        await w.drain()
        gate = w.block()
        w.store([K(4), K(5)])  # one write in flight (pinned), one queued
        task = asyncio.create_task(w.mgr.clear("all"))
        await asyncio.sleep(0.02)
        gate.set()
        assert await asyncio.wait_for(task, 10) == {"l1": 5, "l2": 4}
        await w.drain()
        assert len(w.disk) == 0 and len(w.l1) == 0
        assert w.disk.counters.writes_skipped == 1  # K5 left L1 before its turn
        assert w.l1.allocator.used_bytes == 0

    run(tmp_path, body)


def test_clear_of_l2_runs_after_the_writes_queued_before(tmp_path: Path) -> None:
    async def body(w: World) -> None:
        assert w.disk is not None
        gate = w.block()
        w.store(KEYS)  # one write in flight, two queued in the lane
        task = asyncio.create_task(w.mgr.clear("l2"))
        await until(lambda: len(w.lanes["l2"]._queue) == 3)  # two writes and the clear behind the one in flight
        gate.set()
        assert await asyncio.wait_for(task, 10) == {"l2": 3}
        await w.drain()
        assert len(w.disk) == 0, f"{len(w.disk)} objects written after the clear"

    run(tmp_path, body)


def test_a_deletion_goes_ahead_of_unrelated_write_downs_and_cancels_those_of_its_keys(tmp_path: Path) -> None:
    # (issue 28 review R3) an overwrite's deletion waited behind every queued write-down, unrelated
    # ones included: under write pressure an overwrite waited for the whole backlog
    async def body(w: World) -> None:
        assert w.disk is not None
        lane = w.lanes["l2"]
        w.store([K(9)])
        await w.drain()
        gate = w.block()
        w.store([K(8)])  # in flight behind the gate
        w.store([K(1)], version=1)  # an older version of the deleted key, queued
        w.store([K(2)])  # unrelated, queued
        w.store([K(3)])
        first = lane.delete([K(7)])  # a deletion queued before keeps its place ahead
        deleted = lane.delete([K(1), K(9)])
        assert [type(j).__name__ for j in lane._queue] == ["_Call", "_Call", "_Write", "_Write"]
        assert [j.obj.key for j in lane._queue if isinstance(j, _Write)] == [K(2), K(3)]
        assert lane.writes_cancelled == 1
        w.check()  # (K1's object is clean now: check_dirty agrees)
        gate.set()
        await asyncio.wait_for(deleted, 10)
        assert first.done()
        assert not w.disk.knows(K(1)) and not w.disk.knows(K(9)) and w.disk.knows(K(8))
        await w.drain()
        assert w.disk.knows(K(2)) and w.disk.knows(K(3)) and not w.disk.knows(K(1))
        assert w.disk.counters.writes == 4  # K9, K8, K2, K3 (K1 v1 cancelled)

    run(tmp_path, body)

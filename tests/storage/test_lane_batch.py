"""TierLane's batches of write-downs (storage/lane.py ``_Batch``): the writer thread runs several
queued writes in one call, in queue order, each object held (L1Store.hold) until its own write
is done, then clean at once; a deletion stops a batch after the write in progress, the batch's
unrun writes of its keys are cancelled and the others go right behind it; a failed write ends
the batch and the rest are written after it. In-process over a real L1Store and DiskTier."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

from kvdock.keys import ObjectKey
from kvdock.storage import diskio
from kvdock.storage.writeback import BATCH_MAX, BATCH_S
from tierworld import NB, K, World, payload, run, until


def _record(w: World) -> list[tuple[str, int]]:
    """Log every write and deletion the disk runs, in order: (what, key index)."""
    assert w.disk is not None
    ops: list[tuple[str, int]] = []
    lock = threading.Lock()
    write, delete = w.disk.write_from, w.disk.delete_keys

    def write_from(key: ObjectKey, *args: object) -> int:
        with lock:
            ops.append(("write", key.chunk[0]))
        return write(key, *args)  # type: ignore[arg-type]

    def delete_keys(keys: list[ObjectKey]) -> int | None:
        with lock:
            ops.extend(("delete", k.chunk[0]) for k in keys)
        return delete(keys)

    w.disk.write_from = write_from  # type: ignore[method-assign]
    w.disk.delete_keys = delete_keys  # type: ignore[method-assign]
    return ops


def test_the_batch_size_follows_the_measured_write_time(tmp_path: Path) -> None:
    async def body(w: World) -> None:
        lane, c = w.lanes["l2"], w.lanes["l2"].counters
        assert lane._batch_size() == 1  # nothing measured: one at a time
        c.writes, c.write_seconds = 10, 10 * BATCH_S / 4  # a quarter of BATCH_S a write
        assert lane._batch_size() == 4
        c.write_seconds = 10 * 2.0  # 2 s a write: one at a time, as before batches
        assert lane._batch_size() == 1
        c.write_seconds = 10 * 1e-6
        assert lane._batch_size() == BATCH_MAX
        c.writes, c.write_seconds = 0, 0.0

    run(tmp_path, body)


def test_a_batch_holds_its_objects_and_each_turns_clean_when_written(tmp_path: Path) -> None:
    async def body(w: World) -> None:
        assert w.disk is not None
        lane = w.lanes["l2"]
        lane._batch_size = lambda: 8  # type: ignore[method-assign]
        first = w.block()
        objs = w.store([K(1), K(2), K(3), K(4)])  # K1 alone: the lane pumps at the first write()
        assert lane.writing == [objs[0]] and [o.holds for o in objs] == [1, 0, 0, 0]
        second = w.block()  # the next batch waits behind this
        w.disk.fault_write_delay_s = 0.15
        first.set()
        await until(lambda: lane.writing == objs[1:])
        # the whole batch is held, none pinned; all still dirty; a batch is one job in flight
        assert [o.holds for o in objs] == [0, 1, 1, 1] and [o.pins for o in objs] == [0, 0, 0, 0]
        assert [o.dirty for o in objs] == [0, 1, 1, 1] and lane.backlog() == (3, 3 * NB)
        assert w.l1.lru_keys() == [K(1)]  # only the written one is evictable
        w.check()
        second.set()
        # each object is released and clean as soon as its own write is done, before the batch's end
        await until(lambda: lane.writing == objs[2:])
        assert (objs[1].holds, objs[1].dirty, objs[2].holds, objs[2].dirty) == (0, 0, 1, 1)
        assert w.l1.lru_keys() == [K(1), K(2)]
        w.check()
        await w.drain()
        assert [o.holds for o in objs] == [0, 0, 0, 0] and lane.writing == [] and lane.counters.writes == 4
        for k in (K(1), K(2), K(3), K(4)):
            out = memoryview(bytearray(NB))
            diskio.read_object(w.disk.path_for(k), out)
            assert bytes(out) == payload(k)

    run(tmp_path, body)


def test_a_deletion_stops_the_batch_after_the_write_in_progress(tmp_path: Path) -> None:
    # batch [K2 K3 K4 K5] behind a gate; an overwrite of K3 comes: the writer runs K2 (already
    # its turn), stops; K3's older version is cancelled, K4 and K5 go right behind the deletion,
    # and the new K3 after them
    async def body(w: World) -> None:
        assert w.disk is not None
        lane = w.lanes["l2"]
        lane._batch_size = lambda: 8  # type: ignore[method-assign]
        ops = _record(w)
        first = w.block()
        w.store([K(1)])
        objs = w.store([K(2), K(3), K(4), K(5)])
        second = w.block()
        first.set()
        await until(lambda: lane.writing == objs)
        old = objs[1]
        task = asyncio.ensure_future(w.store_async([K(3)], version=2, overwrite=True))
        await asyncio.sleep(0.05)  # prepared: the deletion is queued, the batch told to stop
        busy = lane._busy
        assert busy is not None and busy.stop.is_set()  # type: ignore[union-attr]
        second.set()
        assert await asyncio.wait_for(task, 10) == 1
        await w.drain()
        assert ops == [("write", 1), ("write", 2), ("delete", 3), ("write", 4), ("write", 5), ("write", 3)]
        c = lane.counters
        assert (c.writes, lane.writes_cancelled, c.writes_skipped, c.deletes) == (5, 1, 0, 1)
        assert old.holds == 0 and not old.live  # retired while held: freed at its release
        out = memoryview(bytearray(NB))
        diskio.read_object(w.disk.path_for(K(3)), out)
        assert bytes(out) == payload(K(3), 2)

    run(tmp_path, body)


def test_a_failed_write_ends_the_batch_and_the_rest_are_written_after(tmp_path: Path) -> None:
    async def body(w: World) -> None:
        assert w.disk is not None
        lane = w.lanes["l2"]
        lane._batch_size = lambda: 8  # type: ignore[method-assign]
        ops = _record(w)
        write = w.disk.write_from
        failed: list[int] = []

        def flaky(key: ObjectKey, *args: object) -> int:
            if key == K(3) and not failed:
                failed.append(1)
                raise OSError("injected: the disk failed once")
            return write(key, *args)  # type: ignore[arg-type]

        w.disk.write_from = flaky  # type: ignore[method-assign]
        first = w.block()
        w.store([K(1)])
        objs = w.store([K(2), K(3), K(4), K(5)])
        first.set()
        await w.drain()
        # K3's failed write ended its batch: K4 and K5 were written by the next one, in order
        assert ops == [("write", 1), ("write", 2), ("write", 4), ("write", 5)]
        c = lane.counters
        assert (c.writes, c.write_errors, c.writes_skipped) == (4, 1, 0)
        assert all(o.holds == 0 and o.dirty == 0 for o in objs)
        assert w.disk.knows(K(4)) is not None and w.disk.knows(K(3)) is None

    run(tmp_path, body)


def test_the_unrun_writes_of_a_stopped_batch_are_dropped_and_counted_after_an_abort(tmp_path: Path) -> None:
    # a deletion stops the batch, then the shutdown drain is aborted (abandon): what the batch did
    # not run is dropped and counted like every queued write-down, never pumped again
    async def body(w: World) -> None:
        lane = w.lanes["l2"]
        lane._batch_size = lambda: 8  # type: ignore[method-assign]
        ops = _record(w)
        first = w.block()
        w.store([K(1)])
        objs = w.store([K(2), K(3), K(4), K(5)])
        second = w.block()
        first.set()
        await until(lambda: lane.writing == objs)
        deleted = lane.delete([K(9)])
        assert lane.abandon() == (0, 0)  # only the deletion was queued: it answers None
        assert await deleted is None
        second.set()
        await until(lambda: lane.idle)
        assert ops == [("write", 1), ("write", 2)]
        assert (lane.counters.writes, lane.counters.writes_skipped) == (2, 3)
        assert all(o.holds == 0 and o.dirty == 0 for o in objs) and lane.backlog() == (0, 0)
        w.check()

    run(tmp_path, body)

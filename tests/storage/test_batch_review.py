"""R-BATCH review (wave 4) of write-downs in batches (storage/lane.py ``_Batch``, L1Store.hold and
release, the batch a deletion stops, ``--writeback-dirty-limit``). In-process over a real L1Store,
StorageManager, DiskTier and a real redis-server (tests/tierworld).

What these check: objects held by a batch keep their bytes whatever the event loop does to L1 in
the meantime (overwrites, removals, clears, stores that need room); what reaches L2 and L3 after
random overwrites landing while batches run is the last acknowledged version of each key (never an
older one, none lost); holds, dirty counts and backlogs go back to 0; a tier stopped mid-batch
drops the rest, counted; a drain abort with a batch in flight; the dirty limit's wait is bounded.
The strict xfails are the findings (each names the fix in its reason)."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from pathlib import Path

import pytest

from helpers import RedisProc
from kvdock.keys import ObjectKey
from kvdock.storage import diskio, writeback
from kvdock.storage.lane import TierLane
from tierworld import CHUNK, GEO, NB, K, World, payload, run, until


def disk_bytes(w: World, key: ObjectKey) -> bytes | None:
    assert w.disk is not None
    if w.disk.knows(key) is None:
        return None
    out = memoryview(bytearray(NB))
    diskio.read_object(w.disk.path_for(key), out)
    return bytes(out)


def redis_bytes(w: World, key: ObjectKey) -> bytes | None:
    assert w.redis is not None
    out = memoryview(bytearray(NB))
    return bytes(out) if w.redis.read_into(key, out, GEO, CHUNK) is not None else None


def settled(w: World) -> None:
    """Every lane idle, nothing in its backlog, no object held or dirty, integrity holds."""
    for lane in w.lanes.values():
        assert lane.idle and lane.backlog() == (0, 0) and lane.writing == [], lane.name
    for obj in w.l1._ready.values():
        assert obj.holds == 0 and obj.dirty == 0 and obj.pins == 0, obj.key
    assert not w.l1._retired, "a retired object still holds its slot"
    w.check()


def slow_writes(lane: TierLane, delay_s: float) -> list[ObjectKey]:
    """Every write of ``lane``'s tier takes ``delay_s`` more (on its writer thread, before the
    copy); returns the keys written, in order."""
    tier = lane.tier
    real = tier.write_from
    done: list[ObjectKey] = []
    lock = threading.Lock()

    def write_from(key: ObjectKey, *args: object) -> int:
        time.sleep(delay_s)
        out = real(key, *args)  # type: ignore[arg-type]
        with lock:
            done.append(key)
        return out

    tier.write_from = write_from  # type: ignore[method-assign,assignment]
    return done


# ---------------------------------------------------------------- random overwrites under batches


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_overwrites_during_batches_leave_every_tier_with_the_last_acknowledged_version(
    tmp_path: Path, redis_server: RedisProc, seed: int
) -> None:
    """Batches of 6 on both lanes (each write slowed), while single-chunk and three-chunk stores and
    overwrites of 10 keys land at random (disjoint keys at once): integrity holds after every step;
    after the drain L1, L2 and L3 each hold exactly the last acknowledged version of every key
    (none lost: nothing was evicted and no tier went down), nothing is held or dirty."""
    rng = random.Random(seed)

    async def body(w: World) -> None:
        for lane in w.lanes.values():
            lane._batch_size = lambda: 6  # type: ignore[method-assign]
            slow_writes(lane, 0.004)
        version: dict[int, int] = {}
        busy: set[int] = set()
        tasks: list[asyncio.Task[None]] = []

        async def overwrite(ids: list[int]) -> None:
            v = max(version.get(i, 0) for i in ids) + 1
            keys = [K(i) for i in ids]
            n = await w.store_async(keys, version=v, overwrite=True)
            assert n == len(ids)
            for i in ids:
                version[i] = v
            busy.difference_update(ids)

        for i in range(1, 11):  # version 0 of every key, queued as batches
            w.store([K(i)])
            version[i] = 0
        for _ in range(40):
            free = [i for i in range(1, 11) if i not in busy]
            if free:
                ids = rng.sample(free, min(len(free), rng.choice([1, 1, 3])))
                busy.update(ids)
                tasks.append(asyncio.ensure_future(overwrite(ids)))
            await asyncio.sleep(rng.choice([0, 0.002, 0.01, 0.03]))
            w.check()
            for lane in w.lanes.values():
                lane.check_integrity()
        await asyncio.wait_for(asyncio.gather(*tasks), 60)
        await w.drain()
        settled(w)
        for i, v in version.items():
            want = payload(K(i), v)
            assert w.l1_bytes(K(i)) == want, i
            assert disk_bytes(w, K(i)) == want, f"L2 holds another version of {i} than {v}"
            assert redis_bytes(w, K(i)) == want, f"L3 holds another version of {i} than {v}"
        for lane in w.lanes.values():
            c = lane.counters
            assert (c.write_errors, lane.dropped_down) == (0, 0), lane.name

    run(tmp_path, body, redis_url=redis_server.url, slots=64)


@pytest.mark.parametrize("seed", [4, 5])
def test_random_overwrites_removals_and_dirty_evictions_under_batches_never_leave_an_older_version(
    tmp_path: Path, redis_server: RedisProc, seed: int
) -> None:
    """A small L1 (12 slots, a 0.05 s wait before dirty evictions) under batches of 5 on both
    lanes: random overwrites (some pool-full: their uncommitted chunks are deleted everywhere),
    plain re-stores, removals and clears of L1. Misses are fine; but after the drain no tier
    holds any version of a key but its last acknowledged one (none where the last overwrite
    deleted it), and nothing is held, dirty or retired."""
    from kvdock.errors import RequestError

    rng = random.Random(seed)
    ids = list(range(1, 17))

    async def body(w: World) -> None:
        w.l1.writeback_wait_s = 0.05
        for lane in w.lanes.values():
            lane._batch_size = lambda: 5  # type: ignore[method-assign]
            slow_writes(lane, 0.012)
        latest: dict[int, int | None] = {}
        busy: set[int] = set()
        tasks: list[asyncio.Task[None]] = []
        n = 0

        async def store(chosen: list[int], overwrite: bool) -> None:
            nonlocal n
            n += 1
            sid = f"r{n}"
            keys = [K(i) for i in chosen]
            v = max((latest.get(i) or 0) for i in chosen) + 1 if overwrite else None
            try:
                if not overwrite and any(latest.get(i) is None for i in chosen):
                    return
                keysets = [keys]
                if writeback.needs_wait(w.mgr, keysets, NB, overwrite):
                    await writeback.wait_for_room(w.mgr, keysets, NB, overwrite)
                try:
                    with w.l1.dirty_eviction():
                        plan = w.mgr.prepare_store("c", sid, keys, NB, overwrite)
                except RequestError:
                    return
                for j, obj in plan.slots:
                    w.l1.view(obj)[:] = payload(keys[j], v if overwrite else latest[chosen[j]] or 0)  # type: ignore[arg-type]
                if overwrite and not plan.slots:  # no room at all: no session, nothing acknowledged
                    return  # (its deletions of the older versions still run: a miss, allowed)
                if overwrite:
                    ok = await w.mgr.wait_deletes("c", sid)
                    assert ok
                    done = {j for j, _ in plan.slots}
                    w.mgr.commit_store("c", sid, sorted(done), ok)
                    for j, i in enumerate(chosen):  # committed: v; the rest deleted everywhere
                        latest[i] = v if j in done else None
                elif plan.slots:
                    w.mgr.commit_store("c", sid, [j for j, _ in plan.slots])
                else:
                    w.mgr.end_session("c", sid)
            finally:
                busy.difference_update(chosen)

        for i in ids:
            latest[i] = None
        for _ in range(60):
            op = rng.random()
            free = [i for i in ids if i not in busy]
            if op < 0.6 and free:
                chosen = rng.sample(free, min(len(free), rng.choice([1, 2, 3])))
                busy.update(chosen)
                tasks.append(asyncio.ensure_future(store(chosen, overwrite=rng.random() < 0.7)))
            elif op < 0.85:
                i = rng.choice(ids)
                w.l1.remove(K(i))  # dropped from L1 only (as an eviction): L2/L3 keep it
            elif op < 0.9:
                w.l1.clear()
            await asyncio.sleep(rng.choice([0, 0.002, 0.01, 0.02]))
            w.check()
        await asyncio.wait_for(asyncio.gather(*tasks), 60)
        await w.drain()
        settled(w)
        for i, v in latest.items():
            want = None if v is None else payload(K(i), v)
            got = {
                "L1": w.l1_bytes(K(i)) if w.l1.get(K(i)) is not None else None,
                "L2": disk_bytes(w, K(i)),
                "L3": redis_bytes(w, K(i)),
            }
            for tier, b in got.items():
                assert b is None or b == want, f"{tier} holds a version of {i} other than its last ({v})"
        for lane in w.lanes.values():
            assert (lane.counters.write_errors, lane.dropped_down) == (0, 0), lane.name

    run(tmp_path, body, redis_url=redis_server.url, slots=12)


# ---------------------------------------------------------------- held bytes stay the object's own


def test_a_held_objects_slot_is_never_given_to_another_key_while_its_batch_runs(tmp_path: Path) -> None:
    """A batch of 4 held behind a gate; meanwhile the event loop removes two held objects (one an
    overwrite's old version), clears L1 and fills the whole pool with new stores needing room.
    No new reservation gets a held slot, and what the batch writes to L2 is each object's own
    bytes (checked by the object file's checksum and by value)."""

    async def body(w: World) -> None:
        lane = w.lanes["l2"]
        lane._batch_size = lambda: 8  # type: ignore[method-assign]
        first = w.block()
        w.store([K(1)])
        objs = w.store([K(2), K(3), K(4), K(5)])
        second = w.block()
        first.set()
        await until(lambda: lane.writing == objs)
        held = {o.offset for o in objs}
        assert w.l1.remove(K(4)) and w.l1.remove(K(5))  # retired while held: slots kept
        w.l1.clear()  # everything retired
        fresh = [K(20 + i) for i in range(8)]
        got = []
        for k in fresh:  # 8 slots, 4 held: at most 4 fit
            obj = w.l1.reserve(k, NB)
            if obj is not None:
                assert obj.offset not in held, "a held slot was given to another key"
                w.l1.view(obj)[:] = b"\xee" * NB
                got.append(obj)
        assert len(got) == 4
        w.l1.check_integrity()  # (raw reservations: no session owns them)
        second.set()
        await until(lambda: lane.writing == [] and lane.idle)
        for obj in got:
            w.l1.abort(obj)
        await w.drain()
        for k in (K(2), K(3), K(4), K(5)):
            assert disk_bytes(w, k) == payload(k), k
        assert not w.l1._retired and all(o.holds == 0 for o in objs)
        w.check()

    run(tmp_path, body, slots=8)


# ---------------------------------------------------------------- a tier going down mid-batch


def test_redis_stopped_mid_batch_drops_the_rest_counted_and_releases_every_hold(
    tmp_path: Path, redis_server: RedisProc
) -> None:
    """A batch of 6 L3 write-downs, Redis stopped before it runs: the first write fails (the tier
    is down), the batch ends, the other five are dropped and counted (writes_skipped,
    dropped_down); L2 still gets all six with their bytes; nothing held or dirty; L1 serves them."""

    async def body(w: World) -> None:
        assert w.redis is not None
        l3 = w.lanes["l3"]
        l3._batch_size = lambda: 8  # type: ignore[method-assign]
        gate = w.block("l3")
        keys = [K(i) for i in range(1, 7)]
        objs = w.store(keys)
        redis_server.stop()
        gate.set()
        await w.drain()
        c = l3.counters
        assert (c.writes, c.write_errors) == (0, 1)
        assert (c.writes_skipped, l3.dropped_down, l3.dropped_down_bytes) == (5, 5, 5 * NB)
        assert not w.redis.up()
        assert all(o.holds == 0 and o.dirty == 0 for o in objs)
        for k in keys:
            assert disk_bytes(w, k) == payload(k) and w.l1_bytes(k) == payload(k)
        settled(w)
        redis_server.start()

    run(tmp_path, body, redis_url=redis_server.url, slots=16)


def test_a_failed_write_mid_batch_with_a_deletion_queued_cancels_only_its_keys(tmp_path: Path) -> None:
    """A batch [K2 K3 K4 K5]; K3's write fails (once); an overwrite of K5 comes while K2 is being
    written: K5's older version is cancelled, K4 is written after the deletion, K3 is not
    written (counted as an error), the new K5 lands; nothing held, nothing dirty."""

    async def body(w: World) -> None:
        assert w.disk is not None
        lane = w.lanes["l2"]
        lane._batch_size = lambda: 8  # type: ignore[method-assign]
        real = w.disk.write_from
        entered, go = threading.Event(), threading.Event()

        def flaky(key: ObjectKey, *args: object) -> int:
            if key == K(2):
                entered.set()
                assert go.wait(10)
            if key == K(3):
                raise OSError("injected")
            out: int = real(key, *args)  # type: ignore[arg-type]
            return out

        w.disk.write_from = flaky  # type: ignore[method-assign]
        gate = w.block()
        w.store([K(1)])
        objs = w.store([K(2), K(3), K(4), K(5)])
        gate.set()
        await until(entered.is_set)
        task = asyncio.ensure_future(w.store_async([K(5)], version=2, overwrite=True))
        await until(lambda: any(getattr(j, "what", "") == "delete" for j in lane._queue))
        go.set()
        assert await asyncio.wait_for(task, 10) == 1
        await w.drain()
        assert disk_bytes(w, K(2)) == payload(K(2)) and disk_bytes(w, K(4)) == payload(K(4))
        assert disk_bytes(w, K(3)) is None and disk_bytes(w, K(5)) == payload(K(5), 2)
        c = lane.counters
        assert (c.writes, c.write_errors, lane.writes_cancelled, c.deletes) == (4, 1, 1, 1)
        assert all(o.holds == 0 for o in objs)
        settled(w)

    run(tmp_path, body, slots=16)


# ---------------------------------------------------------------- another host's overwrite (fence)


@pytest.mark.parametrize("applied", [False, True], ids=["before_the_poll", "after_the_poll"])
def test_an_l3_batch_never_writes_a_version_another_hosts_acknowledged_overwrite_replaced(
    tmp_path: Path, redis_server: RedisProc, applied: bool
) -> None:
    """Host 1 holds K1..K4 (v0) in an L3 batch behind a gate; host 2
    overwrites K3 (v2), acknowledged. Host 1's batch then runs, before its poll applies host 2's
    entries (L3's floor refuses K3 v0: fenced) or after it (K3 is no longer live: fenced too).
    L3 keeps host 2's v2, host 1's L2 never keeps K3 v0, host 1 serves no K3; nothing held."""

    async def main() -> None:
        host1 = World(tmp_path / "h1", redis_url=redis_server.url, disk=True, coherent=True)
        host2 = World(tmp_path / "h2", redis_url=redis_server.url, disk=False, coherent=True)
        try:
            await host1.sync()
            await host2.sync()
            l3 = host1.lanes["l3"]
            l3._batch_size = lambda: 8  # type: ignore[method-assign]
            host1.lanes["l2"]._batch_size = lambda: 8  # type: ignore[method-assign]
            gate = host1.block("l3")  # (L2 runs freely: a poll waits for its deletions there)
            keys = [K(i) for i in range(1, 5)]
            objs = host1.store(keys)
            assert l3.writing == [objs[0]] and len(l3._queue) == 3  # K1 pumped at once (behind the gate)
            assert await host2.store_async([K(3)], version=2, overwrite=True) == 1
            await host2.drain()
            if applied:
                await host1.sync()  # K3 v0 leaves host 1's L1; its L2 copy is deleted
                assert host1.l1.get(K(3)) is None
            gate.set()
            await until(lambda: l3.idle)
            if not applied:
                await host1.sync()
            await host1.drain()
            assert redis_bytes(host1, K(3)) == payload(K(3), 2)
            for k in (K(1), K(2), K(4)):
                assert redis_bytes(host1, k) == payload(k) and disk_bytes(host1, k) == payload(k)
            assert disk_bytes(host1, K(3)) in (None, payload(K(3), 2))
            assert host1.l1.get(K(3)) is None
            c = l3.counters  # (K3 fenced by L3, or by its liveness on the writer, or skipped at the pump)
            assert c.writes_skipped == 1 and c.fenced == (not applied) and c.writes == 3 and c.write_errors == 0
            assert all(o.holds == 0 for o in objs)
            settled(host1)
        finally:
            host1.mgr.close()
            host2.mgr.close()

    asyncio.run(main())


# ---------------------------------------------------------------- shutdown drain, aborted


# Fixed (W-EVICT): R-BATCH: TierLane.abandon (a drain aborted by a second signal) drops the queue
# but not the batch in flight: the writer goes on with every held write of the batch (up to
# BATCH_MAX=32, sized on the tier's *mean* write time so far, so a tier that slowed down makes it
# long), while drain.py promises 'the one write in flight finishes' (b03251c's abandon docstring
# now says the batch finishes; its unrun writes are counted only if a deletion stopped it). Fix:
# abandon() sets self._busy.stop when it is a _Batch (_requeue, since b03251c, then drops and
# counts the unrun writes)
def test_an_aborted_drain_stops_the_batch_after_the_write_in_progress(tmp_path: Path) -> None:
    async def body(w: World) -> None:
        lane = w.lanes["l2"]
        lane._batch_size = lambda: 8  # type: ignore[method-assign]
        written = slow_writes(lane, 0.15)
        gate = w.block()
        w.store([K(1)])
        w.store([K(i) for i in range(2, 10)])  # a batch of 8
        gate.set()
        await until(lambda: len(written) >= 1 and len(lane.writing) == 8)
        lane.abandon()
        assert await lane.drain(10.0)
        assert len(written) <= 3, f"{len(written)} writes ran in all, the abort came during the first"

    run(tmp_path, body, slots=16)


# Fixed (W-EVICT): R-BATCH (low): TierLane._batch_size divides BATCH_S by the tier's mean write
# time since start (counters.writes / write_seconds), so after a long fast period a tier that
# slows down (a disk under contention, a Redis far away) keeps getting batches sized for the old
# speed: 10,000 writes at 1 ms then 100 at 200 ms still give batches of 16, 3.2 s each (64x
# BATCH_S) during which 16 objects per lane are held, unevictable even past the writeback wait,
# and an aborted drain runs them all. Fix: size batches on a recent estimate of the write time (an
# EWMA updated in _wrote, kept beside the counters)
def test_the_batch_size_follows_a_tier_that_slowed_down(tmp_path: Path) -> None:
    async def body(w: World) -> None:
        lane = w.lanes["l2"]
        c = lane.counters
        c.writes, c.write_seconds = 10_000, 10_000 * 0.001  # fast for a long while
        assert lane._batch_size() == 32
        c.writes, c.write_seconds = c.writes + 100, c.write_seconds + 100 * 0.2  # the last 100: 0.2 s each
        assert lane._batch_size() * 0.2 <= 4 * 0.05, f"batches of {lane._batch_size()} writes of 0.2 s"
        c.writes, c.write_seconds = 0, 0.0

    run(tmp_path, body)


# ---------------------------------------------------------------- the dirty limit


def test_the_dirty_limit_wait_is_bounded_and_the_store_then_keeps_every_dirty_chunk(tmp_path: Path) -> None:
    """The writer stuck (a gate), 6 of 16 slots dirty, dirty limit 0.25: a store of 3 more
    chunks waits about --writeback-wait-s, then goes on (free room, no dirty eviction); after
    the gate every chunk, the waiting store's included, is in L2 with its bytes."""

    async def body(w: World) -> None:
        w.l1.dirty_limit = 0.25
        w.l1.writeback_wait_s = 0.3
        gate = w.block()
        try:
            w.store([K(i) for i in range(1, 7)])
            keys = [K(i) for i in range(7, 10)]
            assert writeback.needs_wait(w.mgr, [keys], NB, False)
            t0 = time.monotonic()
            assert not await asyncio.wait_for(writeback.wait_for_room(w.mgr, [keys], NB, False), 5)
            assert 0.3 <= time.monotonic() - t0 < 3
            with w.l1.dirty_eviction():
                plan = w.mgr.prepare_store("c", "s", keys, NB)
            assert [i for i, _ in plan.slots] == [0, 1, 2]
            for i, obj in plan.slots:
                w.l1.view(obj)[:] = payload(keys[i])
            assert w.mgr.commit_store("c", "s", [0, 1, 2]) == 3
            assert w.l1.counters.evicted_dirty == 0
        finally:
            gate.set()
        await w.drain()
        for i in range(1, 10):
            assert disk_bytes(w, K(i)) == payload(K(i))
        settled(w)

    run(tmp_path, body, slots=16)

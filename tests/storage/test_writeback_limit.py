"""``--writeback-dirty-limit`` (storage/writeback.py, ``L1Store.dirty_limit``): a store waits for
write-downs as soon as its chunks would take L1's dirty objects past that share of the pool, so
that clean room stays for reads promoted from a lower tier; it only delays stores, never drops a
chunk. In-process over a real L1Store, StorageManager and DiskTier; the flag through a server."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from kvdock.config import ServerConfig
from kvdock.errors import ConfigError
from kvdock.shm.slots import ALIGN, Partitions, SlotAllocator
from kvdock.storage import writeback
from kvdock.storage.memory import L1Store
from kvdock.storage.shares import Shares
from tierworld import NB, K, World, run


def test_a_store_past_the_dirty_limit_waits_although_clean_room_is_left(tmp_path: Path) -> None:
    async def body(w: World) -> None:
        w.l1.dirty_limit = 0.5  # 4 of the 8 slots
        gate = w.block()
        try:
            w.store([K(1), K(2), K(3)])  # K1 held by the writer (being written), K2 K3 dirty
            assert w.l1.dirty_room(None) == (2 * ALIGN, 8 * ALIGN)  # (the held one is being written: not counted)
            assert w.l1.room(K(9), NB) == (5, 2)  # five free slots: no shortfall
            assert writeback.shortfall(w.mgr, [[K(5), K(6), K(7)]], NB, False) == (0, 2)
            assert not writeback.needs_wait(w.mgr, [[K(5)]], NB, False)  # 2 + 1 <= 4
            assert not writeback.needs_wait(w.mgr, [[K(5), K(6)]], NB, False)  # 2 + 2 <= 4
            assert writeback.needs_wait(w.mgr, [[K(5), K(6), K(7)]], NB, False)  # 2 + 3 > 4
            assert writeback.needs_wait(w.mgr, [[K(1), K(2), K(3)]], NB, True)  # an overwrite writes all 3
            assert not writeback.needs_wait(w.mgr, [[K(1), K(2), K(3)]], NB, False)  # deduped: nothing new
            w.l1.dirty_limit = 1.0  # off: the room is there
            assert not writeback.needs_wait(w.mgr, [[K(5), K(6), K(7)]], NB, False)
            w.l1.dirty_limit = 0.5
            # the wait is bounded: the writer is stuck, so it runs out; nothing is evicted after it
            w.l1.writeback_wait_s = 0.2
            t0 = time.monotonic()
            assert not await writeback.wait_for_room(w.mgr, [[K(5), K(6), K(7)]], NB, False)
            assert time.monotonic() - t0 >= 0.2
            c = w.l1.counters
            assert (c.throttled_stores, c.throttle_timeouts) == (1, 1)
            with w.l1.dirty_eviction():  # what the server does past the wait: free room first
                plan = w.mgr.prepare_store("c", "s", [K(5), K(6), K(7)], NB)
            assert [i for i, _ in plan.slots] == [0, 1, 2] and w.l1.evictions == 0
            assert c.evicted_dirty == 0 and w.l1.get(K(2)) is not None and w.l1.get(K(3)) is not None
            w.mgr.end_session("c", "s")
        finally:
            gate.set()
        await w.drain()
        # written down: nothing dirty, no store waits
        assert w.l1.dirty_room(None) == (0, 8 * ALIGN)
        assert not writeback.needs_wait(w.mgr, [[K(5), K(6), K(7), K(8)]], NB, False)

    run(tmp_path, body, slots=8)


def test_a_waiting_store_goes_on_once_write_downs_bring_the_dirty_share_under_the_limit(tmp_path: Path) -> None:
    async def body(w: World) -> None:
        w.l1.dirty_limit = 0.5
        w.l1.writeback_wait_s = 30.0
        gate = w.block()
        w.store([K(1), K(2), K(3), K(4)])  # K1 held, 3 dirty
        assert writeback.needs_wait(w.mgr, [[K(5), K(6)]], NB, False)  # 3 + 2 > 4
        waiting = asyncio.ensure_future(writeback.wait_for_room(w.mgr, [[K(5), K(6)]], NB, False))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        t0 = time.monotonic()
        gate.set()
        assert await asyncio.wait_for(waiting, 20)  # it fits now: no timeout
        assert time.monotonic() - t0 < 20 and w.l1.counters.throttle_timeouts == 0

    run(tmp_path, body, slots=8)


def test_the_dirty_limit_is_a_share_in_0_1(make_server) -> None:
    assert ServerConfig().writeback_dirty_limit == 0.5  # the default (docs/benchmarks.md: trace replay)
    for bad in (0.0, -0.5, 1.5):
        with pytest.raises(ConfigError, match="writeback_dirty_limit must be in"):
            ServerConfig(writeback_dirty_limit=bad).validate()
    srv = make_server("--writeback-dirty-limit", "0.25")
    assert srv.get("/status")["l1"]["eviction"]["writeback_dirty_limit"] == 0.25


def test_a_tenants_region_has_its_own_dirty_share() -> None:
    # the limit is a share of the store's own region: another tenant's burst never makes it wait
    a, t = SlotAllocator(0, 4 * ALIGN), SlotAllocator(4 * ALIGN, 2 * ALIGN)
    shares = Shares(lambda salt: "t" if salt == "t" else None, {"t": 2 * ALIGN})
    l1 = L1Store(Partitions({None: a, "t": t}), shares=shares)
    for key in (K(1), K(2), K(3, "t")):
        obj = l1.reserve(key, NB)
        assert obj is not None
        l1.commit(obj)
        l1.mark_dirty(obj)
    assert l1.dirty_room(None) == (2 * ALIGN, 4 * ALIGN)
    assert l1.dirty_room("t") == (ALIGN, 2 * ALIGN)
    l1.mark_clean(l1.get(K(1)))  # type: ignore[arg-type]
    assert l1.dirty_room(None) == (ALIGN, 4 * ALIGN)
    l1.check_integrity()

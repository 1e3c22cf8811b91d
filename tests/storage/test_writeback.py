"""kvdock.storage.writeback (review R5): a store waits for write-downs whenever it needs room that
only dirty objects hold, in-process over a real L1Store, StorageManager and DiskTier.

The server's store (server/storing.py) reserves under ``L1Store.dirty_eviction()`` once
``needs_wait`` says no wait is needed; an estimate of the chunks to write that is too low thus
evicts acknowledged, unwritten objects at once, with no back-pressure at all."""

from __future__ import annotations

from pathlib import Path

from kvdock.shm.slots import ALIGN, Partitions, SlotAllocator
from kvdock.storage import writeback
from kvdock.storage.memory import L1Store
from kvdock.storage.shares import Shares
from tierworld import NB, K, World, run


def test_a_store_rewriting_a_held_chunk_that_no_longer_chains_waits_for_write_downs(tmp_path: Path) -> None:
    # L1 holds K2, but its parent (K1's version) is gone from every tier: a store of [K1, K2]
    # writes both (K2 anew: the version in L1 names another K1), and counting K2 as held said
    # "fits" while only one clean slot was there; the other came from a dirty object at once
    async def body(w: World) -> None:
        assert w.disk is not None
        w.store([K(1), K(2)])
        await w.drain()
        w.evict_l1([K(1)])
        w.disk.delete(K(1))  # (e.g. L2's own eviction took the head: it keeps tails)
        gate = w.block()
        try:
            w.store([K(5)])  # in flight (pinned)
            w.store([K(6)])  # queued: dirty, evictable
            assert w.l1.room(K(1), NB) == (1, 1)  # K2 is the one clean slot
            # one short; K6 queued and K5 in flight give room once written
            assert writeback.shortfall(w.mgr, [[K(1), K(2)]], NB, False) == (1, 2)
            assert writeback.needs_wait(w.mgr, [[K(1), K(2)]], NB, False)
            # what the server does once the store may evict dirty objects: both chunks are written
            with w.l1.dirty_eviction():
                plan = w.mgr.prepare_store("c", "s", [K(1), K(2)], NB)
            assert [i for i, _ in plan.slots] == [0, 1] and w.l1.counters.evicted_dirty == 1
            w.mgr.end_session("c", "s")
        finally:
            gate.set()

    run(tmp_path, body, slots=3)


def test_the_chunks_a_store_dedups_in_l1_are_not_room_for_it(tmp_path: Path) -> None:
    # a store pins the leading run it finds in L1 (prepare_store keeps its prefix): a clean
    # object of that run is no room for its own new chunks. Counting it said "fits", the store
    # did not wait, and its reservation evicted a dirty object at once (the trace replay with L2:
    # 745 dirty evictions, 0 waits that ran out)
    async def body(w: World) -> None:
        w.store([K(1)])
        await w.drain()  # K1 clean
        gate = w.block()
        try:
            w.store([K(5)])  # in flight (pinned)
            w.store([K(6)])  # queued: dirty, evictable
            assert w.l1.room(K(1), NB) == (1, 1)  # K1 is the one clean slot...
            # ... which the store of [K1, K2] pins: K2 needs K6's or K5's room, once written
            assert writeback.shortfall(w.mgr, [[K(1), K(2)]], NB, False) == (1, 2)
            assert writeback.needs_wait(w.mgr, [[K(1), K(2)]], NB, False)
            assert writeback.shortfall(w.mgr, [[K(7)]], NB, False) == (0, 1)  # a store not holding K1 fits
            with w.l1.dirty_eviction():  # (what a store past its wait does: K6 goes, counted)
                plan = w.mgr.prepare_store("c", "s", [K(1), K(2)], NB)
            assert [i for i, _ in plan.slots] == [1] and w.l1.counters.evicted_dirty == 1
            w.mgr.end_session("c", "s")
        finally:
            gate.set()

    run(tmp_path, body, slots=3)


def test_a_chain_held_in_l1_or_l2_needs_no_room(tmp_path: Path) -> None:
    async def body(w: World) -> None:
        assert w.disk is not None
        w.store([K(1), K(2)])
        await w.drain()
        w.evict_l1([K(1)])  # its L2 copy chains: deduped from there
        gate = w.block()
        try:
            w.store([K(5)])
            w.store([K(6)])
            assert writeback.shortfall(w.mgr, [[K(1), K(2)]], NB, False) == (0, 1)
            # K3 is written: the one clean slot is K2's, which the store pins (it extends K2): K6
            # and K5 (in flight) give room once written
            assert writeback.shortfall(w.mgr, [[K(1), K(2), K(3)]], NB, False) == (1, 2)
            assert writeback.shortfall(w.mgr, [[K(1), K(2), K(3), K(4)]], NB, False) == (2, 2)
            assert writeback.shortfall(w.mgr, [[K(3)]], NB, False) == (0, 1)  # K2's clean room, not pinned
            assert writeback.shortfall(w.mgr, [[K(1), K(2)]], NB, True) == (1, 2)  # an overwrite writes all
        finally:
            gate.set()

    run(tmp_path, body, slots=3)


def test_a_tenants_region_carved_for_another_size_counts_its_dirty_objects_as_the_room_they_hold() -> None:
    # a tenant's region (its L1 quota) full of one model's slots gives another model's slot size
    # only by evicting all of it (L1Store._recarve): room() said (0 slots, 0 dirty), so the store
    # did not wait, and under dirty_eviction the recarve dropped the unwritten objects at once
    a = SlotAllocator(0, 4 * ALIGN)
    t = SlotAllocator(4 * ALIGN, 4 * ALIGN)
    shares = Shares(lambda salt: "t" if salt == "t" else None, {"t": 4 * ALIGN})
    l1 = L1Store(Partitions({None: a, "t": t}), shares=shares)
    objs = []
    for i in range(4):
        obj = l1.reserve(K(i, "t"), NB)
        assert obj is not None
        l1.commit(obj)
        objs.append(obj)
    l1.mark_dirty(objs[2])
    l1.mark_dirty(objs[3])
    big = K(9, "t")
    assert l1.room(big, 2 * ALIGN) == (0, 2)  # two dirty objects hold the room: wait for them
    l1.pin(objs[3])  # (a lane writes it now: no recarving until it is done; the others still count)
    assert l1.room(big, 2 * ALIGN) == (0, 1)
    l1.unpin(objs[3], used=False)
    assert l1.reserve(big, 2 * ALIGN) is None  # (a load, or a store before its wait ran out)
    l1.mark_clean(objs[2])
    l1.mark_clean(objs[3])
    assert l1.room(big, 2 * ALIGN) == (2, 0)  # all clean: the region is carved anew
    assert l1.reserve(big, 2 * ALIGN) is not None and l1.counters.evicted_dirty == 0
    pinned = l1.get(K(0, "t"))
    assert pinned is None  # (recarved: every object of the region went)
    l1.check_integrity()
    # elsewhere nothing changes: the shared rest is never recarved
    assert l1.room(K(9), 2 * ALIGN) == (2, 0)

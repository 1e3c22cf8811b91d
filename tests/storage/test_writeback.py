"""kvdock.storage.writeback (review R5): a store waits for write-downs whenever it needs room that
only dirty objects hold, in-process over a real L1Store, StorageManager and DiskTier.

The server's store (server/storing.py) reserves under ``L1Store.dirty_eviction()`` once
``needs_wait`` says no wait is needed; an estimate of the chunks to write that is too low thus
evicts acknowledged, unwritten objects at once, with no back-pressure at all."""

from __future__ import annotations

from pathlib import Path

from kvdock.storage import writeback
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
            assert writeback.shortfall(w.mgr, [[K(1), K(2)]], NB, False) == (1, 1)
            assert writeback.needs_wait(w.mgr, [[K(1), K(2)]], NB, False)
            # what the server does once the store may evict dirty objects: both chunks are written
            with w.l1.dirty_eviction():
                plan = w.mgr.prepare_store("c", "s", [K(1), K(2)], NB)
            assert [i for i, _ in plan.slots] == [0, 1] and w.l1.counters.evicted_dirty == 1
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
            assert writeback.shortfall(w.mgr, [[K(1), K(2), K(3)]], NB, False) == (0, 1)  # the clean room
            assert writeback.shortfall(w.mgr, [[K(1), K(2), K(3), K(4)]], NB, False) == (1, 1)
            assert writeback.shortfall(w.mgr, [[K(1), K(2)]], NB, True) == (1, 1)  # an overwrite writes all
        finally:
            gate.set()

    run(tmp_path, body, slots=3)

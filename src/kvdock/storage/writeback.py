"""Back-pressure of stores on write-downs: clean before dirty (a page cache's dirty throttling).

An object committed to L1 with a lower tier below is *dirty* until its write-downs are done
(:mod:`kvdock.storage.lane`): until then L1 holds the only copy of acknowledged data. L1 evicts
clean objects first (:mod:`kvdock.storage.evictable`); a store that needs more slots than free
and clean ones give, while dirty objects hold the rest, first **waits** for write-downs to turn
objects clean, at most ``L1Store.writeback_wait_s`` (``--writeback-wait-s``, default 2 s; 0: never
wait). When the wait runs out (a lower tier slower than the stores for that long), the store's
reservations may evict dirty objects, the one committed last first, so a prefix's head is never
dropped while its tail stays; each is counted (``l1.evicted_dirty``, its bytes, and the lane's
``writes_skipped``) and logged (at most once a minute). A store never fails because a lower tier
is slow; it is slowed down, then the newest unwritten chunks are dropped.

``--writeback-dirty-limit`` (``L1Store.dirty_limit``, a share of the pool; 1: off) makes a store
wait the same bounded way as soon as its chunks would take the dirty objects past that share,
although clean room is left: the rest stays clean for reads promoted from a lower tier (which
never evict a dirty object, so with L1 all dirty every one of them misses). It only delays
stores; past the wait a store goes on as without it (clean objects first).

Loads from lower tiers (promotions into L1) never evict a dirty object: they are misses instead.

The lanes' pace is here too: :class:`BatchSizer`, how many queued write-downs a lane's writer runs
in one call (storage.lane's batches).

The counters (``throttled_stores``, ``throttle_seconds``, ``throttle_timeouts``) are L1's
(:class:`kvdock.storage.memory.L1Counters`, in /status and /metrics).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from typing import TYPE_CHECKING

from kvdock.keys import ObjectKey
from kvdock.shm.slots import aligned

if TYPE_CHECKING:
    from kvdock.storage.manager import StorageManager


def shortfall(mgr: StorageManager, keysets: list[list[ObjectKey]], nbytes: int, overwrite: bool) -> tuple[int, int]:
    """(slots a store of ``keysets`` would reserve beyond the free and clean ones, dirty objects
    that could give them). The chunks it reserves are counted as ``prepare_store`` decides them:
    a leading run that chains (in L1, or in an indexed lower tier) is deduped, every chunk from
    the first that does not is written (a key held in L1 whose version names another parent
    included), an overwrite writes all; the clean objects of the run it finds in L1 are no room for
    it (it pins them). It may only overcount (chunks a lower tier without an
    index holds, a reservation of another store after the run, a plain store's write limit)."""
    if not keysets or not keysets[0]:
        return 0, 0
    plans = [(len(keys), 0) if overwrite else _writes(mgr, keys) for keys in keysets]
    need = sum(n for n, _ in plans)
    room, dirty = mgr.l1.room(keysets[0][0], nbytes)
    room -= sum(held for _, held in plans)  # the clean run it pins is no room for it
    if need > room:  # the objects the lanes write now (held) give room too once written
        region = mgr.l1.region_for(keysets[0][0])
        for o in (o for lane in mgr.lanes for o in lane.writing):
            if o.dirty and o.region == region:
                dirty += region is not None or aligned(o.nbytes) == aligned(nbytes)  # (a tenant's region: recarved)
    return max(0, need - room), dirty


def _writes(mgr: StorageManager, keys: list[ObjectKey]) -> tuple[int, int]:
    """(the chunks of ``keys`` a plain store would write: all from the first that does not chain,
    the clean evictable objects of the leading run it finds in L1: ``prepare_store`` pins those,
    so they are no room for it)."""
    parent = held = 0
    for i, key in enumerate(keys):
        if mgr.l1.is_reserved(key):
            return 0, held  # it and every chunk after it: in flight (another store's), not written
        present = mgr.l1.get(key)
        if present is not None and present.parent == parent:
            parent = present.version
            held += present.pins == 0 and not present.dirty
            continue
        lower = None if key in mgr.deletions else mgr.chains.lower_head(key, parent, None)
        if lower is None:
            return len(keys) - i, held
        parent = lower.version
    return 0, held


def needs_wait(mgr: StorageManager, keysets: list[list[ObjectKey]], nbytes: int, overwrite: bool) -> bool:
    """Whether the store should wait for write-downs first: it needs dirty objects' room, or its
    chunks would take the dirty objects past ``L1Store.dirty_limit`` of the pool (of a tenant's
    region, in it; while any is
    dirty: the limit only ever delays a store, it never drops anything)."""
    l1 = mgr.l1
    if l1.writeback_wait_s <= 0 or not mgr.lanes:
        return False
    short, dirty = shortfall(mgr, keysets, nbytes, overwrite)
    if short > 0 and dirty > 0:
        return True
    if l1.dirty_limit >= 1:
        return False
    dirty_now, capacity = l1.dirty_room(l1.region_for(keysets[0][0]))  # (a tenant's region: its own)
    if not dirty_now:
        return False
    plans = [(len(keys), 0) if overwrite else _writes(mgr, keys) for keys in keysets]
    new = sum(n for n, _ in plans) * aligned(nbytes)
    # a store that writes nothing adds no dirty object: never held back (R-BATCH)
    return new > 0 and dirty_now + new > l1.dirty_limit * capacity


async def wait_for_room(mgr: StorageManager, keysets: list[list[ObjectKey]], nbytes: int, overwrite: bool) -> bool:
    """Wait until the store fits without evicting a dirty object, or nothing more can turn clean
    for it, or ``writeback_wait_s`` passed; whether it fits (False: the wait ran out)."""
    l1 = mgr.l1
    start = time.monotonic()
    deadline = start + l1.writeback_wait_s
    l1.counters.throttled_stores += 1
    loop = asyncio.get_running_loop()
    try:
        while needs_wait(mgr, keysets, nbytes, overwrite):
            left = deadline - time.monotonic()
            if left <= 0:
                l1.counters.throttle_timeouts += 1
                return False
            turned: asyncio.Future[None] = loop.create_future()
            l1.when_clean(functools.partial(_wake, turned))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(turned, left)
        return True
    finally:
        l1.counters.throttle_seconds += time.monotonic() - start


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


# --- the lanes' batches of write-downs (storage.lane) -----------------------------------------
# How many queued write-downs a lane's writer runs in one call: about BATCH_S of writes at the
# tier's *recent* write time, at most BATCH_MAX, one at a time while nothing is measured. Recent:
# the mean of the last window of WINDOW writes, or of the writes since it when they are slower, so a
# tier that slows down (a disk under contention, a Redis far away) gets small batches at once.

BATCH_S = 0.05  # a batch of write-downs takes about this long
BATCH_MAX = 32
WINDOW = 16  # writes per estimate


class BatchSizer:
    """One lane's batch size, from its tier's counters (event loop only)."""

    def __init__(self) -> None:
        self._mark = (0, 0.0)  # (writes, seconds inside them) when the last window closed
        self._last: tuple[int, float] | None = None  # that window's (writes, seconds)

    def size(self, writes: int, seconds: float) -> int:
        """Writes for the next batch, given the tier's counters (writes done, seconds inside them)."""
        n, s = writes - self._mark[0], seconds - self._mark[1]
        if n < 0:  # (counters reset)
            self._mark, self._last, n, s = (writes, seconds), None, 0, 0.0
        known = [w for w in (self._last, (n, s) if n > 0 else None) if w is not None]
        if n >= WINDOW:
            self._mark, self._last = (writes, seconds), (n, s)
        if not known:
            return 1
        n, s = max(known, key=lambda w: w[1] / w[0])  # the slower
        return max(1, min(BATCH_MAX, int(BATCH_S * n / s))) if s > 0 else BATCH_MAX

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

Loads from lower tiers (promotions into L1) never evict a dirty object: they are misses instead.

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

if TYPE_CHECKING:
    from kvdock.storage.manager import StorageManager


def shortfall(mgr: StorageManager, keysets: list[list[ObjectKey]], nbytes: int, overwrite: bool) -> tuple[int, int]:
    """(slots a store of ``keysets`` would reserve beyond the free and clean ones, dirty objects
    that could give them): an estimate that never undercounts by more than chunks whose present
    version does not chain (those are rewritten)."""
    if not keysets or not keysets[0]:
        return 0, 0
    l1 = mgr.l1
    indexed = [lane.tier for lane in mgr.lanes if lane.tier.indexed and lane.tier.up()]
    need = 0
    for keys in keysets:
        for key in keys:
            held = l1.get(key) is not None or l1.is_reserved(key) or any(t.knows(key) for t in indexed)
            need += overwrite or not held
    room, dirty = l1.room(keysets[0][0], nbytes)
    return max(0, need - room), dirty


def needs_wait(mgr: StorageManager, keysets: list[list[ObjectKey]], nbytes: int, overwrite: bool) -> bool:
    """Whether the store should wait for write-downs first (it needs dirty objects' room)."""
    if mgr.l1.writeback_wait_s <= 0 or not mgr.lanes:
        return False
    short, dirty = shortfall(mgr, keysets, nbytes, overwrite)
    return short > 0 and dirty > 0


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

"""Deletions: the keys whose older version is being deleted from the lower tiers for an
overwrite (or an invalidation from another server), and the clears of whole tiers (a gap in the
fleet's invalidations). Owned by the storage manager: while a key is here, no lookup counts it in
a lower tier and no load reads it there; while a clear runs, the tier is not read at all.

A deletion from this host's own tiers only, for another server's invalidation (``local``), keeps
only those tiers (L2) from being read for its keys: the shared tier (L3) is current (that server's
overwrite deleted them there, its E2 entry drops what a read started before got), so a slow L2
never holds up loads of overwritten keys from L3."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable

from kvdock.keys import ObjectKey
from kvdock.storage.lane import TierLane

__all__ = ["Deletion", "Deletions"]

Deletion = asyncio.Future[int | None]  # a lane's deletion: the epoch it names, None if not done


class Deletions:
    """The deletions in flight, per key (event loop only)."""

    def __init__(self) -> None:
        self.counts: dict[ObjectKey, int] = {}  # key -> deletions in flight (never 0)
        self.local: dict[ObjectKey, int] = {}  # key -> ``local`` deletions in flight: L2 is not read
        self.clearing = 0  # clears of whole tiers in flight

    def __contains__(self, key: ObjectKey) -> bool:
        return key in self.counts

    def queue(self, keys: list[ObjectKey], lanes: list[TierLane], local: bool = False) -> list[Deletion]:
        """Queue the deletion of ``keys`` in each of ``lanes``; the keys stay here until every
        one of them is done (or failed). ``local``: ``lanes`` are this host's own tiers, and only
        they are kept from being read meanwhile (see the module docstring)."""
        assert not local or all(lane.tier.indexed for lane in lanes)
        counts = self.local if local else self.counts
        futures = [lane.delete(keys) for lane in lanes]
        for fut in futures:
            for key in keys:
                counts[key] = counts.get(key, 0) + 1
            fut.add_done_callback(functools.partial(self._done, counts, keys))
        return futures

    def _done(self, counts: dict[ObjectKey, int], keys: list[ObjectKey], _fut: object) -> None:
        for key in keys:
            n = counts.pop(key) - 1
            if n:
                counts[key] = n

    def blocks(self, key: ObjectKey, lane: TierLane) -> bool:
        """Whether ``lane`` must not be read for ``key`` now (a deletion of it is in flight)."""
        return key in self.counts or (lane.tier.indexed and key in self.local)

    def clear(self, lanes: list[TierLane]) -> list[Awaitable[object]]:
        """Clear each of ``lanes`` entirely; :attr:`clearing` counts them until done."""
        tasks: list[Awaitable[object]] = []
        for lane in lanes:
            self.clearing += 1
            task = asyncio.ensure_future(lane.clear())
            task.add_done_callback(self._cleared)
            tasks.append(task)
        return tasks

    def _cleared(self, _task: object) -> None:
        self.clearing -= 1

    def check_integrity(self) -> None:
        counts = (*self.counts.values(), *self.local.values())
        assert all(n > 0 for n in counts), "a finished deletion is still recorded"

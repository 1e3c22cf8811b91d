"""Deletions: the keys whose older version is being deleted from the lower tiers for an
overwrite (or an invalidation from another server), and the clears of whole tiers (a gap in the
fleet's invalidations). Owned by the storage manager: while a key is here, no lookup counts it in
a lower tier and no load reads it there; while a clear runs, the tier is not read at all."""

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
        self.clearing = 0  # clears of whole tiers in flight

    def __contains__(self, key: ObjectKey) -> bool:
        return key in self.counts

    def queue(self, keys: list[ObjectKey], lanes: list[TierLane]) -> list[Deletion]:
        """Queue the deletion of ``keys`` in each of ``lanes``; the keys stay here until every
        one of them is done (or failed)."""
        futures = [lane.delete(keys) for lane in lanes]
        for fut in futures:
            for key in keys:
                self.counts[key] = self.counts.get(key, 0) + 1
            fut.add_done_callback(functools.partial(self._done, keys))
        return futures

    def _done(self, keys: list[ObjectKey], _fut: object) -> None:
        for key in keys:
            n = self.counts.pop(key) - 1
            if n:
                self.counts[key] = n

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
        assert all(n > 0 for n in self.counts.values()), "a finished deletion is still recorded"

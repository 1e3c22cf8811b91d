"""Loads: L1 reservations being filled from a lower tier, and the prefetches that make them.

Owned by the storage manager (event loop only). A load reserves the key in L1, reads the version
that continues the asked chain from the first lower tier that has it, and commits the slot only
if it is still the key's reservation: an overwrite (this server's, or another's invalidation)
supersedes a load by detaching its slot, and the bytes read are thrown away. A store never
reserves a key a load holds."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvdock.keys import ObjectKey
from kvdock.layout import KVGeometry
from kvdock.storage.deletions import Deletions
from kvdock.storage.lane import TierLane
from kvdock.storage.memory import L1Object, L1Store
from kvdock.storage.sessions import PrefetchJob, SessionTable
from kvdock.storage.tier import Head

if TYPE_CHECKING:
    from kvdock.storage.keeping import Holdings

__all__ = ["Loads"]

log = logging.getLogger(__name__)


def chains(obj: L1Object | Head | None, parent: int) -> bool:
    """Whether ``obj`` is the version that follows ``parent`` in a chain."""
    return obj is not None and obj.parent == parent


class Loads:
    """The loads in flight. ``readable()`` gives the lower tiers reads may use now; ``epoch()``
    the position of the fleet's invalidations applied so far; ``vouched()`` whether L1 and L2
    may be read (storage.coherence); ``holdings``: with the fleet's coherence, what keeps an
    overwrite's version loaded here readable (storage.keeping)."""

    def __init__(
        self,
        l1: L1Store,
        sessions: SessionTable,
        deletions: Deletions,
        geometry_of: Callable[[str], KVGeometry | None],
        chunk_size: int,
        readable: Callable[[], list[TierLane]],
        epoch: Callable[[], int],
        vouched: Callable[[], bool],
    ) -> None:
        self.l1, self.sessions, self.deletions = l1, sessions, deletions
        self.geometry_of, self.chunk_size = geometry_of, chunk_size
        self.readable, self.epoch, self.vouched = readable, epoch, vouched
        self._loading: set[L1Object] = set()
        self._waits: dict[ObjectKey, asyncio.Future[None]] = {}
        self.holdings: Holdings | None = None

    def __contains__(self, obj: L1Object) -> bool:
        return obj in self._loading

    def __len__(self) -> int:
        return len(self._loading)

    def loading(self, key: ObjectKey) -> bool:
        """Whether a load of ``key`` is in flight."""
        return key in self._waits

    def supersede_all(self) -> None:
        """Detach every load's slot (a gap in the fleet's invalidations: any may be stale)."""
        for slot in list(self._loading):
            if self.l1.reservation(slot.key) is slot:
                self.l1.detach(slot)

    def prefetch(self, job: PrefetchJob) -> None:
        """Run ``job``: load its session's keys past the pinned run, in order, pinning each for
        the session, until the first miss (the session is held while it runs)."""
        self.sessions.hold(job.session)
        job.task = asyncio.get_running_loop().create_task(self._prefetch(job))

    async def _prefetch(self, job: PrefetchJob) -> None:
        session = job.session
        try:
            for key in session.keys[len(session.pinned) :]:
                if job.cancelled or not session.open:
                    break
                parent = session.pinned[-1].version if session.pinned else 0
                obj = await self.load(key, parent)
                # a chunk replaced while we waited (an overwrite) ends the run: never a mix
                if obj is None or not session.open or not all(o.live for o in session.pinned):
                    break
                self.l1.pin(obj)
                session.pinned.append(obj)
        except Exception:
            log.exception("prefetch failed")
        finally:
            self.sessions.unhold(session)
            self.sessions.renew(session)
            job.done.set()

    async def load(self, key: ObjectKey, parent: int) -> L1Object | None:
        """The READY L1 object for ``key`` whose predecessor is version ``parent``, promoted from
        a lower tier if L1 has no such version; None on a miss. While the server does not vouch
        for L1 and L2 (storage.coherence), the version is read from the shared tier (L3) anew."""
        vouched = self.vouched()
        while not chains(obj := self.l1.get(key), parent) and key in self._waits:
            await asyncio.shield(self._waits[key])  # someone else is loading it
        if vouched and obj is not None and obj.parent == parent:
            return obj
        geo = self.geometry_of(key.model)
        lanes = [
            lane
            for lane in self.readable()
            if not self.deletions.blocks(key, lane) and (not lane.tier.indexed or chains(lane.tier.knows(key), parent))
        ]
        if geo is None or not lanes or key in self.deletions or self.l1.is_reserved(key):
            return None
        slot = self.l1.reserve(key, geo.chunk_nbytes(self.chunk_size))
        if slot is None:
            return None
        slot.epoch = self.epoch()  # what was applied before the read starts (storage.coherence)
        self._loading.add(slot)
        self._waits[key] = done = asyncio.get_running_loop().create_future()
        ok, kept = False, None
        try:
            for lane in lanes:
                head = await lane.read(key, self.l1.view(slot), geo, self.chunk_size, parent)
                if head is not None:
                    slot.version, slot.parent = head.version, head.parent
                    # an overwrite's version is readable only while its floor is kept (storage.keeping)
                    if head.overwrite and self.holdings is not None:
                        kept = await self.holdings.keep_load(slot, head, lane)
                        if kept is None:
                            continue  # not this copy (a lower tier may hold the current version)
                    ok = True
                    break
        except Exception:
            log.exception("loading %s into L1 failed", key.chunk.hex()[:16])
        finally:
            self._loading.discard(slot)
            del self._waits[key]
            done.set_result(None)
        if not ok or self.l1.reservation(key) is not slot:  # a miss, or superseded by an overwrite
            self.l1.abort(slot)
            return None
        self.l1.commit(slot)
        if kept is not None and self.holdings is not None:
            self.holdings.loaded(slot, kept)
        return slot

    def check_integrity(self) -> None:
        for obj in self._loading:
            assert obj.live and obj.state.name == "RESERVED", "a load's slot is not reserved"

"""Applying the fleet's invalidations (storage.coherence) to what this server holds.

A function of the storage manager's state (it owns all of it; event loop only): called by
:meth:`StorageManager.apply <kvdock.storage.manager.StorageManager.apply>` for each poll of the
invalidation stream, before the server vouches for L1 and L2 again."""

from __future__ import annotations

import logging
from collections.abc import Awaitable

from kvdock.keys import ObjectKey
from kvdock.storage.coherence import Coherence
from kvdock.storage.deletions import Deletions
from kvdock.storage.lane import TierLane
from kvdock.storage.loads import Loads
from kvdock.storage.memory import L1Store
from kvdock.storage.plans import OVERWRITING, SUPERSEDED
from kvdock.storage.stream import PollResult

__all__ = ["apply_invalidations"]

log = logging.getLogger(__name__)


def apply_invalidations(
    result: PollResult, coh: Coherence, l1: L1Store, loads: Loads, deletions: Deletions, lanes: list[TierLane]
) -> list[Awaitable[object]]:
    """Apply one poll: for each entry's keys, drop the L1 object older than the entry, supersede
    a load or a plain store's reservation of it made before (a store is then not committed: it is
    ordered before the overwrite), note another server's entry on an overwrite's reservation
    (``seen``: the commit compares it with its own E2, the later E2 wins everywhere), and delete
    the key from L2 (unless the entry is this server's own overwrite, which deleted it there
    already and whose reservations are the new version, or L1 holds this server's own later
    overwrite of it, which L2 holds or will: R-LANE).
    A gap (entries lost) drops all of L1 and clears L2, which no read uses until that is done.
    Then the coherence advances (the caller vouches). Returns L2's deletions and clears."""
    local = [lane for lane in lanes if lane.tier.indexed]  # this host's own tiers (L2)
    pending: list[Awaitable[object]] = []
    if result.lost:
        coh.counters.full_drops += 1
        dropped = l1.clear()
        coh.counters.dropped += dropped
        loads.supersede_all()
        log.warning(
            "coherence: invalidations were lost (L3 trimmed or lost its stream past this server's "
            "position): dropped %d L1 object(s) and every L2 object",
            dropped,
        )
        pending += deletions.clear(local)
    for seen in result.recent:  # (a start or a gap: what other servers overwrote lately)
        coh.note_foreign(seen.keys, seen.position)
    for entry in result.entries:
        own = coh.is_own(entry.position)
        stale: list[ObjectKey] = []  # keys whose L2 copy the entry replaced
        for key in entry.keys:
            obj = l1.get(key)
            if obj is not None and obj.epoch < entry.position:
                l1.remove(key)
                coh.counters.dropped += 1
            elif obj is not None:  # this server's own later overwrite (its epoch is its E2): L2
                continue  # holds it, or will; the older versions are gone from there already
            stale.append(key)
            reserved = l1.reservation(key)
            if reserved is None or reserved.epoch == SUPERSEDED:
                continue
            if reserved.epoch == OVERWRITING:  # ordered against this one by E2s at its commit
                if not own:
                    reserved.seen = max(reserved.seen, entry.position)
                continue
            if reserved.epoch >= entry.position:
                continue
            if reserved in loads:
                l1.detach(reserved)  # its bytes may be the replaced version: thrown away
            elif not own:
                reserved.epoch = SUPERSEDED
        if not own:
            coh.note_foreign(entry.keys, entry.position)
        if local and stale and not own:
            pending += deletions.queue(stale, local, local=True)  # (L3 stays readable: storage.deletions)
    coh.applied(result)
    return pending

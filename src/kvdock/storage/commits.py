"""Which reserved chunks of a store request become READY at its commit: the decision of
:meth:`StorageManager.commit_stores <kvdock.storage.manager.StorageManager.commit_stores>`, over
the sessions of every shard of one request (one session per shard; event loop only).

**All shards or none** (R-KEEP 2 and 5). A chunk of a model stored in several shards (TP ranks)
is one version only if every shard of it is: a reader assembles them. So:

* chunk ``i`` of a request commits in every shard or in none: when one shard's must not (an
  overwrite's commit comes too late after its stream entries, or another server's overwrite of
  the chunk came after its own: ``seen``; a plain store's was superseded by an invalidation) no
  shard's does. An overwrite's older versions stay gone (a miss); one whose commit is too late
  commits no chunk of any shard.

The shards' older versions are deleted in one deletion with one invalidation (E1, E2:
:meth:`StorageManager.prepare_stores`), so every server orders two overwrites of a chunk the same
way for all its shards, and ``too_late`` is decided once for them all."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kvdock.errors import RequestError
from kvdock.protocol.codes import ErrorCode
from kvdock.storage.memory import L1Object
from kvdock.storage.plans import SUPERSEDED

if TYPE_CHECKING:
    from kvdock.storage.manager import StorageManager

__all__ = ["to_commit"]

log = logging.getLogger(__name__)


def to_commit(
    mgr: StorageManager, client_id: str, work: list[tuple[str, list[int]]], ok: bool
) -> list[tuple[int, int, L1Object]]:
    """(chunk index, shard, object) of every chunk of ``work`` ((session id, indexes) per shard)
    to commit, their epochs set; every other reservation named is aborted. RequestError
    ``tier_unavailable`` when not ``ok`` (an overwrite whose older versions could not all be
    deleted: the session of the first shard is ended, the caller ends the others)."""
    picked: list[tuple[int, int, L1Object]] = []
    dropped: set[int] = set()  # chunk indexes some shard must not commit
    for shard, (sid, indexes) in enumerate(work):
        objs = mgr.reservations(client_id, sid, indexes)
        session = mgr.sessions.get(client_id, sid)
        if not all(d.done() for d in session.deletes):
            raise AssertionError("commit_store before wait_deletes")
        if not ok:
            mgr.end_session(client_id, sid)
            down = ", ".join(lane.name for lane in mgr.lanes if not lane.tier.up()) or "a lower tier"
            raise RequestError(
                f"overwrite refused: {down} could not delete the older version, which could come back; "
                "nothing was stored (retry when the tier is back)",
                ErrorCode.TIER_UNAVAILABLE,
            )
        committed = set(indexes)
        # an overwrite's versions carry its own invalidation's position (E2: of two concurrent
        # overwrites of a key, the later E2 is what every L1 and L3 keep), never a later one it
        # applied meanwhile (R-LANE: that let both hosts keep their own); others what is applied
        e2 = max([d.result() or 0 for d in session.deletes], default=0)
        epoch = e2 if session.overwrite and e2 else max(mgr._epoch(), e2)
        # committed this late, a plain store elsewhere may already keep other bytes (R-FLEET)
        late = bool(session.overwrite and e2 and mgr.coherence is not None and mgr.coherence.too_late(e2))
        if late:
            log.warning("an overwrite came to its commit too late after its stream entries: not committed")
        if session.overwrite:  # chunks reserved but not committed must not keep their old version
            for i, obj in session.reserved.items():
                if i not in committed:
                    mgr.l1.remove(obj.key)
        for i, obj in zip(indexes, objs, strict=True):
            if late or obj.epoch == SUPERSEDED or obj.seen > epoch:  # (an overwrite elsewhere came after)
                dropped.add(i)
            else:
                obj.epoch, obj.overwrite = epoch, e2 if session.overwrite else 0
            picked.append((i, shard, obj))
    if not dropped:
        return picked
    out = []
    for i, shard, obj in picked:
        if i in dropped:  # (in every shard)
            mgr.l1.abort(obj)
        else:
            out.append((i, shard, obj))
    return out

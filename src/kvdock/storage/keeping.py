"""Holding an overwrite's version across a fleet: a server serves its copy only while it keeps
that overwrite's floor alive in L3; when the floor is gone it drops the copy (a miss).

Why (issue 29's last case): a plain store through another server is refused only while the
overwrite's floor is live in L3 with no value (storage.redis ``floored``), and the floor expires
(``--l3-floor-ttl-ms``). Without this, an overwrite's version that reached L3 after its floor
expired (a write-down backlog), or that L3 evicted (cold there because it is hot here), let
another server store other bytes under the key while this one served the overwrite from L1: two
truths.

How:

* an overwrite's version is *marked*: ``L1Object.overwrite`` and its header's ``overwrite`` hold
  its second stream entry (E2; storage.objfile). Every marked L1 object is *held*
  (:class:`Holdings`);
* every ``refresh_s`` (a sixth of the TTL) one pipelined round of KEEP_SCRIPT
  (storage._coherence_lua) runs for every held key, on a thread of its own (storage.following),
  and its answers are applied on the event loop: 1 serve on; 0 the floor is kept but L3 lost the
  value: write it again (a repair, unless a write-down of it is pending); -1 the floor is gone or
  raised by another overwrite, or L3 holds another version: the object is dropped from L1 and its
  copy from L2 (counted in ``keep_dropped``);
* the *lease*: while it holds any, the server serves L1 and L2 (and its fast readers) only while
  its last complete round was *sent* less than ``lease_s`` (half the TTL) ago
  (:meth:`Coherence.vouched`): every floor it kept lives longer than that, so a server paused or
  cut off past it serves nothing until a poll and a round complete;
* a load of a marked object from L2 or L3 runs KEEP before the object becomes readable
  (:meth:`Holdings.keep_load`): -1 is a miss (and the L2 copy goes), 1 and 0 make it held;
* a marked version's write-down to L3 lands only while its own floor is live (WRITE_SCRIPT), so
  once its holders must drop it, it can never be written again; a plain write-down over the
  version of the overwrite whose floor is live is refused too, and a server whose write-down L3
  refuses as stale drops its copy (:meth:`Holdings.refused`, from L1 and L2); a plain store whose
  L3 heads found no value waits while the floor is live (storage.redis ``floored``, R-KEEP 1);
* *one version per chunk* (F-SHARD2): an overwrite of a model stored in several shards covers
  every shard in one request (one E2; server.storing refuses one rank's), so a held shard of it
  is served only while every shard of its chunk is that overwrite's in L3. A round (and a load's
  KEEP) checks the sibling shards of each held one too (SHARD_SCRIPT: floor E2 with that version
  or no value yet, or no floor and that version); any shard that is not (evicted, a plain store's
  bytes, another overwrite's) makes every held shard of that chunk and E2 -1. A holder that drops
  a shard drops every shard it holds of that commit (``L1Object.unit``), and its next round
  UNKEEPs that E2 on every shard of the chunk (UNKEEP_SCRIPT: E2's version goes from L3, a floor
  at E2 is poisoned), so nobody repairs or loads it again: what a plain store wrote in an evicted
  shard meets the overwrite's other shards for at most one round of their holders;
* KEEP never shortens a floor (holders may run with other TTLs), and an overwrite's floor lives
  at least FLOOR_MIN_MS (a write issued before it lands within the issue limit).

Left: an L3 that evicts a floor refreshed less than ``refresh_s`` ago (allkeys-lru may: a floor is
a small key read only by these rounds) together with the value lets a plain store elsewhere land
while the holders serve on until their next round: a window of at most ``refresh_s``; one that
evicts an overwrite's floor and its value within the issue limit lets a plain write-down issued
before the overwrite land after it (its holders then drop it: docs/scale-out.md).

Event loop only, except :meth:`RedisTier.keep <kvdock.storage.redis.RedisTier.keep>` (a worker
thread)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from kvdock.keys import ObjectKey
from kvdock.layout import KVGeometry
from kvdock.storage import objfile
from kvdock.storage.coherence import Coherence
from kvdock.storage.deletions import Deletions
from kvdock.storage.lane import TierLane
from kvdock.storage.memory import L1Object, L1Store
from kvdock.storage.stream import pos_int, pos_text
from kvdock.storage.tier import Head

__all__ = ["Holdings"]

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Held:
    obj: L1Object
    e2: str  # its overwrite's E2 ("ms-seq")
    mark: bytes  # how its header ends (objfile.mark)


class Holdings:
    """The overwrites' versions this server holds in L1 (see the module docstring). ``repair(obj)``
    queues a write-down of ``obj`` to L3 (the manager's)."""

    def __init__(
        self,
        l1: L1Store,
        lanes: list[TierLane],
        deletions: Deletions,
        coherence: Coherence,
        geometry_of: Callable[[str], KVGeometry | None],
        chunk_size: int,
        repair: Callable[[L1Object], None],
    ) -> None:
        self.l1, self.deletions, self.coherence = l1, deletions, coherence
        self.l3 = next(lane for lane in lanes if not lane.tier.indexed)
        self.local = [lane for lane in lanes if lane.tier.indexed]
        self.geometry_of, self.chunk_size, self.repair = geometry_of, chunk_size, repair
        self._held: dict[ObjectKey, _Held] = {}
        self._unkeep: dict[ObjectKey, str] = {}  # shards whose E2 version goes from L3 next round
        self.l3.refused = self.refused  # (a version L3 refuses is not served here either)

    @classmethod
    def make(
        cls,
        l1: L1Store,
        lanes: list[TierLane],
        deletions: Deletions,
        coherence: Coherence | None,
        geometry_of: Callable[[str], KVGeometry | None],
        chunk_size: int,
        write_down: Callable[[list[L1Object], list[TierLane]], None],
    ) -> Holdings | None:
        """The holdings of a server with the fleet's coherence (None without): repairs go through
        ``write_down(objs, lanes)`` to the L3 lane only."""
        l3 = [lane for lane in lanes if not lane.tier.indexed]
        if coherence is None or not l3:
            return None
        return cls(l1, lanes, deletions, coherence, geometry_of, chunk_size, lambda obj: write_down([obj], l3))

    def __len__(self) -> int:
        return len(self._held)

    def _mark(self, obj: L1Object) -> _Held | None:
        geo = self.geometry_of(obj.key.model) if obj.overwrite else None
        if geo is None:
            return None
        e2 = pos_text(obj.overwrite)
        return _Held(obj, e2, objfile.mark(obj.version, obj.parent, geo.digest(self.chunk_size), e2))

    def add(self, objs: list[L1Object], sent: float | None = None) -> None:
        """[loop] ``objs`` became READY; those that are an overwrite's version are held, their
        floor known live at ``sent`` (a load's KEEP; by default, for an overwrite's commit, when
        its second step raised the floor: its E2's age on L3's clock as this server estimates it,
        never less)."""
        coh = self.coherence
        for obj in objs:
            held = self._mark(obj)
            if held is not None:
                self._held[obj.key] = held
                if sent is None:
                    l3_now = coh.l3_now_ms()
                    age_ms = max(l3_now - (obj.overwrite >> 64), 0.0) if l3_now is not None else coh.floor_ttl_ms
                    coh.hold(coh.clock() - age_ms / 1000, len(self._held))
                else:
                    coh.hold(sent, len(self._held))

    def _live(self) -> list[_Held]:
        """The held objects still READY in L1 (the others are forgotten)."""
        gone = [k for k, h in self._held.items() if not h.obj.live or self.l1.get(k) is not h.obj]
        for key in gone:
            del self._held[key]
        return list(self._held.values())

    async def round(self, run: Callable[..., Awaitable[Any]]) -> None:
        """One round: KEEP for every held key (``run(fn, *args)`` runs ``fn`` off the loop; it
        raises while L3 cannot be reached: then the lease is not renewed), its answers applied,
        then the lease renewed from the instant it was sent."""
        items = self._live()
        sent = self.coherence.clock()
        if items:
            mine = [(h.obj.key, h.e2, h.mark) for h in items]
            results: list[int] = await run(self._keep, mine, self._siblings(mine))
            for held, result in zip(items, results, strict=True):
                self._apply(held.obj, result)
        if self._unkeep:
            unkeep, self._unkeep = self._unkeep, {}
            try:
                await run(self.l3.tier.unkeep, list(unkeep.items()))
            except BaseException:
                self._unkeep = unkeep | self._unkeep  # (again next round)
                raise
        self.coherence.kept(sent, len(self._live()))

    def _siblings(self, items: list[tuple[ObjectKey, str, bytes]]) -> list[tuple[ObjectKey, str]]:
        """[any] The other shards of the chunks of ``items`` (a model stored in several shards),
        each with its item's E2, those that are items themselves left out."""
        mine = {(key, e2) for key, e2, _ in items}
        out: dict[tuple[ObjectKey, str], None] = {}
        for key, e2, _ in items:
            geo = self.geometry_of(key.model)
            for rank in range(geo.shards if geo is not None else 1):
                sib = (ObjectKey(key.model, rank, key.salt, key.chunk), e2)
                if sib not in mine:
                    out[sib] = None
        return list(out)

    def _keep(self, items: list[tuple[ObjectKey, str, bytes]], siblings: list[tuple[ObjectKey, str]]) -> list[int]:
        """[worker] KEEP for ``items``, then whether their ``siblings`` are still their overwrite's
        (SHARD_SCRIPT): an item whose chunk has any shard that is not (evicted, a plain version:
        F-SHARD2), or one that KEEP drops, is -1, with every item of its chunk and E2."""
        results = self.l3.tier.keep(items)
        bad = {(k.model, k.salt, k.chunk, e2) for (k, e2, _), r in zip(items, results, strict=True) if r < 0}
        if siblings:
            for (k, e2), r in zip(siblings, self.l3.tier.shards_kept(siblings), strict=True):
                if r < 0:
                    bad.add((k.model, k.salt, k.chunk, e2))
        return [
            -1 if (k.model, k.salt, k.chunk, e2) in bad else r for (k, e2, _), r in zip(items, results, strict=True)
        ]

    def _apply(self, obj: L1Object, result: int) -> None:
        """[loop] One KEEP answer for ``obj`` (still held unless the loop dropped it meanwhile)."""
        if self.l1.get(obj.key) is not obj:
            return
        if result < 0:
            self.drop(obj)
        elif result == 0 and not obj.dirty:  # (a pending write-down will land: no repair)
            self.coherence.counters.keep_repaired += 1
            log.info("coherence: L3 lost %s, an overwrite's version held here: written again", obj.key.chunk.hex()[:16])
            self.repair(obj)

    def drop(self, obj: L1Object) -> None:
        """[loop] Drop ``obj`` from L1 and its version from L2 (a miss from now on), and with it
        the other shards of its chunk held here (``L1Object.unit``, one request's commit): a
        shard dropped alone could be stored again with other bytes beside the ones kept (R-KEEP 5)."""
        unit = [obj]
        if obj.unit:
            unit += [h.obj for h in self._held.values() if h.obj.unit == obj.unit and h.obj is not obj]
        for one in unit:
            if one is not obj and self.l1.get(one.key) is not one:
                continue
            self.l1.remove(one.key)
            self._held.pop(one.key, None)
            self.coherence.counters.keep_dropped += 1
            key = one.key.chunk.hex()[:16]
            log.info("coherence: an overwrite's version of %s is no longer kept in L3: dropped", key)
            self._drop_local(one.key, one.version)
            self._unkeep_chunk(one)

    def _unkeep_chunk(self, obj: L1Object) -> None:
        """[loop] Queue, for the next round, the UNKEEP (storage._coherence_lua) of every shard of
        ``obj``'s chunk for ``obj``'s overwrite (nothing for a plain version or a model in one
        shard): that overwrite's version goes from L3 and its floors are poisoned, so that no
        holder (a loader holds its shard alone) keeps, repairs or loads one shard of it beside
        another version's sibling (F-SHARD2)."""
        geo = self.geometry_of(obj.key.model)
        if not obj.overwrite or geo is None or geo.shards < 2:
            return
        e2, k = pos_text(obj.overwrite), obj.key
        for rank in range(geo.shards):
            self._unkeep.setdefault(ObjectKey(k.model, rank, k.salt, k.chunk), e2)

    def refused(self, obj: L1Object) -> None:
        """[loop] L3 refused ``obj``'s write-down (stale, past a floor, or over the version of
        the overwrite that set it: storage.lane): still READY here, it goes from L1 and L2 too."""
        if self.l1.get(obj.key) is obj:
            self.drop(obj)

    def _drop_local(self, key: ObjectKey, version: int) -> None:
        lanes = [lane for lane in self.local if (h := lane.tier.knows(key)) is not None and h.version == version]
        if lanes:
            self.deletions.queue([key], lanes)

    async def keep_load(self, slot: L1Object, head: Head, lane: TierLane) -> tuple[float, int] | None:
        """[loop] A load read ``head`` (an overwrite's version: ``head.overwrite`` set) into
        ``slot`` from ``lane``: KEEP before it becomes readable. None: a miss (L3 unreachable, or
        the version is not kept: its copy in L2, if it came from there, goes). Else ``slot`` is
        marked, and the caller passes the answer to :meth:`loaded` once it is committed."""
        geo = self.geometry_of(slot.key.model)
        try:
            overwrite = pos_int(head.overwrite)
        except ValueError:
            return None
        if geo is None:
            return None
        mark = objfile.mark(head.version, head.parent, geo.digest(self.chunk_size), head.overwrite)
        sent = self.coherence.clock()
        none: list[int] = []
        item = [(slot.key, head.overwrite, mark)]
        got = await self.l3.on_reader(self._keep, item, self._siblings(item), default=none)
        if not got or got[0] < 0:
            if got:
                self.coherence.counters.keep_dropped += 1
                if lane.tier.indexed:
                    self._drop_local(slot.key, head.version)
                k = slot.key
                if (shards := geo.shards) > 1:
                    for rank in range(shards):
                        self._unkeep.setdefault(ObjectKey(k.model, rank, k.salt, k.chunk), head.overwrite)
            return None
        # its bytes are that overwrite's version (KEEP vouched for them): its own entries, applied
        # after the load started, must not drop it (an overwrite's commit takes its E2 as epoch too)
        slot.overwrite, slot.epoch = overwrite, max(slot.epoch, overwrite)
        return sent, got[0]

    def loaded(self, obj: L1Object, kept: tuple[float, int]) -> None:
        """[loop] A load that :meth:`keep_load` let through is READY: held (and written to L3
        again if L3 had lost it)."""
        sent, result = kept
        self.add([obj], sent)
        self._apply(obj, result)

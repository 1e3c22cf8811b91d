"""Chains: how far a key list is cached as one version chain, in L1 and in the lower tiers.

Read-only queries of the storage manager's state (it owns every piece of it; event loop only).
A chunk counts only if it names the version of the chunk before it (its *parent*), so a run
never mixes two versions of a prefix; a key whose older version is being deleted counts only if
L1 has the new one; while the server does not vouch for L1 and L2 (storage.coherence), only the
shared tier (L3) counts."""

from __future__ import annotations

from collections.abc import Callable

from kvdock.keys import ObjectKey
from kvdock.storage.deletions import Deletions
from kvdock.storage.lane import TierLane
from kvdock.storage.memory import L1Object, L1Store
from kvdock.storage.plans import Chain, Placement, StoreRun, is_edited
from kvdock.storage.tier import Head

__all__ = ["Chains"]


class Chains:
    """``lanes``: every lower tier; ``readable()`` those reads may use now; ``vouched()`` whether
    L1 and L2 may be read."""

    def __init__(
        self,
        l1: L1Store,
        lanes: list[TierLane],
        deletions: Deletions,
        readable: Callable[[], list[TierLane]],
        vouched: Callable[[], bool],
    ) -> None:
        self.l1, self.lanes, self.deletions = l1, lanes, deletions
        self.readable, self.vouched = readable, vouched

    def l1_run(self, keys: list[ObjectKey]) -> list[L1Object]:
        """The leading READY L1 objects of ``keys`` that form one chain (none while not vouched)."""
        run: list[L1Object] = []
        if not self.vouched():
            return run
        parent = 0
        for key in keys:
            obj = self.l1.get(key)
            if obj is None or obj.parent != parent:
                break
            run.append(obj)
            parent = obj.version
        return run

    async def chain(self, keys: list[ObjectKey], start: Chain) -> Chain:
        """How many leading ``keys`` are cached in any tier as one chain, and the version of the
        run's last chunk, given that the first ``start.count`` were in L1 when ``start`` was
        taken (they may be gone by now: it counts on from ``start.parent``, never re-reading
        them). A tier without an index is asked once, for the keys from the first that no
        indexed tier continues."""
        vouched = self.vouched()
        if not vouched:
            start = Chain(0, 0)
        n, parent = start.count, start.parent
        remote: list[Head] | None = None  # heads from the tiers without an index, fetched once
        remote_at = n
        lanes = self.readable()
        while n < len(keys):
            key = keys[n]
            obj = self.l1.get(key) if vouched else None
            heads = [Head(obj.version, obj.parent)] if obj is not None else []
            if key not in self.deletions:  # (L2 not while a deletion of the key from it is in flight)
                local = [lane for lane in lanes if lane.tier.indexed and not self.deletions.blocks(key, lane)]
                heads += [h for lane in local if (h := lane.tier.knows(key)) is not None]
                if not any(h.parent == parent for h in heads):
                    if remote is None:
                        remote, remote_at = await self.remote_heads(lanes, keys[n:]), n
                    if n - remote_at < len(remote):
                        heads.append(remote[n - remote_at])
            match = next((h for h in heads if h.parent == parent), None)
            if match is None:
                break
            parent = match.version
            n += 1
        return Chain(n, parent)

    async def locate(self, keys: list[ObjectKey]) -> tuple[list[list[Placement]], list[str]]:
        """For each key, the objects stored under it in L1 (READY only) and in each reachable lower
        tier, L1 first; and the tiers that could not be asked (down). For inspection: versions are
        reported as found, whether or not they chain (or are being deleted). A tier without an
        index answers for the leading keys it holds (one round trip)."""
        found = [[Placement("l1", Head(o.version, o.parent))] if (o := self.l1.get(k)) else [] for k in keys]
        down = []
        for lane in self.lanes:
            if not lane.tier.up():
                down.append(lane.name)
                continue
            if lane.tier.indexed:
                heads: list[Head | None] = [lane.tier.knows(k) for k in keys]
            else:
                remote: list[Head] = await lane.on_reader(lane.tier.heads, keys, default=[])
                heads = list(remote)
            for row, head in zip(found, heads, strict=False):
                if head is not None:
                    row.append(Placement(lane.name, head))
        return found, down

    async def remote_heads(self, lanes: list[TierLane], keys: list[ObjectKey]) -> list[Head]:
        """The heads of the leading ``keys`` held by the first of ``lanes`` without an index that
        holds any (one round trip each)."""
        for lane in lanes:
            if not lane.tier.indexed:
                found: list[Head] = await lane.on_reader(lane.tier.heads, keys, default=[])
                if found:
                    return found
        return []

    async def pending_overwrites(self, keys: list[ObjectKey], shards: int = 1) -> set[ObjectKey]:
        """Those of ``keys`` that a shared tier says an overwrite is writing (a live floor, no
        value yet: storage.redis ``floored``), for the manager's ``prepare_store(pending=)``: a plain
        store of them here would keep other bytes than that overwrite once it lands (R-FLEET; one
        round trip). Of a model stored in ``shards`` shards, a key is pending while the floor of
        any shard of its chunk is live: an overwrite's other shards are held (their floors kept)
        or on their way, and this shard beside them would make a chunk of two versions (F-SHARD2)."""
        chunk = {
            k: [ObjectKey(k.model, r, k.salt, k.chunk) for r in range(shards)] if shards > 1 else [k] for k in keys
        }
        probe = list(dict.fromkeys(s for sibs in chunk.values() for s in sibs))
        live: set[ObjectKey] = set()
        for lane in self.lanes:
            if not lane.tier.indexed and lane.tier.up():
                live |= await lane.on_reader(lane.tier.floored, probe, default=set())
        return {k for k, sibs in chunk.items() if any(s in live for s in sibs)}

    def store_run(self, keys: list[ObjectKey], below: dict[ObjectKey, Head] | None) -> StoreRun:
        """The leading run of ``keys`` a plain store dedups now (the same checks as the manager's
        ``prepare_store``, in the same step: L1's READY object or a lower tier's head that chains;
        a key being written stops it), with its tip and its versions from its last EDITED one on."""
        parent, n = 0, 0
        since_edit: list[int] = []
        indexed = self.indexed()
        for key in keys:
            if self.l1.reservation(key) is not None:
                break
            present = self.l1.get(key)
            head = Head(present.version, present.parent) if present is not None else None
            if head is None or head.parent != parent:
                head = None if key in self.deletions else self.lower_head(key, parent, below, indexed)
            if head is None:
                break
            parent, n = head.version, n + 1
            if is_edited(parent):
                since_edit.clear()
            if since_edit or is_edited(parent):
                since_edit.append(parent)
        return StoreRun(n, parent, tuple(since_edit))

    def indexed(self) -> list[TierLane]:
        """The tiers with an index that reads may use now (L2): what :meth:`lower_head` asks. A
        caller asking for many keys in one step of the event loop takes it once."""
        return [lane for lane in self.readable() if lane.tier.indexed]

    def lower_head(
        self,
        key: ObjectKey,
        parent: int,
        below: dict[ObjectKey, Head] | None,
        indexed: list[TierLane] | None = None,
    ) -> Head | None:
        """The head of ``key`` in a lower tier if it continues ``parent``'s chain: from an indexed
        tier's index (L2: ``indexed``, default :meth:`indexed`), or from ``below`` (heads already
        read from the others)."""
        for lane in self.indexed() if indexed is None else indexed:
            if not self.deletions.blocks(key, lane):
                head = lane.tier.knows(key)
                if head is not None and head.parent == parent:
                    return head
        found = below.get(key) if below else None
        return found if found is not None and found.parent == parent else None

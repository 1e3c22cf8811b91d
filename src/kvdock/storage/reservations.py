"""Which chunks of a store get a slot (storage.manager's prepare_store, chunk by chunk).

A function of the storage manager's state (event loop only): walk the store's keys in order,
dedup each against L1 and the lower tiers as long as it continues the version chain, stop
counting at another client's write in flight, reserve a slot for the rest until the pool is full
or the edited-prefix rule (storage.plans.write_limit) says stop, and stamp each reservation with
its version and epoch. The manager opens the session and queues the overwrite's deletions."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvdock.keys import ObjectKey
from kvdock.storage.chains import Chains
from kvdock.storage.deletions import Deletions
from kvdock.storage.loads import Loads
from kvdock.storage.memory import L1Object, L1Store
from kvdock.storage.plans import OVERWRITING, StorePlan, new_version, random_bits
from kvdock.storage.tier import Head

__all__ = ["Reserved", "reserve"]


@dataclass
class Reserved:
    """What :func:`reserve` did: the plan to answer with, the deduped L1 objects it pinned (held
    until the commit, so that making room never evicts the prefix the store extends), and the
    keys an overwrite replaces (their older versions go from every tier)."""

    plan: StorePlan
    kept: list[L1Object] = field(default_factory=list)
    replaced: list[ObjectKey] = field(default_factory=list)


def reserve(
    l1: L1Store,
    loads: Loads,
    deletions: Deletions,
    chains: Chains,
    epoch: int,
    keys: list[ObjectKey],
    nbytes: int,
    overwrite: bool,
    below: dict[ObjectKey, Head] | None,
    limit: int | None,
    edited: bool,
    recent: Callable[[ObjectKey], bool] | None = None,
) -> Reserved:
    """Reserve slots for the chunks of ``keys`` that need writing (see
    :meth:`StorageManager.prepare_store <kvdock.storage.manager.StorageManager.prepare_store>`
    for the arguments). ``epoch``: the position of the fleet's invalidations applied now (a plain
    store's reservations are superseded by a later entry; an overwrite's get theirs at the commit).
    ``recent(key)``: whether another server overwrote ``key`` lately (Coherence.recently_overwritten):
    a plain store does not write it (in flight), as that overwrite may not be in L3 yet."""
    out = Reserved(StorePlan([], 0, 0, 0))
    slots: list[tuple[int, L1Object]] = []
    deduped = in_flight = pool_full = diverged = 0
    parent = 0  # the version chain: each chunk names the version of the one before it
    indexed = chains.indexed()  # (the lower tiers' indexes, taken once for the request's keys)
    lowers = bool(indexed or below) and not overwrite  # whether a lower tier could hold a key
    bits: list[int] = []  # the new versions' random bits, drawn at the first reservation for all
    reservation, present_of, reserve_slot = l1.reservation, l1.get, l1.reserve
    for i, key in enumerate(keys):
        pending = reservation(key)
        if pending is not None and pending in loads and overwrite:
            l1.detach(pending)  # the load's bytes are the older version: thrown away
        elif pending is not None or in_flight:
            # another store, or a load that may still fail: not known stored; and the chunks
            # after it cannot name their predecessor's version
            in_flight += 1
            continue
        present = present_of(key)
        if not overwrite and present is not None and present.parent == parent:
            deduped += 1
            parent = present.version
            if not pool_full:
                l1.pin(present)
                out.kept.append(present)
            continue
        lower = chains.lower_head(key, parent, below, indexed) if lowers and key not in deletions else None
        if lower is not None:  # a lower tier holds this very version: stored already
            deduped += 1
            parent = lower.version
            continue
        if not overwrite and recent is not None and recent(key):
            in_flight += 1  # (and the chunks after it: they could not name its version)
            continue
        if limit is not None and i >= limit:
            diverged = len(keys) - i
            break
        obj = None if pool_full else reserve_slot(key, nbytes)
        if overwrite:
            out.replaced.append(key)
        if obj is None:
            pool_full += 1
            if overwrite:
                l1.remove(key)  # it will not be rewritten: its old version must not stay
        else:
            bits = bits or random_bits(len(keys) - i)
            obj.version, obj.parent = new_version(overwrite or edited, parent, bits.pop()), parent
            # what it was decided against: apply supersedes a plain store's reservation older than
            # an invalidation; an overwrite's is the new version (its epoch is set at the commit)
            obj.epoch = OVERWRITING if overwrite else epoch
            parent = obj.version
            slots.append((i, obj))
    out.plan = StorePlan(slots, deduped, in_flight, pool_full, diverged)
    return out

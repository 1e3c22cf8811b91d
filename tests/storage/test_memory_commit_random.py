"""Review R-BULK: L1Store.commit of many objects against one commit each, over random histories:
two regions (a tenant's quota and the rest, each with a small directory of its own), two slot
sizes (two buckets per region), chains with overwrites, orphans, stale parents, pins, holds,
dirty objects, removals, and batches that mix new keys with replacements in any order. After each
step both twins must agree on everything a commit may change (eviction order, policy state,
directory bytes, unindexed counts, generations, watcher calls), and pass check_integrity."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest
from test_memory_commit import Log, _policy_state

from kvdock.keys import ObjectKey
from kvdock.shm.directory import Directory
from kvdock.shm.segment import PoolSegment
from kvdock.shm.slots import ALIGN, Partitions, SlotAllocator
from kvdock.storage.memory import L1Store
from kvdock.storage.shares import Shares

SLOTS = 12  # pages per region


def K(i: int, salt: str) -> ObjectKey:
    return ObjectKey("m", 0, salt, i.to_bytes(2, "little") * 16)


class RTwin:
    def __init__(self, policy: str) -> None:
        self.segs = {r: PoolSegment.create(SLOTS * ALIGN, 8) for r in (None, "t")}
        self.dirs = {r: Directory(s, complete=False) for r, s in self.segs.items()}
        parts = Partitions(
            {
                r: SlotAllocator(s.data_offset + (0 if r is None else 1 << 30), SLOTS * ALIGN, s.generations())
                for r, s in self.segs.items()
            }
        )
        self.base = {r: s.data_offset + (0 if r is None else 1 << 30) for r, s in self.segs.items()}
        shares = Shares(lambda salt: "t" if salt == "t" else None, {"t": SLOTS * ALIGN})
        self.log = Log()
        self.store = L1Store(parts, self.log, directories=dict(self.dirs), shares=shares, policy=policy)

    def state(self) -> dict[str, Any]:
        s = self.store
        objs = sorted(
            [*s._ready.values(), *s._retired, *s._reserved.values(), *s._detached],
            key=lambda o: (o.key.salt, o.key.chunk, o.version),
        )
        return {
            "lru": [(k.salt, k.chunk) for k in s.lru_keys()],
            "policies": [(k, _policy_state(b.policy)) for k, b in sorted(s._evictable._buckets.items(), key=repr)],
            "objects": [
                (
                    o.key.salt,
                    o.key.chunk,
                    o.version,
                    o.state,
                    o.seq,
                    o.entry,
                    o.depth,
                    o.live,
                    o.pins,
                    o.holds,
                    o.dirty,
                    o.offset - self.base[o.region],
                )
                for o in objs
            ],
            "seq": s._seq,
            "dirs": {r: (bytes(d._bytes) if d._bytes is not None else b"", d.unindexed) for r, d in self.dirs.items()},
            "gens": [[int(g) for g in seg.generations()] for seg in self.segs.values()],
            "watcher": list(self.log.calls),
            "evictions": s.evictions,
        }

    def close(self) -> None:
        for d in self.dirs.values():
            d.close()
        for s in self.segs.values():
            s.close()
            s.unlink()


@pytest.fixture(params=["lru", "prefix-lru", "s3fifo"])
def policy(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _step(rng: random.Random, twins: tuple[RTwin, RTwin], versions: Iterator[int]) -> None:
    """One random step, the same on both twins (the bulk twin commits a batch in one call)."""
    bulk, each = twins
    op = rng.random()
    salt = rng.choice(["", "t"])
    if op < 0.6:  # a batch: a chain of keys, some present (replaced), some new
        n = rng.randint(1, 6)
        start = rng.randint(0, 14)
        keys = [K(start + j, salt) for j in range(n)]
        if rng.random() < 0.3:
            rng.shuffle(keys)
        parent = rng.choice([0, 0, 7, bulk_version(bulk, keys[0]), some_version(bulk, rng)])
        sizes = rng.choice([[1000], [5000], [1000, 5000]])
        plan = []
        for key in keys:
            v = next(versions)
            plan.append((key, rng.choice(sizes), v, parent))
            parent = v if rng.random() < 0.85 else rng.choice([0, 3, some_version(bulk, rng)])
        batches = []
        for twin in twins:
            objs = []
            for key, nb, v, p in plan:
                if twin.store.is_reserved(key):
                    objs.append(None)
                    continue
                obj = twin.store.reserve(key, nb)
                if obj is not None:
                    obj.version, obj.parent = v, p
                objs.append(obj)
            batches.append(objs)
        assert [o is None for o in batches[0]] == [o is None for o in batches[1]]
        drop = {i for i in range(len(plan)) if rng.random() < 0.1}  # aborted reservations
        for twin, objs in zip(twins, batches, strict=True):
            for i in sorted(drop):
                if objs[i] is not None:
                    twin.store.abort(objs[i])
        live = [[o for i, o in enumerate(objs) if o is not None and i not in drop] for objs in batches]
        bad = rng.randint(0, len(live[0])) if live[0] and rng.random() < 0.15 else None
        if bad is not None:  # a READY object (committed already) at position ``bad``: the commit fails there
            for twin, objs in zip(twins, live, strict=True):
                ready = sorted(twin.store._ready.values(), key=lambda o: o.seq)
                if not ready:
                    bad = None
                    break
                objs.insert(bad, ready[len(ready) // 2])
        if bad is None:
            bulk.store.commit(*live[0])
            for obj in live[1]:
                each.store.commit(obj)
            return
        with pytest.raises(AssertionError):
            bulk.store.commit(*live[0])
        with pytest.raises(AssertionError):
            for obj in live[1]:
                each.store.commit(obj)
        for twin, objs in zip(twins, live, strict=True):  # the ones after it are still reservations
            for obj in objs[bad + 1 :]:
                assert twin.store.reservation(obj.key) is obj
                twin.store.abort(obj)
    elif op < 0.7:  # pin / unpin / hold / release
        key = K(rng.randint(0, 20), salt)
        kind = rng.choice(["pin", "unpin", "hold", "release"])
        for twin in twins:
            obj = twin.store.get(key)
            pinned = [o for o in twin.store.pinned_objects() if o.key == key and o.pins]
            if kind == "pin" and obj is not None:
                twin.store.pin(obj)
            elif kind == "unpin" and pinned:
                twin.store.unpin(pinned[0])
            elif kind == "hold" and obj is not None:
                twin.store.hold(obj)
            elif kind == "release":
                held = [o for o in (*twin.store._ready.values(), *twin.store._retired) if o.key == key and o.holds]
                if held:
                    twin.store.release(held[0])
    elif op < 0.8:  # dirty / clean
        key = K(rng.randint(0, 20), salt)
        mark = rng.random() < 0.5
        for twin in twins:
            obj = twin.store.get(key)
            if obj is None:
                continue
            if mark:
                twin.store.mark_dirty(obj)
            elif obj.dirty:
                twin.store.mark_clean(obj)
    elif op < 0.9:
        key = K(rng.randint(0, 20), salt)
        for twin in twins:
            twin.store.remove(key)
    else:  # a read through the directory (touch) of some published object
        key = K(rng.randint(0, 20), salt)
        for twin in twins:
            obj = twin.store.get(key)
            if obj is not None and obj.entry >= 0:
                twin.store.touch(obj.entry, obj.offset, twin.store.allocator.generation(obj.offset), obj.region)


def bulk_version(t: RTwin, key: ObjectKey) -> int:
    obj = t.store.get(key)
    return obj.parent if obj is not None else 0


def some_version(t: RTwin, rng: random.Random) -> int:
    """The version of a READY object (a chain that continues it), 0 if none."""
    ready = sorted(t.store._ready.values(), key=lambda o: o.seq)
    return rng.choice(ready).version if ready else 0


@pytest.mark.parametrize("seed", range(40))
def test_random_histories_commit_in_bulk_as_one_by_one(policy: str, seed: int) -> None:
    rng = random.Random(seed)
    twins = (RTwin(policy), RTwin(policy))
    try:
        versions = iter(range(1000, 10**9))
        for step in range(250):
            _step(rng, twins, versions)
            for twin in twins:
                twin.store.check_integrity()
            a, b = twins[0].state(), twins[1].state()
            if a != b:
                diff = {k: (a[k], b[k]) for k in a if a[k] != b[k]}
                raise AssertionError(f"step {step}: twins differ in {sorted(diff)}: {str(diff)[:3000]}")
    finally:
        for twin in twins:
            twin.close()

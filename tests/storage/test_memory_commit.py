"""kvdock.storage.memory: L1Store.commit of many objects (a store's chunks in one call) leaves
exactly the state one commit each, in the same order, leaves: the eviction order and each policy's
own state (S3-FIFO's queues, frequencies, ghost), the prompts' index (orphans demoted), the seq
numbers, the pool directory's bytes and unindexed count, the watcher's calls, and the evictions
that follow. Two twin stores over real segments, one committed in one call, the other one by one.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import pytest

from kvdock.keys import ObjectKey
from kvdock.shm.directory import Directory
from kvdock.shm.pool import FlatMemory
from kvdock.shm.segment import PoolSegment
from kvdock.shm.slots import ALIGN, SlotAllocator
from kvdock.storage.memory import L1Object, L1Store
from kvdock.storage.policy import Queue

SIZE = 1000  # one page a slot
SLOTS = 24


def K(i: int) -> ObjectKey:
    return ObjectKey("m", 0, "", i.to_bytes(2, "little") * 16)


class Log:
    """A watcher that records its calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, bytes, bool]] = []

    def stored(self, obj: L1Object) -> None:
        self.calls.append(("stored", obj.key.chunk, False))

    def removed(self, obj: L1Object, evicted: bool) -> None:
        self.calls.append(("removed", obj.key.chunk, evicted))

    def cleared(self) -> None:
        self.calls.append(("cleared", b"", False))


class Twin:
    """An L1Store of SLOTS one-page slots over its own segment, with a 16-entry directory (two
    buckets of 8: some objects go unindexed) and a recording watcher."""

    def __init__(self, policy: str) -> None:
        self.seg = PoolSegment.create(SLOTS * ALIGN, 16)
        self.directory = Directory(self.seg, complete=False)
        alloc = SlotAllocator(self.seg.data_offset, SLOTS * ALIGN, self.seg.generations())
        self.log = Log()
        self.store = L1Store(
            alloc, self.log, FlatMemory(self.seg.buf), directories={None: self.directory}, policy=policy
        )

    def put(self, i: int, version: int, parent: int) -> L1Object:
        obj = self.reserve(i, version, parent)
        self.store.commit(obj)
        return obj

    def reserve(self, i: int, version: int, parent: int) -> L1Object:
        obj = self.store.reserve(K(i), SIZE)
        assert obj is not None
        obj.version, obj.parent = version, parent
        return obj

    def state(self) -> dict[str, Any]:
        """Everything a commit may change, as plain values."""
        s = self.store
        d = self.directory
        objs = sorted(
            [*s._ready.values(), *s._retired, *s._reserved.values()], key=lambda o: (o.key.chunk, o.version)
        )
        return {
            "lru": [k.chunk for k in s.lru_keys()],
            "policies": [_policy_state(b.policy) for b in s._evictable._buckets.values()],
            "objects": [(o.key.chunk, o.version, o.state, o.seq, o.entry, o.depth, o.live, o.pins) for o in objs],
            "seq": s._seq,
            "directory": bytes(d._bytes) if d._bytes is not None else b"",
            "unindexed": d.unindexed,
            "generations": s.allocator.generations([o.offset for o in objs]),
            "watcher": list(self.log.calls),
            "used": s.allocator.used_bytes,
        }

    def close(self) -> None:
        self.directory.close()
        self.seg.close()
        self.seg.unlink()


def _policy_state(policy: object) -> dict[str, Any]:
    """A policy's own fields: queues as lists, dicts (ordered ones in order) as item lists."""
    out: dict[str, Any] = {}
    for name, value in vars(policy).items():
        if isinstance(value, Queue):
            out[name] = list(value)
        elif isinstance(value, OrderedDict):
            out[name] = list(value.items())
        elif isinstance(value, dict):
            out[name] = sorted(value.items(), key=repr)
        else:
            out[name] = value
    return out


@pytest.fixture(params=["lru", "prefix-lru", "s3fifo"])
def twins(request: pytest.FixtureRequest) -> Iterator[tuple[Twin, Twin]]:
    a, b = Twin(request.param), Twin(request.param)
    yield a, b
    a.close()
    b.close()


def _setup(t: Twin) -> list[L1Object]:
    """READY prompts, some evicted (S3-FIFO's ghost remembers them), one old version pinned; then
    the reservations of a store: overwrites (of a pinned and an unpinned object, whose successor
    is left an orphan), a new prompt's chunks, an orphan, a key that comes back from the ghost."""
    for i in range(SLOTS):  # prompt 0..23, then 6 more chunks: the first 6 evicted
        t.put(i, 100 + i, 100 + i - 1 if i else 0)
    for i in range(SLOTS, SLOTS + 6):
        t.put(i, 100 + i, 100 + i - 1)
    assert t.store.evictions == 6
    evicted = [int.from_bytes(c[:2], "little") for kind, c, _ in t.log.calls if kind == "removed"]
    pinned = t.store.get(K(10))
    assert pinned is not None
    t.store.pin(pinned)
    for i in (12, 13):  # (room for the store: unpinned ones evicted in policy order)
        gone = t.store.get(K(i))
        assert gone is not None
        t.store.remove(K(i))
    plan = [
        (10, 900, 109),  # overwrite of a pinned object (retired until unpinned), chained to 9
        (11, 901, 900),  # overwrite of an unpinned one
        (40, 902, 901),  # new chunks after it
        (41, 903, 902),
        (50, 910, 777),  # an orphan: its predecessor is in no tier of this store
        (51, 911, 910),
        (evicted[0], 920, 0),  # a key evicted before (S3-FIFO: from the ghost to main)
        (20, 930, 0),  # an overwrite whose old version's successors (21...) become orphans
    ]
    assert all(t.store.get(K(i)) is not None for i in (10, 11, 20)) and t.store.get(K(evicted[0])) is None
    return [t.reserve(i, v, p) for i, v, p in plan]


def test_a_commit_of_many_is_one_commit_each(twins: tuple[Twin, Twin]) -> None:
    bulk, each = twins
    objs_bulk, objs_each = _setup(bulk), _setup(each)
    assert bulk.state() == each.state()
    bulk.store.commit(*objs_bulk)
    for obj in objs_each:
        each.store.commit(obj)
    bulk.store.check_integrity()
    each.store.check_integrity()
    got, want = bulk.state(), each.state()
    assert got == want
    assert want["unindexed"] > 0  # (both buckets filled: the test covers unindexed objects too)
    assert any(e >= 0 for *_, e, _, _, _ in want["objects"])
    assert [c for c in want["watcher"][-len(objs_each) :]] == [("stored", o.key.chunk, False) for o in objs_each]
    # and what follows agrees: every unpinned object evicted, in the same order
    for twin in (bulk, each):
        old = twin.store.pinned_objects()
        for obj in old:
            twin.store.unpin(obj)
        for i in range(1000, 1000 + SLOTS):
            twin.put(i, 5000 + i, 0)
        twin.store.check_integrity()
    assert bulk.state() == each.state()
    assert bulk.store.evictions == each.store.evictions > 6 + SLOTS - 2


def test_a_failing_commit_of_many_stops_where_one_by_one_stops(twins: tuple[Twin, Twin]) -> None:
    """An object that is not a reservation (committed already) fails the commit there: the ones
    before it are committed, evictable, published and told, exactly as one by one; the ones
    after it stay reserved."""
    bulk, each = twins
    objs_bulk, objs_each = _setup(bulk), _setup(each)
    bulk.store.commit(objs_bulk[2])
    each.store.commit(objs_each[2])
    with pytest.raises(AssertionError):
        bulk.store.commit(*objs_bulk)
    with pytest.raises(AssertionError):
        for obj in objs_each:
            each.store.commit(obj)
    assert bulk.state() == each.state()
    assert [o.state.name for o in objs_bulk] == ["READY"] * 3 + ["RESERVED"] * 5
    for twin, objs in ((bulk, objs_bulk), (each, objs_each)):
        for obj in objs[3:]:
            twin.store.abort(obj)
        twin.store.check_integrity()
    assert bulk.state() == each.state()

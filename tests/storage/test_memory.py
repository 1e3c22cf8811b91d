"""kvdock.storage.memory: L1 object states, pins, LRU eviction, overwrite, abort, remove, clear."""

from __future__ import annotations

import pytest

from kvdock.keys import ObjectKey
from kvdock.shm.slots import ALIGN, SlotAllocator
from kvdock.storage.memory import L1Object, L1Store, State

P = ALIGN
SMALL = 1000  # one page per slot
BIG = P + 1  # two pages per slot


def K(i: int, salt: str = "") -> ObjectKey:
    return ObjectKey("m", 0, salt, bytes([i]) * 32)


class Harness:
    """An L1Store over ``slots`` one-page slots that records evictions."""

    def __init__(self, slots: int) -> None:
        self.evicted: list[ObjectKey] = []
        self.evicted_objs: list[L1Object] = []
        self.stored_keys: list[ObjectKey] = []
        self.deleted: list[ObjectKey] = []
        self.store = L1Store(SlotAllocator(base=P, capacity=slots * P), watcher=self)

    def stored(self, obj: L1Object) -> None:
        self.stored_keys.append(obj.key)

    def removed(self, obj: L1Object, evicted: bool) -> None:
        if evicted:
            self.evicted.append(obj.key)
            self.evicted_objs.append(obj)
        else:
            self.deleted.append(obj.key)

    def cleared(self) -> None:
        self.deleted.append(ObjectKey("*", 0, "", b""))

    def put(self, key: ObjectKey, nbytes: int = SMALL) -> L1Object:
        obj = self.store.reserve(key, nbytes)
        assert obj is not None, f"no room for {key}"
        self.check()
        self.store.commit(obj)
        self.check()
        return obj

    def check(self) -> None:
        self.store.check_integrity()

    @property
    def used(self) -> int:
        return self.store.allocator.used_bytes


@pytest.fixture
def h() -> Harness:
    return Harness(slots=3)


# ---------------------------------------------------------------- states


def test_reserve_is_invisible_until_commit(h: Harness) -> None:
    obj = h.store.reserve(K(1), SMALL)
    assert obj is not None
    h.check()
    assert obj.state is State.RESERVED and obj.pins == 0 and obj.live and obj.nbytes == SMALL
    assert obj.offset == P
    assert h.store.get(K(1)) is None
    assert h.store.is_reserved(K(1))
    assert h.store.reserved_count() == 1
    assert len(h.store) == 0
    assert h.store.lru_keys() == []
    assert h.used == P
    h.store.commit(obj)
    h.check()
    assert obj.state is State.READY
    assert h.store.get(K(1)) is obj
    assert not h.store.is_reserved(K(1))
    assert h.store.reserved_count() == 0
    assert len(h.store) == 1
    assert h.store.lru_keys() == [K(1)]


def test_reserving_a_key_twice_is_an_assertion(h: Harness) -> None:
    assert h.store.reserve(K(1), SMALL) is not None
    with pytest.raises(AssertionError, match="already reserved"):
        h.store.reserve(K(1), SMALL)
    h.check()


def test_misuse_is_an_assertion(h: Harness) -> None:
    obj = h.store.reserve(K(1), SMALL)
    assert obj is not None
    with pytest.raises(AssertionError):
        h.store.pin(obj)  # not READY
    h.store.commit(obj)
    with pytest.raises(AssertionError):
        h.store.commit(obj)  # twice
    with pytest.raises(AssertionError):
        h.store.abort(obj)  # not RESERVED
    with pytest.raises(AssertionError):
        h.store.unpin(obj)  # not pinned
    h.check()


def test_abort_frees_the_slot(h: Harness) -> None:
    obj = h.store.reserve(K(1), SMALL)
    assert obj is not None
    h.store.abort(obj)
    h.check()
    assert not obj.live
    assert not h.store.is_reserved(K(1)) and h.store.get(K(1)) is None
    assert h.used == 0
    again = h.store.reserve(K(1), SMALL)
    assert again is not None and again.offset == obj.offset


def test_abort_of_an_overwrite_keeps_the_old_version(h: Harness) -> None:
    old = h.put(K(1))
    new = h.store.reserve(K(1), SMALL)
    assert new is not None
    h.check()
    assert h.store.get(K(1)) is old and h.store.is_reserved(K(1))
    h.store.abort(new)
    h.check()
    assert h.store.get(K(1)) is old and old.live
    assert h.used == P


# ---------------------------------------------------------------- LRU order and eviction


def test_lru_order_and_touch_by_pin_unpin(h: Harness) -> None:
    a, b, c = h.put(K(1)), h.put(K(2)), h.put(K(3))
    assert h.store.lru_keys() == [K(1), K(2), K(3)]
    h.store.pin(a)
    h.check()
    assert h.store.lru_keys() == [K(2), K(3)]
    h.store.unpin(a)
    h.check()
    assert h.store.lru_keys() == [K(2), K(3), K(1)]
    h.store.pin(c)
    h.store.pin(c)
    h.store.unpin(c)
    h.check()
    assert c.pins == 1
    assert h.store.lru_keys() == [K(2), K(1)]
    h.store.unpin(c)
    h.check()
    assert h.store.lru_keys() == [K(2), K(1), K(3)]
    assert b.pins == 0


def test_exact_lru_eviction_order(h: Harness) -> None:
    a = h.put(K(1))
    h.put(K(2))
    h.put(K(3))
    h.store.pin(a)
    h.store.unpin(a)  # order now 2, 3, 1
    assert h.store.lru_keys() == [K(2), K(3), K(1)]
    d = h.store.reserve(K(9), SMALL)
    assert d is not None
    assert h.evicted == [K(2)]
    h.check()
    h.store.commit(d)
    h.check()
    assert h.store.lru_keys() == [K(3), K(1), K(9)]
    h.put(K(10))
    assert h.evicted == [K(2), K(3)]
    h.put(K(11))
    assert h.evicted == [K(2), K(3), K(1)]
    assert h.store.lru_keys() == [K(9), K(10), K(11)]
    assert h.store.evictions == 3
    assert all(not o.live for o in h.evicted_objs)
    assert h.store.get(K(1)) is None and h.store.get(K(2)) is None and h.store.get(K(3)) is None
    assert h.used == 3 * P


def test_eviction_reuses_the_evicted_slot(h: Harness) -> None:
    a = h.put(K(1))
    h.put(K(2))
    h.put(K(3))
    d = h.store.reserve(K(4), SMALL)
    assert d is not None and d.offset == a.offset
    assert h.evicted == [K(1)]
    h.check()


def test_no_eviction_while_there_is_room() -> None:
    h = Harness(slots=4)
    for i in range(4):
        h.put(K(i))
    assert h.evicted == [] and h.store.evictions == 0
    assert h.used == 4 * P


def test_pinned_objects_are_never_evicted(h: Harness) -> None:
    a, b = h.put(K(1)), h.put(K(2))
    h.put(K(3))
    h.store.pin(a)
    h.store.pin(b)
    h.check()
    h.put(K(4))
    assert h.evicted == [K(3)]
    h.store.pin(h.store.get(K(4)))  # type: ignore[arg-type]
    h.check()
    assert h.store.reserve(K(5), SMALL) is None  # "pool full"
    h.check()
    assert h.evicted == [K(3)]
    assert [h.store.get(K(i)) is not None for i in (1, 2, 4)] == [True, True, True]
    assert not h.store.is_reserved(K(5))
    assert h.store.lru_keys() == []
    assert h.used == 3 * P


def test_reservations_are_never_evicted(h: Harness) -> None:
    objs = [h.store.reserve(K(i), SMALL) for i in range(3)]
    assert all(o is not None for o in objs)
    assert h.store.reserve(K(3), SMALL) is None
    h.check()
    assert h.store.reserved_count() == 3 and h.evicted == []


def test_pool_full_then_unpin_makes_room(h: Harness) -> None:
    objs = [h.put(K(i)) for i in range(3)]
    for o in objs:
        h.store.pin(o)
    assert h.store.reserve(K(7), SMALL) is None
    h.store.unpin(objs[1])
    h.check()
    new = h.store.reserve(K(7), SMALL)
    assert new is not None and new.offset == objs[1].offset
    assert h.evicted == [K(1)]
    h.check()


def test_eviction_only_takes_slots_of_the_same_size() -> None:
    h = Harness(slots=5)
    h.put(K(1), SMALL)
    h.put(K(2), BIG)
    h.put(K(3), SMALL)
    h.put(K(4), SMALL)  # 5 pages carved, pool full
    big = h.store.reserve(K(5), BIG)
    assert big is not None
    assert h.evicted == [K(2)]  # K(1) is older but a different size
    h.check()
    # no BIG object left to evict: smaller unpinned ones are not merged to make room
    assert h.store.reserve(K(6), BIG) is None
    assert h.evicted == [K(2)]
    assert h.store.lru_keys() == [K(1), K(3), K(4)]
    h.check()


# ---------------------------------------------------------------- overwrite


def test_overwrite_unpinned_frees_old_slot_at_commit(h: Harness) -> None:
    old = h.put(K(1))
    h.put(K(2))
    new = h.store.reserve(K(1), SMALL)
    assert new is not None and new.offset != old.offset
    assert h.used == 3 * P
    h.store.commit(new)
    h.check()
    assert h.store.get(K(1)) is new
    assert not old.live
    assert h.used == 2 * P
    assert h.store.lru_keys() == [K(2), K(1)]
    assert h.store.pinned_objects() == []


def test_overwrite_while_pinned_frees_old_slot_at_last_unpin(h: Harness) -> None:
    old = h.put(K(1))
    h.store.pin(old)
    h.store.pin(old)
    new = h.store.reserve(K(1), SMALL)
    assert new is not None
    h.store.commit(new)
    h.check()
    assert h.store.get(K(1)) is new
    assert not old.live and old.pins == 2
    assert h.store.pinned_objects() == [old]
    assert h.store.lru_keys() == [K(1)]  # the new version
    assert h.used == 2 * P
    h.store.unpin(old)
    h.check()
    assert h.used == 2 * P  # one pin left
    h.store.unpin(old)
    h.check()
    assert h.used == P
    assert h.store.pinned_objects() == []
    assert h.store.lru_keys() == [K(1)] and h.store.get(K(1)) is new
    # the old slot is free again and reused
    nxt = h.store.reserve(K(2), SMALL)
    assert nxt is not None and nxt.offset == old.offset


def test_retired_object_is_not_evicted_nor_in_lru(h: Harness) -> None:
    old = h.put(K(1))
    h.store.pin(old)
    h.put(K(1))  # overwrite: old retired, still pinned
    h.put(K(2))
    # pool: retired old, K(1) new, K(2); reserving evicts K(1)-new (LRU), never the retired slot
    obj = h.store.reserve(K(3), SMALL)
    assert obj is not None and obj.offset != old.offset
    assert h.evicted == [K(1)]
    assert h.store.get(K(1)) is None
    h.check()
    h.store.unpin(old)
    h.check()
    assert h.used == 2 * P


def test_overwrite_may_evict_the_old_version_itself() -> None:
    h = Harness(slots=1)
    old = h.put(K(1))
    new = h.store.reserve(K(1), SMALL)
    assert new is not None and new.offset == old.offset
    assert h.evicted == [K(1)] and h.store.get(K(1)) is None
    h.check()
    h.store.commit(new)
    h.check()
    assert h.store.get(K(1)) is new


# ---------------------------------------------------------------- remove / clear


def test_remove(h: Harness) -> None:
    h.put(K(1))
    h.put(K(2))
    assert h.store.remove(K(1)) is True
    h.check()
    assert h.store.get(K(1)) is None
    assert h.store.lru_keys() == [K(2)]
    assert h.used == P
    assert h.store.remove(K(1)) is False
    assert h.store.remove(K(42)) is False
    h.check()
    assert h.evicted == []  # removal is not eviction
    assert h.store.evictions == 0


def test_remove_pinned_frees_at_unpin(h: Harness) -> None:
    a = h.put(K(1))
    h.store.pin(a)
    assert h.store.remove(K(1)) is True
    h.check()
    assert h.store.get(K(1)) is None and not a.live
    assert h.store.pinned_objects() == [a]
    assert h.used == P
    h.store.unpin(a)
    h.check()
    assert h.used == 0
    assert h.store.lru_keys() == []


def test_remove_does_not_touch_a_pending_reservation(h: Harness) -> None:
    h.put(K(1))
    pending = h.store.reserve(K(1), SMALL)
    assert pending is not None
    assert h.store.remove(K(1)) is True
    h.check()
    assert h.store.is_reserved(K(1))
    h.store.commit(pending)
    h.check()
    assert h.store.get(K(1)) is pending


def test_clear_keeps_reservations_and_pinned_slots(h: Harness) -> None:
    a = h.put(K(1))
    h.put(K(2))
    h.store.pin(a)
    pending = h.store.reserve(K(3), SMALL)
    assert pending is not None
    assert h.store.clear() == 2
    h.check()
    assert len(h.store) == 0 and h.store.lru_keys() == []
    assert h.store.is_reserved(K(3))
    assert h.used == 2 * P  # pinned a + reservation
    h.store.unpin(a)
    h.check()
    assert h.used == P
    h.store.commit(pending)
    h.check()
    assert h.store.lru_keys() == [K(3)]
    assert h.store.clear() == 1
    assert h.store.clear() == 0
    h.check()
    assert h.used == 0


def test_salted_keys_are_distinct_objects(h: Harness) -> None:
    a = h.put(K(1))
    b = h.put(K(1, salt="s"))
    assert h.store.get(K(1)) is a and h.store.get(K(1, salt="s")) is b
    assert h.store.remove(K(1)) is True
    assert h.store.get(K(1, salt="s")) is b
    h.check()


# ---------------------------------------------------------------- corruption is detected


def test_integrity_detects_pinned_object_in_lru(h: Harness) -> None:
    a = h.put(K(1))
    a.pins = 1
    with pytest.raises(AssertionError, match="evictable membership"):
        h.check()


def test_integrity_detects_leaked_slot(h: Harness) -> None:
    h.put(K(1))
    h.store.allocator.alloc(SMALL)
    with pytest.raises(AssertionError, match="allocator says"):
        h.check()


def test_integrity_detects_shared_slot(h: Harness) -> None:
    a, b = h.put(K(1)), h.put(K(2))
    b.offset = a.offset
    with pytest.raises(AssertionError, match="share a slot"):
        h.check()

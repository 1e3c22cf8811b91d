"""Tenants' quotas in each tier (storage.shares): a tenant over its quota evicts only its own
least recently used objects, a full tier evicts only objects of tenants without a quota or of the
one making room, and a store that cannot get within its quota is refused; charges stay exact."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvdock.errors import ConfigError, NoRoom
from kvdock.keys import ObjectKey
from kvdock.shm.pool import Pool
from kvdock.shm.slots import ALIGN, Partitions, SlotAllocator
from kvdock.storage.disk import DiskTier
from kvdock.storage.memory import L1Store
from kvdock.storage.shares import Shares, check_fits

P = ALIGN  # one page: one slot


def owner_of(salt: str) -> str | None:
    return salt.split("/")[0] if salt.startswith(("a/", "b/")) else None


def K(i: int, salt: str) -> ObjectKey:
    return ObjectKey("m", 0, salt, bytes([i]) * 32)


def shares(a: int, b: int = 0) -> Shares:
    return Shares(owner_of, {"a": a, "b": b})


def test_accounting_and_who_may_evict_whom() -> None:
    s = shares(2 * P, P)
    assert s.quotas == {"a": 2 * P, "b": P}
    assert (s.owner(K(1, "a/x")), s.owner(K(1, "b/y")), s.owner(K(1, "z"))) == ("a", "b", None)
    s.charge("a", P)
    assert (s.over("a", P), s.over("a", 2 * P), s.over(None, 10**9)) == (0, P, 0)
    assert s.too_big("b", 2 * P) and not s.too_big("a", 2 * P) and not s.too_big(None, 10**12)
    assert s.may_evict("a", "a") and s.may_evict(None, "a") and not s.may_evict("b", "a")
    assert not s.may_evict("a", None) and s.may_evict(None, None)
    s.release("a", P)
    assert s.used == {}
    with pytest.raises(AssertionError, match="below zero"):
        s.release("a", 1)
    with pytest.raises(ConfigError, match="add up to 3 bytes, more than the tier's 2"):
        check_fits("l1", 2, {"a": 1, "b": 2})


def l1(slots: int, s: Shares) -> L1Store:
    """An L1 of ``slots`` pages cut into the tenants' regions (their quotas) and the shared rest."""
    pool = Pool.create(slots * P, s.quotas, shm=False, tenants=True)
    return L1Store(pool.allocator, memory=pool, shares=s)


def regions(store: L1Store) -> dict[str | None, SlotAllocator]:
    assert isinstance(store.allocator, Partitions)
    return store.allocator.regions


def put(store: L1Store, key: ObjectKey, nbytes: int = 1000) -> bool:
    obj = store.reserve(key, nbytes)
    if obj is None:
        return False
    store.commit(obj)
    store.check_integrity()
    return True


def test_l1_a_tenant_lives_in_its_region_and_evicts_only_its_own_oldest() -> None:
    store = l1(6, shares(2 * P, 2 * P))
    for i in range(2):
        assert put(store, K(i, "b/x"))
    for i in range(5):  # a's region is 2 slots: each store past it evicts a's own oldest
        assert put(store, K(10 + i, "a/x"))
    for i in range(4):  # nobody's: the shared rest (2 slots), never a's or b's
        assert put(store, K(20 + i, "free"))
    assert set(store.lru_keys()) == {K(0, "b/x"), K(1, "b/x"), K(13, "a/x"), K(14, "a/x"), K(22, "free"), K(23, "free")}
    assert {n: r.used_bytes for n, r in regions(store).items()} == {"a": 2 * P, "b": 2 * P, None: 2 * P}
    assert store.evictions == 5


def test_l1_other_slot_sizes_cannot_carve_a_tenants_region() -> None:
    """(review) Slots are carved per size and never re-carved: in one shared pool, a quota-less
    tenant's larger slots could take the whole pool, and a tenant within its quota found no room
    at all. Its region is carved only by its own objects."""
    store = l1(10, shares(4 * P))
    for i in range(30):  # two pages each: the shared rest (6 pages) holds three
        assert put(store, K(i, "free"), nbytes=P + 1)
    for i in range(4):
        assert put(store, K(40 + i, "a/x"))  # all four of a's pages
    assert {n: r.used_bytes for n, r in regions(store).items()} == {"a": 4 * P, None: 6 * P}


def test_l1_pinned_objects_and_too_big_stores_are_refused_without_evicting_anything() -> None:
    store = l1(8, shares(2 * P))
    assert store.reserve(K(0, "a/x"), 3 * P) is None  # bigger than the whole region
    assert put(store, K(1, "a/x")) and put(store, K(2, "a/x"))
    for k in (K(1, "a/x"), K(2, "a/x")):
        obj = store.get(k)
        assert obj is not None
        store.pin(obj)  # in use: a cannot evict them
    assert store.reserve(K(3, "a/x"), 1000) is None
    assert store.reserve(K(4, "a/x"), P + 1) is None  # (another size: no eviction either)
    assert store.evictions == 0 and store.get(K(1, "a/x")) is not None
    assert put(store, K(5, "free"))  # the rest of the pool still serves others
    store.check_integrity()


def disk(tmp_path: Path, capacity: int, s: Shares) -> DiskTier:
    return DiskTier(tmp_path / "l2", capacity, s)


def write(store: DiskTier, key: ObjectKey, n: int = 100) -> int:
    from kvdock.storage import objfile

    data = bytes([key.chunk[0]]) * n
    header = objfile.encode_header(key, "float32", [n // 4], memoryview(data), 1, 0)
    size = store.write_from(key, header, memoryview(data))
    store.check_integrity()
    return size


def test_l2_quotas_hold_and_survive_a_restart(tmp_path: Path) -> None:
    probe = disk(tmp_path, 10**6, shares(10**6))
    size = write(probe, K(99, "free"))
    probe.delete(K(99, "free"))
    probe.close()
    store = disk(tmp_path, 6 * size, shares(2 * size, 2 * size))
    try:
        write(store, K(0, "b/x"))
        write(store, K(1, "b/x"))
        write(store, K(2, "free"))
        write(store, K(3, "free"))
        for i in range(4):  # a's quota: two files; past it a's own oldest go
            write(store, K(10 + i, "a/x"))
        assert [store.knows(K(10 + i, "a/x")) is not None for i in range(4)] == [False, False, True, True]
        assert store.knows(K(0, "b/x")) and store.knows(K(1, "b/x"))
        write(store, K(4, "free"))  # full: nobody's may evict only nobody's
        assert store.knows(K(2, "free")) is None and store.knows(K(0, "b/x")) is not None
        with pytest.raises(NoRoom, match="quota"):
            write(store, K(20, "b/x"), n=3 * size)  # bigger than b's whole quota
        assert store.shares is not None and store.shares.used["a"] == 2 * size
    finally:
        store.close()
    again = disk(tmp_path, 6 * size, shares(size))  # restarted with a smaller quota for a
    try:
        again.scan()
        again.check_integrity()
        assert again.shares is not None and again.shares.used["a"] == size  # its oldest file went
        assert again.knows(K(13, "a/x")) is not None and again.knows(K(12, "a/x")) is None
    finally:
        again.close()


def test_l1_a_tenant_switching_slot_sizes_recarves_its_region_when_nothing_there_is_in_use() -> None:
    """(review) A region carved for one model's slot size had no slot for the tenant's other
    model and nothing of that size to evict: the other model was refused for good."""
    pool = Pool.create(8 * P, {"a": 4 * P}, shm=False, tenants=True)
    gens = pool.own["a"].generations()  # the region's own table, in its own segment
    store = L1Store(pool.allocator, memory=pool, shares=shares(4 * P))
    for i in range(4):
        assert put(store, K(i, "a/x"))  # one page each: the region is carved in pages
    before = gens[:4].copy()
    assert put(store, K(10, "a/x"), nbytes=P + 1)  # two pages: everything of a's goes, recarved
    assert store.lru_keys() == [K(10, "a/x")] and store.evictions == 4
    assert (gens[:4] > before).all()  # every page moved on: no old slot can be read as current
    assert put(store, K(11, "a/x"), nbytes=P + 1)  # the second two-page slot
    obj = store.get(K(11, "a/x"))
    assert obj is not None
    store.pin(obj)  # in use: a's one-page store cannot empty the region now
    evictions = store.evictions
    assert not put(store, K(12, "a/x"))
    assert store.evictions == evictions and store.get(K(10, "a/x")) is not None  # nothing was given up
    assert store.reserve(K(13, "a/x"), 5 * P) is None  # bigger than the region: never
    store.check_integrity()


def test_l1_each_tenants_directory_lists_its_own_objects_and_touches_stay_in_their_region() -> None:
    """Per-tenant pool directories: an object is published in its own region's directory only
    (each in that tenant's segment), handed over there by an overwrite and unpublished there
    before its slot is freed; a FastReads touch names its reader's region."""
    from kvdock.keys import namespace_digest
    from kvdock.shm.directory import Directory

    pool = Pool.create(8 * P, {"a": 2 * P, "b": 2 * P}, tenants=True, directories=True)
    dirs = {r: Directory(seg, complete=True) for r, seg in pool.shared_segments().items()}
    assert sorted(dirs) == ["a", "b"]  # the shared rest has none: nobody maps it
    store = L1Store(pool.allocator, memory=pool, directories=dirs, shares=shares(2 * P, 2 * P))

    def listed(region: str) -> list[tuple[bytes, int]]:
        d = dirs[region]
        return sorted((e.ns, e.offset) for i in range(d.entries) if (e := d.read(i)) is not None)

    try:
        for key in (K(1, "a/x"), K(2, "b/y"), K(3, "z")):
            assert put(store, key)
        a, b = store.get(K(1, "a/x")), store.get(K(2, "b/y"))
        assert a is not None and b is not None and store.get(K(3, "z")) is not None
        assert listed("a") == [(namespace_digest("m", 0, "a/x"), a.offset)]
        assert listed("b") == [(namespace_digest("m", 0, "b/y"), b.offset)]
        gen = pool.allocator.generation(a.offset)
        assert not store.touch(a.entry, a.offset, gen, "b") and not store.touch(a.entry, a.offset, gen, None)
        assert store.touch(a.entry, a.offset, gen, "a")
        # an overwrite hands the entry over within a's directory; the old slot is freed after
        new = store.reserve(K(1, "a/x"), 1000)
        assert new is not None
        store.commit(new)
        assert listed("a") == [(namespace_digest("m", 0, "a/x"), new.offset)] and new.offset != a.offset
        store.check_integrity()
        for i in range(2, 6):  # a evicts its own: each one out of a's directory first
            assert put(store, K(i, "a/x"))
            assert len(listed("a")) == min(i, 2) and len(listed("b")) == 1
        assert store.clear() == 4  # two of a's, one of b's, one of nobody's
        assert listed("a") == [] and listed("b") == []
        store.check_integrity()
    finally:
        for d in dirs.values():
            d.close()
        pool.close()

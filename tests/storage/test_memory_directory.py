"""kvdock.storage.memory with a pool directory: every READY object is published (or counted as
unindexed) exactly while it is READY, and out of the directory before its slot is freed."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvdock.keys import ObjectKey, namespace_digest
from kvdock.shm.directory import Directory, DirectoryReader
from kvdock.shm.pool import FlatMemory
from kvdock.shm.segment import BUCKET, PoolSegment
from kvdock.shm.slots import ALIGN, SlotAllocator
from kvdock.storage.memory import L1Store

SIZE = 1000  # one page per slot


def K(i: int, salt: str = "") -> ObjectKey:
    return ObjectKey("m", 0, salt, bytes([i]) * 32)


class World:
    """An L1Store of ``slots`` one-page slots over a real segment with a 16-entry directory, and a
    reader of that directory (as a client has)."""

    def __init__(self, slots: int) -> None:
        self.seg = PoolSegment.create(slots * ALIGN, 16)
        self.directory = Directory(self.seg, complete=True)
        self.reader = DirectoryReader(self.seg)
        alloc = SlotAllocator(self.seg.data_offset, slots * ALIGN, self.seg.generations())
        self.store = L1Store(alloc, memory=FlatMemory(self.seg.buf), directories={None: self.directory})
        self.freed_while_published: list[int] = []
        real_free = alloc.free

        def free(offset: int) -> None:  # every slot freed must be out of the directory by then
            published = {int(o) for o in self._all_offsets()}
            if offset in published:
                self.freed_while_published.append(offset)
            real_free(offset)

        alloc.free = free  # type: ignore[method-assign]

    def _all_offsets(self) -> list[int]:
        return [e.offset for i in range(self.directory.entries) if (e := self.directory.read(i)) is not None]

    def put(self, key: ObjectKey, version: int = 1, parent: int = 0):  # type: ignore[no-untyped-def]
        obj = self.store.reserve(key, SIZE)
        assert obj is not None
        obj.version, obj.parent = version, parent
        self.store.commit(obj)
        self.store.check_integrity()
        return obj

    def find(self, key: ObjectKey):  # type: ignore[no-untyped-def]
        return self.reader.find(namespace_digest(key.model, key.rank, key.salt), key.chunk, SIZE)

    def close(self) -> None:
        self.directory.close()
        self.reader.close()
        self.seg.close()
        self.seg.unlink()


@pytest.fixture
def w() -> Iterator[World]:
    world = World(slots=3)
    yield world
    world.close()


def test_a_committed_object_is_published_with_its_slot_and_generation(w: World) -> None:
    assert w.find(K(1)).ended == "absent"
    reserved = w.store.reserve(K(1), SIZE)
    assert reserved is not None
    assert w.find(K(1)).ended == "absent"  # a reservation is never readable
    w.store.commit(reserved)
    found = w.find(K(1))
    assert found.ended == "all" and found.offsets.tolist() == [reserved.offset]
    assert found.gens.tolist() == [w.store.allocator.generation(reserved.offset)]
    assert found.entries.tolist() == [reserved.entry] and reserved.entry >= 0
    assert w.find(K(1, salt="other")).ended == "absent"  # the salt is part of the key
    w.store.check_integrity()


def test_eviction_unpublishes_before_the_slot_is_freed(w: World) -> None:
    objs = [w.put(K(i)) for i in range(3)]
    w.put(K(3))  # evicts K(0), the least recently used
    assert w.find(K(0)).ended == "absent"
    assert w.find(K(3)).offsets.tolist() == [objs[0].offset]  # the slot went to K(3) ...
    gen0 = w.store.allocator.generation(objs[0].offset)
    assert w.find(K(3)).gens.tolist() == [gen0] and gen0 == 1  # ... with the generation moved on
    assert w.freed_while_published == []
    w.store.check_integrity()


def test_an_overwrite_republishes_and_a_pinned_old_version_stays_out(w: World) -> None:
    old = w.put(K(1), version=5)
    w.store.pin(old)
    new = w.store.reserve(K(1), SIZE)
    assert new is not None
    new.version = 6
    assert w.find(K(1)).offsets.tolist() == [old.offset]  # until the commit, the old one is readable
    entry = old.entry
    w.store.commit(new)
    assert w.find(K(1)).offsets.tolist() == [new.offset]
    assert new.entry == entry  # rewritten in place: no reader saw the key missing in between
    assert w.directory.read(new.entry).version == 6  # type: ignore[union-attr]
    w.directory.check_integrity(1)  # the retired, pinned old version is not in the directory
    w.store.unpin(old)  # its slot is freed now
    assert w.freed_while_published == []
    w.store.check_integrity()


def test_remove_and_clear_unpublish(w: World) -> None:
    w.put(K(1))
    w.put(K(2))
    assert w.store.remove(K(1))
    assert w.find(K(1)).ended == "absent" and w.find(K(2)).ended == "all"
    assert w.store.clear() == 1
    assert w.find(K(2)).ended == "absent"
    w.directory.check_integrity(0)
    assert w.freed_while_published == []
    w.store.check_integrity()


def test_objects_without_room_in_their_bucket_are_counted_unindexed() -> None:
    world = World(slots=BUCKET + 3)
    try:
        ns = namespace_digest("m", 0, "")
        same = [i for i in range(256) if (i * 0x0101010101010101 ^ int.from_bytes(ns[:8], "little")) % 2 == 0]
        keys = [K(i) for i in same[: BUCKET + 1]]  # all in bucket 0 (a chunk of bytes([i]) * 32)
        objs = [world.put(k) for k in keys]
        assert [o.entry >= 0 for o in objs] == [True] * BUCKET + [False]
        assert world.reader.unindexed == 1 and not world.reader.complete
        assert world.find(keys[-1]).ended == "absent"  # a reader must then ask the server
        world.store.remove(keys[-1])
        assert world.reader.unindexed == 0 and world.reader.complete
        world.store.remove(keys[0])
        assert world.put(keys[-1]).entry >= 0  # room again
        world.store.check_integrity()
    finally:
        world.close()


def test_touch_moves_only_the_object_still_in_the_slot_it_was_read_from(w: World) -> None:
    a, b, c = w.put(K(1)), w.put(K(2)), w.put(K(3))
    gen = w.store.allocator.generation(a.offset)
    assert w.store.touch(a.entry, a.offset, gen, None)
    assert w.store.lru_keys() == [K(2), K(3), K(1)]
    assert not w.store.touch(b.entry, b.offset, gen + 1, None)  # another generation: another object
    assert not w.store.touch(b.entry, c.offset, gen, None)  # another slot
    assert not w.store.touch(15, b.offset, gen, None)  # an entry holding nothing
    assert w.store.lru_keys() == [K(2), K(3), K(1)]
    w.put(K(4))  # evicts K(2), not the touched K(1)
    assert w.find(K(2)).ended == "absent" and w.find(K(1)).ended == "all"
    stale_entry, stale_offset = b.entry, b.offset
    assert not w.store.touch(stale_entry, stale_offset, gen, None)  # K(2) is gone, its slot reused by K(4)
    w.store.check_integrity()


def test_check_integrity_finds_an_entry_the_store_does_not_know(w: World) -> None:
    w.put(K(1))
    w.directory.publish([(namespace_digest("m", 0, ""), K(9).chunk, w.seg.data_offset, 0, SIZE, 1, 0)])[0]
    with pytest.raises(AssertionError, match="2 directory entries in use, 1 published"):
        w.store.check_integrity()


def test_check_integrity_finds_a_wrong_entry(w: World) -> None:
    obj = w.put(K(1))
    w.directory.unpublish(obj.entry)
    entry = w.directory.publish([(namespace_digest("m", 0, ""), K(1).chunk, obj.offset, 7, SIZE, 1, 0)])[0]
    assert entry == obj.entry
    with pytest.raises(AssertionError, match="a directory entry is wrong"):
        w.store.check_integrity()

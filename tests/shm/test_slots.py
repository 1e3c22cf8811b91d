"""kvdock.shm.slots: page-aligned slot allocation, reuse by size, integrity checks."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from kvdock.shm.slots import ALIGN, Partitions, SlotAllocator, aligned

P = ALIGN  # one page


def test_align_is_a_page() -> None:
    assert ALIGN == 4096


@pytest.mark.parametrize(("n", "expected"), [(1, P), (P - 1, P), (P, P), (P + 1, 2 * P), (3 * P, 3 * P), (0, 0)])
def test_aligned(n: int, expected: int) -> None:
    assert aligned(n) == expected


def test_base_must_be_page_aligned() -> None:
    with pytest.raises(AssertionError):
        SlotAllocator(base=100, capacity=4 * P)


def test_fresh_allocator() -> None:
    a = SlotAllocator(base=P, capacity=4 * P)
    assert a.used_bytes == 0
    assert a.free_bytes == 4 * P
    a.check_integrity()


def test_alloc_carves_consecutive_page_aligned_slots() -> None:
    a = SlotAllocator(base=P, capacity=10 * P)
    offs = [a.alloc(100), a.alloc(P), a.alloc(P + 1), a.alloc(1)]
    assert offs == [P, 2 * P, 3 * P, 5 * P]
    assert all(o is not None and o % ALIGN == 0 for o in offs)
    assert a.used_bytes == 5 * P
    assert a.free_bytes == 5 * P
    a.check_integrity()


def test_alloc_returns_none_when_full_and_state_is_unchanged() -> None:
    a = SlotAllocator(base=0, capacity=3 * P)
    assert [a.alloc(P), a.alloc(P), a.alloc(P)] == [0, P, 2 * P]
    assert a.alloc(1) is None
    assert a.used_bytes == 3 * P
    assert a.free_bytes == 0
    a.check_integrity()


def test_alloc_none_when_slot_bigger_than_remaining() -> None:
    a = SlotAllocator(base=0, capacity=3 * P)
    assert a.alloc(2 * P) == 0
    assert a.alloc(2 * P) is None
    assert a.alloc(P) == 2 * P  # the smaller size still fits
    a.check_integrity()


def test_capacity_not_a_page_multiple_does_not_overrun() -> None:
    a = SlotAllocator(base=0, capacity=2 * P + 100)
    assert a.alloc(P) == 0
    assert a.alloc(P) == P
    assert a.alloc(1) is None  # only 100 bytes left, a slot is a page
    a.check_integrity()


def test_free_then_alloc_same_size_reuses_offset() -> None:
    a = SlotAllocator(base=0, capacity=3 * P)
    x, y, z = a.alloc(10), a.alloc(10), a.alloc(10)
    assert (x, y, z) == (0, P, 2 * P)
    a.free(y)
    assert a.used_bytes == 2 * P
    a.check_integrity()
    assert a.alloc(P) == P  # same aligned size (10 and 4096 round to one page)
    assert a.used_bytes == 3 * P
    a.check_integrity()


def test_freed_slot_is_not_reused_for_another_size() -> None:
    a = SlotAllocator(base=0, capacity=4 * P)
    small = a.alloc(P)
    big = a.alloc(2 * P)
    assert (small, big) == (0, P)
    a.free(small)
    # one page free on the list and one page never carved: a 2-page slot fits nowhere
    assert a.alloc(2 * P) is None
    assert a.alloc(P) == 0  # the freed page, not the bump pointer
    assert a.alloc(P) == 3 * P  # now from the bump
    assert a.alloc(P) is None
    a.check_integrity()


def test_freed_big_slot_reused_for_big_only() -> None:
    a = SlotAllocator(base=0, capacity=3 * P)
    big = a.alloc(2 * P)
    a.free(big)
    assert a.alloc(2 * P) == big
    a.free(big)
    assert a.alloc(P) == 2 * P  # bump, not the free 2-page slot
    assert a.alloc(P) is None
    assert a.free_bytes == 2 * P  # free by accounting, but carved for another size
    a.check_integrity()


def test_free_list_is_lifo() -> None:
    a = SlotAllocator(base=0, capacity=3 * P)
    offs = [a.alloc(P) for _ in range(3)]
    for o in offs:
        a.free(o)
    assert [a.alloc(P) for _ in range(3)] == list(reversed(offs))
    a.check_integrity()


def test_double_free_raises() -> None:
    a = SlotAllocator(base=0, capacity=2 * P)
    o = a.alloc(P)
    assert o is not None
    a.free(o)
    with pytest.raises(KeyError):
        a.free(o)
    with pytest.raises(KeyError):
        a.free(P)  # inside the pool, never allocated
    a.check_integrity()


def test_a_refused_free_changes_nothing() -> None:
    a = SlotAllocator(base=0, capacity=2 * P)
    o = a.alloc(P)
    assert o is not None
    a.free(o)
    with pytest.raises(KeyError):
        a.free(o)
    assert a.generation(o) == 1, "the refused double free bumped the generation"
    with pytest.raises(KeyError):
        a.free(12345)  # the old contract: an unknown offset is a KeyError
    a.check_integrity()


# ---------------------------------------------------------------- generations


def test_free_bumps_the_generation_of_the_slots_page_and_alloc_does_not() -> None:
    a = SlotAllocator(base=0, capacity=4 * P)
    x, y = a.alloc(P), a.alloc(2 * P)
    assert (x, y) == (0, P)
    assert a.generation(x) == a.generation(y) == 0
    a.free(y)
    assert a.generation(y) == 1 and a.generation(x) == 0
    assert a.generation(2 * P) == 0  # only the slot's first page carries its generation
    assert a.alloc(2 * P) == y and a.generation(y) == 1  # reuse: the generation stays as freed
    a.free(y)
    a.free(x)
    assert (a.generation(x), a.generation(y)) == (1, 2)
    a.check_integrity()


def test_generation_is_per_page_from_base() -> None:
    a = SlotAllocator(base=3 * P, capacity=3 * P)
    offs = [a.alloc(P) for _ in range(3)]
    assert offs == [3 * P, 4 * P, 5 * P]
    a.free(4 * P)
    assert [a.generation(o) for o in offs] == [0, 1, 0]
    assert list(a._gens) == [0, 1, 0]


def test_a_table_given_by_the_caller_is_the_one_written() -> None:
    table = np.zeros(8, dtype="<u8")  # e.g. a view of the segment's generation table
    a = SlotAllocator(base=2 * P, capacity=4 * P, generations=table)
    offs = [a.alloc(P) for _ in range(4)]
    a.free(offs[2])
    a.free(offs[0])
    assert a.alloc(P) == offs[0]  # LIFO reuse
    a.free(offs[0])
    assert list(table) == [2, 0, 1, 0, 0, 0, 0, 0]
    table[1] = 41  # and it is read back from there, not from a copy
    assert a.generation(offs[1]) == 41


def test_a_table_too_small_for_the_pool_is_refused() -> None:
    with pytest.raises(AssertionError, match="generation table too small"):
        SlotAllocator(base=0, capacity=4 * P + 1, generations=np.zeros(4, dtype="<u8"))
    SlotAllocator(base=0, capacity=4 * P, generations=np.zeros(4, dtype="<u8")).check_integrity()


def test_random_sequences_keep_integrity() -> None:
    rng = random.Random(1234)
    a = SlotAllocator(base=2 * P, capacity=64 * P)
    held: dict[int, int] = {}
    sizes = [1, P, P + 1, 3 * P]
    for _ in range(2000):
        if held and rng.random() < 0.45:
            off = rng.choice(list(held))
            a.free(off)
            del held[off]
        else:
            n = rng.choice(sizes)
            off = a.alloc(n)
            if off is not None:
                assert off not in held
                assert off % ALIGN == 0
                assert off >= 2 * P and off + aligned(n) <= 66 * P
                held[off] = aligned(n)
        assert a.used_bytes == sum(held.values())
        assert a.free_bytes == 64 * P - a.used_bytes
        a.check_integrity()
    # held slots never overlap
    spans = sorted((o, o + s) for o, s in held.items())
    assert all(e1 <= s2 for (_, e1), (s2, _) in itertools.pairwise(spans))


# ---------------------------------------------------------------- corruption is detected


def _populated() -> tuple[SlotAllocator, list[int]]:
    a = SlotAllocator(base=0, capacity=8 * P)
    offs = [a.alloc(P) for _ in range(4)]
    a.free(offs[1])
    a.check_integrity()
    return a, [o for o in offs if o is not None]


def test_corrupt_used_offset_also_on_free_list() -> None:
    a, offs = _populated()
    a._free[P].append(offs[0])
    with pytest.raises(AssertionError, match="both used and free"):
        a.check_integrity()


def test_corrupt_offset_twice_on_free_list() -> None:
    a, offs = _populated()
    a._free[P].append(offs[1])
    with pytest.raises(AssertionError, match="free list twice"):
        a.check_integrity()


def test_corrupt_used_bytes_counter() -> None:
    a, _ = _populated()
    a.used_bytes += 1
    with pytest.raises(AssertionError):
        a.check_integrity()


def test_corrupt_lost_slot() -> None:
    a, offs = _populated()
    del a._used[offs[0]]
    a.used_bytes -= P
    with pytest.raises(AssertionError, match="carved"):
        a.check_integrity()


def test_corrupt_slot_outside_pool() -> None:
    a = SlotAllocator(base=0, capacity=2 * P)
    a._used[2 * P] = P
    a.used_bytes += P
    a._bump += P
    with pytest.raises(AssertionError):
        a.check_integrity()


def test_partitions_give_each_tenant_its_region_with_its_own_generation_table() -> None:
    from kvdock.shm.slots import Partitions

    tables = {n: np.zeros(pages, dtype="<u8") for n, pages in (("a", 2), ("b", 3), ("z", 0), (None, 5))}
    parts = Partitions(
        {
            None: SlotAllocator(ALIGN, 5 * ALIGN, tables[None]),
            "a": SlotAllocator(6 * ALIGN, 2 * ALIGN, tables["a"]),
            "z": SlotAllocator(8 * ALIGN, 0, tables["z"]),  # empty, where "b" starts
            "b": SlotAllocator(8 * ALIGN, 3 * ALIGN, tables["b"]),
        }
    )
    assert parts.capacity == 10 * ALIGN
    a1, a2 = parts.alloc(100, "a"), parts.alloc(100, "a")
    assert (a1, a2, parts.alloc(100, "a")) == (6 * ALIGN, 7 * ALIGN, None)  # a's region is full
    shared = parts.alloc(100)
    assert shared == ALIGN and parts.name_of(shared) is None and parts.name_of(a2) == "a"
    b1 = parts.alloc(100, "b")
    assert b1 == 8 * ALIGN and parts.name_of(b1) == "b" and parts.alloc(100, "z") is None
    parts.free(a2)
    assert list(tables["a"]) == [0, 1] and parts.generation(a2) == 1  # in the region's own table
    parts.free(shared)
    assert tables[None][0] == 1 and parts.generation(shared) == 1 and not tables["b"].any()
    assert (parts.used_bytes, parts.free_bytes) == (2 * ALIGN, 8 * ALIGN)
    parts.check_integrity()
    with pytest.raises(AssertionError, match="overlap"):
        Partitions({None: SlotAllocator(0, 2 * ALIGN), "a": SlotAllocator(ALIGN, ALIGN)})


def test_recarve_moves_every_generation_on_and_carves_anew() -> None:
    gens = np.zeros(4, dtype="<u8")
    a = SlotAllocator(ALIGN, 4 * ALIGN, gens)
    offs = [a.alloc(100) for _ in range(4)]
    assert a.alloc(2 * ALIGN) is None  # carved in pages
    with pytest.raises(AssertionError, match="slots in use"):
        a.recarve()
    for off in offs:
        a.free(off)  # type: ignore[arg-type]
    assert list(gens) == [1, 1, 1, 1]
    a.recarve()
    assert list(gens) == [2, 2, 2, 2]  # a reader of any old slot sees it moved
    assert (a.alloc(2 * ALIGN), a.alloc(2 * ALIGN), a.alloc(1)) == (ALIGN, 3 * ALIGN, None)
    a.check_integrity()


def test_generations_are_each_slots_generation() -> None:
    """generations(offsets) reads what generation(offset) reads, offset by offset and in order,
    over one pool and over regions (a run of one region's offsets finds it once; here the runs
    alternate), after frees moved some generations on."""
    table = np.zeros(64, dtype="<u8")
    shared, tenant = SlotAllocator(0, 32 * ALIGN, table[:32]), SlotAllocator(32 * ALIGN, 32 * ALIGN, table[32:])
    parts = Partitions({None: shared, "t": tenant})
    offsets = [parts.alloc(ALIGN, None) for _ in range(6)] + [parts.alloc(ALIGN, "t") for _ in range(6)]
    assert None not in offsets
    for off in offsets[::3]:
        parts.free(off)  # (generation 1)
        assert parts.alloc(ALIGN, parts.name_of(off)) == off
    parts.free(offsets[1])
    parts.free(offsets[7])
    mixed = [offsets[i] for i in (0, 7, 1, 6, 3, 9, 2)]
    assert parts.generations(mixed) == [parts.generation(o) for o in mixed] == [1, 1, 1, 1, 1, 1, 0]
    assert shared.generations(offsets[:6]) == [shared.generation(o) for o in offsets[:6]] == [1, 1, 0, 1, 0, 0]
    assert all(type(g) is int for g in parts.generations(mixed))
    assert parts.generations([]) == []
    assert list(table[:6]) == [1, 1, 0, 1, 0, 0]  # (the table's own words: what clients read)

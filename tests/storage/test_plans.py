"""The version ids and the write limit of storage.plans: an overwrite's versions carry the
EDITED bit and no other version does; a plain store stops at a run holding an edit unless it was
computed over that run's tip, in every shard alike."""

from __future__ import annotations

from kvdock.storage.plans import EDITED, StoreRun, is_edited, new_version, write_limit


def test_only_edited_versions_carry_the_bit() -> None:
    plain = [new_version() for _ in range(2000)]
    edits = [new_version(edited=True) for _ in range(2000)]
    assert all(0 < v < 2**63 for v in plain + edits)
    assert not any(is_edited(v) for v in plain)
    assert all(is_edited(v) and v & EDITED for v in edits)
    assert len(set(plain + edits)) == 4000


def test_a_run_without_an_edit_sets_no_limit() -> None:
    assert write_limit([StoreRun(3, 77)], None) is None
    assert write_limit([StoreRun(3, 77)], [5]) is None
    assert write_limit([StoreRun(0, 0), StoreRun(0, 0)], None) is None


def test_a_run_with_an_edit_is_extended_only_over_a_chunk_from_its_last_edit_on() -> None:
    edit, later = new_version(edited=True), new_version()
    run = StoreRun(3, later, (edit, later))  # chunk 0 (not listed), the edit, a chunk computed over it
    assert run.edited
    assert write_limit([run], None) == 3
    assert write_limit([run], [later ^ 2]) == 3
    assert write_limit([run], [later]) is None  # its tip
    assert write_limit([run], [edit]) is None  # the edit: ``later`` was computed over it as well


def test_one_diverging_shard_stops_every_shard_at_the_shortest_run() -> None:
    a, b = new_version(edited=True), new_version()
    # shard 1 lost chunk 1 (its run is shorter): nothing is written in either shard from chunk 1
    assert write_limit([StoreRun(2, a, (a,)), StoreRun(1, b)], None) == 1
    assert write_limit([StoreRun(2, a, (a,)), StoreRun(1, b)], [a, 0]) is None
    c = new_version(edited=True)
    assert write_limit([StoreRun(2, a, (a,)), StoreRun(2, c, (c,))], [a, c ^ 2]) == 2


def test_a_chunk_chained_onto_an_edit_is_derived_not_edited() -> None:
    """The DERIVED bit: set on a plain chunk whose parent is an edit or derived from one, never on
    an edit, never on a chunk of unedited parents; write_limit ignores it (only edits count)."""
    from kvdock.storage.plans import DERIVED, EDITED, depends_on_edit, is_edited, new_version

    plain = new_version(False, 0)
    edit = new_version(True, plain)
    after = new_version(False, edit)
    after_after = new_version(False, after)
    assert not depends_on_edit(plain) and not depends_on_edit(new_version(False, plain))
    assert is_edited(edit) and not edit & DERIVED
    assert after & DERIVED and not after & EDITED and depends_on_edit(after) and not is_edited(after)
    assert after_after & DERIVED and depends_on_edit(after_after)
    assert all(0 < v < 2**63 for v in (plain, edit, after, after_after))


def test_random_bits_are_the_random_part_of_a_version() -> None:
    """A store draws its new versions' random parts at once (random_bits: one read of the OS's
    randomness); each is a version's random part as secrets.randbits(61) would be."""
    from kvdock.storage.plans import DERIVED, random_bits

    bits = random_bits(4000)
    assert len(bits) == 4000 and all(type(b) is int and 0 <= b < 2**61 for b in bits)
    assert len(set(bits)) == 4000 and max(bits) >= 2**60  # random, all 61 bits used
    assert random_bits(0) == []
    assert new_version(False, 0, 6) == 7  # never 0: the low bit is set
    assert new_version(True, 0, 6) == EDITED | 7
    assert new_version(False, EDITED | 3, 2**64 - 1) == DERIVED | (2**61 - 1)  # only the random bits kept

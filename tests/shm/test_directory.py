"""kvdock.shm.directory: the pool directory's entries, buckets, chains and seqlock, on real segments
(a writer in one process, readers in another where it matters)."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import numpy as np
import pytest
from blake3 import blake3

from kvdock.shm.directory import (
    BYTES_PER_ENTRY,
    MIN_ENTRIES,
    Directory,
    DirectoryReader,
    entries_for,
)
from kvdock.shm.segment import BUCKET, PoolSegment

SLOT = 4096
NS = blake3(b"namespace a").digest()
OTHER_NS = blake3(b"namespace b").digest()


def digest(i: int) -> bytes:
    return blake3(i.to_bytes(8, "little")).digest()


def in_bucket(bucket: int, nbuckets: int, ns: bytes, start: int = 0) -> Iterator[bytes]:
    """Chunk hashes whose key (with ``ns``) falls in ``bucket``."""
    i = start
    while True:
        h = digest(i)
        if (int.from_bytes(h[:8], "little") ^ int.from_bytes(ns[:8], "little")) % nbuckets == bucket:
            yield h
        i += 1


@pytest.fixture
def seg() -> Iterator[PoolSegment]:
    s = PoolSegment.create(64 * SLOT, 16)  # 2 buckets of 8
    yield s
    s.close()
    s.unlink()


@pytest.fixture
def pair(seg: PoolSegment) -> Iterator[tuple[Directory, DirectoryReader]]:
    d, r = Directory(seg, complete=True), DirectoryReader(seg)
    yield d, r
    d.close()
    r.close()


def slot(i: int, seg: PoolSegment) -> int:
    return seg.data_offset + i * SLOT


def test_entries_for_is_a_power_of_two_of_one_per_16_kib() -> None:
    assert entries_for(1) == MIN_ENTRIES == 1024
    assert entries_for(MIN_ENTRIES * BYTES_PER_ENTRY) == 1024
    assert entries_for(MIN_ENTRIES * BYTES_PER_ENTRY + 1) == 2048
    assert entries_for(4 << 30) == (4 << 30) // (16 << 10) == 262144
    assert entries_for(3 << 30) == 262144  # rounded up


def test_a_published_chain_is_found_with_its_slots(seg: PoolSegment, pair) -> None:
    d, r = pair
    hashes = [digest(i) for i in range(3)]
    versions = [11, 22, 33]
    entries = [
        d.publish([(NS, h, slot(i, seg), 5 + i, SLOT, versions[i], versions[i - 1] if i else 0)])[0]
        for i, h in enumerate(hashes)
    ]
    assert all(e >= 0 for e in entries)
    d.check_integrity(3)
    found = r.find(NS, b"".join(hashes), SLOT)
    assert found.ended == "all" and found.count == 3
    assert found.entries.tolist() == entries
    assert found.offsets.tolist() == [slot(i, seg) for i in range(3)]
    assert found.gens.tolist() == [5, 6, 7] and found.gens.dtype == np.uint64
    assert r.live and r.complete
    e = d.read(entries[1])
    assert e is not None and (e.ns, e.chunk, e.offset, e.gen, e.nbytes, e.version, e.parent) == (
        NS, hashes[1], slot(1, seg), 6, SLOT, 22, 11,
    )  # fmt: skip
    d.check_integrity(3)


def test_lookups_stop_at_an_absent_a_broken_or_an_unsure_chunk(seg: PoolSegment, pair) -> None:
    d, r = pair
    h = [digest(i) for i in range(4)]
    d.publish([(NS, h[0], slot(0, seg), 0, SLOT, 1, 0)])[0]
    d.publish([(NS, h[1], slot(1, seg), 0, SLOT, 2, 1)])[0]
    d.publish([(NS, h[3], slot(3, seg), 0, SLOT, 4, 3)])[0]
    found = r.find(NS, b"".join(h), SLOT)
    assert (found.count, found.ended) == (2, "absent")
    d.publish([(NS, h[2], slot(2, seg), 0, SLOT, 9, 7)])[0]  # present, but its parent is not chunk 1's version
    found = r.find(NS, b"".join(h), SLOT)
    assert (found.count, found.ended) == (2, "broken")
    assert r.find(NS, b"".join(h[:2]), SLOT + 4096).ended == "unsure"  # another slot size: not this model's
    assert r.find(OTHER_NS, b"".join(h), SLOT).count == 0  # another namespace sees nothing
    assert (r.find(NS, b"", SLOT).count, r.find(NS, b"", SLOT).ended) == (0, "all")


def test_a_first_chunk_must_have_no_parent(seg: PoolSegment, pair) -> None:
    d, r = pair
    d.publish([(NS, digest(0), slot(0, seg), 0, SLOT, 1, 77)])[0]  # a chunk 1 of some other prefix, at position 0
    assert (r.find(NS, digest(0), SLOT).count, r.find(NS, digest(0), SLOT).ended) == (0, "broken")


@pytest.mark.parametrize("where", ["before the slot area", "past the pool", "not page-aligned"])
def test_an_entry_outside_the_slot_area_is_never_handed_out(seg: PoolSegment, pair, where: str) -> None:
    d, r = pair
    offset = {
        "before the slot area": seg.directory_offset,
        "past the pool": seg.size - SLOT + 4096,
        "not page-aligned": slot(1, seg) + 64,
    }[where]
    d.publish([(NS, digest(0), offset, 0, SLOT, 1, 0)])[0]
    assert (r.find(NS, digest(0), SLOT).count, r.find(NS, digest(0), SLOT).ended) == (0, "unsure")


def test_unpublish_frees_the_entry_and_a_full_bucket_refuses(seg: PoolSegment, pair) -> None:
    d, r = pair
    same = in_bucket(0, d.nbuckets, NS)
    hashes = [next(same) for _ in range(BUCKET + 1)]
    entries = d.publish([(NS, h, slot(i, seg), 0, SLOT, i + 1, 0) for i, h in enumerate(hashes[:BUCKET])])
    assert sorted(entries) == list(range(BUCKET))  # bucket 0 is entries 0..7
    assert d.publish([(NS, hashes[BUCKET], slot(BUCKET, seg), 0, SLOT, 99, 0)]) == [-1]  # no room: the caller counts it
    d.check_integrity(BUCKET)
    d.unpublish(entries[3])
    assert r.find(NS, hashes[3], SLOT).ended == "absent" and d.read(entries[3]) is None
    assert d.publish([(NS, hashes[BUCKET], slot(BUCKET, seg), 0, SLOT, 99, 0)])[0] == entries[3]  # the freed entry
    assert r.find(NS, hashes[BUCKET], SLOT).offsets.tolist() == [slot(BUCKET, seg)]
    d.check_integrity(BUCKET)


def test_rewrite_replaces_an_entry_of_the_same_key_only(seg: PoolSegment, pair) -> None:
    d, r = pair
    entry = d.publish([(NS, digest(0), slot(0, seg), 3, SLOT, 1, 0)])[0]
    d.rewrite(entry, NS, digest(0), slot(4, seg), 8, SLOT, 2, 0)
    found = r.find(NS, digest(0), SLOT)
    assert (found.entries.tolist(), found.offsets.tolist(), found.gens.tolist()) == ([entry], [slot(4, seg)], [8])
    d.check_integrity(1)
    with pytest.raises(ValueError, match="same key"):
        d.rewrite(entry, NS, digest(1), slot(4, seg), 8, SLOT, 2, 0)
    with pytest.raises(ValueError, match="same key"):
        d.rewrite(entry, OTHER_NS, digest(0), slot(4, seg), 8, SLOT, 2, 0)
    with pytest.raises(ValueError, match="same key"):
        d.rewrite(entry + 1, NS, digest(0), slot(4, seg), 8, SLOT, 2, 0)  # a free entry
    d.check_integrity(1)


def test_complete_needs_the_flag_and_nothing_unindexed(seg: PoolSegment, pair) -> None:
    d, r = pair
    assert r.complete and r.live
    d.set_unindexed(1)
    assert r.unindexed == 1 and not r.complete and r.live
    d.set_unindexed(0)
    assert r.complete
    other = Directory(seg, complete=False)  # what a server with a lower tier writes
    assert not r.complete and r.live
    other.close()


def test_a_segment_without_entries_has_no_directory_and_entries_are_bounds_checked(seg: PoolSegment, pair) -> None:
    bare = PoolSegment.create(4096)
    try:
        with pytest.raises(ValueError, match="no directory"):
            Directory(bare, complete=True)
        with pytest.raises(ValueError, match="no directory"):
            DirectoryReader(bare)
    finally:
        bare.close()
        bare.unlink()
    d, _ = pair
    for bad in (-1, d.entries):
        with pytest.raises(IndexError):
            d.unpublish(bad)
        with pytest.raises(IndexError):
            d.read(bad)
    d.close()
    with pytest.raises(ValueError, match="closed"):
        d.unpublish(0)


def test_check_integrity_finds_a_miscount_and_an_entry_out_of_its_bucket(seg: PoolSegment, pair) -> None:
    d, _ = pair
    d.publish([(NS, next(in_bucket(0, d.nbuckets, NS)), slot(0, seg), 0, SLOT, 1, 0)])[0]
    with pytest.raises(AssertionError, match="1 directory entries in use, 2 published"):
        d.check_integrity(2)
    d.check_integrity(1)
    # move the entry's bytes into bucket 1 behind the writer's back
    raw = np.frombuffer(seg.buf, np.uint8, count=128 * 16, offset=seg.directory_offset)
    raw[8 * 128 : 9 * 128] = raw[0:128]
    raw[0:128] = 0
    with pytest.raises(AssertionError, match="not in their key's bucket"):
        d.check_integrity(1)
    del raw


def test_a_reader_in_another_process_never_sees_half_an_entry(seg: PoolSegment, pair) -> None:
    """The writer republishes one key as fast as it can, alternating two objects whose fields are
    all different; a reader process reads it 600,000 times: every read is one of the two whole
    (without the seqlock, a mix shows up in about every other run)."""
    d, _ = pair
    h = digest(1)
    reader = textwrap.dedent(
        f"""
        import json
        from kvdock.shm.segment import PoolSegment
        from kvdock.shm.directory import DirectoryReader
        seg = PoolSegment.attach({seg.name!r})
        r = DirectoryReader(seg)
        seen = set()
        print("ready", flush=True)
        for _ in range(600_000):
            f = r.find({NS!r}, {h!r}, {SLOT})
            if f.count:
                seen.add((f.offsets.tolist()[0], f.gens.tolist()[0]))
        print(json.dumps(sorted(seen)), flush=True)
        """
    )
    p = subprocess.Popen([sys.executable, "-c", reader], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    a = (slot(2, seg), 1111)
    b = (slot(5, seg), 2222)
    entry = d.publish([(NS, h, *a, SLOT, 1, 0)])[0]
    flips = 0
    while p.poll() is None:
        d.unpublish(entry)
        off, gen = b if flips % 2 == 0 else a
        entry = d.publish([(NS, h, off, gen, SLOT, 1, 0)])[0]
        flips += 1
    out = p.stdout.read().strip()
    assert p.returncode == 0, out
    seen = {tuple(pair) for pair in json.loads(out)}  # the (offset, gen) pairs the reader saw
    assert seen and seen <= {a, b}, (seen, flips)
    assert flips > 1000


def test_publish_of_many_is_one_at_a_time_in_one_write(seg: PoolSegment) -> None:
    """One publish of many items leaves the same entries, byte for byte, as one publish each, in
    order: a full bucket's extra item gets -1 in both, and an item whose bucket has room takes the
    same free entry (L1Store.commit publishes a store's chunks in one call)."""
    twin = PoolSegment.create(64 * SLOT, 16)
    try:
        many, one = Directory(seg, complete=True), Directory(twin, complete=True)
        full = list(itertools.islice(in_bucket(0, many.nbuckets, NS), BUCKET + 2))
        a, b = itertools.islice(in_bucket(1, many.nbuckets, NS), 2)  # (the other bucket: room)
        items = [(NS, h, slot(i, seg), i, SLOT, i + 1, i) for i, h in enumerate([a, *full, b])]
        got = many.publish(items)
        assert got == [one.publish([item])[0] for item in items]
        assert got.count(-1) == 2 and len(set(got) - {-1}) == len(items) - 2
        assert bytes(seg.meta[seg.directory_offset : seg.directory_offset + many.entries * 128]) == bytes(
            twin.meta[twin.directory_offset : twin.directory_offset + one.entries * 128]
        )
        many.check_integrity(len(items) - 2)
        assert many.read(got[0]) == one.read(got[0]) and many.read(got[0]) is not None
        assert many.publish([]) == []
        many.close()
        one.close()
    finally:
        twin.close()
        twin.unlink()


@pytest.mark.parametrize(
    "bad",
    [(NS, digest(9), 0, 0, SLOT, 1, 0), (NS, b"short", SLOT, 0, SLOT, 1, 0), (NS[:31], digest(9), SLOT, 0, SLOT, 1, 0)],
)
def test_publish_checks_every_item_before_writing_any(seg: PoolSegment, bad: tuple) -> None:  # type: ignore[type-arg]
    """A bad item anywhere in a publish (offset 0, a digest not of 32 bytes) is a ValueError and
    nothing is written, not even the good items before it: the owner's bookkeeping (Listings)
    never misses an entry that is in the directory."""
    d = Directory(seg, complete=True)
    good = [(NS, digest(i), slot(i, seg), 0, SLOT, i + 1, 0) for i in range(3)]
    with pytest.raises(ValueError):
        d.publish([*good, bad])
    d.check_integrity(0)
    entries = d.publish(good)  # (then the good ones go in, and only they)
    assert min(entries) >= 0
    d.check_integrity(3)
    d.close()

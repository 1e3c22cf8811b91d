"""kvdock.storage.disk: the L2 file format on disk, atomic writes, the start-up scan, LRU budget."""

from __future__ import annotations

import errno
import os
import resource
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvdock.keys import ObjectKey
from kvdock.storage import disk as diskmod
from kvdock.storage import objfile
from kvdock.storage.disk import DiskEntry, DiskInUseError, DiskStore, ScanReport
from kvdock.storage.objfile import ALIGN, CorruptObject

DTYPE = "float32"
SHAPE = [2, 3, 16, 10]
NB = 2 * 3 * 16 * 10 * 4  # 3840: not a page multiple
FILE = ALIGN + NB  # size of one object file


def K(i: int, model: str = "tiny") -> ObjectKey:
    return ObjectKey(model, 0, "", bytes([i]) * 32)


def payload(i: int) -> bytes:
    return bytes((j * 7 + i * 13) % 256 for j in range(NB))


def write(store: DiskStore, key: ObjectKey, data: bytes | None = None) -> DiskEntry:
    """Write an object file the way the tiers do (no indexing)."""
    data = payload(key.chunk[0]) if data is None else data
    path = store.path_for(key)
    size = diskmod.write_object(path, objfile.encode_header(key, DTYPE, SHAPE, memoryview(data)), memoryview(data))
    return DiskEntry(key, path, size)


def put(store: DiskStore, key: ObjectKey, data: bytes | None = None) -> DiskEntry:
    """make_room + write + add, deleting what was evicted; checks integrity."""
    evicted = store.make_room(FILE)
    for e in evicted:
        e.path.unlink()
    entry = write(store, key, data)
    store.add(entry, FILE)
    store.check_integrity()
    return entry


def files(root: Path) -> list[Path]:
    return sorted(p for p in root.glob("*/*"))


_open: list[DiskStore] = []  # stores to close at teardown (close() is not idempotent)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[DiskStore]:
    _open.append(DiskStore(tmp_path / "l2", capacity=10 * FILE))
    yield _open[-1]
    while _open:
        _open.pop().close()


def reopen(store: DiskStore, capacity: int | None = None) -> DiskStore:
    """Close ``store`` and open its directory again, as a restarted server does."""
    _open.remove(store)
    store.close()
    _open.append(DiskStore(store.root, store.capacity if capacity is None else capacity))
    return _open[-1]


# ---------------------------------------------------------------- one file


def test_write_then_read_is_byte_exact(store: DiskStore) -> None:
    data = payload(1)
    entry = write(store, K(1), data)
    assert entry.file_size == FILE == entry.path.stat().st_size
    assert entry.path == store.root / entry.path.name[:2] / entry.path.name
    assert entry.path.name == diskmod.object_name(K(1)) + ".kv" and len(entry.path.name) == 51
    out = memoryview(bytearray(NB))
    header = diskmod.read_object(entry.path, out)
    assert bytes(out) == data
    assert header.key == K(1) and header.dtype == DTYPE and list(header.shape) == SHAPE and header.nbytes == NB
    raw = entry.path.read_bytes()
    assert raw[:8] == objfile.MAGIC and raw[ALIGN:] == data


def test_read_into_a_slice_of_a_larger_buffer(store: DiskStore) -> None:
    entry = write(store, K(2))
    pool = bytearray(3 * ALIGN)
    pool[:] = b"\xaa" * len(pool)
    diskmod.read_object(entry.path, memoryview(pool)[ALIGN : ALIGN + NB])
    assert pool[ALIGN : ALIGN + NB] == payload(2)
    assert pool[:ALIGN] == b"\xaa" * ALIGN and pool[ALIGN + NB :] == b"\xaa" * (2 * ALIGN - NB)


def test_read_of_wrong_size_buffer_raises(store: DiskStore) -> None:
    entry = write(store, K(1))
    with pytest.raises(CorruptObject, match=f"payload is {NB} bytes, expected {NB + 1}"):
        diskmod.read_object(entry.path, memoryview(bytearray(NB + 1)))


def test_write_leaves_no_temp_file_and_replaces_atomically(store: DiskStore) -> None:
    write(store, K(1), payload(1))
    entry = write(store, K(1), payload(9))  # a new version over the old file
    assert files(store.root) == [entry.path]
    assert not any(p.name.startswith(".tmp") for p in store.root.rglob("*"))
    out = memoryview(bytearray(NB))
    diskmod.read_object(entry.path, out)
    assert bytes(out) == payload(9)


def test_failed_write_leaves_no_temp_file(store: DiskStore) -> None:
    """A write that fails midway (file size limit: a real EFBIG from the kernel) removes its temp
    file and leaves the previous version of the object in place."""
    old = write(store, K(1), payload(1))
    data = payload(2)
    header = objfile.encode_header(K(1), DTYPE, SHAPE, memoryview(data))
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (ALIGN + 100, hard))
    try:
        with pytest.raises(OSError) as info:
            diskmod.write_object(old.path, header, memoryview(data))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)
    assert info.value.errno == errno.EFBIG
    assert files(store.root) == [old.path]
    out = memoryview(bytearray(NB))
    diskmod.read_object(old.path, out)
    assert bytes(out) == payload(1)


def test_flipped_payload_byte_raises(store: DiskStore) -> None:
    entry = write(store, K(3))
    with open(entry.path, "r+b") as f:
        f.seek(ALIGN + 100)
        b = f.read(1)
        f.seek(ALIGN + 100)
        f.write(bytes([b[0] ^ 0x40]))
    with pytest.raises(CorruptObject, match="checksum mismatch"):
        diskmod.read_object(entry.path, memoryview(bytearray(NB)))


def test_truncated_file_raises_on_read(store: DiskStore) -> None:
    entry = write(store, K(3))
    os.truncate(entry.path, FILE - 10)
    with pytest.raises(CorruptObject, match="shorter than its header"):
        diskmod.read_object(entry.path, memoryview(bytearray(NB)))


def test_read_of_a_vanished_file_is_oserror(store: DiskStore) -> None:
    with pytest.raises(FileNotFoundError):
        diskmod.read_object(store.path_for(K(4)), memoryview(bytearray(NB)))


# ---------------------------------------------------------------- scan


def test_scan_removes_temp_torn_and_misnamed_files(store: DiskStore) -> None:
    good = [write(store, K(i)) for i in (1, 2, 3)]
    fan = good[0].path.parent
    (fan / ".tmp-x").write_bytes(b"half a write")
    torn = write(store, K(4))
    os.truncate(torn.path, FILE - 1)
    misnamed = fan / ("0" * 48 + ".kv")
    misnamed.write_bytes(write(store, K(5)).path.read_bytes())
    store.path_for(K(5)).unlink()
    garbage = store.root / "ab" / ("ab" + "1" * 46 + ".kv")
    garbage.parent.mkdir(exist_ok=True)
    garbage.write_bytes(b"not an object at all")
    empty = store.root / "cd" / ("cd" + "2" * 46 + ".kv")
    empty.parent.mkdir(exist_ok=True)
    empty.write_bytes(b"")
    other = fan / "notes.txt"  # not ours: left alone
    other.write_text("hello")

    s2 = reopen(store)
    assert s2.scan() == ScanReport(loaded=3, torn=4, temp_files=1)
    assert files(s2.root) == sorted([*(e.path for e in good), other])
    assert len(s2) == 3 and s2.used_bytes == 3 * FILE and s2.pending_bytes == 0
    assert all(s2.contains(K(i)) for i in (1, 2, 3)) and not s2.contains(K(4)) and not s2.contains(K(5))
    s2.check_integrity()


def test_scan_of_an_empty_dir(store: DiskStore) -> None:
    assert store.scan() == ScanReport(0, 0, 0)
    assert len(store) == 0 and store.used_bytes == 0
    store.check_integrity()


def test_scan_orders_lru_by_mtime(store: DiskStore) -> None:
    entries = {i: write(store, K(i)) for i in range(1, 6)}
    mtimes = {1: 5000, 2: 1000, 3: 4000, 4: 2000, 5: 3000}  # LRU order: 2 4 5 3 1
    for i, t in mtimes.items():
        os.utime(entries[i].path, (t, t))
    s2 = reopen(store, capacity=5 * FILE)
    assert s2.scan() == ScanReport(5, 0, 0)
    assert list(s2._index) == [K(2), K(4), K(5), K(3), K(1)]
    s2.check_integrity()
    assert [e.key for e in s2.make_room(2 * FILE)] == [K(2), K(4)]
    assert s2.used_bytes == 3 * FILE and s2.pending_bytes == 2 * FILE


def test_scan_evicts_oldest_when_the_budget_shrank(store: DiskStore) -> None:
    entries = {i: write(store, K(i)) for i in range(1, 5)}
    for i, t in {1: 400, 2: 100, 3: 300, 4: 200}.items():
        os.utime(entries[i].path, (t, t))
    s2 = reopen(store, capacity=2 * FILE + 100)
    assert s2.scan() == ScanReport(loaded=2, torn=0, temp_files=0)
    assert list(s2._index) == [K(3), K(1)]
    assert not entries[2].path.exists() and not entries[4].path.exists()
    assert s2.used_bytes == 2 * FILE and s2.pending_bytes == 0
    s2.check_integrity()


# ---------------------------------------------------------------- index and budget


def test_make_room_evicts_exact_lru_keys(tmp_path: Path) -> None:
    s = DiskStore(tmp_path, capacity=4 * FILE)
    try:
        for i in (1, 2, 3, 4):
            put(s, K(i))
        assert s.used_bytes == 4 * FILE
        assert s.get(K(1)) is not None  # 1 becomes most recently used: order 2 3 4 1
        assert s.get(K(9)) is None
        evicted = s.make_room(FILE)
        assert [e.key for e in evicted] == [K(2)]
        assert s.used_bytes == 3 * FILE and s.pending_bytes == FILE
        for e in evicted:
            e.path.unlink()
        s.check_integrity()
        assert s.make_room(0) == []  # used + pending == capacity: fits exactly
        s.release(FILE)
        assert s.pending_bytes == 0
        assert [e.key for e in s.make_room(3 * FILE)] == [K(3), K(4)]  # 1 still fits beside 3 files
        assert s.pending_bytes == 3 * FILE and s.used_bytes == FILE
    finally:
        s.close()


def test_make_room_respects_pending_bytes(tmp_path: Path) -> None:
    s = DiskStore(tmp_path, capacity=4 * FILE)
    try:
        put(s, K(1))
        put(s, K(2))
        assert s.make_room(FILE) == [] and s.make_room(FILE) == []  # two writes in flight
        assert s.pending_bytes == 2 * FILE and s.used_bytes == 2 * FILE
        # a third write needs room: the promised bytes count, so the oldest file goes
        assert [e.key for e in s.make_room(FILE)] == [K(1)]
        assert s.used_bytes == FILE and s.pending_bytes == 3 * FILE
        s.release(FILE)
        assert s.pending_bytes == 2 * FILE
        # writes in flight plus this one exceed the whole budget: refused, nothing evicted
        assert s.make_room(3 * FILE) is None
        assert len(s) == 1 and s.used_bytes == FILE and s.pending_bytes == 2 * FILE
        # what fits alongside the writes in flight evicts the rest
        assert [e.key for e in s.make_room(2 * FILE)] == [K(2)]
        assert len(s) == 0 and s.used_bytes == 0 and s.pending_bytes == 4 * FILE
    finally:
        s.close()


def test_add_replaces_an_older_version(tmp_path: Path) -> None:
    s = DiskStore(tmp_path, capacity=10 * FILE)
    try:
        put(s, K(1))
        put(s, K(2))
        s.make_room(FILE + 5)
        e2 = write(s, K(1), payload(42))
        s.add(DiskEntry(K(1), e2.path, FILE + 5), FILE + 5)  # a different size to see the accounting
        assert len(s) == 2 and s.used_bytes == 2 * FILE + 5 and s.pending_bytes == 0
        assert list(s._index) == [K(2), K(1)]  # the new version is most recently used
        assert s.get(K(1)) is not None and s.get(K(1)).file_size == FILE + 5  # type: ignore[union-attr]
        assert s.remove(K(1)) is not None and s.remove(K(1)) is None
        assert s.used_bytes == FILE
        s.check_integrity()
    finally:
        s.close()


def test_remove_and_clear(store: DiskStore) -> None:
    entries = [put(store, K(i)) for i in (1, 2, 3)]
    assert store.remove(K(2)) == entries[1] and store.used_bytes == 2 * FILE
    entries[1].path.unlink()
    store.check_integrity()
    assert store.clear() == [entries[0], entries[2]]
    assert len(store) == 0 and store.used_bytes == 0
    store.check_integrity()


def test_check_integrity_fails_when_an_indexed_file_vanishes(store: DiskStore) -> None:
    entries = [put(store, K(i)) for i in (1, 2)]
    entries[0].path.unlink()
    with pytest.raises(AssertionError, match="is missing"):
        store.check_integrity()


def test_check_integrity_fails_on_wrong_accounting(store: DiskStore) -> None:
    put(store, K(1))
    store.used_bytes += 1
    with pytest.raises(AssertionError):
        store.check_integrity()


def test_second_store_on_the_same_dir_is_refused(store: DiskStore) -> None:
    with pytest.raises(DiskInUseError, match="in use"):
        DiskStore(store.root, capacity=FILE)
    with pytest.raises(DiskInUseError):  # the failed attempt left the lock with its owner
        DiskStore(store.root, capacity=FILE)
    again = reopen(store, capacity=FILE)  # free once the owner closed it
    assert again.scan() == ScanReport(0, 0, 0)

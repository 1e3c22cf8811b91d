"""kvdock.storage.disk: the L2 file format on disk, atomic writes, the start-up scan, the LRU budget,
and DiskTier's I/O API (read_into / write_from / delete / clear, called from worker threads) with
its thread-safe index (knows / heads: each object's place in its version chain, from its header)."""

from __future__ import annotations

import errno
import logging
import os
import resource
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvdock.keys import ObjectKey
from kvdock.layout import KVGeometry
from kvdock.storage import StorageTier, diskspace, objfile
from kvdock.storage import disk as diskmod
from kvdock.storage.disk import DiskEntry, DiskInUseError, DiskTier, NoRoom, ScanReport
from kvdock.storage.objfile import ALIGN, CorruptObject
from kvdock.storage.tier import Head
from tierworld import K as WK
from tierworld import World, legacy_header, run

DTYPE = "float32"
SHAPE = [2, 3, 16, 10]
NB = 2 * 3 * 16 * 10 * 4  # 3840: not a page multiple
FILE = ALIGN + NB  # size of one object file
GEO, CHUNK = KVGeometry(3, 2, 5, DTYPE), 16  # chunks of SHAPE


def K(i: int, model: str = "tiny") -> ObjectKey:
    return ObjectKey(model, 0, "", bytes([i]) * 32)


def payload(i: int, n: int = NB) -> bytes:
    return bytes((j * 7 + i * 13) % 256 for j in range(n))


def H(i: int) -> Head:
    """A head for object ``i`` of a test: a nonzero version, its predecessor's as parent."""
    return Head(1000 + i, 1000 + i - 1 if i > 1 else 0)


NO_HEAD = Head(0, 0)  # what objects written before version chains read as


def header(key: ObjectKey, data: bytes, head: Head = NO_HEAD) -> bytes:
    return objfile.encode_header(key, DTYPE, SHAPE, memoryview(data), *head[:2], identity=GEO.digest(CHUNK))


def write(store: DiskTier, key: ObjectKey, data: bytes | None = None, head: Head | None = None) -> DiskEntry:
    """Write an object file beside the tier (no indexing), as a previous run of the server did;
    ``head`` defaults to H(i) for K(i)."""
    data = payload(key.chunk[0]) if data is None else data
    head = H(key.chunk[0]) if head is None else head
    path = store.path_for(key)
    size = diskmod.write_object(path, header(key, data, head), memoryview(data))
    return DiskEntry(key, path, size, head)


def put(store: DiskTier, key: ObjectKey, data: bytes | None = None, head: Head | None = None) -> DiskEntry:
    """write_from as the lane's writer thread does; checks integrity and that the index took the
    header's head (H(i) for K(i) by default); returns the index entry."""
    data = payload(key.chunk[0]) if data is None else data
    head = H(key.chunk[0]) if head is None else head
    size = store.write_from(key, header(key, data, head), memoryview(data))
    assert size == ALIGN + len(data)
    store.check_integrity()
    entry = store._index[key]
    assert entry.head == head == store.knows(key)
    return entry


def read(store: DiskTier, key: ObjectKey) -> bytes | None:
    """The payload of ``key`` through read_into, None on a miss; the head read_into returns must be
    the one the file's header holds."""
    out = memoryview(bytearray(NB))
    entry = store._index.get(key)
    got = store.read_into(key, out, GEO, CHUNK)
    if got is None:
        return None
    assert entry is not None and got == entry.head, (got, entry)
    return bytes(out)


def files(root: Path) -> list[Path]:
    return sorted(p for p in root.glob("*/*"))


def flip_last_byte(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))


_open: list[DiskTier] = []  # tiers to close at teardown


@pytest.fixture
def store(tmp_path: Path) -> Iterator[DiskTier]:
    _open.append(DiskTier(tmp_path / "l2", capacity=10 * FILE))
    yield _open[-1]
    while _open:
        _open.pop().close()


def reopen(store: DiskTier, capacity: int | None = None) -> DiskTier:
    """Close ``store`` and open its directory again, as a restarted server does."""
    _open.remove(store)
    store.close()
    _open.append(DiskTier(store.root, store.capacity if capacity is None else capacity))
    return _open[-1]


def test_l2_is_the_disk_tier() -> None:
    assert DiskTier.name == "l2" and issubclass(DiskTier, StorageTier)


# ---------------------------------------------------------------- one file


def test_write_then_read_is_byte_exact(store: DiskTier) -> None:
    data = payload(1)
    entry = write(store, K(1), data)
    assert entry.file_size == FILE == entry.path.stat().st_size
    assert entry.path == store.root / entry.path.name[:2] / entry.path.name
    assert entry.path.name == diskmod.object_name(K(1)) + ".kv" and len(entry.path.name) == 51
    out = memoryview(bytearray(NB))
    h = diskmod.read_object(entry.path, out)
    assert bytes(out) == data
    assert h.key == K(1) and h.dtype == DTYPE and list(h.shape) == SHAPE and h.nbytes == NB
    assert Head(h.version, h.parent) == H(1) == entry.head
    raw = entry.path.read_bytes()
    assert raw[:8] == objfile.MAGIC and raw[ALIGN:] == data


def test_read_into_a_slice_of_a_larger_buffer(store: DiskTier) -> None:
    entry = write(store, K(2))
    pool = bytearray(3 * ALIGN)
    pool[:] = b"\xaa" * len(pool)
    diskmod.read_object(entry.path, memoryview(pool)[ALIGN : ALIGN + NB])
    assert pool[ALIGN : ALIGN + NB] == payload(2)
    assert pool[:ALIGN] == b"\xaa" * ALIGN and pool[ALIGN + NB :] == b"\xaa" * (2 * ALIGN - NB)
    # the same through the tier's API, which returns the head of the file's header
    put(store, K(3), head=Head(77, 66))
    assert store.read_into(K(3), memoryview(pool)[ALIGN : ALIGN + NB], GEO, CHUNK) == Head(77, 66)
    assert pool[ALIGN : ALIGN + NB] == payload(3) and pool[:ALIGN] == b"\xaa" * ALIGN


def test_read_of_wrong_size_buffer_raises(store: DiskTier) -> None:
    entry = write(store, K(1))
    with pytest.raises(CorruptObject, match=f"payload is {NB} bytes, expected {NB + 1}"):
        diskmod.read_object(entry.path, memoryview(bytearray(NB + 1)))


def test_write_leaves_no_temp_file_and_replaces_atomically(store: DiskTier) -> None:
    write(store, K(1), payload(1))
    entry = write(store, K(1), payload(9))  # a new version over the old file
    assert files(store.root) == [entry.path]
    assert not any(p.name.startswith(".tmp") for p in store.root.rglob("*"))
    out = memoryview(bytearray(NB))
    diskmod.read_object(entry.path, out)
    assert bytes(out) == payload(9)


def test_failed_write_leaves_no_temp_file(store: DiskTier) -> None:
    """A write that fails midway (file size limit: a real EFBIG from the kernel) removes its temp
    file and leaves the previous version of the object in place."""
    old = write(store, K(1), payload(1))
    data = payload(2)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (ALIGN + 100, hard))
    try:
        with pytest.raises(OSError) as info:
            diskmod.write_object(old.path, header(K(1), data), memoryview(data))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)
    assert info.value.errno == errno.EFBIG
    assert files(store.root) == [old.path]
    out = memoryview(bytearray(NB))
    diskmod.read_object(old.path, out)
    assert bytes(out) == payload(1)


def test_failed_write_from_drops_the_older_version(store: DiskTier) -> None:
    """write_from that fails (EFBIG) raises, frees its promised bytes, and the older version of the
    key does not stay behind (it would be served after the newer one was acknowledged)."""
    put(store, K(1), payload(1))
    put(store, K(2))
    data = payload(5)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (ALIGN + 100, hard))
    try:
        with pytest.raises(OSError) as info:
            store.write_from(K(1), header(K(1), data), memoryview(data))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)
    assert info.value.errno == errno.EFBIG and not store.disk_full
    assert not store.knows(K(1)) and not store.path_for(K(1)).exists() and read(store, K(1)) is None
    assert store.used_bytes == FILE and files(store.root) == [store.path_for(K(2))]
    store.check_integrity()


def test_flipped_payload_byte_raises(store: DiskTier) -> None:
    entry = write(store, K(3))
    with open(entry.path, "r+b") as f:
        f.seek(ALIGN + 100)
        b = f.read(1)
        f.seek(ALIGN + 100)
        f.write(bytes([b[0] ^ 0x40]))
    with pytest.raises(CorruptObject, match="checksum mismatch"):
        diskmod.read_object(entry.path, memoryview(bytearray(NB)))


def test_truncated_file_raises_on_read(store: DiskTier) -> None:
    entry = write(store, K(3))
    os.truncate(entry.path, FILE - 10)
    with pytest.raises(CorruptObject, match="shorter than its header"):
        diskmod.read_object(entry.path, memoryview(bytearray(NB)))


def test_read_of_a_vanished_file_is_oserror(store: DiskTier) -> None:
    with pytest.raises(FileNotFoundError):
        diskmod.read_object(store.path_for(K(4)), memoryview(bytearray(NB)))


# ---------------------------------------------------------------- scan


def test_scan_removes_temp_torn_and_misnamed_files(store: DiskTier) -> None:
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
    assert s2.scan() == ScanReport(loaded=3, torn=4, temp_files=1) == s2.last_scan
    assert files(s2.root) == sorted([*(e.path for e in good), other])
    assert len(s2) == 3 and s2.used_bytes == 3 * FILE
    # each entry's head is the one in its file's header
    assert [s2.knows(K(i)) for i in (1, 2, 3)] == [H(1), H(2), H(3)]
    assert s2.knows(K(4)) is None and s2.knows(K(5)) is None
    assert s2.counters.corrupted == 4  # the torn files count as corrupted objects
    s2.check_integrity()


def test_a_file_whose_header_names_no_geometry_is_never_read(store: DiskTier) -> None:
    """Written before geometry digests (here before version chains too): scanned and indexed,
    but skipped by lookups once identity_of says the model's geometry, and refused (deleted) by
    a read: it cannot say which split of the heads its bytes are."""
    data = payload(1)
    path = store.path_for(K(1))
    path.parent.mkdir(exist_ok=True)
    diskmod.write_object(path, legacy_header(K(1), DTYPE, SHAPE, data), memoryview(data))
    write(store, K(2), head=Head(5, 0))
    s2 = reopen(store)
    assert s2.scan() == ScanReport(loaded=2, torn=0, temp_files=0)
    assert s2.knows(K(1)) == Head(0, 0) and s2.heads([K(1), K(2)]) == [Head(0, 0), Head(5, 0)]  # unfiltered
    s2.identity_of = lambda model: GEO.digest(CHUNK)  # as the server's registry says
    assert s2.knows(K(1)) is None and s2.knows(K(2)) == Head(5, 0)
    assert s2.heads([K(1), K(2)]) == [] and s2.heads([K(2)]) == [Head(5, 0)]
    s2.identity_of = lambda model: KVGeometry(3, 1, 10, DTYPE).digest(CHUNK)  # the same shape, split otherwise
    assert s2.knows(K(2)) is None
    out = memoryview(bytearray(NB))
    assert s2.read_into(K(1), out, GEO, CHUNK) is None and not path.exists()
    assert s2.read_into(K(2), out, KVGeometry(3, 1, 10, DTYPE), CHUNK) is None  # refused, deleted
    assert len(s2) == 0 and s2.counters.corrupted == 2
    s2.check_integrity()


def test_scan_of_an_empty_dir(store: DiskTier) -> None:
    assert store.scan() == ScanReport(0, 0, 0)
    assert len(store) == 0 and store.used_bytes == 0
    store.check_integrity()


def test_scan_orders_lru_by_mtime(store: DiskTier) -> None:
    entries = {i: write(store, K(i)) for i in range(1, 6)}
    mtimes = {1: 5000, 2: 1000, 3: 4000, 4: 2000, 5: 3000}  # LRU order: 2 4 5 3 1
    for i, t in mtimes.items():
        os.utime(entries[i].path, (t, t))
    s2 = reopen(store, capacity=5 * FILE)
    assert s2.scan() == ScanReport(5, 0, 0)
    assert s2.order() == [K(2), K(4), K(5), K(3), K(1)]
    s2.check_integrity()
    put(s2, K(6))
    put(s2, K(7))  # two new files evict the two least recently used
    assert s2.order() == [K(5), K(3), K(1), K(6), K(7)]
    assert not entries[2].path.exists() and not entries[4].path.exists()
    assert s2.used_bytes == 5 * FILE


def test_scan_evicts_oldest_when_the_budget_shrank(store: DiskTier) -> None:
    entries = {i: write(store, K(i)) for i in range(1, 5)}
    for i, t in {1: 400, 2: 100, 3: 300, 4: 200}.items():
        os.utime(entries[i].path, (t, t))
    s2 = reopen(store, capacity=2 * FILE + 100)
    assert s2.scan() == ScanReport(loaded=2, torn=0, temp_files=0)
    assert s2.order() == [K(3), K(1)]
    assert not entries[2].path.exists() and not entries[4].path.exists()
    assert s2.used_bytes == 2 * FILE
    s2.check_integrity()


# ---------------------------------------------------------------- index and budget


def test_writes_evict_exact_lru_keys(tmp_path: Path) -> None:
    s = DiskTier(tmp_path, capacity=4 * FILE)
    try:
        for i in (1, 2, 3, 4):
            put(s, K(i))
        assert s.used_bytes == 4 * FILE
        assert read(s, K(1)) == payload(1)  # 1 becomes most recently used: order 2 3 4 1
        assert read(s, K(9)) is None
        put(s, K(5))
        assert s.order() == [K(3), K(4), K(1), K(5)] and not s.path_for(K(2)).exists()
        assert s.used_bytes == 4 * FILE
        put(s, K(6), payload(6, 2 * FILE - ALIGN))  # a file of two: the next two go
        assert s.order() == [K(1), K(5), K(6)]
        assert s.used_bytes == 4 * FILE and files(s.root) == sorted(s.path_for(k) for k in (K(1), K(5), K(6)))
        # larger than the whole budget: refused, nothing evicted
        big = payload(7, 4 * FILE)
        with pytest.raises(NoRoom, match=f"{ALIGN + 4 * FILE} bytes do not fit in the L2 budget of {4 * FILE}"):
            s.write_from(K(7), header(K(7), big), memoryview(big))
        assert s.order() == [K(1), K(5), K(6)] and s.used_bytes == 4 * FILE
        s.check_integrity()
    finally:
        s.close()


def test_write_from_counts_the_bytes_of_writes_in_flight(tmp_path: Path) -> None:
    """The bytes of a write are promised (under the lock) before its file is written, so writes
    in flight together never overshoot the budget (regression: concurrent writes did)."""
    s = DiskTier(tmp_path, capacity=2 * FILE)
    s.fault_write_delay_s = 1.0
    try:
        data = payload(1)
        threads = [
            threading.Thread(target=s.write_from, args=(K(i), header(K(i), data), memoryview(data))) for i in (1, 2)
        ]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 5
        while s.pending_bytes < 2 * FILE:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        assert len(s) == 0 and s.used_bytes == 0  # both promised, neither indexed yet
        # a third write needs room: nothing indexed can be evicted, the two in flight count
        s.fault_write_delay_s = 0
        data = payload(3)
        with pytest.raises(NoRoom):
            s.write_from(K(3), header(K(3), data), memoryview(data))
        for t in threads:
            t.join()
        assert sorted(s._index, key=lambda k: k.chunk) == [K(1), K(2)] and s.used_bytes == 2 * FILE
        s.check_integrity()
        put(s, K(3))  # with both indexed, the least recently used one makes room
        assert len(s) == 2 and s.knows(K(3)) and s.used_bytes == 2 * FILE
    finally:
        s.close()


def test_write_from_replaces_an_older_version(tmp_path: Path) -> None:
    s = DiskTier(tmp_path, capacity=10 * FILE)
    try:
        put(s, K(1))
        put(s, K(2))
        put(s, K(1), payload(42, NB + 5), Head(4242, 0))  # a different size to see the accounting
        assert s.knows(K(1)) == Head(4242, 0)  # the new version's head
        assert len(s) == 2 and s.used_bytes == 2 * FILE + 5
        assert s.order() == [K(2), K(1)]  # the new version is most recently used
        assert s._index[K(1)].file_size == FILE + 5 == s.path_for(K(1)).stat().st_size
        assert files(s.root) == sorted([s.path_for(K(1)), s.path_for(K(2))])
        s.delete(K(1))
        assert s.used_bytes == FILE and not s.knows(K(1))
        s.check_integrity()
    finally:
        s.close()


def test_write_that_does_not_fit_drops_the_older_version(store: DiskTier) -> None:
    put(store, K(1))
    big = payload(1, 11 * FILE)
    with pytest.raises(NoRoom):
        store.write_from(K(1), header(K(1), big), memoryview(big))
    assert not store.knows(K(1)) and not store.path_for(K(1)).exists() and store.used_bytes == 0
    store.check_integrity()


def test_knows_and_heads(store: DiskTier) -> None:
    # changed on purpose: knows() gives the object's head (None if absent) instead of a bool, and
    # heads() (the heads of the leading run) replaces count_present
    for i in (1, 2, 4):
        put(store, K(i))
    assert store.indexed is True
    assert store.knows(K(1)) == H(1) and store.knows(K(2)) == Head(1002, 1001) and store.knows(K(3)) is None
    assert store.heads([]) == []
    assert store.heads([K(1), K(2), K(3), K(4)]) == [H(1), H(2)]
    assert store.heads([K(3), K(1)]) == []
    assert store.heads([K(4), K(1), K(1, model="other")]) == [H(4), H(1)]
    assert store.up() and not store.probe_due()


def test_delete_removes_file_and_index_entry_and_is_harmless_when_absent(store: DiskTier) -> None:
    entries = [put(store, K(i)) for i in (1, 2, 3)]
    store.delete(K(2))
    assert not entries[1].path.exists() and not store.knows(K(2)) and read(store, K(2)) is None
    assert store.used_bytes == 2 * FILE and store.order() == [K(1), K(3)]
    store.check_integrity()
    store.delete(K(2))  # absent now: harmless
    store.delete(K(9))  # never there (its fan-out directory does not even exist)
    assert store.used_bytes == 2 * FILE and len(store) == 2
    # a file left on the key's path without an index entry (e.g. by a crash) goes too
    stray = write(store, K(7))
    store.delete(K(7))
    assert not stray.path.exists()
    store.check_integrity()


def test_clear(store: DiskTier) -> None:
    entries = [put(store, K(i)) for i in (1, 2, 3)]
    store.delete(K(2))
    assert store.clear() == 2
    assert len(store) == 0 and store.used_bytes == 0
    assert not any(e.path.exists() for e in entries)
    store.check_integrity()
    assert store.clear() == 0


def test_status(store: DiskTier) -> None:
    put(store, K(1))
    assert store.status() == {
        "kind": "disk",
        "up": True,
        "path": str(store.root),
        "capacity_bytes": 10 * FILE,
        "used_bytes": FILE,
        "objects": 1,
        "disk_full": False,
    }


# ---------------------------------------------------------------- reads that find a bad file


def test_read_into_a_corrupt_file_unlinks_it_and_counts_it(store: DiskTier, caplog: pytest.LogCaptureFixture) -> None:
    put(store, K(1))
    put(store, K(2))
    flip_last_byte(store.path_for(K(1)))
    with caplog.at_level(logging.WARNING, "kvdock.storage.disk"):
        assert read(store, K(1)) is None
    assert "is corrupted (checksum mismatch); deleted" in caplog.text
    assert not store.path_for(K(1)).exists() and not store.knows(K(1))
    assert store.counters.corrupted == 1 and store.used_bytes == FILE
    # a file of another object (or layout) under the key's path is refused the same way
    data = payload(2)
    store.path_for(K(2)).write_bytes(header(K(3), data) + data)
    assert read(store, K(2)) is None and not store.path_for(K(2)).exists() and store.counters.corrupted == 2
    store.check_integrity()


def test_a_vanished_file_is_forgotten_not_counted_corrupt(store: DiskTier) -> None:
    put(store, K(1))
    store.path_for(K(1)).unlink()  # e.g. someone cleaned the directory by hand
    assert read(store, K(1)) is None
    assert not store.knows(K(1)) and store.used_bytes == 0 and store.counters.corrupted == 0
    store.check_integrity()


def test_drop_of_a_stale_entry_never_unlinks_a_newer_file(store: DiskTier) -> None:
    """A reader found the file it read corrupt, but meanwhile a newer version was renamed onto the
    same path: the reader must not unlink it (it unlinks only while the index names its file)."""
    stale = put(store, K(1), payload(1))
    fresh = put(store, K(1), payload(2))  # the writer thread replaced it
    assert stale is not fresh and stale.path == fresh.path
    store._drop(stale, CorruptObject("checksum mismatch"))
    assert store._index[K(1)] is fresh and fresh.path.exists() and store.used_bytes == FILE
    assert store.counters.corrupted == 0
    assert read(store, K(1)) == payload(2)
    # a deletion meanwhile: the stale entry is not in the index either, nothing happens
    store.delete(K(1))
    put(store, K(2))
    store._drop(fresh, CorruptObject("x"))
    assert store.used_bytes == FILE and store.knows(K(2))
    store.check_integrity()


# ---------------------------------------------------------------- ENOSPC


def enospc(path: Path, h: bytes, p: memoryview) -> Path:
    raise OSError(errno.ENOSPC, "No space left on device")


class FakeDisk:
    """What statvfs says of the disk (``free`` bytes of ``total``), and the clock of the re-probes."""

    def __init__(self, store: DiskTier, monkeypatch: pytest.MonkeyPatch, free: int = 0, total: int = 1000 * FILE):
        self.free, self.total, self.now, self.probes = free, total, 1000.0, 0
        monkeypatch.setattr(diskspace, "free_space", self._free_space)
        monkeypatch.setattr(store.space, "clock", lambda: self.now)

    def _free_space(self, path: Path) -> tuple[int, int]:
        self.probes += 1
        return self.free, self.total


def test_disk_full_cuts_the_budget_to_what_is_stored(
    store: DiskTier, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    for i in (1, 2, 3):
        put(store, K(i))
    disk = FakeDisk(store, monkeypatch)  # no room, whenever it is asked
    real_write_temp = diskmod._write_temp
    monkeypatch.setattr(diskmod, "_write_temp", enospc)
    with caplog.at_level(logging.WARNING, "kvdock.storage.disk"):
        data = payload(4)
        with pytest.raises(NoRoom, match=f"disk full at {store.root}"):
            store.write_from(K(4), header(K(4), data), memoryview(data))
        assert store.disk_full and store.status()["disk_full"] is True
        assert store.capacity == store.used_bytes == 3 * FILE and store.order() == [K(1), K(2), K(3)]
        # the next write makes room in the cut budget (evicting the least recently used file);
        # still ENOSPC: the budget is cut again, to what is stored now
        data = payload(5)
        with pytest.raises(NoRoom, match=f"disk full at {store.root}"):
            store.write_from(K(5), header(K(5), data), memoryview(data))
        assert store.capacity == store.used_bytes == 2 * FILE and store.order() == [K(2), K(3)]
    warnings = [r for r in caplog.records if "disk full" in r.getMessage()]
    assert len(warnings) == 1, "the disk-full warning is logged once"
    assert f"budget cut to the {3 * FILE} bytes stored" in warnings[0].getMessage()
    assert not any(p.name.startswith(".tmp") for p in store.root.rglob("*"))
    assert not store.path_for(K(1)).exists()
    store.check_integrity()
    # later writes make room by evicting the least recently used files instead of failing
    monkeypatch.setattr(diskmod, "_write_temp", real_write_temp)
    put(store, K(4))
    assert store.order() == [K(3), K(4)] and not store.path_for(K(2)).exists()
    disk.now += 3600  # however long after: the disk still has no room when asked
    put(store, K(5))
    assert store.order() == [K(4), K(5)] and store.used_bytes == 2 * FILE == store.capacity
    assert store.disk_full and disk.probes == 1  # stays cut: the disk told us what it holds
    store.check_integrity()


def test_a_full_disk_is_probed_with_backoff_and_its_budget_comes_back_with_room(
    store: DiskTier, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    put(store, K(1))
    put(store, K(2))
    disk = FakeDisk(store, monkeypatch)  # reserve: 1/100 of the disk, 10 files
    real_write_temp = diskmod._write_temp
    monkeypatch.setattr(diskmod, "_write_temp", enospc)
    with caplog.at_level(logging.INFO, "kvdock.storage.disk"):
        with pytest.raises(NoRoom, match="disk full"):
            store.write_from(K(3), header(K(3), payload(3)), memoryview(payload(3)))
        monkeypatch.setattr(diskmod, "_write_temp", real_write_temp)
        assert store.disk_full and store.capacity == 2 * FILE
        disk.now += diskspace.PROBE_FIRST_S - 0.1
        put(store, K(3))  # before the first re-probe is due: within the cut budget (K1 evicted)
        assert disk.probes == 0 and store.order() == [K(2), K(3)]
        disk.now += 0.2
        put(store, K(4))  # probed: still no room, and the next probe waits twice as long
        assert disk.probes == 1 and store.disk_full and store.order() == [K(3), K(4)]
        disk.free = 13 * FILE  # room for 3 more files beyond the reserve
        disk.now += 2 * diskspace.PROBE_FIRST_S - 0.1
        put(store, K(5))
        assert disk.probes == 1 and store.disk_full and store.order() == [K(4), K(5)]
        disk.now += 0.2
        put(store, K(6))  # room again: the budget is back, bounded by what the disk holds
        assert disk.probes == 2 and not store.disk_full
        assert store.capacity == 2 * FILE + 3 * FILE and store.order() == [K(4), K(5), K(6)]
        assert store.status()["disk_full"] is False and store.status()["capacity_bytes"] == 5 * FILE
        put(store, K(7))
        put(store, K(8))
        assert store.order() == [K(4), K(5), K(6), K(7), K(8)] and disk.probes == 2  # no probe when not full
        # full again, then a disk with plenty of room: back to the whole configured budget
        monkeypatch.setattr(diskmod, "_write_temp", enospc)
        with pytest.raises(NoRoom, match="disk full"):
            store.write_from(K(9), header(K(9), payload(9)), memoryview(payload(9)))
        monkeypatch.setattr(diskmod, "_write_temp", real_write_temp)
        assert store.disk_full and store.capacity == 4 * FILE  # (K4 was evicted to make room first)
        disk.free, disk.now = 500 * FILE, disk.now + diskspace.PROBE_FIRST_S
        put(store, K(9))
        assert not store.disk_full and store.capacity == store.space.budget == 10 * FILE
        assert store.order() == [K(i) for i in range(5, 10)]
    messages = [r.getMessage() for r in caplog.records]
    full = [t for t in messages if "disk full" in t]
    room = [t for t in messages if "has room again (" in t]
    assert len(full) == 2 and len(room) == 2, messages  # once per transition
    assert f"budget cut to the {2 * FILE} bytes stored" in full[0]
    assert f"({13 * FILE} bytes free); budget back to {5 * FILE} bytes" in room[0]
    assert f"budget back to {10 * FILE} bytes" in room[1]
    store.check_integrity()


def test_a_full_disk_recovers_on_a_real_file_system_with_room(
    store: DiskTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No fakes but the ENOSPC itself: statvfs of the test's directory finds room."""
    put(store, K(1))
    monkeypatch.setattr(diskmod, "_write_temp", enospc)
    with pytest.raises(NoRoom, match="disk full"):
        store.write_from(K(2), header(K(2), payload(2)), memoryview(payload(2)))
    monkeypatch.undo()
    assert store.disk_full and store.capacity == FILE
    free, _ = diskspace.free_space(store.root)
    assert free > 20 * FILE, "the test's file system is nearly full"
    deadline = time.monotonic() + 30
    while store.disk_full:
        assert time.monotonic() < deadline, "the budget never came back"
        put(store, K(2))
        time.sleep(0.05)
    assert store.capacity == 10 * FILE  # (K1 was evicted to make room in the cut budget)
    for i in range(3, 8):
        put(store, K(i))
    assert store.order() == [K(i) for i in range(2, 8)]
    store.check_integrity()


def test_disk_full_on_an_overwrite_drops_the_older_version(store: DiskTier, monkeypatch: pytest.MonkeyPatch) -> None:
    put(store, K(1))
    put(store, K(2))
    FakeDisk(store, monkeypatch)
    monkeypatch.setattr(diskmod, "_write_temp", enospc)
    data = payload(9)
    with pytest.raises(NoRoom):
        store.write_from(K(1), header(K(1), data), memoryview(data))
    assert not store.knows(K(1)) and not store.path_for(K(1)).exists()
    assert store.capacity == store.used_bytes == FILE
    store.check_integrity()


# ---------------------------------------------------------------- integrity and the lock


def test_check_integrity_fails_when_an_indexed_file_vanishes(store: DiskTier) -> None:
    entries = [put(store, K(i)) for i in (1, 2)]
    entries[0].path.unlink()
    with pytest.raises(AssertionError, match="is missing"):
        store.check_integrity()


def test_check_integrity_fails_on_wrong_accounting(store: DiskTier) -> None:
    put(store, K(1))
    store._budget.used += 1
    with pytest.raises(AssertionError, match="bytes used drifted"):
        store.check_integrity()


def test_second_store_on_the_same_dir_is_refused(store: DiskTier) -> None:
    with pytest.raises(DiskInUseError, match="in use"):
        DiskTier(store.root, capacity=FILE)
    with pytest.raises(DiskInUseError):  # the failed attempt left the lock with its owner
        DiskTier(store.root, capacity=FILE)
    again = reopen(store, capacity=FILE)  # free once the owner closed it
    assert again.scan() == ScanReport(0, 0, 0)
    again.close()
    again.close()  # harmless twice


def test_a_closed_dir_is_free_though_a_forked_child_still_holds_its_lock_descriptor(store: DiskTier) -> None:
    """Regression (seen once under --cov: DiskInUseError on a reopen): a child forked while the
    tier was open holds a copy of the lock's descriptor, and a flock belongs to the open file, so
    closing ours alone left the directory locked until the child exited. close() unlocks first."""
    ready_r, ready_w = os.pipe()
    done_r, done_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: holds every descriptor of the parent, the lock's too, until told
        os.write(ready_w, b"x")
        os.read(done_r, 1)
        os._exit(0)
    try:
        assert os.read(ready_r, 1) == b"x"
        again = reopen(store)  # the child still runs with its copy of the descriptor
        assert again.scan() == ScanReport(0, 0, 0)
        with pytest.raises(DiskInUseError, match="in use"):  # and the new owner's lock holds
            DiskTier(store.root, capacity=FILE)
    finally:
        os.write(done_w, b"x")
        assert os.waitpid(pid, 0)[1] == 0
        for fd in (ready_r, ready_w, done_r, done_w):
            os.close(fd)


# ---------------------------------------------------------------- through the manager and a lane


def test_l2_budget_holds_with_a_long_cache_salt(tmp_path: Path) -> None:
    """Regression: the budget used to promise ALIGN + nbytes per file, but the header is padded to
    a multiple of 4 KiB and grows with the cache_salt (client input). write_from now counts the
    real header."""

    async def body(w: World) -> None:
        assert w.disk is not None
        salt = "s" * 5000
        w.store([WK(1, salt), WK(2, salt)])
        await w.drain()
        assert w.disk.used_bytes <= w.disk.capacity, (w.disk.used_bytes, w.disk.capacity)
        # one such file (8 KiB header) is all that fits in a budget of two plain files
        assert len(w.disk) == 1 and w.disk.knows(WK(2, salt)) and w.disk.counters.writes == 2

    run(tmp_path, body, disk_files=2)


def test_l2_budget_holds_with_writes_queued_together(tmp_path: Path) -> None:
    """Regression: writes in flight together used to overshoot the budget (make_room promised the
    bytes even with nothing left to evict)."""

    async def body(w: World) -> None:
        assert w.disk is not None
        gate = w.block()
        w.store([WK(1), WK(2), WK(3), WK(4)])  # four writes queued, room for two files
        gate.set()
        await w.drain()
        assert w.disk.used_bytes <= w.disk.capacity, (w.disk.used_bytes, w.disk.capacity, len(w.disk))
        assert list(w.disk._index) == [WK(3), WK(4)] and w.disk.counters.writes == 4

    run(tmp_path, body, disk_files=2)


# ---------------------------------------------------------------- durability of deletions


def test_delete_of_an_already_unlinked_file_still_syncs_its_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = DiskTier(tmp_path / "l2", capacity=FILE)
    try:
        put(s, K(1))
        put(s, K(2))  # evicts K(1): its file is unlinked, the directory is not synced
        assert not s.knows(K(1)) and not s.path_for(K(1)).exists()
        synced: list[Path] = []
        real = diskmod._fsync_dir
        monkeypatch.setattr(diskmod, "_fsync_dir", lambda p: (synced.append(p), real(p)))
        s.delete(K(1))  # an overwrite's durable deletion
        assert s.path_for(K(1)).parent in synced, "delete() returned without making the unlink durable"
    finally:
        s.close()

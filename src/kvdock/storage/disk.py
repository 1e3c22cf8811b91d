"""L2: one file per object in a local directory, kept across restarts.

Split by thread: the index (which keys are on disk, LRU order, bytes used) lives on the server's
event-loop thread; ``write_object`` / ``read_object`` do the file I/O in worker threads and never
touch the index.

Files are written to a temporary name, fsynced, then renamed, so a crash leaves either the old
file, the new one, or a ``.tmp`` file that the next start deletes. At start-up the index is
rebuilt from the headers; a file whose size does not match its header is torn and deleted. The
payload checksum is verified on every read, so a corrupted file is detected when it would be
used, deleted, and never returned.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import secrets
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from blake3 import blake3

from kvdock.errors import DiskInUseError
from kvdock.keys import ObjectKey
from kvdock.storage import objfile

log = logging.getLogger(__name__)

SUFFIX = ".kv"


@dataclass(slots=True)
class DiskEntry:
    key: ObjectKey
    path: Path
    file_size: int


@dataclass(frozen=True)
class ScanReport:
    loaded: int
    torn: int
    temp_files: int


def object_name(key: ObjectKey) -> str:
    h = blake3(key.model.encode() + b"\0" + str(key.rank).encode() + b"\0" + key.salt.encode() + b"\0" + key.chunk)
    return h.hexdigest()[:48]


class DiskStore:
    """Index of the L2 directory. Not thread-safe: call from the event loop only."""

    def __init__(self, root: Path, capacity: int) -> None:
        self.root = root
        self.capacity = capacity
        root.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(root / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(self._lock_fd)
            if e.errno in (errno.EAGAIN, errno.EACCES):
                raise DiskInUseError(f"disk dir {root} is in use by another kvdock server") from None
            raise
        self._index: OrderedDict[ObjectKey, DiskEntry] = OrderedDict()  # least recently used first
        self.used_bytes = 0
        self.pending_bytes = 0  # room promised to writes in flight
        self.last_scan = ScanReport(0, 0, 0)

    def close(self) -> None:
        """Release the directory lock; harmless twice."""
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    def __len__(self) -> int:
        return len(self._index)

    def path_for(self, key: ObjectKey) -> Path:
        name = object_name(key)
        return self.root / name[:2] / (name + SUFFIX)

    def scan(self) -> ScanReport:
        """Rebuild the index from the files (oldest modification first = least recently used)."""
        found: list[tuple[float, DiskEntry]] = []
        torn = temps = 0
        for path in self.root.glob("*/*"):
            if path.name.startswith(".tmp"):
                path.unlink(missing_ok=True)
                temps += 1
                continue
            if path.suffix != SUFFIX:
                continue
            try:
                st = path.stat()
                with open(path, "rb") as f:
                    first = f.read(objfile.ALIGN)
                    size = objfile.header_size_hint(first)
                    block = first if size <= len(first) else first + f.read(size - len(first))
                header, offset = objfile.decode_header(block)
                if st.st_size != offset + header.nbytes or path != self.path_for(header.key):
                    raise objfile.CorruptObject("size or name does not match the header")
            except (OSError, objfile.CorruptObject) as e:
                log.warning("L2: deleting torn or foreign file %s (%s)", path, e)
                path.unlink(missing_ok=True)
                torn += 1
                continue
            found.append((st.st_mtime, DiskEntry(header.key, path, st.st_size)))
        for _, entry in sorted(found, key=lambda t: t[0]):
            self._index[entry.key] = entry
            self.used_bytes += entry.file_size
        evicted = self.make_room(0) or []  # the budget may have shrunk since the last run
        for old in evicted:
            old.path.unlink(missing_ok=True)
        self.last_scan = ScanReport(len(self._index), torn, temps)
        return self.last_scan

    def get(self, key: ObjectKey) -> DiskEntry | None:
        """The entry for ``key`` (now most recently used) or None."""
        entry = self._index.get(key)
        if entry is not None:
            self._index.move_to_end(key)
        return entry

    def contains(self, key: ObjectKey) -> bool:
        return key in self._index

    def make_room(self, file_size: int) -> list[DiskEntry] | None:
        """Drop least recently used entries until ``file_size`` more bytes fit; returns them (the
        caller deletes their files), or None (nothing dropped) when writes already in flight leave
        no room. Bytes are promised to the write until :meth:`add`/:meth:`release`."""
        if self.pending_bytes + file_size > self.capacity:
            return None
        evicted = []
        while self._index and self.used_bytes + self.pending_bytes + file_size > self.capacity:
            _, entry = self._index.popitem(last=False)
            self.used_bytes -= entry.file_size
            evicted.append(entry)
        self.pending_bytes += file_size
        return evicted

    def release(self, file_size: int) -> None:
        """A promised write did not happen."""
        self.pending_bytes -= file_size

    def add(self, entry: DiskEntry, promised: int) -> None:
        """A write finished: index it (replacing an older version of the key)."""
        self.pending_bytes -= promised
        old = self._index.pop(entry.key, None)
        if old is not None:
            self.used_bytes -= old.file_size
        self._index[entry.key] = entry
        self.used_bytes += entry.file_size

    def remove(self, key: ObjectKey) -> DiskEntry | None:
        entry = self._index.pop(key, None)
        if entry is not None:
            self.used_bytes -= entry.file_size
        return entry

    def clear(self) -> list[DiskEntry]:
        entries = list(self._index.values())
        self._index.clear()
        self.used_bytes = 0
        return entries

    def check_integrity(self) -> None:
        """Assert: bytes used == sum of indexed files, within budget, every indexed file present."""
        assert self.used_bytes == sum(e.file_size for e in self._index.values())
        assert self.pending_bytes >= 0
        assert self.used_bytes <= self.capacity or not self._index
        for key, e in self._index.items():
            assert e.key == key and e.path == self.path_for(key)
            assert e.path.exists(), f"indexed file {e.path} is missing"


def write_object(path: Path, header: bytes, payload: memoryview) -> int:
    """Write header + payload to ``path`` atomically (temp file, fsync, rename); returns its size.
    Runs in a worker thread."""
    path.parent.mkdir(exist_ok=True)
    tmp = path.parent / f".tmp-{secrets.token_hex(8)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        _write_all(fd, [header, payload])
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    os.rename(tmp, path)
    return len(header) + len(payload)


def _write_all(fd: int, bufs: list[bytes | memoryview]) -> None:
    views = [memoryview(b).cast("B") for b in bufs]
    while views:
        n = os.writev(fd, views)
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


def read_object(path: Path, out: memoryview) -> objfile.ObjectHeader:
    """Read the file's payload straight into ``out`` (exactly its size) and verify its checksum.
    Runs in a worker thread. Raises CorruptObject (or OSError if the file vanished)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        first = os.pread(fd, objfile.ALIGN, 0)
        size = objfile.header_size_hint(first)
        block = first if size <= len(first) else os.pread(fd, size, 0)
        header, offset = objfile.decode_header(block)
        if header.nbytes != len(out):
            raise objfile.CorruptObject(f"payload is {header.nbytes} bytes, expected {len(out)}")
        done = 0
        while done < len(out):
            n = os.preadv(fd, [out[done:]], offset + done)
            if n == 0:
                raise objfile.CorruptObject("file is shorter than its header says")
            done += n
    finally:
        os.close(fd)
    objfile.verify_payload(header, out)
    return header

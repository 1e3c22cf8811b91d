"""L2: one file per object in a local directory, kept across restarts (:class:`DiskTier`).

Files are written to a temporary name, fsynced, then renamed, so a crash leaves either the old
file, the new one, or a ``.tmp`` file that the next start deletes. At start-up the index is
rebuilt from the headers; a file whose size does not match its header is torn and deleted. The
payload checksum is verified on every read, so a corrupted file is detected when it would be
used, deleted, and never returned. :meth:`DiskTier.delete` unlinks and fsyncs the directory, so
a deleted object does not come back after a crash.

The index (which keys are on disk; their sizes, owners and eviction order in a
:class:`~kvdock.storage.budget.Budget`) is guarded by one lock. Every rename
onto an object's path and every unlink of one happens under that lock together with the index
change, so a reader that found a corrupt file can never unlink a newer file renamed onto the
same path: it unlinks only while the index still names the file it read.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from blake3 import blake3

from kvdock import faults
from kvdock.errors import CorruptObject, DiskInUseError, NoRoom
from kvdock.keys import ObjectKey
from kvdock.layout import KVGeometry
from kvdock.storage import objfile
from kvdock.storage.budget import Budget
from kvdock.storage.diskio import _fsync_dir, _write_temp, read_object, write_object
from kvdock.storage.diskspace import DiskSpace
from kvdock.storage.policy import Policy
from kvdock.storage.shares import Shares
from kvdock.storage.tier import Head, StorageTier, TierCounters

log = logging.getLogger(__name__)

SUFFIX = ".kv"
NO_HEAD = Head(0, 0)  # objects written before version chains: each chains to the previous one
FAULT_DELAY_ENV = faults.L2_WRITE_DELAY_ENV  # seconds each L2 write or delete sleeps first (tests only)

__all__ = ["DiskEntry", "DiskInUseError", "DiskTier", "NoRoom", "ScanReport", "read_object", "write_object"]


@dataclass(slots=True, eq=False)
class DiskEntry:
    key: ObjectKey
    path: Path
    file_size: int
    head: Head = NO_HEAD
    identity: str = ""  # the geometry digest its header names (objfile.ObjectHeader.identity)


@dataclass(frozen=True)
class ScanReport:
    loaded: int
    torn: int
    temp_files: int


def object_name(key: ObjectKey) -> str:
    h = blake3(key.model.encode() + b"\0" + str(key.rank).encode() + b"\0" + key.salt.encode() + b"\0" + key.chunk)
    return h.hexdigest()[:48]


class DiskTier(StorageTier):
    """The L2 directory and its index. Thread-safe (see the module docstring)."""

    name = "l2"

    def __init__(
        self, root: Path, capacity: int, shares: Shares | None = None, policy: Policy[Hashable] | None = None
    ) -> None:
        self.root = root
        self.space = DiskSpace(root, capacity)  # the budget, cut while the disk is full
        # tenants' quotas (storage.shares): charged for indexed files and writes in flight
        self.shares = shares
        self.counters = TierCounters()
        root.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(root / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(self._lock_fd)
            if e.errno in (errno.EAGAIN, errno.EACCES):
                raise DiskInUseError(f"disk dir {root} is in use by another kvdock server") from None
            raise
        self._lock = threading.Lock()
        self._index: dict[ObjectKey, DiskEntry] = {}
        # the indexed files' sizes, owners and eviction order (``policy``: LRU unless told)
        self._budget: Budget[ObjectKey] = Budget(shares, policy)
        self.pending_bytes = 0  # promised to writes in flight
        # fault injection for tests of a slow disk (a real one cannot be made slow on demand)
        self.fault_write_delay_s = faults.current().l2_write_delay_s
        self.last_scan = ScanReport(0, 0, 0)
        # the geometry digest of a model's objects now (the server's registry; None: unknown model):
        # knows() and heads() skip files written under another geometry of the name. None: not checked
        # there (reads still refuse them: objfile.check)
        self.identity_of: Callable[[str], str | None] | None = None

    @property
    def used_bytes(self) -> int:
        """Bytes of the indexed files."""
        return self._budget.used

    @property
    def capacity(self) -> int:
        """The bytes writes may use now: the configured budget, or less while the disk is full."""
        return self.space.capacity

    @property
    def disk_full(self) -> bool:
        """ENOSPC was met and the disk has not shown room since (see storage.diskspace)."""
        return self.space.full

    def close(self) -> None:
        """Release the directory lock; harmless twice. Unlocked before the close: a lock of
        ``flock`` belongs to the open file, which a child forked meanwhile (a subprocess between
        its fork and exec, a forked worker) still holds after this process closes its descriptor."""
        if self._lock_fd >= 0:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            self._lock_fd = -1

    def __len__(self) -> int:
        return len(self._index)

    def order(self) -> list[ObjectKey]:
        """The indexed keys, first to be evicted first (tests and checks: O(n))."""
        with self._lock:
            return self._budget.policy.order()

    def path_for(self, key: ObjectKey) -> Path:
        name = object_name(key)
        return self.root / name[:2] / (name + SUFFIX)

    def scan(self) -> ScanReport:
        """Rebuild the index from the files (oldest modification first = least recently used).
        Call once, before the tier's threads start."""
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
                    raise CorruptObject("size or name does not match the header")
            except (OSError, CorruptObject) as e:
                log.warning("L2: deleting torn or foreign file %s (%s)", path, e)
                path.unlink(missing_ok=True)
                torn += 1
                continue
            head = Head(header.version, header.parent)
            found.append((st.st_mtime, DiskEntry(header.key, path, st.st_size, head, header.identity)))
        with self._lock:
            for _, entry in sorted(found, key=lambda t: t[0]):
                self._index[entry.key] = entry
                v, p = entry.head.version, entry.head.parent
                self._budget.add(entry.key, entry.file_size, self._owner(entry.key), version=v, parent=p)
            for owner in list(self.shares.quotas) if self.shares is not None else ():
                self._make_room(0, owner)  # a quota may have shrunk since the last run
            self._make_room(0)  # ... and so may the budget
        self.counters.corrupted += torn
        self.last_scan = ScanReport(len(self._index), torn, temps)
        return self.last_scan

    # --- StorageTier ---------------------------------------------------------------------------

    def up(self) -> bool:
        return True

    indexed = True

    def knows(self, key: ObjectKey) -> Head | None:
        with self._lock:
            entry = self._index.get(key)
            return None if entry is None or not self._current(entry) else entry.head

    def heads(self, keys: list[ObjectKey]) -> list[Head]:
        with self._lock:
            out = []
            for key in keys:
                entry = self._index.get(key)
                if entry is None or not self._current(entry):
                    break
                out.append(entry.head)
            return out

    def _current(self, entry: DiskEntry) -> bool:
        """Whether ``entry`` was written under its model's geometry now (see ``identity_of``)."""
        return self.identity_of is None or entry.identity == self.identity_of(entry.key.model)

    def read_into(self, key: ObjectKey, out: memoryview, geometry: KVGeometry, chunk_size: int) -> Head | None:
        with self._lock:
            entry = self._index.get(key)
            if entry is None:
                return None
            self._budget.touch(key)
        try:
            header = read_object(entry.path, out)
            objfile.check(header, key, geometry, chunk_size)
        except (FileNotFoundError, CorruptObject) as e:
            self._drop(entry, e)  # gone or bad: forget it (and unlink a corrupt file)
            return None
        except OSError as e:  # EMFILE, ENOMEM, EIO...: a miss now; the file itself may be fine
            log.warning("L2: cannot read %s (%s); a miss", entry.path, e)
            return None
        return Head(header.version, header.parent, header.overwrite)

    def _drop(self, entry: DiskEntry, err: BaseException) -> None:
        """Forget (and unlink) a file that could not be read, unless a newer one replaced it."""
        with self._lock:
            if self._index.get(entry.key) is not entry:
                return  # replaced or deleted meanwhile: the path is not this file any more
            self._unindex(entry.key)
            try:
                entry.path.unlink(missing_ok=True)
            except OSError as e:
                log.error("L2: cannot delete %s: %s", entry.path, e)
        if isinstance(err, CorruptObject):
            self.counters.corrupted += 1
            log.warning("L2: %s is corrupted (%s); deleted", entry.path, err)

    def write_from(self, key: ObjectKey, header: bytes, payload: memoryview, fence: object = None) -> int:
        size = len(header) + len(payload)
        path = self.path_for(key)
        decoded, _ = objfile.decode_header(header)
        head = Head(decoded.version, decoded.parent)
        owner = self.shares.owner(key) if self.shares is not None else None
        with self._lock:
            old = self._unindex(key)  # its file is replaced by the rename below
            if self.space.full:  # re-probe the free space (when its backoff has passed)
                self.space.recover(self.used_bytes + self.pending_bytes, size)
            if not self._make_room(size, owner):
                if old is not None:
                    old.path.unlink(missing_ok=True)  # not written: the older version must not stay
                raise NoRoom(f"{size} bytes do not fit in the L2 budget of {self.capacity} (or its owner's quota)")
            self.pending_bytes += size  # promised to this write until it is indexed or fails
            if self.shares is not None:
                self.shares.charge(owner, size)
        try:
            if self.fault_write_delay_s:
                time.sleep(self.fault_write_delay_s)
            tmp = _write_temp(path, header, payload)
        except OSError as e:
            with self._lock:
                self.pending_bytes -= size
                if self.shares is not None:
                    self.shares.release(owner, size)
                if old is not None:
                    path.unlink(missing_ok=True)  # not replaced: the older version must not stay
                if e.errno == errno.ENOSPC:  # cut the budget to what is stored now (logged once)
                    self.space.cut(self.used_bytes + self.pending_bytes)
            if e.errno == errno.ENOSPC:
                raise NoRoom(f"disk full at {self.root}") from None
            raise
        with self._lock:
            self.pending_bytes -= size
            try:
                os.rename(tmp, path)
            except OSError:
                if self.shares is not None:
                    self.shares.release(owner, size)
                tmp.unlink(missing_ok=True)
                if old is not None:
                    path.unlink(missing_ok=True)  # not replaced: the older version must not stay
                raise
            self._index[key] = DiskEntry(key, path, size, head, decoded.identity)
            # (charged since the promise); after the chunk before it in its prompt (storage.budget)
            self._budget.add(key, size, owner, charge=False, version=head.version, parent=head.parent)
        return size

    def _unindex(self, key: ObjectKey) -> DiskEntry | None:
        """Forget ``key``'s file (not unlinked here); its entry, or None. Caller holds the lock."""
        entry = self._index.pop(key, None)
        if entry is not None:
            self._budget.remove(key)
        return entry

    def _owner(self, key: ObjectKey) -> str | None:
        return self.shares.owner(key) if self.shares is not None else None

    def _make_room(self, file_size: int, owner: str | None = None) -> bool:
        """Unlink files, first in the eviction policy's order, until ``file_size`` more bytes of
        ``owner`` fit in the budget and in the owner's quota (evicting only what it may:
        storage.budget); False if they never can. Caller holds the lock."""
        while True:
            try:
                victim = self._budget.next_victim(file_size, owner, self.capacity, self.pending_bytes)
            except NoRoom:
                return False
            if victim is None:
                return True
            entry = self._index.pop(victim)
            self._budget.remove(victim, evicted=True)
            entry.path.unlink(missing_ok=True)

    def delete(self, key: ObjectKey) -> None:
        path = self.path_for(key)
        if self.fault_write_delay_s:
            time.sleep(self.fault_write_delay_s)
        with self._lock:
            self._unindex(key)
            path.unlink(missing_ok=True)
        # even when the file was gone already: an earlier unlink (eviction, a dropped corrupt
        # file) was not synced, and must not come back after a power loss
        if path.parent.exists():
            _fsync_dir(path.parent)

    def clear(self) -> int:
        with self._lock:
            entries = list(self._index.values())
            for e in entries:
                self._unindex(e.key)
                e.path.unlink(missing_ok=True)
        return len(entries)

    def status(self) -> dict[str, Any]:
        return {
            "kind": "disk",
            "up": True,
            "path": str(self.root),
            "capacity_bytes": self.capacity,
            "used_bytes": self.used_bytes,
            "objects": len(self._index),
            "disk_full": self.disk_full,
        }

    def check_integrity(self) -> None:
        """Assert: bytes used == sum of indexed files, within budget, every indexed file present."""
        with self._lock:
            assert self._budget.used == sum(e.file_size for e in self._index.values()), "L2 bytes used drifted"
            assert set(self._budget) == set(self._index), "L2's budget and index disagree"
            self._budget.check(shares=False)
            assert self.used_bytes + self.pending_bytes <= self.capacity or not self._index, "L2 over its budget"
            for key, e in self._index.items():
                assert e.key == key and e.path == self.path_for(key)
                assert e.path.exists(), f"indexed file {e.path} is missing"
            if self.shares is not None and not self.pending_bytes:  # (writes in flight are charged too)
                self.shares.check((self.shares.owner(k), e.file_size) for k, e in self._index.items())

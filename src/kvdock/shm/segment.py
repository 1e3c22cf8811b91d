"""One shared-memory segment of the L1 pool.

Linux only. A *named* segment is a file under ``/dev/shm`` (mode 0600, random name) that
clients of the server's user open by name; we open it directly instead of using
``multiprocessing.shared_memory`` because on Python < 3.13 its resource tracker unlinks a segment
when any process that merely *attached* to it exits. A *private* segment (a tenant's pool,
:mod:`kvdock.shm.pool`) is a memfd: it has no name anyone could open, only the descriptor the
server holds and hands to its tenant's clients (:mod:`kvdock.transport.door`), and it is sealed
against resizing, so that no client can shrink it under the server (a SIGBUS there).

Layout: a 4 KiB header, the slot generation table, the directory (may be empty), then the slot
area. The header carries a magic, the creator's pid and process start time (to detect stale
segments of dead servers, and to tell that a local socket's peer is this segment's server), a
random nonce (a client proves it mapped the same segment by echoing it when it registers), where
the table, the directory and the slot area start, the offset the server names the slot area's
first byte by (``first``: a tenant's segment holds one region of the pool's offsets, see
:mod:`kvdock.shm.pool`), at ``STATE_OFFSET`` the directory's state words
(:mod:`kvdock.shm.directory`), and right after them (``VALID_UNTIL_OFFSET``) the u64
``valid_until_ns``: until when, in CLOCK_MONOTONIC ns (``time.monotonic_ns()``, one clock for
the whole host), the server vouches for the pool directory; past it fast reads ask the server
(:mod:`kvdock.sdk._fastpath` checks it before and after a copy). A new segment holds
``NO_DEADLINE`` (2**64 - 1: no limit). Only the server writes it, through its own mapping, as
one aligned 8-byte store that readers load as one (numpy, as the state words).

The generation table has one little-endian u64 per 4 KiB page of the slot area; the entry of a
slot's first page is that slot's generation. The server bumps it each time the slot is freed,
before the slot can be handed to anyone else, so a reader that copied a slot and then finds the
generation it was given unchanged knows it copied the object it asked for (seqlock style: see
:class:`kvdock.shm.slots.SlotAllocator`).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import secrets
import struct
from pathlib import Path

import numpy as np

from kvdock.shm.processes import proc_start_time as proc_start_time  # (its old home)
from kvdock.shm.processes import process_alive as process_alive
from kvdock.shm.processes import process_visible as process_visible

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
PREFIX = "kvdock-"
HEADER_SIZE = 4096
PAGE = 4096
MAGIC = b"KVDOCKL1"
VERSION = 5  # 5: ``valid_until_ns``; 4: ``first``; 3: the directory
# magic, version, pid, start time, nonce, total size, generation table offset, slot area offset,
# directory offset, directory entries, first
_HEADER = struct.Struct("<8sIIQ32sQQQQQQ")
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL  # a private segment's size is for good
F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)  # (Linux 5.1; Python 3.12 names it)
ENTRY_SIZE = 128  # bytes of one directory entry (kvdock.shm.directory; _directory.c agrees)
BUCKET = 8  # entries per directory bucket
STATE_OFFSET = 1024  # the directory's state words (u64s), written by the server only
STATE_WORDS = 4
VALID_UNTIL_OFFSET = STATE_OFFSET + 8 * STATE_WORDS  # the u64 valid_until_ns, written by the server only
NO_DEADLINE = 2**64 - 1  # valid_until_ns of a new segment: the directory is vouched for without a limit
_V1 = struct.Struct("<8sIIQ32sQ")  # what cleanup_stale needs, the same in every version
assert _HEADER.size <= STATE_OFFSET and VALID_UNTIL_OFFSET + 8 <= HEADER_SIZE and VALID_UNTIL_OFFSET % 8 == 0


def table_bytes(data_size: int) -> int:
    """Size of the generation table for a slot area of ``data_size`` bytes (page-aligned)."""
    entries = -(-data_size // PAGE)
    return -(-entries * 8 // PAGE) * PAGE


def directory_bytes(entries: int) -> int:
    """Size of a directory of ``entries`` entries, rounded up to pages."""
    return -(-entries * ENTRY_SIZE // PAGE) * PAGE


class PoolSegment:
    """A mapped segment: ``meta`` (header, generation table, directory: the first
    ``data_offset`` bytes of its layout) and ``data`` (the slot area), writable memoryviews in
    the process that made it. Offsets the server hands out (``SlotRef.offset``) are *pool*
    offsets: the slot at pool offset ``o`` starts at ``data[o - first]`` (``first`` is where the
    segment's slots start in the pool: a tenant's segment holds one region of it).

    A named or anonymous segment is one mapping. A private one (a tenant's pool) is two memfds:
    the metadata, sealed against every write but through the server's own mapping (clients map
    it read-only, so that no client can touch a generation, a directory entry or the nonce the
    server trusts), and the slot area, which its clients write; both sealed against resizing."""

    def __init__(
        self, name: str, mm: mmap.mmap, owner: bool, data_mm: mmap.mmap | None = None, fds: tuple[int, ...] = ()
    ) -> None:
        fields = _HEADER.unpack_from(mm, 0)
        self.creator_pid, self.creator_start = int(fields[2]), int(fields[3])
        self.size = int(fields[5])  # header, table, directory and slot area together
        self.table_offset = int(fields[6])
        self.data_offset = int(fields[7])  # where the slot area starts in the layout
        self.directory_offset = int(fields[8])
        self.directory_entries = int(fields[9])
        self.first = int(fields[10])  # the pool offset of the slot area's first byte (SlotAllocator's base)
        dir_end = self.directory_offset + self.directory_entries * ENTRY_SIZE
        split = data_mm is not None
        if not (
            HEADER_SIZE <= self.table_offset <= self.directory_offset <= dir_end <= self.data_offset <= self.size
            and self.directory_entries % BUCKET == 0
            and (self.directory_entries // BUCKET) & (self.directory_entries // BUCKET - 1) == 0
            and self.first % PAGE == 0
            and len(mm) == (self.data_offset if split else self.size)
            and (data_mm is None or len(data_mm) == self.size - self.data_offset)
        ):
            raise ValueError(f"segment {name or 'handed over'} has an impossible layout")
        self.name = name
        self._mm, self._data_mm = mm, data_mm
        self._fds = fds  # a private segment's descriptors: (metadata, slot area)
        whole = memoryview(mm)
        self.meta = whole if split else whole[: self.data_offset]
        self.data = memoryview(data_mm) if data_mm is not None else whole[self.data_offset :]
        self._whole = whole
        self._views = [self.meta, self.data, whole]
        self.owner = owner
        # (one aligned u64 viewing the header: loads and stores of it are single 8-byte accesses)
        self._valid_until: np.ndarray | None = np.frombuffer(self.meta, "<u8", count=1, offset=VALID_UNTIL_OFFSET)

    @property
    def buf(self) -> memoryview:
        """The whole layout as one view (header at 0, slots from ``data_offset``): a named or
        anonymous segment only (ValueError for a private one: two mappings)."""
        if self._data_mm is not None:
            raise ValueError("a private segment is two mappings: use meta and data")
        return self._whole

    @property
    def data_size(self) -> int:
        return self.size - self.data_offset

    @property
    def private(self) -> bool:
        """Whether this is a memfd segment, mappable only through its descriptors."""
        return bool(self._fds)

    def filenos(self) -> tuple[int, int]:
        """A private segment's descriptors, metadata and slot area (to hand to a client);
        ValueError for any other segment."""
        if not self._fds:
            raise ValueError("only a private segment has descriptors to hand over")
        return self._fds[0], self._fds[1]

    def state_words(self) -> np.ndarray:
        """The directory's state words as a u64 array viewing the header (writable in the
        server only; drop it before :meth:`close`)."""
        return np.frombuffer(self.meta, dtype="<u8", count=STATE_WORDS, offset=STATE_OFFSET)

    def generations(self) -> np.ndarray:
        """The generation table as a u64 array that views the mapping (one entry per page of the
        slot area; writable in the server only). Callers must drop it before :meth:`close`."""
        n = (self.data_offset - self.table_offset) // 8
        return np.frombuffer(self.meta, dtype="<u8", count=n, offset=self.table_offset)

    def valid_until_ns(self) -> int:
        """Until when (``time.monotonic_ns()``) the server vouches for the pool directory: reads
        may be answered from it only before. 0 once the segment is closed."""
        word = self._valid_until
        return int(word[0]) if word is not None else 0

    def set_valid_until_ns(self, ns: int) -> None:
        """Vouch for the pool directory until ``ns`` (``time.monotonic_ns()``; 0: not now), from the
        server's own mapping (a tenant's sealed one too). ValueError through a read-only mapping,
        for an ``ns`` outside u64 or a closed segment."""
        if not 0 <= ns <= NO_DEADLINE:
            raise ValueError(f"valid_until_ns must be a u64, not {ns}")
        word = self._valid_until
        if word is None:
            raise ValueError("the segment is closed")
        word[0] = ns  # (numpy raises ValueError for a read-only mapping)

    @property
    def nonce(self) -> str:
        nonce: bytes = _HEADER.unpack_from(self._mm, 0)[4]
        return nonce.hex()

    @classmethod
    def create(cls, data_size: int, directory_entries: int = 0) -> PoolSegment:
        """Create, allocate and pre-fault a new named segment (mode 0600, random name) with a
        directory of ``directory_entries`` (0, or a power-of-two number of buckets of BUCKET
        entries).

        Raises OSError (ENOSPC) if /dev/shm cannot hold it, instead of SIGBUS on a later write.
        """
        name = PREFIX + secrets.token_hex(16)
        size = HEADER_SIZE + table_bytes(data_size) + directory_bytes(directory_entries) + data_size
        fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, size)
                mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
            except BaseException:  # ENOSPC, or a SIGTERM / Ctrl-C while it pre-faults (seconds)
                os.unlink(SHM_DIR / name)
                raise
        finally:
            os.close(fd)
        _write_header(mm, size, data_size, directory_entries)
        return cls(name, mm, owner=True)

    @classmethod
    def create_private(cls, data_size: int, first: int, label: str = "pool", directory_entries: int = 0) -> PoolSegment:
        """Create, allocate and pre-fault a private segment (two memfds, no name; ``label``
        shows in /proc/PID/maps) whose slot area is pool offsets ``[first, first + data_size)``,
        with a directory of ``directory_entries`` (``data_size`` > 0). OSError (ENOSPC) if memory
        cannot hold it."""
        assert data_size > 0, "an empty private segment"
        meta_size = HEADER_SIZE + table_bytes(data_size) + directory_bytes(directory_entries)
        fds: list[int] = []
        maps: list[mmap.mmap] = []
        try:
            for part, nbytes in (("meta", meta_size), ("slots", data_size)):
                fd = os.memfd_create(f"kvdock-{label}"[:200] + f"-{part}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
                fds.append(fd)
                os.posix_fallocate(fd, 0, nbytes)
                maps.append(mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE))
                # the metadata is written through the mapping made above, and nowhere else ever
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS | (F_SEAL_FUTURE_WRITE if part == "meta" else 0))
        except BaseException:
            for mm in maps:
                mm.close()
            for fd in fds:
                os.close(fd)
            raise
        _write_header(maps[0], meta_size + data_size, data_size, directory_entries, first)
        return cls("", maps[0], owner=True, data_mm=maps[1], fds=(fds[0], fds[1]))

    @classmethod
    def anonymous(cls, data_size: int, first: int | None = None) -> PoolSegment:
        """Private pre-faulted memory that no client maps (``--no-shm``; the shared rest of a
        pool with tenants), its slot area at pool offset ``first`` (None: where it starts)."""
        size = HEADER_SIZE + table_bytes(data_size) + data_size
        mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)
        _write_header(mm, size, data_size, 0, first)
        return cls("", mm, owner=True)

    @classmethod
    def attach(cls, name: str) -> PoolSegment:
        """Map an existing named segment read-write, without faulting its pages in; OSError if
        it cannot be opened, ValueError if it is not ours."""
        if "/" in name or not name.startswith(PREFIX):
            raise ValueError(f"not a kvdock segment name: {name!r}")
        fd = os.open(SHM_DIR / name, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            # not populated here: for a large pool that takes ~35 ms per GiB; the client's
            # transfer faults the pages in in the background (kvdock.sdk._transfer.Prefault)
            mm = _map(fd, size, name)
        finally:
            os.close(fd)
        return cls._checked(name, mm)

    @classmethod
    def from_fds(cls, meta_fd: int, data_fd: int) -> PoolSegment:
        """Map a private segment handed over as its two descriptors (the segment owns them from
        now on: closed by :meth:`close`, or here on failure): the metadata read-only, the slot
        area read-write. ValueError if they are not a sealed kvdock segment (a server that could
        shrink one would crash us), OSError if unmappable."""
        meta_mm = data_mm = None
        try:
            for fd in (meta_fd, data_fd):
                if fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SEALS != SEALS:
                    raise ValueError("a descriptor handed over is not a sealed memfd")
            meta_mm = _map(meta_fd, os.fstat(meta_fd).st_size, "", prot=mmap.PROT_READ)
            data_mm = _map(data_fd, os.fstat(data_fd).st_size, "", minimum=1)
            seg = cls._checked("", meta_mm, data_mm, (meta_fd, data_fd))
        except BaseException:
            for mm in (meta_mm, data_mm):
                if mm is not None:
                    mm.close()
            os.close(meta_fd)
            os.close(data_fd)
            raise
        return seg

    @classmethod
    def _checked(
        cls, name: str, mm: mmap.mmap, data_mm: mmap.mmap | None = None, fds: tuple[int, ...] = ()
    ) -> PoolSegment:
        magic, version = _HEADER.unpack_from(mm, 0)[:2]
        if magic != MAGIC or version != VERSION:
            mm.close()
            raise ValueError(f"segment {name or 'handed over'} has no kvdock v{VERSION} header")
        try:
            return cls(name, mm, owner=False, data_mm=data_mm, fds=fds)
        except ValueError:
            mm.close()
            raise

    def map_readonly(self, offset: int, length: int) -> mmap.mmap:
        """A second, read-only mapping of pool offsets ``[offset, offset + length)`` (page-aligned;
        not populated): tensors on it cannot write into the pool (a write is a SIGSEGV, not a
        corrupted cache). OSError if the segment is gone or the address space full."""
        at = offset - self.first
        if self._fds:
            return mmap.mmap(self._fds[1], length, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ, offset=at)
        fd = os.open(SHM_DIR / self.name, os.O_RDONLY)
        try:
            return mmap.mmap(fd, length, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ, offset=self.data_offset + at)
        finally:
            os.close(fd)

    def close(self) -> None:
        """Unmap (and close a private segment's descriptors). Harmless twice. Exported buffers
        still alive keep the mapping until collected."""
        self._valid_until = None  # (it views meta: released first)
        for view in self._views:
            with contextlib.suppress(BufferError):
                view.release()
        fds, self._fds = self._fds, ()
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        for mm in (self._mm, self._data_mm):
            if mm is None:
                continue
            try:
                mm.close()
            except BufferError:
                log.debug("segment %s still has exported buffers; unmapped when they are freed", self.name)

    def unlink(self) -> None:
        if not self.name:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(SHM_DIR / self.name)


def _map(
    fd: int, size: int, name: str, prot: int = mmap.PROT_READ | mmap.PROT_WRITE, minimum: int = HEADER_SIZE
) -> mmap.mmap:
    if size < minimum:
        raise ValueError(f"segment {name or 'handed over'} is too small to be a kvdock pool")
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=prot)


def cleanup_stale() -> list[str]:
    """Unlink kvdock segments whose creating server no longer runs; returns their names."""
    removed = []
    for path in SHM_DIR.glob(PREFIX + "*"):
        try:
            with open(path, "rb") as f:
                raw = f.read(_V1.size)
        except OSError:
            continue
        if len(raw) < _V1.size:
            continue
        magic, _ver, pid, start, _nonce, _size = _V1.unpack_from(raw)
        if magic != MAGIC:
            continue
        alive_start = proc_start_time(pid)
        if alive_start is None or (start and alive_start != start):
            try:
                path.unlink()
                removed.append(path.name)
            except OSError:
                continue
    return removed


def _write_header(mm: mmap.mmap, size: int, data_size: int, directory_entries: int, first: int | None = None) -> None:
    pid = os.getpid()
    table = HEADER_SIZE
    directory = table + table_bytes(data_size)
    data = directory + directory_bytes(directory_entries)
    start = proc_start_time(pid) or 0
    nonce = secrets.token_bytes(32)
    first = data if first is None else first
    header = _HEADER.pack(MAGIC, VERSION, pid, start, nonce, size, table, data, directory, directory_entries, first)
    mm[: len(header)] = header
    mm[VALID_UNTIL_OFFSET : VALID_UNTIL_OFFSET + 8] = NO_DEADLINE.to_bytes(8, "little")

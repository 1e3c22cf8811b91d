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
:mod:`kvdock.shm.pool`), and at ``STATE_OFFSET`` the directory's state words
(:mod:`kvdock.shm.directory`).

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

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
PREFIX = "kvdock-"
HEADER_SIZE = 4096
PAGE = 4096
MAGIC = b"KVDOCKL1"
VERSION = 4  # 4: ``first``; 3: the directory
# magic, version, pid, start time, nonce, total size, generation table offset, slot area offset,
# directory offset, directory entries, first
_HEADER = struct.Struct("<8sIIQ32sQQQQQQ")
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL  # a private segment's size is for good
ENTRY_SIZE = 128  # bytes of one directory entry (kvdock.shm.directory; _directory.c agrees)
BUCKET = 8  # entries per directory bucket
STATE_OFFSET = 1024  # the directory's state words (u64s), written by the server only
STATE_WORDS = 4
_V1 = struct.Struct("<8sIIQ32sQ")  # what cleanup_stale needs, the same in every version


def table_bytes(data_size: int) -> int:
    """Size of the generation table for a slot area of ``data_size`` bytes (page-aligned)."""
    entries = -(-data_size // PAGE)
    return -(-entries * 8 // PAGE) * PAGE


def directory_bytes(entries: int) -> int:
    """Size of a directory of ``entries`` entries, rounded up to pages."""
    return -(-entries * ENTRY_SIZE // PAGE) * PAGE


def proc_start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot, or None if it does not exist."""
    return _proc_start_time(pid)


def process_alive(pid: int, start_time: int) -> bool:
    """Whether process ``pid`` that started at ``start_time`` still runs (a zombie does not).
    Only a missing /proc entry means gone: any other error (EMFILE, ENOMEM) answers "alive",
    since freeing a live writer's slots would let it write into another object."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    except OSError:
        return True
    fields = stat.rsplit(")", 1)[1].split()
    return fields[0] not in ("Z", "X") and int(fields[19]) == start_time


def _proc_start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot, or None if it does not exist."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name may contain spaces; fields resume after the last ')'
    return int(stat.rsplit(")", 1)[1].split()[19])


class PoolSegment:
    """A mapped segment. ``buf`` is a writable memoryview of the whole mapping.

    Offsets the server hands out (``SlotRef.offset``) are *pool* offsets; the slot at pool offset
    ``o`` starts at ``buf[o - shift]`` (``shift`` is 0 but for a tenant's segment, which holds
    one region of the pool's offsets, from ``first``)."""

    def __init__(self, name: str, mm: mmap.mmap, owner: bool, fd: int = -1) -> None:
        fields = _HEADER.unpack_from(mm, 0)
        self.creator_pid, self.creator_start = int(fields[2]), int(fields[3])
        self.table_offset = int(fields[6])
        self.data_offset = int(fields[7])  # where the slot area starts in the mapping
        self.directory_offset = int(fields[8])
        self.directory_entries = int(fields[9])
        self.first = int(fields[10])  # the pool offset of the slot area's first byte (SlotAllocator's base)
        dir_end = self.directory_offset + self.directory_entries * ENTRY_SIZE
        if not (
            HEADER_SIZE <= self.table_offset <= self.directory_offset <= dir_end <= self.data_offset <= len(mm)
            and self.directory_entries % BUCKET == 0
            and (self.directory_entries // BUCKET) & (self.directory_entries // BUCKET - 1) == 0
            and self.first % PAGE == 0
        ):
            raise ValueError(f"segment {name or 'handed over'} has an impossible layout")
        self.name = name
        self.size = len(mm)
        self.shift = self.first - self.data_offset  # pool offset - shift = position in the mapping
        self._mm = mm
        self._fd = fd  # a private segment's descriptor (-1: a named or anonymous one)
        self.buf = memoryview(mm)
        self.owner = owner

    @property
    def data_size(self) -> int:
        return self.size - self.data_offset

    @property
    def private(self) -> bool:
        """Whether this is a memfd segment, mappable only through its descriptor."""
        return self._fd >= 0

    def fileno(self) -> int:
        """A private segment's descriptor (to hand to a client); ValueError for any other."""
        if self._fd < 0:
            raise ValueError("only a private segment has a descriptor to hand over")
        return self._fd

    def slot_area(self) -> memoryview:
        """The slot area: byte ``o - first`` of it is pool offset ``o``."""
        return self.buf[self.data_offset :]

    def state_words(self) -> np.ndarray:
        """The directory's state words as a writable u64 array viewing the header (drop it
        before :meth:`close`)."""
        return np.frombuffer(self.buf, dtype="<u8", count=STATE_WORDS, offset=STATE_OFFSET)

    def generations(self) -> np.ndarray:
        """The generation table as a writable u64 array that views the mapping (one entry per
        page of the slot area). Callers must drop it before :meth:`close`."""
        n = (self.data_offset - self.table_offset) // 8
        return np.frombuffer(self.buf, dtype="<u8", count=n, offset=self.table_offset)

    @property
    def nonce(self) -> str:
        return _HEADER.unpack_from(self._mm, 0)[4].hex()

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
        _write_header(mm, data_size, directory_entries)
        return cls(name, mm, owner=True)

    @classmethod
    def create_private(cls, data_size: int, first: int, label: str = "pool", directory_entries: int = 0) -> PoolSegment:
        """Create, allocate and pre-fault a memfd segment (no name; ``label`` shows in
        /proc/PID/maps) whose slot area is pool offsets ``[first, first + data_size)``, with a
        directory of ``directory_entries``, sealed against any resizing. OSError (ENOSPC) if
        memory cannot hold it."""
        size = HEADER_SIZE + table_bytes(data_size) + directory_bytes(directory_entries) + data_size
        fd = os.memfd_create(f"kvdock-{label}"[:200], os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.posix_fallocate(fd, 0, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        except BaseException:
            os.close(fd)
            raise
        _write_header(mm, data_size, directory_entries, first)
        return cls("", mm, owner=True, fd=fd)

    @classmethod
    def anonymous(cls, data_size: int, first: int | None = None) -> PoolSegment:
        """Private pre-faulted memory that no client maps (``--no-shm``; the shared rest of a
        pool with tenants), its slot area at pool offset ``first`` (None: where it starts)."""
        size = HEADER_SIZE + table_bytes(data_size) + data_size
        mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)
        _write_header(mm, data_size, 0, first)
        return cls("", mm, owner=True)

    @classmethod
    def attach(cls, name: str) -> PoolSegment:
        """Map an existing named segment read-write, without faulting its pages in; OSError if
        it cannot be opened, ValueError if it is not ours."""
        if "/" in name or not name.startswith(PREFIX):
            raise ValueError(f"not a kvdock segment name: {name!r}")
        fd = os.open(SHM_DIR / name, os.O_RDWR)
        try:
            return cls._map(fd, name)
        finally:
            os.close(fd)

    @classmethod
    def from_fd(cls, fd: int) -> PoolSegment:
        """Map a private segment handed over as descriptor ``fd`` (the segment owns it from now
        on: closed by :meth:`close`, or here on failure). ValueError if it is not a sealed
        kvdock segment (a server that could shrink it would crash us), OSError if unmappable."""
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            if seals & SEALS != SEALS:
                raise ValueError("the descriptor handed over is not a sealed memfd")
            seg = cls._map(fd, "", keep_fd=True)
        except BaseException:
            os.close(fd)
            raise
        return seg

    @classmethod
    def _map(cls, fd: int, name: str, keep_fd: bool = False) -> PoolSegment:
        size = os.fstat(fd).st_size
        if size < HEADER_SIZE:
            raise ValueError(f"segment {name or 'handed over'} is too small to be a kvdock pool")
        # not populated here: for a large pool that takes ~35 ms per GiB; the client's
        # transfer faults the pages in in the background (kvdock.sdk.transfer.Prefault)
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        magic, version = _HEADER.unpack_from(mm, 0)[:2]
        if magic != MAGIC or version != VERSION:
            mm.close()
            raise ValueError(f"segment {name or 'handed over'} has no kvdock v{VERSION} header")
        try:
            return cls(name, mm, owner=False, fd=fd if keep_fd else -1)
        except ValueError:
            mm.close()
            raise

    def map_readonly(self, offset: int, length: int) -> mmap.mmap:
        """A second, read-only mapping of ``[offset, offset + length)`` of the segment (a position
        in the mapping, page-aligned; not populated): tensors on it cannot write into the pool (a
        write is a SIGSEGV, not a corrupted cache). OSError if the segment is gone or the address
        space full."""
        if self._fd >= 0:
            return mmap.mmap(self._fd, length, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ, offset=offset)
        fd = os.open(SHM_DIR / self.name, os.O_RDONLY)
        try:
            return mmap.mmap(fd, length, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ, offset=offset)
        finally:
            os.close(fd)

    def close(self) -> None:
        """Unmap (and close a private segment's descriptor). Harmless twice. Exported buffers
        still alive keep the mapping until collected."""
        self.buf.release()
        fd, self._fd = self._fd, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)
        try:
            self._mm.close()
        except BufferError:
            log.debug("segment %s still has exported buffers; unmapped when they are freed", self.name)

    def unlink(self) -> None:
        if not self.name:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(SHM_DIR / self.name)


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
        alive_start = _proc_start_time(pid)
        if alive_start is None or (start and alive_start != start):
            try:
                path.unlink()
                removed.append(path.name)
            except OSError:
                continue
    return removed


def _write_header(mm: mmap.mmap, data_size: int, directory_entries: int, first: int | None = None) -> None:
    pid = os.getpid()
    table = HEADER_SIZE
    directory = table + table_bytes(data_size)
    data = directory + directory_bytes(directory_entries)
    start = _proc_start_time(pid) or 0
    nonce = secrets.token_bytes(32)
    first = data if first is None else first
    header = _HEADER.pack(MAGIC, VERSION, pid, start, nonce, len(mm), table, data, directory, directory_entries, first)
    mm[: len(header)] = header

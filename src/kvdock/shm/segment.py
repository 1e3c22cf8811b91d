"""One POSIX shared-memory segment holding the L1 pool.

Linux only: segments are files under ``/dev/shm``. We open them directly instead of using
``multiprocessing.shared_memory`` because on Python < 3.13 its resource tracker unlinks a segment
when any process that merely *attached* to it exits.

Layout: a 4 KiB header, then the slot area. The header carries a magic, the creator's pid and
process start time (to detect stale segments of dead servers) and a random nonce; a client proves
it mapped the same segment by echoing the nonce when it registers.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import secrets
import struct
from pathlib import Path

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
PREFIX = "kvdock-"
HEADER_SIZE = 4096
MAGIC = b"KVDOCKL1"
_HEADER = struct.Struct("<8sIIQ32sQ")  # magic, version, pid, start time, nonce, total size


def _proc_start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot, or None if it does not exist."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name may contain spaces; fields resume after the last ')'
    return int(stat.rsplit(")", 1)[1].split()[19])


class PoolSegment:
    """A mapped segment. ``buf`` is a writable memoryview of the whole mapping."""

    def __init__(self, name: str, mm: mmap.mmap, owner: bool) -> None:
        self.name = name
        self.size = len(mm)
        self._mm = mm
        self.buf = memoryview(mm)
        self.owner = owner

    @property
    def data_size(self) -> int:
        return self.size - HEADER_SIZE

    @property
    def nonce(self) -> str:
        return _HEADER.unpack_from(self._mm, 0)[4].hex()

    @classmethod
    def create(cls, data_size: int) -> PoolSegment:
        """Create, allocate and pre-fault a new segment (mode 0600, random name).

        Raises OSError (ENOSPC) if /dev/shm cannot hold it, instead of SIGBUS on a later write.
        """
        name = PREFIX + secrets.token_hex(16)
        size = HEADER_SIZE + data_size
        fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, size)
                mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
            except OSError:
                os.unlink(SHM_DIR / name)
                raise
        finally:
            os.close(fd)
        pid = os.getpid()
        header = _HEADER.pack(MAGIC, 1, pid, _proc_start_time(pid) or 0, secrets.token_bytes(32), size)
        mm[: len(header)] = header
        return cls(name, mm, owner=True)

    @classmethod
    def anonymous(cls, data_size: int) -> PoolSegment:
        """Private pre-faulted memory for a server that shares no memory (``--no-shm``)."""
        mm = mmap.mmap(-1, HEADER_SIZE + data_size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)
        return cls("", mm, owner=True)

    @classmethod
    def attach(cls, name: str) -> PoolSegment:
        """Map an existing segment read-write; OSError if it cannot be opened, ValueError if it is not ours."""
        if "/" in name or not name.startswith(PREFIX):
            raise ValueError(f"not a kvdock segment name: {name!r}")
        fd = os.open(SHM_DIR / name, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_SIZE:
                raise ValueError(f"segment {name} is too small to be a kvdock pool")
            # populate the page tables now so that the first copy runs as fast as the hundredth
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        finally:
            os.close(fd)
        if _HEADER.unpack_from(mm, 0)[0] != MAGIC:
            mm.close()
            raise ValueError(f"segment {name} has no kvdock header")
        return cls(name, mm, owner=False)

    def close(self) -> None:
        """Unmap. Harmless twice. Exported buffers still alive keep the mapping until collected."""
        self.buf.release()
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
                raw = f.read(_HEADER.size)
        except OSError:
            continue
        if len(raw) < _HEADER.size:
            continue
        magic, _ver, pid, start, _nonce, _size = _HEADER.unpack(raw)
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

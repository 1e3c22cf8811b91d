"""L2's file I/O: an object file written atomically (temporary name, fsync, rename), read straight
into a slot and verified (:mod:`kvdock.storage.disk` keeps the index)."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from kvdock.errors import CorruptObject
from kvdock.storage import objfile


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_temp(path: Path, header: bytes, payload: memoryview) -> Path:
    """Write header + payload to a fresh temporary file beside ``path`` and fsync it."""
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
    return tmp


def write_object(path: Path, header: bytes, payload: memoryview) -> int:
    """Write header + payload to ``path`` atomically (temp file, fsync, rename); returns its size."""
    os.rename(_write_temp(path, header, payload), path)
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
            raise CorruptObject(f"payload is {header.nbytes} bytes, expected {len(out)}")
        done = 0
        while done < len(out):
            n = os.preadv(fd, [out[done:]], offset + done)
            if n == 0:
                raise CorruptObject("file is shorter than its header says")
            done += n
    finally:
        os.close(fd)
    objfile.verify_payload(header, out)
    return header

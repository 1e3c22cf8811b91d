"""The L3 tier's fast read: one value received straight into an L1 slot.

redis-py parses a GET reply into a bytes object (the pure-Python parser with many small socket
reads and joins), which the tier then copied into the slot: ~0.2 GB/s for 32 MiB values on a
2-core VM. Receiving that one GET reply with ``recv_into`` instead gave ~0.6 GB/s, and 1 MiB
GETRANGE replies 1.1-1.2 GB/s (redis-server 7.0 sends one large bulk reply more slowly than many
smaller ones). So :func:`read_value` sends one transaction on a connection redis-py made (its
auth, TLS, database and, for a cluster, the node that owns the key's slot)::

    MULTI; EXISTS k; STRLEN k; GETRANGE k 0 H-1; GETRANGE k H ...; ...; EXEC

and parses the reply itself: the header block (``H`` bytes) lands in a small buffer, and the
payload's pieces are received with ``socket.recv_into`` into the destination memoryview, each
handed to ``on_piece`` (the checksum) as it lands. The transaction makes the pieces one atomic
snapshot of the value. Only the exact shape of the reply this transaction gives is accepted:
anything else (an error such as MOVED or ASK, a RESP3 push, another length) raises
:class:`~kvdock.errors.UnexpectedReply` with the rest of the reply unread, so the caller must
drop the connection.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import redis as redis_py

from kvdock.errors import UnexpectedReply

log = logging.getLogger(__name__)

PIECE = 1 << 20  # bytes per GETRANGE: measured 1.1-1.2 GB/s at 256 KiB-1 MiB, 0.6 for one GET
_MAX_LINE = 64  # a status, integer or bulk length line of these replies is far shorter


class Reader:
    """RESP reading from ``sock``: short lines through a small buffer, bulk payloads straight
    into the caller's memory. Bytes of the next payload the buffer read ahead are copied out of it."""

    def __init__(self, sock: Any, size: int = 1 << 16) -> None:
        self.sock = sock
        self.buf = bytearray(size)
        self.view = memoryview(self.buf)
        self.start = self.end = 0  # unparsed bytes: buf[start:end]

    def _fill(self) -> None:
        if self.start == self.end:
            self.start = self.end = 0
        elif self.end == len(self.buf):  # compact (only a line's few bytes can be left)
            n = self.end - self.start
            self.buf[:n] = self.buf[self.start : self.end]
            self.start, self.end = 0, n
        got = self.sock.recv_into(self.view[self.end :])
        if not got:
            raise redis_py.ConnectionError("the server closed the connection in the middle of a reply")
        self.end += got

    def line(self) -> bytes:
        """The next line, without its CRLF."""
        while True:
            i = self.buf.find(b"\r\n", self.start, self.end)
            if i >= 0:
                line = bytes(self.buf[self.start : i])
                self.start = i + 2
                return line
            if self.end - self.start > _MAX_LINE:
                raise UnexpectedReply("a reply line is too long")
            self._fill()

    def expect(self, want: bytes) -> None:
        line = self.line()
        if line != want:
            raise UnexpectedReply(f"expected {want!r}, got {line[:200]!r}")

    def number(self, kind: bytes) -> int:
        """The number of a ``:n`` (integer), ``*n`` (array) or ``$n`` (bulk length) line."""
        line = self.line()
        if line[:1] != kind or not line[1:].isdigit():
            raise UnexpectedReply(f"expected {kind!r}<n>, got {line[:200]!r}")
        return int(line[1:])

    def into(self, dst: memoryview) -> None:
        """Exactly ``len(dst)`` bytes of the stream into ``dst``."""
        n = len(dst)
        have = min(n, self.end - self.start)
        dst[:have] = self.view[self.start : self.start + have]
        self.start += have
        pos = have
        while pos < n:
            got = self.sock.recv_into(dst[pos:], n - pos)
            if not got:
                raise redis_py.ConnectionError("the server closed the connection in the middle of a reply")
            pos += got

    def bulk_into(self, dst: memoryview) -> None:
        """One bulk string of exactly ``len(dst)`` bytes into ``dst``."""
        if self.number(b"$") != len(dst):
            raise UnexpectedReply("a bulk string of another length")
        self.into(dst)
        self.expect(b"")  # its CRLF

    def drained(self) -> bool:
        return self.start == self.end


def read_value(
    conn: Any, key: bytes, head: memoryview, out: memoryview, on_piece: Callable[[memoryview], None]
) -> bool:
    """Read the value of ``key``, expected to be exactly ``len(head) + len(out)`` bytes, on
    ``conn`` (a redis-py Connection with nothing pending): its first ``len(head)`` bytes into
    ``head``, the rest into ``out`` (``on_piece`` is called with each piece once it landed).
    False if the key does not exist (the connection is then clean, as after a True). Raises
    :class:`~kvdock.errors.UnexpectedReply` (also for a value of another length) or redis-py's ConnectionError /
    TimeoutError with the reply partly read: the caller must disconnect ``conn``."""
    size = len(out)
    pieces = [(off, min(size, off + PIECE)) for off in range(0, size, PIECE)]
    h = len(head)
    cmds: list[tuple[Any, ...]] = [("MULTI",), ("EXISTS", key), ("STRLEN", key), ("GETRANGE", key, 0, h - 1)]
    cmds += [("GETRANGE", key, h + a, h + b - 1) for a, b in pieces]
    cmds.append(("EXEC",))
    conn.send_packed_command(conn.pack_commands(cmds))
    sock = conn._sock
    if sock is None:
        raise redis_py.ConnectionError("the connection closed while sending")
    r = Reader(sock)
    try:
        r.expect(b"+OK")
        for _ in cmds[1:-1]:
            r.expect(b"+QUEUED")
        if r.number(b"*") != len(cmds) - 2:
            raise UnexpectedReply("EXEC gave another number of replies")
        exists, length = r.number(b":"), r.number(b":")
        if not exists:
            for _ in range(len(cmds) - 4):  # the GETRANGEs of an absent key: empty strings
                r.bulk_into(memoryview(bytearray()))
            if not r.drained():
                raise UnexpectedReply("bytes after the reply")
            return False
        if length != h + size:
            raise UnexpectedReply(f"the value has {length} bytes, not {h + size}")
        r.bulk_into(head)
        for a, b in pieces:
            piece = out[a:b]
            r.bulk_into(piece)
            on_piece(piece)
        if not r.drained():
            raise UnexpectedReply("bytes after the reply")
    except TimeoutError as e:
        raise redis_py.TimeoutError(f"timeout reading a value from L3: {e}") from None
    except OSError as e:
        raise redis_py.ConnectionError(f"error reading a value from L3: {e}") from None
    return True


def receive(
    pool: Any, key: bytes, head: memoryview, out: memoryview, on_piece: Callable[[memoryview], None]
) -> bool | None:
    """:func:`read_value` on a connection of redis-py's ``pool``; None where the caller must fall
    back to redis-py's own GET: the reply was not the expected one (a redirection, a value of
    another size), something was pending on the connection, or it failed (a stale pooled
    connection, a cluster node gone: redis-py reconnects and refreshes the topology). A
    connection whose reply was not read to its end is disconnected before it goes back to the
    pool, so no later command reads its leftovers. A timeout raises (waiting out a second one
    would only delay the tier being marked down), as does a failure to connect."""
    conn = pool.get_connection()
    clean = False
    try:
        if conn.can_read():  # something is pending (a RESP3 push): not ours to parse
            return None
        found = read_value(conn, key, head, out, on_piece)
        clean = True
        return found
    except UnexpectedReply as e:
        log.debug("L3: a fast read of %r fell back: %s", key, e)
        return None
    except redis_py.ConnectionError:
        return None
    finally:
        if not clean:
            conn.disconnect()
        pool.release(conn)

"""LocalListener: the server's end of the local control channel (framing in ``transport.local``)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import shutil
import socket
import stat
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvdock.errors import ProtocolError
from kvdock.transport.local import HEAD, READ_BYTES, SCHEME, Buffer, FrameReader, pack, peer_creds

log = logging.getLogger("kvdock.transport")

MAX_CONNECTIONS = 1024
MAX_UNSENT = 64 << 20  # a connection whose client leaves this much of its replies unread is dropped
MAX_BUFFERED = 256 << 20  # bytes received and not yet handled, all connections together
MAX_BATCH = 256  # messages of one source (a local connection, the zmq socket) handled per turn of the loop
ACCEPT_PAUSE_S = 0.5  # out of descriptors: stop accepting this long
DIR_PREFIX = "kvdock-"
SOCKET_NAME = "control.sock"
DOOR_SOCKET_NAME = "door.sock"  # the pool door's (transport.door), in a directory of its own

Handler = Callable[[int, list[memoryview]], None]


def listen_private(name: str, dir_mode: int, socket_mode: int, backlog: int) -> tuple[str, socket.socket]:
    """A non-blocking UNIX socket listening at ``name`` in a fresh directory (an unguessable
    ``DIR_PREFIX`` name, mode ``dir_mode``; the socket ``socket_mode``): the directory and the
    socket. It binds under another name and renames once it listens, so that
    :func:`cleanup_stale` never takes a starting server's socket for a dead one's. OSError if it
    cannot be made (an unwritable TMPDIR, a path over the 107 bytes a UNIX socket's may have);
    nothing is left behind then."""
    directory = tempfile.mkdtemp(prefix=DIR_PREFIX)  # 0700
    binding = os.path.join(directory, "binding.sock")
    try:
        os.chmod(directory, dir_mode)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(binding)
            os.chmod(binding, socket_mode)
            sock.listen(backlog)
            sock.setblocking(False)
            os.rename(binding, os.path.join(directory, name))
        except BaseException:
            sock.close()
            raise
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    return directory, sock


def cleanup_stale() -> list[str]:
    """Remove the socket directories of this user's servers that no longer run (a killed server
    leaves its own behind); returns their paths. A directory is stale when it is this user's own
    (not a link) and holds nothing but a socket named SOCKET_NAME that refuses connections (a
    server binds under another name and renames once it listens, so a starting one is never
    taken for a dead one). Never waits: a live server whose backlog is full is left alone. The
    pool door's directories (DOOR_SOCKET_NAME) go the same way."""
    removed = []
    for d in Path(tempfile.gettempdir()).glob(DIR_PREFIX + "*"):
        try:
            st = d.lstat()
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
                continue
            names = [p.name for p in d.iterdir()]
            if len(names) != 1 or names[0] not in (SOCKET_NAME, DOOR_SOCKET_NAME):
                continue
            sock_path = d / names[0]
            if not stat.S_ISSOCK(sock_path.lstat().st_mode):
                continue
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                probe.setblocking(False)
                probe.connect(str(sock_path))
        except ConnectionRefusedError:
            shutil.rmtree(d, ignore_errors=True)
            removed.append(str(d))
        except OSError:
            continue
    return removed


def accept_or_pause(
    listener: socket.socket,
    loop: asyncio.AbstractEventLoop,
    resume: Callable[[], None],
    what: str,
) -> socket.socket | None:
    """The next connection in ``listener``'s backlog (non-blocking), or None: none waiting, or
    accepting failed (logged, naming ``what``). Out of descriptors the connection stays in the
    backlog and the listener reads as ready at once, so it is not watched for ``ACCEPT_PAUSE_S``
    (then ``resume`` is called) instead of spinning. Shared by the listener and the pool door."""
    try:
        sock, _ = listener.accept()
    except (BlockingIOError, InterruptedError):
        return None
    except OSError as e:
        out_of_room = e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
        log.warning("%s: accept failed (%s)%s", what, e, f"; pausing {ACCEPT_PAUSE_S:g} s" * out_of_room)
        if out_of_room:
            loop.remove_reader(listener.fileno())
            loop.call_later(ACCEPT_PAUSE_S, resume)
        return None
    return sock


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    reader: FrameReader
    out: bytearray = field(default_factory=bytearray)  # reply bytes the socket has not taken yet
    queued: int = 0  # reply bytes ever sent to this connection (written or waiting in out)
    written: int = 0  # of those, the bytes the socket took
    deaf: bool = False  # a send failed (the client is gone): replies are dropped, its EOF follows
    paused: bool = False  # not read while complete messages wait (more than MAX_BATCH arrived)
    counted: int = 0  # what this connection adds to LocalListener._buffered


class LocalListener:
    """Listens on a UNIX socket in a fresh private directory (mode 0700, an unguessable name);
    accepts connections of this user only (``SO_PEERCRED``), at most MAX_CONNECTIONS.

    Each complete message goes to the handler given to :meth:`start` as (connection id, frames),
    from the loop's reader callbacks, at most MAX_BATCH of one connection per turn of the loop
    (the connection is not read until its backlog is worked off), so a flooding client shares
    the loop with the others. Received bytes not yet handled are bounded per message (the
    framing's ``max_body``) and, for unfinished messages, for all connections together
    (MAX_BUFFERED: a connection whose read passes it while holding no complete message is
    dropped; complete ones are worked off first). ``send`` never blocks: what the socket does not take at once is
    kept and written when it can be (:meth:`written` tells when), and a connection with more
    than MAX_UNSENT unwritten bytes is dropped, with no more of its messages run. A message
    that cannot be one, an EOF or a socket error closes its connection; a client gone before
    its replies still has the messages it sent run. Connection ids are never reused. The event
    loop's thread only."""

    def __init__(self, max_body: int) -> None:
        """OSError if the socket cannot be made (an unwritable TMPDIR, a path over the 107 bytes
        a UNIX socket's may have); nothing is left behind then."""
        self._dir, self._listener = listen_private(SOCKET_NAME, 0o700, 0o600, 128)
        self.path = os.path.join(self._dir, SOCKET_NAME)
        self._max_body = max_body
        self._conns: dict[int, _Conn] = {}
        self._next_id = 0
        self._buffered = 0  # sum of the connections' ``counted`` (their reader.pending, once synced)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handler: Handler | None = None
        self._scratch = memoryview(bytearray(READ_BYTES))

    @property
    def url(self) -> str:
        return SCHEME + self.path

    def start(self, loop: asyncio.AbstractEventLoop, handler: Handler) -> None:
        """Accept connections from now on and hand their messages to ``handler``; a ProtocolError
        it raises drops the message's connection, anything else must not escape it."""
        self._loop, self._handler = loop, handler
        loop.add_reader(self._listener.fileno(), self._accept)

    def send(self, cid: int, frames: Sequence[Buffer]) -> int:
        """Send one message to connection ``cid``, or drop it if that connection is gone. The
        frames are not referenced after the call returns. Returns the mark to give
        :meth:`written`."""
        conn = self._conns.get(cid)
        if conn is None or conn.deaf:
            return 0
        bufs = pack(frames)
        size = HEAD.size + HEAD.unpack(bufs[0])[0]
        conn.queued += size
        if not conn.out:
            try:
                sent = conn.sock.sendmsg(bufs, (), socket.MSG_NOSIGNAL)
            except BlockingIOError:
                sent = 0
            except OSError:
                # The client is gone (EPIPE). What it sent before still runs: a closing client's
                # last messages (CommitRetrieve, CloseClient) are exactly the ones that matter.
                self._deafen(conn)
                return conn.queued
            conn.written += sent
            if sent < size:  # keep what the socket did not take
                for b in bufs:
                    n = memoryview(b).nbytes
                    if sent < n:
                        conn.out += memoryview(b)[sent:]
                    sent = max(0, sent - n)
            if conn.out:
                assert self._loop is not None
                self._loop.add_writer(conn.sock.fileno(), self._flush, cid)
        else:
            for b in bufs:
                conn.out += b
        if len(conn.out) > MAX_UNSENT:
            self._drop(cid, f"{len(conn.out)} bytes of replies unread")
        return conn.queued

    def written(self, cid: int, mark: int) -> bool:
        """Whether the reply that :meth:`send` gave ``mark`` for no longer waits in the server
        (written to the socket, or dropped with its connection)."""
        conn = self._conns.get(cid)
        return conn is None or conn.deaf or conn.written >= mark

    def stop(self) -> None:
        """Take no more connections or messages (replies still go out until close). Harmless twice."""
        if self._loop is not None and not self._loop.is_closed() and self._listener.fileno() >= 0:
            self._loop.remove_reader(self._listener.fileno())
            for conn in self._conns.values():
                self._loop.remove_reader(conn.sock.fileno())
        self._handler = None

    def close(self) -> None:
        self.stop()
        for cid in list(self._conns):
            self._drop(cid, None)
        self._listener.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    def check_integrity(self) -> None:
        """Every listed connection is open, has at most MAX_UNSENT bytes waiting, and an id that
        was handed out; at most MAX_CONNECTIONS are listed; the buffered count adds up."""
        assert len(self._conns) <= MAX_CONNECTIONS, f"{len(self._conns)} connections listed"
        for cid, conn in self._conns.items():
            assert conn.sock.fileno() >= 0, f"connection {cid} is closed but still listed"
            assert len(conn.out) <= MAX_UNSENT, f"connection {cid} holds {len(conn.out)} unsent bytes"
            assert conn.written + len(conn.out) <= conn.queued or conn.deaf, f"connection {cid}"
            assert 0 < cid <= self._next_id
        held = sum(c.reader.pending for c in self._conns.values())
        assert held == self._buffered, f"{self._buffered} bytes counted as buffered, {held} held"

    # --- internals -----------------------------------------------------------------------------

    def _accept(self) -> None:
        assert self._loop is not None
        while True:
            sock = accept_or_pause(self._listener, self._loop, self._resume_accepting, "local control channel")
            if sock is None:
                return
            try:
                refused = peer_creds(sock)[1] != os.geteuid() or len(self._conns) >= MAX_CONNECTIONS
            except OSError:
                refused = True
            if refused:
                sock.close()
                continue
            sock.setblocking(False)
            self._next_id += 1
            self._conns[self._next_id] = _Conn(sock, FrameReader(self._max_body))
            self._loop.add_reader(sock.fileno(), self._read, self._next_id)

    def _resume_accepting(self) -> None:
        if self._handler is not None and self._loop is not None and self._listener.fileno() >= 0:
            self._loop.add_reader(self._listener.fileno(), self._accept)

    def _read(self, cid: int) -> None:
        conn = self._conns.get(cid)
        if conn is None or self._handler is None:
            return
        alive = conn.reader.read_from(conn.sock, self._scratch)
        self._count(cid, conn)
        if not alive:
            self._drop(cid, None)
            return
        if self._buffered > MAX_BUFFERED and conn.reader.pending > 0 and not conn.reader.has_message():
            self._drop(cid, f"{self._buffered} bytes of unfinished messages buffered, over {MAX_BUFFERED}")
            return
        self._work(cid)

    def _work(self, cid: int) -> None:
        """Handle up to MAX_BATCH complete messages of ``cid``; with more waiting, come back in
        the loop's next turn, not reading the socket meanwhile."""
        conn, handler, loop = self._conns.get(cid), self._handler, self._loop
        if conn is None or handler is None or loop is None:
            return
        try:
            for n, frames in enumerate(conn.reader.messages(), 1):
                handler(cid, frames)
                if cid not in self._conns:  # dropped for leaving its replies unread: serve no more
                    return
                if n == MAX_BATCH and conn.reader.has_message():
                    if not conn.paused:
                        conn.paused = True
                        loop.remove_reader(conn.sock.fileno())
                    loop.call_soon(self._work, cid)
                    return
        except ProtocolError as e:
            self._drop(cid, str(e))
            return
        finally:
            self._count(cid, conn)
        if conn.paused:
            conn.paused = False
            loop.add_reader(conn.sock.fileno(), self._read, cid)

    @staticmethod
    def _deafen(conn: _Conn) -> None:
        """No more replies to ``conn``. Shut its sending side too: a client still alive (the send
        failed for want of memory, say) then reads EOF and stops waiting, instead of timing out."""
        conn.deaf = True
        with contextlib.suppress(OSError):
            conn.sock.shutdown(socket.SHUT_WR)

    def _count(self, cid: int, conn: _Conn) -> None:
        if cid in self._conns:  # a dropped one's share left with it
            self._buffered += conn.reader.pending - conn.counted
            conn.counted = conn.reader.pending

    def _flush(self, cid: int) -> None:
        conn = self._conns.get(cid)
        if conn is None:
            return
        assert self._loop is not None
        try:
            sent = conn.sock.send(conn.out, socket.MSG_NOSIGNAL)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:  # gone, as in send(): its EOF drops it
            self._deafen(conn)
            conn.out.clear()
            self._loop.remove_writer(conn.sock.fileno())
            return
        del conn.out[:sent]
        conn.written += sent
        if not conn.out:
            self._loop.remove_writer(conn.sock.fileno())

    def _drop(self, cid: int, why: str | None) -> None:
        conn = self._conns.pop(cid, None)
        if conn is None:  # dropped already (a handler's send failed while its batch ran)
            return
        self._buffered -= conn.counted
        if why:
            log.warning("local control channel: connection %d dropped: %s", cid, why)
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(conn.sock.fileno())
            self._loop.remove_writer(conn.sock.fileno())
        with contextlib.suppress(OSError):
            conn.sock.close()

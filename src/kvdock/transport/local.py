"""The local control channel: the same messages as the zmq control plane, over a UNIX stream socket.

Why a second channel: a zmq round trip passes through both sides' I/O threads, four thread
hops that cost ~160 us over loopback TCP (~120 us over ``ipc://``) on a 2-core VM, more than a
one-chunk retrieve should take in all; a UNIX socket read and written by the two Python threads
themselves takes ~20 us. The server offers it to clients granted shared memory (they run on its
host, as the same user), which keep zmq as the fallback.

One message on the wire (little-endian): ``u32 body length``, ``u32 frame count n``, then the
body: ``n`` u32 frame lengths and the frames back to back. A request's frames are ``[seq,
header, *payload]`` and so are a reply's, exactly the zmq envelope without the routing identity.

``LocalListener`` is the server side (the event loop's thread only), ``LocalChannel`` the
client side (driven by ``transport.client.ControlClient``, which serializes its calls).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import select
import shutil
import socket
import struct
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from kvdock.errors import ConnectionLost, ControlTimeout, ProtocolError

log = logging.getLogger("kvdock.transport")

Buffer = bytes | bytearray | memoryview
HEAD = struct.Struct("<II")
MAX_FRAMES = 1 << 16
READ_BYTES = 1 << 20  # per recv, through a reused buffer (a fresh one costs an mmap and munmap)
MAX_CONNECTIONS = 1024
MAX_UNSENT = 64 << 20  # a connection whose client leaves this much of its replies unread is dropped
SCHEME = "unix://"
IOV_FRAMES = 512  # past this many frames one joined buffer is sent (sendmsg takes at most 1024)


def pack(frames: Sequence[Buffer]) -> list[Buffer]:
    """The buffers of one message (for ``sendmsg``: the frames themselves are not copied, unless
    there are more than IOV_FRAMES of them)."""
    lens = [memoryview(f).nbytes for f in frames]
    if not 0 < len(lens) <= MAX_FRAMES:
        raise ProtocolError(f"a message has 1 to {MAX_FRAMES} frames, not {len(lens)}")
    counts = struct.pack(f"<{len(lens)}I", *lens)
    body = len(counts) + sum(lens)
    if body >= 1 << 32:
        raise ProtocolError(f"a message of {body} bytes is over the local channel's 4 GiB")
    if len(lens) > IOV_FRAMES:
        return [HEAD.pack(body, len(lens)), counts, b"".join(frames)]
    return [HEAD.pack(body, len(lens)), counts, *frames]


class FrameReader:
    """Reassembles messages from the bytes of a stream. ProtocolError for a message that cannot
    be one (too many frames, lengths that do not add up, a body over ``max_body``)."""

    def __init__(self, max_body: int) -> None:
        self.max_body = max_body
        self._buf = bytearray()

    @property
    def pending(self) -> int:
        """Bytes received and not yet returned as messages."""
        return len(self._buf)

    def feed(self, data: Buffer) -> None:
        self._buf += data

    def read_from(self, sock: socket.socket, scratch: memoryview) -> bool:
        """Take what ``sock`` (non-blocking) has, through ``scratch``; False at EOF or on a
        socket error, True otherwise (also when nothing was there yet)."""
        try:
            n = sock.recv_into(scratch)
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            return False
        if n:
            self._buf += scratch[:n]
        return n > 0

    def messages(self) -> Iterator[list[memoryview]]:
        buf = self._buf
        while len(buf) >= HEAD.size:
            body, n = HEAD.unpack_from(buf)
            if body > self.max_body or not 0 < n <= MAX_FRAMES or 4 * n > body:
                raise ProtocolError(f"not a message: body of {body} bytes, {n} frames (at most {self.max_body} bytes)")
            if len(buf) < HEAD.size + body:
                return
            msg = memoryview(bytes(buf[HEAD.size : HEAD.size + body]))
            del buf[: HEAD.size + body]
            lens = struct.unpack_from(f"<{n}I", msg)
            if 4 * n + sum(lens) != body:
                raise ProtocolError(f"frame lengths {sum(lens)} + {4 * n} do not add up to the body of {body} bytes")
            frames, at = [], 4 * n
            for length in lens:
                frames.append(msg[at : at + length])
                at += length
            yield frames


def _peer_uid(sock: socket.socket) -> int:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", creds)[1])


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    reader: FrameReader
    out: bytearray = field(default_factory=bytearray)
    deaf: bool = False  # a send failed (the client is gone): replies are dropped, its EOF follows


class LocalListener:
    """Listens on a UNIX socket in a fresh private directory (mode 0700, an unguessable name);
    accepts connections of this user only (``SO_PEERCRED``), at most MAX_CONNECTIONS.

    Each complete message goes to the handler given to :meth:`start` as (connection id, frames),
    from the loop's reader callback; one callback reads at most READ_BYTES of a connection, so a
    flooding client shares the loop with the others. ``send`` never blocks: what the socket does
    not take at once is kept and written when it can be, and a connection with more than
    MAX_UNSENT unwritten bytes is dropped. A message that cannot be one, an EOF or a socket error
    closes its connection; the others go on. Connection ids are never reused. The event loop's
    thread only."""

    def __init__(self, max_body: int) -> None:
        """OSError if the socket cannot be made (an unwritable TMPDIR, a path over the 107 bytes
        a UNIX socket's may have); nothing is left behind then."""
        self._dir = tempfile.mkdtemp(prefix="kvdock-")  # 0700
        self.path = os.path.join(self._dir, "control.sock")
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._listener.bind(self.path)
            os.chmod(self.path, 0o600)
            self._listener.listen(128)
            self._listener.setblocking(False)
        except BaseException:
            self._listener.close()
            shutil.rmtree(self._dir, ignore_errors=True)
            raise
        self._max_body = max_body
        self._conns: dict[int, _Conn] = {}
        self._next_id = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handler: Callable[[int, list[memoryview]], None] | None = None
        self._scratch = memoryview(bytearray(READ_BYTES))

    @property
    def url(self) -> str:
        return SCHEME + self.path

    def start(self, loop: asyncio.AbstractEventLoop, handler: Callable[[int, list[memoryview]], None]) -> None:
        """Accept connections from now on and hand their messages to ``handler``; a ProtocolError
        it raises drops the message's connection, anything else must not escape it."""
        self._loop, self._handler = loop, handler
        loop.add_reader(self._listener.fileno(), self._accept)

    def send(self, cid: int, frames: Sequence[Buffer]) -> None:
        """Send one message to connection ``cid``, or drop it if that connection is gone. The
        frames are not referenced after the call returns."""
        conn = self._conns.get(cid)
        if conn is None or conn.deaf:
            return
        bufs = pack(frames)
        if not conn.out:
            try:
                sent = conn.sock.sendmsg(bufs, (), socket.MSG_NOSIGNAL)
            except BlockingIOError:
                sent = 0
            except OSError:
                # The client is gone (EPIPE). What it sent before still runs: a closing client's
                # last messages (CommitRetrieve, CloseClient) are exactly the ones that matter.
                conn.deaf = True
                return
            for b in bufs:
                size = memoryview(b).nbytes
                if sent < size:
                    conn.out += memoryview(b)[sent:]
                sent = max(0, sent - size)
            if conn.out:
                assert self._loop is not None
                self._loop.add_writer(conn.sock.fileno(), self._flush, cid)
        else:
            for b in bufs:
                conn.out += b
        if len(conn.out) > MAX_UNSENT:
            self._drop(cid, f"{len(conn.out)} bytes of replies unread")

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
        was handed out; at most MAX_CONNECTIONS are listed."""
        assert len(self._conns) <= MAX_CONNECTIONS, f"{len(self._conns)} connections listed"
        for cid, conn in self._conns.items():
            assert conn.sock.fileno() >= 0, f"connection {cid} is closed but still listed"
            assert len(conn.out) <= MAX_UNSENT, f"connection {cid} holds {len(conn.out)} unsent bytes"
            assert 0 < cid <= self._next_id

    # --- internals -----------------------------------------------------------------------------

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # EMFILE and the like: the client sees a closed socket
                log.warning("local control channel: accept failed: %s", e)
                return
            try:
                refused = _peer_uid(sock) != os.geteuid() or len(self._conns) >= MAX_CONNECTIONS
            except OSError:
                refused = True
            if refused:
                sock.close()
                continue
            sock.setblocking(False)
            self._next_id += 1
            self._conns[self._next_id] = _Conn(sock, FrameReader(self._max_body))
            assert self._loop is not None
            self._loop.add_reader(sock.fileno(), self._read, self._next_id)

    def _read(self, cid: int) -> None:
        conn = self._conns.get(cid)
        if conn is None:
            return
        handler = self._handler
        if handler is None:  # stopped
            return
        if not conn.reader.read_from(conn.sock, self._scratch):
            self._drop(cid, None)
            return
        try:
            for frames in conn.reader.messages():
                handler(cid, frames)
                if cid not in self._conns:  # dropped for leaving its replies unread: serve no more
                    return
        except ProtocolError as e:
            self._drop(cid, str(e))

    def _flush(self, cid: int) -> None:
        conn = self._conns.get(cid)
        if conn is None:
            return
        try:
            sent = conn.sock.send(conn.out, socket.MSG_NOSIGNAL)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:  # gone, as in send(): its EOF drops it
            conn.deaf = True
            conn.out.clear()
            assert self._loop is not None
            self._loop.remove_writer(conn.sock.fileno())
            return
        del conn.out[:sent]
        if not conn.out:
            assert self._loop is not None
            self._loop.remove_writer(conn.sock.fileno())

    def _drop(self, cid: int, why: str | None) -> None:
        conn = self._conns.pop(cid, None)
        if conn is None:  # dropped already (a handler's send failed while its batch ran)
            return
        if why:
            log.warning("local control channel: connection %d dropped: %s", cid, why)
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(conn.sock.fileno())
            self._loop.remove_writer(conn.sock.fileno())
        conn.sock.close()


class LocalChannel:
    """The client's end: one connection to a LocalListener. Not thread-safe (ControlClient
    serializes every call but ``fileno``). ``fileno`` is level-triggered: readable while bytes
    wait. ConnectionLost once the server closed the connection (it exited or dropped us)."""

    edge_triggered = False

    def __init__(self, url: str, timeout: float) -> None:
        if not url.startswith(SCHEME):
            raise ValueError(f"not a local control URL: {url!r}")
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.settimeout(timeout)
            self._sock.connect(url.removeprefix(SCHEME))
        except OSError as e:
            self._sock.close()
            raise ValueError(f"cannot connect to {url!r}: {e}") from None
        self._sock.setblocking(False)
        self._reader = FrameReader(1 << 62)  # the server is trusted for sizes
        self._lost = False
        self._scratch = memoryview(bytearray(READ_BYTES))

    def fileno(self) -> int:
        return self._sock.fileno()

    def send(self, frames: Sequence[Buffer], deadline: float | None) -> None:
        """Write a whole message, waiting until ``deadline`` (monotonic; None: fail at once) for
        room; ControlTimeout if that passes first with nothing sent. Whatever stops a message
        halfway (the deadline, an error, an exception in this thread) hangs up, so that the
        server drops the half it holds, and raises ConnectionLost (or the exception)."""
        if self._lost:
            raise ConnectionLost("the server closed the local control connection", sent=False)
        bufs: list[memoryview] = [memoryview(b).cast("B") for b in pack(frames)]
        started = False
        try:
            while bufs:
                try:
                    sent = self._sock.sendmsg(bufs, (), socket.MSG_NOSIGNAL)
                except BlockingIOError:
                    sent = 0
                except OSError as e:
                    self._lost = True
                    raise ConnectionLost(f"the local control connection failed: {e}", sent=False) from None
                started = started or sent > 0
                while bufs and sent >= bufs[0].nbytes:
                    sent -= bufs.pop(0).nbytes
                if bufs:
                    bufs[0] = bufs[0][sent:]
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is None or left <= 0 or not self._writable(left):
                        if started:  # hung up below: the server drops the half it holds unrun
                            raise ConnectionLost("a message was cut off: the server did not read it", sent=False)
                        raise ControlTimeout("the server did not take the message in time")
        except BaseException:
            if started and bufs:  # the server holds half a message: hang up, so that it drops it
                self._lost = True
                with contextlib.suppress(OSError):
                    self._sock.shutdown(socket.SHUT_RDWR)
            raise

    def _writable(self, timeout_s: float) -> bool:
        poller = select.poll()  # not select(): descriptors past 1024 are common in engines
        poller.register(self._sock.fileno(), select.POLLOUT)
        return bool(poller.poll(max(1, int(timeout_s * 1000))))

    def receive(self) -> list[list[memoryview]]:
        """Every message that has arrived (maybe none); never waits. One read as a rule: the
        descriptor is level-triggered, so what is left in the socket polls readable."""
        if self._lost:
            raise ConnectionLost("the server closed the local control connection")
        out: list[list[memoryview]] = []
        while True:
            before = self._reader.pending
            if not self._reader.read_from(self._sock, self._scratch):
                self._lost = True
                break
            got = self._reader.pending - before
            try:
                out.extend(self._reader.messages())
            except ProtocolError:
                self._lost = True
                break
            if got < len(self._scratch):
                break
        if self._lost and not out:
            raise ConnectionLost("the server closed the local control connection")
        return out

    def close(self, linger_s: float = 0.0) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()

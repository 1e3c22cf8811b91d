"""The local control channel: the same messages as the zmq control plane, over a UNIX stream socket.

Why a second channel: a zmq round trip passes through both sides' I/O threads, four thread
hops that cost ~160 us over loopback TCP (~120 us over ``ipc://``) on a 2-core VM, more than a
one-chunk retrieve should take in all; a UNIX socket read and written by the two Python threads
themselves takes ~20 us. The server offers it to clients granted shared memory (they run on its
host, as the same user), which keep zmq as the fallback.

One message on the wire (little-endian): ``u32 body length``, ``u32 frame count n``, then the
body: ``n`` u32 frame lengths and the frames back to back. A request's frames are ``[seq,
header, *payload]`` and so are a reply's, exactly the zmq envelope without the routing identity.

``transport.listener.LocalListener`` is the server side, ``LocalChannel`` (here, with the
framing) the client side, driven by ``transport.client.ControlClient``, which serializes its calls.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Iterator, Sequence

from kvdock.errors import ConnectionLost, ControlTimeout, ProtocolError
from kvdock.protocol.limits import MAX_FRAMES, MAX_LOCAL_BODY

Buffer = bytes | bytearray | memoryview
HEAD = struct.Struct("<II")
READ_BYTES = 1 << 20  # per recv, through a reused buffer (a fresh one costs an mmap and munmap)
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
    if body > MAX_LOCAL_BODY:
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

    def has_message(self) -> bool:
        """Whether a whole message (or a header that cannot be one) waits in the buffer."""
        if len(self._buf) < HEAD.size:
            return False
        body: int = HEAD.unpack_from(self._buf)[0]
        return body > self.max_body or len(self._buf) >= HEAD.size + body

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


class PeerWatch:
    """Whether the process at the other end of a local connection still holds it, told without
    reading anything: a duplicate of the connection's descriptor (so that closing the connection
    never lets its number name another file), polled for a hang-up. ``pid`` is the peer's, as the
    kernel recorded it when the server listened (``SO_PEERCRED``). A process that dies, or drops
    the connection, hangs it up at once. Thread-safe: :meth:`close` waits for a poll in progress,
    and a closed watch says the peer is gone."""

    def __init__(self, sock: socket.socket) -> None:
        self.pid = peer_creds(sock)[0]
        self._fd = os.dup(sock.fileno())
        self._lock = threading.Lock()  # the descriptor is never closed under a poll of it

    def alive(self) -> bool:
        """False once the peer hung up (or either side shut the connection down), or closed."""
        with self._lock:
            if self._fd < 0:
                return False
            poller = select.poll()  # per call: a poll object is not for two threads at once
            poller.register(self._fd, select.POLLRDHUP)  # (POLLHUP, POLLERR and POLLNVAL always count)
            return not poller.poll(0)

    def close(self) -> None:
        with self._lock:
            fd, self._fd = self._fd, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)


_CREDS = struct.Struct("3i")  # struct ucred: pid, uid, gid


def peer_creds(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end of a UNIX socket, as the kernel recorded them
    when it connected (``SO_PEERCRED``; pid 0: not in our PID namespace). OSError if closed."""
    pid, uid, _gid = _CREDS.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDS.size))
    return pid, uid


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

    def alert_fd(self) -> int | None:
        return None

    def watch(self) -> PeerWatch:
        """A watch of the server's end of this connection (OSError if the socket is closed)."""
        return PeerWatch(self._sock)

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

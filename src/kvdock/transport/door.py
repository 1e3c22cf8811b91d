"""The pool door: a UNIX socket where a client trades a ticket for a descriptor of shared memory.

A tenant's pool is a memfd (``shm.pool``) with no name any process could open: the only way to
map it is to be handed its descriptor, over a UNIX socket as SCM_RIGHTS ancillary data. The door
does that and nothing else. Who gets what is the handler's call (``server.pools``: a ticket
issued over the authenticated control plane names the tenant); the door only moves bytes.

Any local user may knock (the socket is 0666 in a directory others may traverse but not list):
tenants may run as other users, and what opens the door is the ticket, not who knocks (the handler is told who
knocks: ``SO_PEERCRED``). So the door assumes nothing of a caller: one request per connection,
at most ``MAX_REQUEST`` bytes ended by the caller shutting down its sending side, within
``DEADLINE_S``; one reply (with at most MAX_FDS descriptors); then it hangs up. At most
``MAX_WAITING`` connections wait at once, ``MAX_PER_USER`` of one user (more are closed at once,
so that one user holding connections open cannot shut the door on the others); at most
``MAX_ACCEPTS`` are taken per turn of the event loop, and out of descriptors it stops accepting
for ``ACCEPT_PAUSE_S``. Descriptors a caller sends along are
discarded unread (the kernel closes them: no room is given for ancillary data). The client's end
(:func:`knock`) takes the descriptor close-on-exec.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import logging
import os
import shutil
import socket
from collections.abc import Callable
from dataclasses import dataclass, field

from kvdock.protocol.limits import DOOR_MAX_FDS as MAX_FDS
from kvdock.protocol.limits import DOOR_MAX_REPLY as MAX_REPLY
from kvdock.protocol.limits import DOOR_MAX_REQUEST as MAX_REQUEST
from kvdock.transport.listener import DOOR_SOCKET_NAME, accept_or_pause, listen_private
from kvdock.transport.local import SCHEME, peer_creds

log = logging.getLogger("kvdock.transport")

MAX_WAITING = 64
MAX_PER_USER = 8
MAX_ACCEPTS = 64
DEADLINE_S = 2.0


@dataclass(frozen=True)
class Caller:
    """Who knocks, as the kernel says (``SO_PEERCRED`` when it connected; pid 0: not in the
    server's PID namespace)."""

    pid: int
    uid: int


# (the request's bytes, its caller) -> (the reply's bytes, the descriptors to send with it, at
# most MAX_FDS); it must not raise
DoorHandler = Callable[[bytes, Caller], tuple[bytes, tuple[int, ...]]]
_FD = array.array("i")  # (a descriptor's size)


@dataclass(eq=False)
class _Waiting:
    conn: socket.socket
    caller: Caller
    timer: asyncio.TimerHandle
    got: bytearray = field(default_factory=bytearray)


class PoolDoor:
    """The server's end. ``start`` it on the event loop; the event loop's thread only."""

    def __init__(self) -> None:
        """OSError if the socket cannot be made (nothing is left behind then)."""
        # others reach the socket by its path; nobody lists the directory
        self._dir, self._sock = listen_private(DOOR_SOCKET_NAME, 0o711, 0o666, MAX_WAITING)
        self.path = os.path.join(self._dir, DOOR_SOCKET_NAME)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handler: DoorHandler | None = None
        self._waiting: dict[int, _Waiting] = {}  # by descriptor

    @property
    def url(self) -> str:
        return SCHEME + self.path

    def start(self, loop: asyncio.AbstractEventLoop, handler: DoorHandler) -> None:
        self._loop, self._handler = loop, handler
        loop.add_reader(self._sock.fileno(), self._accept)

    def close(self) -> None:
        """Stop answering, hang up on every caller, remove the socket. Harmless twice."""
        if self._loop is not None and not self._loop.is_closed() and self._sock.fileno() >= 0:
            self._loop.remove_reader(self._sock.fileno())
        for fd in list(self._waiting):
            self._hang_up(fd)
        self._sock.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    def check_integrity(self) -> None:
        assert len(self._waiting) <= MAX_WAITING, f"{len(self._waiting)} callers wait at the door"
        per_user: dict[int, int] = {}
        for fd, w in self._waiting.items():
            assert w.conn.fileno() == fd and len(w.got) <= MAX_REQUEST
            per_user[w.caller.uid] = per_user.get(w.caller.uid, 0) + 1
        assert all(n <= MAX_PER_USER for n in per_user.values()), f"callers waiting by user: {per_user}"

    def _accept(self) -> None:
        assert self._loop is not None
        for _ in range(MAX_ACCEPTS):  # (the rest wait in the backlog for the next turn)
            conn = accept_or_pause(self._sock, self._loop, self._resume, "pool door")  # (review: no spinning)
            if conn is None:
                return
            try:
                caller = Caller(*peer_creds(conn))
            except OSError:
                conn.close()
                continue
            mine = sum(1 for w in self._waiting.values() if w.caller.uid == caller.uid)
            if len(self._waiting) >= MAX_WAITING or mine >= MAX_PER_USER:
                conn.close()
                continue
            conn.setblocking(False)
            fd = conn.fileno()
            timer = self._loop.call_later(DEADLINE_S, self._hang_up, fd)
            self._waiting[fd] = _Waiting(conn, caller, timer)
            self._loop.add_reader(fd, self._read, fd)

    def _resume(self) -> None:
        if self._handler is not None and self._loop is not None and self._sock.fileno() >= 0:
            self._loop.add_reader(self._sock.fileno(), self._accept)

    def _read(self, fd: int) -> None:
        entry = self._waiting.get(fd)
        if entry is None:
            return
        conn, got = entry.conn, entry.got
        try:
            data = conn.recv(MAX_REQUEST + 1 - len(got))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._hang_up(fd)
            return
        got += data
        if len(got) > MAX_REQUEST:
            self._hang_up(fd)
        elif not data and got:  # the whole request (the caller shut its side)
            self._answer(fd, bytes(got))
        elif not data:  # nothing asked (a liveness probe: listener.cleanup_stale)
            self._hang_up(fd)

    def _answer(self, fd: int, request: bytes) -> None:
        waiting = self._waiting[fd]
        conn = waiting.conn
        handler = self._handler
        if handler is not None:
            reply, fds = handler(request, waiting.caller)
            assert len(fds) <= MAX_FDS
            with contextlib.suppress(OSError):  # a caller gone, or not reading: its loss
                if fds:
                    socket.send_fds(conn, [reply], list(fds), socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
                else:
                    conn.send(reply, socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
        self._hang_up(fd)

    def _hang_up(self, fd: int) -> None:
        entry = self._waiting.pop(fd, None)
        if entry is None:
            return
        entry.timer.cancel()
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(fd)
        entry.conn.close()


def knock(url: str, request: bytes, timeout: float) -> tuple[bytes, list[int]]:
    """The client's end: send ``request`` to the door at ``url`` and return its reply and the
    descriptors that came with it (close-on-exec; the caller owns them). OSError if the door
    cannot be reached or hangs up without a reply, TimeoutError past ``timeout`` seconds,
    ValueError for a URL that is not a door's."""
    if not url.startswith(SCHEME):
        raise ValueError(f"not a pool door URL: {url!r}")
    fds: list[int] = []
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(url.removeprefix(SCHEME))
        sock.sendall(request)
        sock.shutdown(socket.SHUT_WR)
        reply = bytearray()
        try:
            while len(reply) <= MAX_REPLY:
                # (not socket.recv_fds: before Python 3.12 it drops its flags, and the descriptor
                # must be close-on-exec from the start, or any program this process runs inherits it)
                data, ancillary, _flags, _addr = sock.recvmsg(
                    MAX_REPLY + 1, socket.CMSG_LEN(MAX_FDS * _FD.itemsize), socket.MSG_CMSG_CLOEXEC
                )
                for level, kind, payload in ancillary:
                    if (level, kind) == (socket.SOL_SOCKET, socket.SCM_RIGHTS):
                        got = array.array("i")
                        got.frombytes(payload[: len(payload) - len(payload) % _FD.itemsize])
                        fds += got
                if not data:
                    break
                reply += data
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
    if not reply or len(reply) > MAX_REPLY or len(fds) > MAX_FDS:
        for fd in fds:
            os.close(fd)
        raise OSError(f"the pool door at {url} hung up without a reply")
    return bytes(reply), fds

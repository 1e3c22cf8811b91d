"""The control-plane client (used by the SDK and engines), shared by many threads.

It talks over a *channel*: a zmq DEALER socket (``ZmqChannel``, any zmq URL) or the server's
local UNIX socket (``transport.local.LocalChannel``, a ``unix://`` URL), picked by the URL.

Every request carries a fresh ``seq`` frame that the server echoes in its reply, so several
threads can have requests in flight on one socket and each waits only for its own reply: a
request the server holds (a PrepareRetrieve or WaitPrefetch waiting for a prefetch) does not
delay the others.

How the waiting works (leader/follower, no background thread):

* ``_sock_lock`` guards every use of the channel (zmq sockets are not thread-safe). It is held
  only to send, or to receive what has already arrived (non-blocking), never while waiting for a
  reply. A send may wait for room in the socket (until the call's deadline),
  and the lock with it: the server reads without waiting for anything, so that wait is short.
* A caller opens a slot for its seq in ``_slots`` before sending. Whoever receives a reply puts
  it in the slot of its seq and notifies ``_cond``; a reply without a slot (its caller gave up)
  is dropped.
* Of the threads waiting, one at a time is the *leader*: it sleeps in ``poll()`` on the channel's
  file descriptor (zmq's ``ZMQ_FD``; it needs no lock) and on a wake-up pipe, then takes the
  socket lock and receives everything that arrived. The others, the *followers*, wait on
  ``_cond``. A leader whose reply came hands the role on (notify) and returns.
* ``ZMQ_FD`` is edge-triggered: it only signals again for what arrives after someone emptied the
  socket (the UNIX socket's is level-triggered: there the same rules are merely redundant). So
  whoever holds the socket lock receives until the channel has nothing more before letting go
  (a sender too, while a leader sleeps: the send may have taken the edge), and
  if it delivered a reply while another thread leads, it writes a byte to the wake-up pipe so
  that the leader looks at its slot again.

A single thread pays no thread switch: it sends, becomes the leader and receives its own reply.
A channel that breaks (the server closed the UNIX socket) fails every waiting call at once with
ConnectionLost, and every later one.
"""

from __future__ import annotations

import contextlib
import math
import os
import select
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, overload

import msgspec

from kvdock.errors import ConnectionLost, ControlTimeout, HandshakeRefused, ProtocolError
from kvdock.protocol import decode_reply, encode
from kvdock.protocol import messages as m
from kvdock.transport.channels import Buffer, Channel, ZmqChannel, open_channel
from kvdock.transport.curve import ClientCurve
from kvdock.transport.local import LocalChannel, PeerWatch

__all__ = [
    "Answer",
    "Channel",
    "ConnectionLost",
    "ControlClient",
    "ControlTimeout",
    "HandshakeRefused",
    "Response",
    "ZmqChannel",
    "open_channel",
]

R = TypeVar("R", bound=m.ReplyBase)
T_co = TypeVar("T_co", covariant=True)


def _close_fds(*fds: int) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


@dataclass(frozen=True)
class Answer(Generic[T_co]):
    """A decoded reply and the raw payload frames that came with it (each view keeps its frame's
    memory alive). ``ControlClient.call`` of a ``RequestBase[R]`` answers ``Answer[R | m.Error]``:
    the op's own reply type, or the server's refusal."""

    reply: T_co
    frames: list[memoryview]


# The name call()'s result had before replies were typed: an answer whose reply type the caller
# did not say (kept for code that sends plain msgspec.Structs).
Response = Answer[Any]


def check_reply(msg: msgspec.Struct, reply: object) -> None:
    """ProtocolError unless ``reply`` is an Error or the reply type ``msg``'s op declares
    (:func:`kvdock.protocol.messages.reply_type`): a server that answers a request with another
    op's reply is broken, and its fields must never be read as this one's."""
    expected = m.reply_type(msg) if isinstance(msg, m.REQUESTS) else None
    if expected is not None and not isinstance(reply, (expected, m.Error)):
        raise ProtocolError(f"a {type(msg).__name__} was answered {type(reply).__name__}, not {expected.__name__}")


class ControlClient:
    """One channel to one server. Thread-safe, and calls of different threads overlap (see the
    module docstring). ``url``: a zmq endpoint or a ``unix://`` local socket (ValueError if it
    cannot be used)."""

    def __init__(self, url: str, timeout: float, curve: ClientCurve | None = None) -> None:
        self.url = url
        self.timeout = timeout
        self._chan = open_channel(url, timeout, curve)
        self._fd = self._chan.fileno()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._close_pipe = weakref.finalize(self, _close_fds, self._wake_r, self._wake_w)  # if never closed
        self._poller = select.poll()  # used by the leader only, so never by two threads at once
        self._poller.register(self._fd, select.POLLIN)
        self._poller.register(self._wake_r, select.POLLIN)
        alert = self._chan.alert_fd()
        if alert is not None:
            self._poller.register(alert, select.POLLIN)
        self._sock_lock = threading.Lock()
        # _cond's own lock, entered directly: Condition.__enter__ is a Python-level call, and a
        # call takes the lock up to nine times
        self._mutex = threading.Lock()
        self._cond = threading.Condition(self._mutex)
        # under _cond: seq -> the reply frames once received (None while awaited; the exception
        # to raise when it cannot come)
        self._slots: dict[bytes, list[memoryview] | HandshakeRefused | None] = {}
        self._leader: threading.Thread | None = None
        self._seq = 0
        self._closed = False
        self._lost: ConnectionLost | None = None  # once the channel broke (under _cond)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def lost(self) -> bool:
        """Whether the channel broke (the server closed it): every call fails from then on."""
        return self._lost is not None

    @property
    def usable(self) -> bool:
        """Neither closed nor broken."""
        return not self._closed and self._lost is None

    def peer_watch(self) -> PeerWatch | None:
        """A watch of the server's end of a local channel (None for zmq, or once unusable)."""
        with self._sock_lock:
            if not self.usable or not isinstance(self._chan, LocalChannel):
                return None
            try:
                return self._chan.watch()
            except OSError:
                return None

    @overload
    def call(
        self, msg: m.RequestBase[R], payload: Sequence[Buffer] = (), timeout: float | None = None
    ) -> Answer[R | m.Error]: ...

    @overload
    def call(self, msg: msgspec.Struct, payload: Sequence[Buffer] = (), timeout: float | None = None) -> Response: ...

    def call(self, msg: msgspec.Struct, payload: Sequence[Buffer] = (), timeout: float | None = None) -> Response:
        """Send ``msg`` (plus raw payload frames, zero-copy: leave them unchanged until this
        returns) and wait for its reply; ControlTimeout if none comes in time or the client is
        closed meanwhile, ConnectionLost (``sent`` says whether the message left) if the channel
        broke; ProtocolError for a reply that cannot be one to ``msg`` (:func:`check_reply`)."""
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        header = encode(msg)
        with self._mutex:
            if self._closed:  # nothing sent: a caller may send it another way
                raise ConnectionLost(f"the client of {self.url} is closed", sent=False)
            if self._lost is not None:  # (a send could only wait for room that never comes)
                raise ConnectionLost(str(self._lost), sent=False)
            seq = self._next_seq()
            self._slots[seq] = None
        try:
            try:
                self._send([seq, header, *payload], deadline)
            except ConnectionLost as e:
                raise type(e)(str(e), sent=False) from None
            except ControlTimeout:
                raise ControlTimeout(f"could not send to {self.url} within {limit:.1f}s") from None
            frames = self._wait(seq, deadline, limit)
        finally:
            with self._mutex:
                self._slots.pop(seq, None)
        reply = decode_reply(frames[1])
        check_reply(msg, reply)
        return Answer(reply, frames[2:])

    def send_nowait(self, msg: msgspec.Struct, wait_s: float = 0.0) -> bool:
        """Send without waiting for the reply, which is dropped when it arrives (used for
        best-effort cleanup); waits up to ``wait_s`` for room to send. Whether it was sent: not
        once closed or broken (also when that happens meanwhile), nor when there was no room.
        Never raises for the channel's state."""
        with self._mutex:
            if self._closed:
                return False
            seq = self._next_seq()
        try:
            self._send([seq, encode(msg)], time.monotonic() + wait_s if wait_s > 0 else None)
        except ControlTimeout:  # no room, or the channel broke (ConnectionLost is one)
            return False
        return True

    def close(self, linger_s: float = 0.0) -> None:
        """Close the socket and context, waiting up to ``linger_s`` for queued messages to leave;
        threads still waiting for a reply get ControlTimeout. Harmless to call twice."""
        with self._mutex:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()  # followers: stop waiting
            while self._leader is not None:  # the leader wakes from poll() and leaves promptly
                self._poke()
                self._cond.wait(0.05)
        with self._sock_lock:
            self._chan.close(linger_s)
        with self._mutex:  # pokes happen under _cond, while a leader exists: none can now
            self._close_pipe()

    # --- internals -----------------------------------------------------------------------------

    def _next_seq(self) -> bytes:  # under _cond
        self._seq += 1
        return self._seq.to_bytes(8, "little")

    def try_send(self, msg: msgspec.Struct) -> bool:
        """Send a message whose reply nobody waits for now or not at all: never waiting for the
        socket (another thread may be sending through it) nor for room in it. False when either
        is busy (nothing was sent), or the client is closed or broken. A local message that fits
        one socket buffer unit (about 32 KiB) is written whole or not at all, never cut off."""
        with self._mutex:
            if self._closed:
                return False
            seq = self._next_seq()
        try:
            self._send([seq, encode(msg)], None, block=False)
        except ControlTimeout:  # busy, no room, or broken (ConnectionLost is one)
            return False
        return True

    def _send(self, frames: list[Any], deadline: float | None, block: bool = True) -> None:
        if not self._sock_lock.acquire(blocking=block):
            raise ControlTimeout(f"the socket of {self.url} is busy")
        try:
            if self._closed:  # checked under the lock that close() takes to close the socket
                raise ConnectionLost(f"the client of {self.url} is closed", sent=False)
            try:
                self._chan.send(frames, deadline)
            except HandshakeRefused:
                raise  # (not broken for good: see ZmqChannel)
            except ConnectionLost as e:
                self._broke(e)
                raise
            finally:
                # The send may have consumed ZMQ_FD's edge, which matters to a leader asleep in
                # poll() now; a leader that starts later drains first (under this lock) anyway.
                delivered = self._leader is not None and self._drain()
        finally:
            self._sock_lock.release()
        if delivered:
            self._poke_leader()

    def _drain(self) -> bool:
        """Receive everything that arrived and deliver it (socket lock held). Whether any reply
        went to a waiting caller."""
        delivered = False
        try:
            arrived = self._chan.receive()
        except HandshakeRefused as e:
            self._refuse_waiting(e)
            return True
        except ConnectionLost as e:
            self._broke(e)
            return True
        for frames in arrived:
            if len(frames) < 2:
                continue
            seq = bytes(frames[0])
            with self._mutex:
                if seq in self._slots and self._slots[seq] is None:
                    self._slots[seq] = frames
                    delivered = True
                # else: a late reply to a request given up on, or a send_nowait's: dropped
        if delivered:
            with self._mutex:
                self._cond.notify_all()
        return delivered

    def _refuse_waiting(self, e: HandshakeRefused) -> None:
        """Fail the calls waiting now (their requests cannot get through); later calls try again
        (socket lock held)."""
        with self._mutex:
            for seq, frames in self._slots.items():
                if frames is None:
                    self._slots[seq] = e
            self._cond.notify_all()

    def _broke(self, e: ConnectionLost) -> None:
        """The channel broke: fail every waiting call (socket lock held)."""
        with self._mutex:
            if self._lost is None:
                self._lost = ConnectionLost(f"{self.url}: {e}")
            self._cond.notify_all()

    def _poke(self) -> None:  # under _cond, while the pipe is open
        with contextlib.suppress(BlockingIOError):  # full: the leader has wake-ups pending anyway
            os.write(self._wake_w, b"\0")

    def _poke_leader(self) -> None:
        with self._mutex:
            if self._leader is not None and self._leader is not threading.current_thread():
                self._poke()

    def _wait(self, seq: bytes, deadline: float, limit: float) -> list[memoryview]:
        while True:
            with self._mutex:
                while True:
                    frames = self._slots.get(seq)
                    if isinstance(frames, HandshakeRefused):
                        raise HandshakeRefused(str(frames), sent=True)
                    if frames is not None:
                        return frames
                    if self._lost is not None:
                        raise ConnectionLost(str(self._lost))
                    if self._closed:
                        raise ControlTimeout(f"the client of {self.url} was closed while waiting for a reply")
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise ControlTimeout(f"no reply from {self.url} within {limit:.1f}s")
                    if self._leader is None:
                        self._leader = threading.current_thread()
                        break
                    self._cond.wait(remaining)
            try:
                self._lead(seq, deadline)
            finally:
                with self._mutex:
                    self._leader = None
                    self._cond.notify_all()  # a follower takes over

    def _lead(self, seq: bytes, deadline: float) -> None:
        """Receive for everyone until our reply is in, the deadline passed or the client closes."""
        # a level-triggered channel polls readable for anything not yet received: no need to
        # look before sleeping (a receive that finds nothing costs a syscall and an exception)
        look = self._chan.edge_triggered
        while True:
            if look:
                with self._sock_lock:
                    if self._closed:
                        return
                    self._drain()
            look = True
            with self._mutex:
                if self._slots.get(seq) is not None or self._closed or self._lost is not None:
                    return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            for fd, _ in self._poller.poll(math.ceil(remaining * 1000)):
                if fd == self._wake_r:
                    with contextlib.suppress(BlockingIOError):
                        os.read(self._wake_r, 4096)

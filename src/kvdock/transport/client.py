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
from typing import Any, Protocol

import msgspec
import zmq
from zmq.utils.monitor import parse_monitor_message

from kvdock.errors import ConnectionLost, ControlTimeout, HandshakeRefused
from kvdock.protocol import decode_reply, encode
from kvdock.transport.curve import ClientCurve, apply_client
from kvdock.transport.local import SCHEME, LocalChannel, PeerWatch

__all__ = ["ConnectionLost", "ControlClient", "ControlTimeout", "HandshakeRefused", "Response"]

Buffer = bytes | memoryview


def _close_fds(*fds: int) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


@dataclass
class Response:
    """A decoded reply and the raw payload frames that came with it (each view keeps its frame's
    memory alive)."""

    reply: Any
    frames: list[memoryview]


class Channel(Protocol):
    """One connection to a server, as ControlClient drives it: every method but ``fileno`` is
    called under the client's socket lock."""

    edge_triggered: bool  # fileno signals only for what arrived after ``receive`` emptied it

    def fileno(self) -> int:
        """An OS descriptor that polls readable when a message may have arrived."""
        ...

    def alert_fd(self) -> int | None:
        """Another descriptor (edge-triggered) that polls readable when ``receive`` should look
        at the connection's state; None if there is none."""
        ...

    def send(self, frames: Sequence[Buffer], deadline: float | None) -> None:
        """Send one message, waiting until ``deadline`` (monotonic) for room, or not at all when
        None. ControlTimeout if it could not be sent; ConnectionLost if the channel broke."""
        ...

    def receive(self) -> list[list[memoryview]]:
        """Every message that has arrived (maybe none); never waits. ConnectionLost if broken
        (HandshakeRefused: the server refused this client's CURVE handshake)."""
        ...

    def close(self, linger_s: float) -> None:
        """Close, letting queued messages leave for up to ``linger_s``."""
        ...


_HANDSHAKE_FAILED: dict[int, str] = {
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "the server refused this client's CURVE key (not authorized there)",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake failed: a wrong server public key, or CURVE on one side only",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "the handshake failed: CURVE on one side only?",
}


class ZmqChannel:
    """A DEALER socket (any zmq endpoint; ValueError otherwise), a CURVE client with ``curve``.

    A monitor of the socket reports how handshakes end; libzmq itself would only retry, silently.
    While the last one failed (a key the server does not authorize, CURVE on one side only, or,
    before any handshake ever succeeded, the wrong server key), calls fail at once with
    HandshakeRefused; a later handshake that succeeds (the server restarted with this key
    authorized, say) makes the channel work again. A failure without detail after a success is
    taken for what it usually is then, a connection dropped during the greeting (a restart), and
    only retried."""

    edge_triggered = True

    def __init__(self, url: str, curve: ClientCurve | None = None) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._monitor: zmq.Socket[bytes] | None = None
        self._succeeded = False  # a handshake ever succeeded
        self._failed = ""  # why the last one failed, "" once one succeeds again
        try:
            self._sock.setsockopt(zmq.LINGER, 0)
            if curve is not None:
                apply_client(self._sock, curve)
            # (also without CURVE: a server that requires it fails the handshake)
            events = zmq.EVENT_HANDSHAKE_SUCCEEDED
            for event in _HANDSHAKE_FAILED:
                events |= event
            self._monitor = self._sock.get_monitor_socket(events)
            self._sock.connect(url)
        except zmq.ZMQError as e:
            self._close(0)
            raise ValueError(f"cannot connect to {url!r}: {e}") from None
        fd = self._sock.getsockopt(zmq.FD)
        assert isinstance(fd, int)
        self._fd = fd

    def fileno(self) -> int:
        return self._fd

    def alert_fd(self) -> int | None:
        if self._monitor is None:
            return None
        fd = self._monitor.getsockopt(zmq.FD)
        assert isinstance(fd, int)
        return fd

    def _check_handshake(self) -> None:
        """HandshakeRefused while the last handshake the monitor reported failed (see the class)."""
        mon = self._monitor
        while mon is not None and int(mon.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            event = int(parse_monitor_message(mon.recv_multipart(zmq.NOBLOCK))["event"])
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._succeeded, self._failed = True, ""
            elif event != zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL or not self._succeeded:
                self._failed = _HANDSHAKE_FAILED.get(event, self._failed)
        if self._failed:
            raise HandshakeRefused(self._failed, sent=False)

    def send(self, frames: Sequence[Buffer], deadline: float | None) -> None:
        # Never a blocking send: a DEALER whose handshake failed has no pipe, and would wait for
        # one until the deadline; the monitor says why meanwhile.
        self._check_handshake()
        poller: zmq.Poller | None = None
        while True:
            try:
                self._sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                return
            except zmq.Again:
                remaining = -1.0 if deadline is None else deadline - time.monotonic()
                if remaining <= 0:
                    raise ControlTimeout("the message could not be queued in time") from None
            except zmq.ZMQError as e:
                raise ControlTimeout(f"the message could not be sent: {e}") from None
            if poller is None:
                poller = zmq.Poller()
                poller.register(self._sock, zmq.POLLOUT)
                if self._monitor is not None:
                    poller.register(self._monitor, zmq.POLLIN)
            poller.poll(max(1, math.ceil(remaining * 1000)))
            self._check_handshake()

    def receive(self) -> list[list[memoryview]]:
        # ZMQ_EVENTS, unlike a recv that fails with EAGAIN, costs no exception; once it reports
        # nothing to read, ZMQ_FD signals again for the next message
        self._check_handshake()
        out = []
        while int(self._sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            out.append([f.buffer for f in self._sock.recv_multipart(zmq.NOBLOCK, copy=False)])
        return out

    def close(self, linger_s: float) -> None:
        self._close(int(linger_s * 1000))

    def _close(self, linger_ms: int) -> None:
        if self._monitor is not None:
            self._sock.disable_monitor()
            self._monitor.close(linger=0)
        self._sock.close(linger=linger_ms)
        self._ctx.term()


def open_channel(url: str, timeout: float, curve: ClientCurve | None = None) -> Channel:
    """The channel for ``url``: ``unix://PATH`` is a server's local socket (same host, same user:
    CURVE is not needed there), anything else zmq."""
    return LocalChannel(url, timeout) if url.startswith(SCHEME) else ZmqChannel(url, curve)


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

    def call(self, msg: msgspec.Struct, payload: Sequence[Buffer] = (), timeout: float | None = None) -> Response:
        """Send ``msg`` (plus raw payload frames, zero-copy: leave them unchanged until this
        returns) and wait for its reply; ControlTimeout if none comes in time or the client is
        closed meanwhile, ConnectionLost (``sent`` says whether the message left) if the channel
        broke."""
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
        return Response(decode_reply(frames[1]), frames[2:])

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

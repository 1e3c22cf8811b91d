"""DEALER client for the control plane (used by the SDK and engines), shared by many threads.

Every request carries a fresh ``seq`` frame that the server echoes in its reply, so several
threads can have requests in flight on one socket and each waits only for its own reply: a
request the server holds (a PrepareRetrieve or WaitPrefetch waiting for a prefetch) does not
delay the others.

How the waiting works (leader/follower, no background thread):

* ``_sock_lock`` guards every use of the socket (zmq sockets are not thread-safe). It is held
  only to send, or to receive what has already arrived (non-blocking), never while waiting.
* A caller opens a slot for its seq in ``_slots`` before sending. Whoever receives a reply puts
  it in the slot of its seq and notifies ``_cond``; a reply without a slot (its caller gave up)
  is dropped.
* Of the threads waiting, one at a time is the *leader*: it sleeps in ``poll()`` on the socket's
  ``ZMQ_FD`` (an OS file descriptor, which needs no lock) and on a wake-up pipe, then takes the
  socket lock and receives everything that arrived. The others, the *followers*, wait on
  ``_cond``. A leader whose reply came hands the role on (notify) and returns.
* ``ZMQ_FD`` is edge-triggered: it only signals again for what arrives after someone emptied the
  socket. So whoever holds the socket lock receives until ``ZMQ_EVENTS`` shows nothing more
  before letting go (a sender too, while a leader sleeps: the send may have taken the edge), and
  if it delivered a reply while another thread leads, it writes a byte to the wake-up pipe so
  that the leader looks at its slot again.

A single thread pays no thread switch: it sends, becomes the leader and receives its own reply.
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
from typing import Any

import msgspec
import zmq

from kvdock.errors import ControlTimeout
from kvdock.protocol import decode_reply, encode

__all__ = ["ControlClient", "ControlTimeout", "Response"]

Buffer = bytes | memoryview


def _close_fds(*fds: int) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


@dataclass
class Response:
    """A decoded reply and the raw payload frames that came with it (kept alive by this object)."""

    reply: Any
    frames: list[zmq.Frame]

    def buffers(self) -> list[memoryview]:
        return [f.buffer for f in self.frames]


class ControlClient:
    """One DEALER socket to one server. Thread-safe, and calls of different threads overlap (see
    the module docstring). ``url`` must be a zmq endpoint (ValueError otherwise)."""

    def __init__(self, url: str, timeout: float) -> None:
        self.url = url
        self.timeout = timeout
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        try:
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.setsockopt(zmq.SNDTIMEO, int(timeout * 1000))
            self._sock.connect(url)
        except zmq.ZMQError as e:
            self._sock.close(linger=0)
            self._ctx.term()
            raise ValueError(f"cannot connect to {url!r}: {e}") from None
        fd = self._sock.getsockopt(zmq.FD)
        assert isinstance(fd, int)
        self._fd = fd
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._close_pipe = weakref.finalize(self, _close_fds, self._wake_r, self._wake_w)  # if never closed
        self._poller = select.poll()  # used by the leader only, so never by two threads at once
        self._poller.register(self._fd, select.POLLIN)
        self._poller.register(self._wake_r, select.POLLIN)
        self._sock_lock = threading.Lock()
        self._cond = threading.Condition(threading.Lock())
        # under _cond: seq -> the reply frames once received (None while awaited)
        self._slots: dict[bytes, list[zmq.Frame] | None] = {}
        self._leader: threading.Thread | None = None
        self._seq = 0
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def call(self, msg: msgspec.Struct, payload: Sequence[Buffer] = (), timeout: float | None = None) -> Response:
        """Send ``msg`` (plus raw payload frames, zero-copy: leave them unchanged until this
        returns) and wait for its reply; ControlTimeout if none comes in time or the client is
        closed meanwhile."""
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        header = encode(msg)
        with self._cond:
            if self._closed:
                raise ControlTimeout(f"the client of {self.url} is closed")
            seq = self._next_seq()
            self._slots[seq] = None
        try:
            try:
                self._send([seq, header, *payload], 0)
            except zmq.Again:
                raise ControlTimeout(f"could not send to {self.url} within {limit:.1f}s") from None
            frames = self._wait(seq, deadline, limit)
        finally:
            with self._cond:
                self._slots.pop(seq, None)
        return Response(decode_reply(frames[1].buffer), frames[2:])

    def send_nowait(self, msg: msgspec.Struct) -> None:
        """Send without waiting; the reply is dropped when it arrives (used for best-effort
        cleanup). Does nothing once closed."""
        with self._cond:
            if self._closed:
                return
            seq = self._next_seq()
        with contextlib.suppress(zmq.ZMQError, ControlTimeout):
            self._send([seq, encode(msg)], zmq.NOBLOCK)

    def close(self, linger_s: float = 0.0) -> None:
        """Close the socket and context, waiting up to ``linger_s`` for queued messages to leave;
        threads still waiting for a reply get ControlTimeout. Harmless to call twice."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()  # followers: stop waiting
            while self._leader is not None:  # the leader wakes from poll() and leaves promptly
                self._poke()
                self._cond.wait(0.05)
        with self._sock_lock:
            self._sock.close(linger=int(linger_s * 1000))
            self._ctx.term()
        with self._cond:  # pokes happen under _cond, while a leader exists: none can now
            self._close_pipe()

    # --- internals -----------------------------------------------------------------------------

    def _next_seq(self) -> bytes:  # under _cond
        self._seq += 1
        return self._seq.to_bytes(8, "little")

    def _send(self, frames: list[Any], flags: int) -> None:
        with self._sock_lock:
            if self._closed:  # checked under the lock that close() takes to close the socket
                raise ControlTimeout(f"the client of {self.url} is closed")
            try:
                self._sock.send_multipart(frames, flags=flags, copy=False)
            finally:
                # The send may have consumed ZMQ_FD's edge, which matters to a leader asleep in
                # poll() now; a leader that starts later drains first (under this lock) anyway.
                delivered = self._leader is not None and self._drain()
        if delivered:
            self._poke_leader()

    def _drain(self) -> bool:
        """Receive everything that arrived and deliver it (socket lock held). Whether any reply
        went to a waiting caller."""
        delivered = False
        # ZMQ_EVENTS, unlike a recv that fails with EAGAIN, costs no exception; once it reports
        # nothing to read, ZMQ_FD signals again for the next message
        while int(self._sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            if len(frames) < 2:
                continue
            seq = frames[0].bytes
            with self._cond:
                if seq in self._slots and self._slots[seq] is None:
                    self._slots[seq] = frames
                    delivered = True
                # else: a late reply to a request given up on, or a send_nowait's: dropped
        if delivered:
            with self._cond:
                self._cond.notify_all()
        return delivered

    def _poke(self) -> None:  # under _cond, while the pipe is open
        with contextlib.suppress(BlockingIOError):  # full: the leader has wake-ups pending anyway
            os.write(self._wake_w, b"\0")

    def _poke_leader(self) -> None:
        with self._cond:
            if self._leader is not None and self._leader is not threading.current_thread():
                self._poke()

    def _wait(self, seq: bytes, deadline: float, limit: float) -> list[zmq.Frame]:
        while True:
            with self._cond:
                while True:
                    frames = self._slots.get(seq)
                    if frames is not None:
                        return frames
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
                with self._cond:
                    self._leader = None
                    self._cond.notify_all()  # a follower takes over

    def _lead(self, seq: bytes, deadline: float) -> None:
        """Receive for everyone until our reply is in, the deadline passed or the client closes."""
        while True:
            with self._sock_lock:
                if self._closed:
                    return
                self._drain()
            with self._cond:
                if self._slots.get(seq) is not None or self._closed:
                    return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            for fd, _ in self._poller.poll(math.ceil(remaining * 1000)):
                if fd == self._wake_r:
                    with contextlib.suppress(BlockingIOError):
                        os.read(self._wake_r, 4096)

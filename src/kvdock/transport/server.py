"""The server's control-plane endpoint: a zmq ROUTER and, optionally, the local UNIX socket."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import zmq

from kvdock.transport.curve import Gate, ServerCurve, apply_server
from kvdock.transport.listener import MAX_BATCH, LocalListener

log = logging.getLogger("kvdock.transport")

Buffer = bytes | memoryview


@dataclass
class Incoming:
    """One request as received: who sent it (a zmq routing identity, or the id of a local
    connection), its sequence tag, header and payload buffers."""

    identity: bytes
    seq: bytes
    header: memoryview | None  # None when the frames did not even have the envelope shape
    payload: list[memoryview]
    local: int = 0  # the local connection it came on; 0: zmq
    key: bytes = b""  # over CURVE: the Z85 public key the sender authenticated with

    @property
    def peer(self) -> tuple[int, bytes]:
        """Names the sender across both channels (a zmq client picks its own identity, so an
        identity alone could pose as a local connection)."""
        return (self.local, self.identity)


def _incoming(identity: bytes, frames: list[memoryview], local: int = 0, key: bytes = b"") -> Incoming:
    if len(frames) < 2:
        return Incoming(identity, bytes(frames[0]) if frames else b"", None, [], local, key)
    return Incoming(identity, bytes(frames[0]), frames[1], frames[2:], local, key)


Handler = Callable[[Incoming], None]


def _user_id(frame: zmq.Frame) -> bytes:
    try:
        return str(frame.get("User-Id")).encode()
    except zmq.ZMQError:  # (never over CURVE: the handshake named one)
        return b""


class ControlServer:
    """Binds a ROUTER socket (and, with ``local``, a LocalListener: ``local_url``); hands every
    request to the handler given to :meth:`start` and sends each reply the way its request came.
    Never decodes messages.

    Requests are handled straight from the event loop's reader callbacks: no queue, no task
    switch per message (on a 2-core VM each costs more than a local round trip). The socket is a
    plain (not ``zmq.asyncio``) one watched through its ``ZMQ_FD``, which is edge-triggered: the
    reader takes messages until ``ZMQ_EVENTS`` shows none, at most MAX_BATCH per turn of the loop
    (then it comes back in the next turn: the rest wait in zmq's queue, RCVHWM, which pushes back
    on a flooding peer); a send made outside the reader may take the edge of a message that
    arrived meanwhile, so it schedules the reader too. Sends never block: a ROUTER without
    ROUTER_MANDATORY drops a reply to a peer whose queue is full or gone. The event loop's
    thread only."""

    def __init__(
        self, url: str, max_frame_bytes: int = 16 * 2**30, local_max_bytes: int = 0, curve: ServerCurve | None = None
    ) -> None:
        """Bind ``url`` (zmq.ZMQError if it cannot be), taking frames of at most
        ``max_frame_bytes``; with ``local_max_bytes``, also a local socket for messages of at
        most that many bytes (if it cannot be made, a warning, and the server runs without).
        With ``curve``, zmq clients must complete a CURVE handshake with a key it allows, and
        each request carries that key (``Incoming.key``)."""
        self._ctx = zmq.Context()
        self._gate = Gate(self._ctx, curve) if curve is not None else None
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        # Without a cap, one client that sends a huge garbage frame could exhaust memory; zmq
        # drops the connection of a peer that sends a larger one.
        self._sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
        if curve is not None:
            apply_server(self._sock, curve)
        try:
            self._sock.bind(url)
        except zmq.ZMQError:
            self._sock.close(linger=0)
            if self._gate is not None:
                self._gate.stop()
            self._ctx.term()
            raise
        self.url = url
        self._fd = int(self._sock.getsockopt(zmq.FD))
        self._local: LocalListener | None = None
        if local_max_bytes:
            try:
                self._local = LocalListener(local_max_bytes)
            except OSError as e:
                log.warning("no local control socket (%s): shared-memory clients use zmq", e)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped = False
        self._handler: Handler | None = None
        self._reading = False  # inside _on_zmq: it looks at ZMQ_EVENTS again before it returns
        self._scheduled = False  # an _on_zmq call is due in the next turn of the loop

    @property
    def refused(self) -> int:
        """CURVE handshakes refused so far (0 without CURVE)."""
        return self._gate.refused if self._gate is not None else 0

    @property
    def local_url(self) -> str:
        """``unix://PATH`` of the local socket, "" without one."""
        return self._local.url if self._local is not None else ""

    def start(self, handler: Handler) -> None:
        """Call ``handler(request)`` for every request from now on, in the running loop's
        thread. It must not block; an exception it raises is logged and serving goes on."""
        self._loop = asyncio.get_running_loop()
        self._handler = handler
        self._loop.add_reader(self._fd, self._on_zmq)
        if self._local is not None:
            self._local.start(self._loop, self._on_local)
        self._schedule()  # what arrived before the reader was there

    def _dispatch(self, msg: Incoming) -> None:
        assert self._handler is not None
        try:
            self._handler(msg)
        except Exception:  # e.g. a reply that cannot be sent: keep serving everyone else
            log.exception("control plane")

    def _on_local(self, cid: int, frames: list[memoryview]) -> None:
        self._dispatch(_incoming(b"", frames, cid))

    def _on_zmq(self) -> None:
        self._scheduled = False
        if self._stopped:
            return
        sock = self._sock
        self._reading = True
        try:
            for _ in range(MAX_BATCH):
                if not int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                    return  # reading ZMQ_EVENTS rearmed the FD
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                # the key the ZAP handler named as the sender's User-Id (a property of the
                # message's frames; the routing id frame ROUTER makes up has none)
                key = _user_id(frames[-1]) if self._gate is not None else b""
                self._dispatch(_incoming(frames[0].bytes, [f.buffer for f in frames[1:]], key=key))
            self._schedule()  # more may wait, and no edge will say so
        finally:
            self._reading = False

    def _schedule(self) -> None:
        if not self._scheduled and self._loop is not None:
            self._scheduled = True
            self._loop.call_soon(self._on_zmq)

    def _send(self, frames: list[Any]) -> None:
        if self._stopped:  # shutting down: late replies are dropped, as zmq would at close
            return
        try:
            self._sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        finally:
            if not self._reading and int(self._sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                self._schedule()  # the send may have taken the edge of what arrived meanwhile

    def send(self, to: Incoming, header: bytes, payload: Sequence[Buffer] = ()) -> None:
        """Send the reply to request ``to``; over zmq payload buffers are sent zero-copy and must
        stay unchanged until delivered (use send_tracked when they may change afterwards)."""
        if to.local:
            assert self._local is not None
            self._local.send(to.local, [to.seq, header, *payload])
            return
        self._send([to.identity, to.seq, header, *payload])

    async def send_tracked(self, to: Incoming, header: bytes, payload: Sequence[Buffer]) -> None:
        """Send the reply to request ``to`` and return once it no longer waits in the server:
        zmq wrote the payload buffers to the peer's socket (or dropped them because the peer
        went away), or the local socket took the reply (it copies what it cannot write at once,
        and that copy counts as unsent until written)."""
        if to.local:
            assert self._local is not None
            mark = self._local.send(to.local, [to.seq, header, *payload])
            delay = 0.0005
            while not self._local.written(to.local, mark):
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.05)
            return
        # A tracker per frame: send_multipart's own tracks the last frame only, and none at all
        # when that one is small enough for zmq to copy.
        # Only the trackers are kept: a Frame object holds its message, so while one lives its
        # tracker never reports the buffer free.
        frames = [zmq.Frame(b, copy=False, track=True) for b in payload]
        trackers = [_tracker(f) for f in frames]
        self._send([to.identity, to.seq, header, *frames])
        del frames
        delay = 0.0005
        while not all(t.done for t in trackers):
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.05)

    def stop(self) -> None:
        """Handle no more requests and send nothing more over zmq (shutdown's first step; local
        replies already queued still go out until close). Harmless twice."""
        self._stopped = True
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._fd)
        if self._local is not None:
            self._local.stop()

    def close(self) -> None:
        self.stop()
        if self._local is not None:
            self._local.close()
        self._sock.close(linger=0)
        if self._gate is not None:
            self._gate.stop()
        self._ctx.term()


def _tracker(frame: zmq.Frame) -> zmq.MessageTracker:
    """The tracker of a frame made with ``track=True`` (which always has one)."""
    tracker: zmq.MessageTracker | None = frame.tracker
    assert tracker is not None
    return tracker

"""asyncio ROUTER endpoint for the server's control plane."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import zmq

Buffer = bytes | memoryview


@dataclass
class Incoming:
    """One request as received: who sent it, its sequence tag, header and payload buffers."""

    identity: bytes
    seq: bytes
    header: memoryview | None  # None when the frames did not even have the envelope shape
    payload: list[memoryview]


MAX_QUEUED = 1024  # messages received from zmq but not yet handled


class ControlServer:
    """Binds a ROUTER socket; receives requests and sends replies. Never decodes messages.

    The socket is a plain (not ``zmq.asyncio``) one that the event loop watches through its
    ``ZMQ_FD``: zmq.asyncio's futures and per-call polling cost more than 100 us per message,
    more than the round trip itself. ``ZMQ_FD`` is edge-triggered, so whoever touches the socket
    (a receive, or a send, which may consume the edge) drains what has arrived into ``_queue``
    before returning control to the loop. Sends never block: a ROUTER without ROUTER_MANDATORY
    drops a reply to a peer whose queue is full or gone. The event loop's thread only."""

    def __init__(self, url: str, max_frame_bytes: int = 16 * 2**30) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        # Without a cap, one client that sends a huge garbage frame could exhaust memory; zmq
        # drops the connection of a peer that sends a larger one.
        self._sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
        self._sock.bind(url)
        self.url = url
        self._queue: deque[list[zmq.Frame]] = deque()
        self._arrived = asyncio.Event()
        self._watching: asyncio.AbstractEventLoop | None = None
        self._fd = int(self._sock.getsockopt(zmq.FD))

    def _drain(self) -> None:
        # At most MAX_QUEUED messages are taken out of zmq: past that they wait in zmq's own
        # queue (RCVHWM), which pushes back on flooding peers. Reading ZMQ_EVENTS rearms the
        # FD even when nothing is taken; recv() drains again as the queue shrinks.
        sock, queued = self._sock, self._queue
        while int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN and len(queued) < MAX_QUEUED:
            queued.append(sock.recv_multipart(zmq.NOBLOCK, copy=False))
        if queued:
            self._arrived.set()

    async def recv(self) -> Incoming:
        if self._watching is None:
            self._watching = asyncio.get_running_loop()
            self._watching.add_reader(self._fd, self._drain)
        while not self._queue:
            self._arrived.clear()
            self._drain()
            if not self._queue:
                await self._arrived.wait()
        frames = self._queue.popleft()
        if len(self._queue) < MAX_QUEUED // 2:
            self._drain()  # what a full queue left in zmq (its edge may be gone already)
        identity = frames[0].bytes
        if len(frames) < 3:
            return Incoming(identity, frames[1].bytes if len(frames) > 1 else b"", None, [])
        return Incoming(identity, frames[1].bytes, frames[2].buffer, [f.buffer for f in frames[3:]])

    def _send(self, frames: list[Any]) -> None:
        try:
            self._sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        finally:
            self._drain()  # the send may have taken the edge of what arrived meanwhile

    async def send(self, identity: bytes, seq: bytes, header: bytes, payload: Sequence[Buffer] = ()) -> None:
        """Send a reply; payload buffers are sent zero-copy and must stay unchanged until delivered
        (use send_tracked when they may change afterwards)."""
        self._send([identity, seq, header, *payload])

    async def send_tracked(self, identity: bytes, seq: bytes, header: bytes, payload: Sequence[Buffer]) -> None:
        """Send a reply zero-copy and return once zmq no longer needs any payload buffer (they
        were written to the peer's socket, or dropped because the peer went away)."""
        # A tracker per frame: send_multipart's own tracks the last frame only, and none at all
        # when that one is small enough for zmq to copy.
        # Only the trackers are kept: a Frame object holds its message, so while one lives its
        # tracker never reports the buffer free.
        frames = [zmq.Frame(b, copy=False, track=True) for b in payload]
        trackers = [f.tracker for f in frames]
        self._send([identity, seq, header, *frames])
        del frames
        delay = 0.0005
        while not all(t.done for t in trackers):  # type: ignore[union-attr]
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.05)

    def close(self) -> None:
        if self._watching is not None and not self._watching.is_closed():
            self._watching.remove_reader(self._fd)
        self._sock.close(linger=0)
        self._ctx.term()

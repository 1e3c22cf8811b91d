"""asyncio ROUTER endpoint for the server's control plane."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

import zmq
import zmq.asyncio

Buffer = bytes | memoryview


@dataclass
class Incoming:
    """One request as received: who sent it, its sequence tag, header and payload buffers."""

    identity: bytes
    seq: bytes
    header: memoryview | None  # None when the frames did not even have the envelope shape
    payload: list[memoryview]


class ControlServer:
    """Binds a ROUTER socket; receives requests and sends replies. Never decodes messages."""

    def __init__(self, url: str, max_frame_bytes: int = 16 * 2**30) -> None:
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        # Without a cap, one client that sends a huge garbage frame could exhaust memory; zmq
        # drops the connection of a peer that sends a larger one.
        self._sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
        self._sock.bind(url)
        self.url = url

    async def recv(self) -> Incoming:
        frames = await self._sock.recv_multipart(copy=False)
        identity = frames[0].bytes
        if len(frames) < 3:
            return Incoming(identity, frames[1].bytes if len(frames) > 1 else b"", None, [])
        return Incoming(identity, frames[1].bytes, frames[2].buffer, [f.buffer for f in frames[3:]])

    async def send(self, identity: bytes, seq: bytes, header: bytes, payload: Sequence[Buffer] = ()) -> None:
        """Send a reply; payload buffers are sent zero-copy and must stay unchanged until delivered
        (use send_tracked when they may change afterwards)."""
        await self._sock.send_multipart([identity, seq, header, *payload], copy=False)

    async def send_tracked(self, identity: bytes, seq: bytes, header: bytes, payload: Sequence[Buffer]) -> None:
        """Send a reply zero-copy and return once zmq no longer needs any payload buffer (they
        were written to the peer's socket, or dropped because the peer went away)."""
        # A tracker per frame: send_multipart's own tracks the last frame only, and none at all
        # when that one is small enough for zmq to copy.
        # Only the trackers are kept: a Frame object holds its message, so while one lives its
        # tracker never reports the buffer free.
        frames = [zmq.Frame(b, copy=False, track=True) for b in payload]
        trackers = [f.tracker for f in frames]
        await self._sock.send_multipart([identity, seq, header, *frames], copy=False)
        del frames
        delay = 0.0005
        while not all(t.done for t in trackers):  # type: ignore[union-attr]
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.05)

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()

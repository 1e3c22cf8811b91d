"""Blocking DEALER client for the control plane (used by the SDK and engines)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

from kvdock.errors import ControlTimeout
from kvdock.protocol import decode_reply, encode

__all__ = ["ControlClient", "ControlTimeout", "Response"]

Buffer = bytes | memoryview


@dataclass
class Response:
    """A decoded reply and the raw payload frames that came with it (kept alive by this object)."""

    reply: Any
    frames: list[zmq.Frame]

    def buffers(self) -> list[memoryview]:
        return [f.buffer for f in self.frames]


class ControlClient:
    """One DEALER socket to one server. Thread-safe: calls are serialized by a lock."""

    def __init__(self, url: str, timeout: float) -> None:
        self.url = url
        self.timeout = timeout
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDTIMEO, int(timeout * 1000))
        self._sock.connect(url)
        self._seq = 0
        self._lock = threading.Lock()
        self._closed = False

    def call(self, msg: msgspec.Struct, payload: Sequence[Buffer] = (), timeout: float | None = None) -> Response:
        """Send ``msg`` (plus raw payload frames) and wait for its reply; ControlTimeout if none comes."""
        limit = self.timeout if timeout is None else timeout
        with self._lock:
            seq = self._next_seq()
            try:
                self._sock.send_multipart([seq, encode(msg), *payload], copy=False)
            except zmq.Again:
                raise ControlTimeout(f"could not send to {self.url} within {limit:.1f}s") from None
            deadline = time.monotonic() + limit
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._sock.poll(int(remaining * 1000) + 1, zmq.POLLIN):
                    if time.monotonic() >= deadline:
                        raise ControlTimeout(f"no reply from {self.url} within {limit:.1f}s")
                    continue
                frames = self._sock.recv_multipart(copy=False)
                if len(frames) < 2 or frames[0].bytes != seq:
                    continue  # a late reply to a request we gave up on
                return Response(decode_reply(frames[1].buffer), frames[2:])

    def send_nowait(self, msg: msgspec.Struct) -> None:
        """Send without waiting; the reply is dropped when it arrives (used for best-effort cleanup)."""
        with self._lock, contextlib.suppress(zmq.ZMQError):
            self._sock.send_multipart([self._next_seq(), encode(msg)], flags=zmq.NOBLOCK)

    def _next_seq(self) -> bytes:
        self._seq += 1
        return self._seq.to_bytes(8, "little")

    def close(self, linger_s: float = 0.0) -> None:
        """Close the socket and context, waiting up to ``linger_s`` for queued messages to leave;
        harmless to call twice."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._sock.close(linger=int(linger_s * 1000))
            self._ctx.term()

"""The PUB socket a server publishes KV events on, and the SUB side ``kvdock events`` reads."""

from __future__ import annotations

import contextlib

import zmq

from kvdock.errors import ProtocolError
from kvdock.protocol.events import TOPIC, KVEventBatch, decode_batch, encode_batch


class EventPublisher:
    """A PUB socket bound to ``url``. Sends never block: a subscriber that does not keep up loses
    messages past zmq's high-water mark (it sees a gap in ``seq``), so a subscriber that stops
    reading holds at most ``hwm`` batches of this server's memory. The event loop only."""

    def __init__(self, url: str, hwm: int = 8) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, hwm)
        self._sock.bind(url)
        self.url = url
        self.seq = 0

    def publish(self, batch: KVEventBatch) -> None:
        frames = [TOPIC, self.seq.to_bytes(8, "big"), encode_batch(batch)]
        self.seq += 1
        with contextlib.suppress(zmq.Again):  # PUB drops rather than blocks: a gap in seq
            self._sock.send_multipart(frames, flags=zmq.NOBLOCK)

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()


class EventSubscriber:
    """A SUB socket connected to a server's event URL."""

    def __init__(self, url: str) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SUBSCRIBE, TOPIC)
        self._sock.connect(url)

    def receive(self, timeout_s: float | None = None) -> tuple[int, KVEventBatch] | None:
        """The next batch and its seq; None if none came within ``timeout_s`` (None: wait).
        ProtocolError for a malformed message."""
        if not self._sock.poll(None if timeout_s is None else int(timeout_s * 1000)):
            return None
        frames = self._sock.recv_multipart()
        if len(frames) != 3 or len(frames[1]) != 8:
            sizes = [len(f) for f in frames]
            raise ProtocolError(f"a KV event message has frames of {sizes} bytes, not [topic, seq, batch]")
        return int.from_bytes(frames[1], "big"), decode_batch(frames[2])

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()

"""The PUB socket a server publishes KV events on, and the SUB side ``kvdock events`` reads."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import zmq

from kvdock.errors import ProtocolError
from kvdock.protocol.events import TOPIC, KVEventBatch, decode_batch, encode_batch
from kvdock.protocol.limits import MAX_SUBSCRIPTION_BYTES  # zmq drops a subscriber that sends more
from kvdock.transport.curve import ClientCurve, Gate, ServerCurve, apply_client, apply_server

# (the subscriber's CURVE key or b"", the topic it asked for) -> the topic it gets, None: none
Topics = Callable[[bytes, bytes], bytes | None]
MAX_SUBSCRIPTIONS_PER_TURN = 256  # subscription messages read per turn of the event loop


class EventPublisher:
    """A PUB socket bound to ``url``. Sends never block: a subscriber that does not keep up loses
    messages past zmq's high-water mark (it sees a gap in ``seq``), so a subscriber that stops
    reading holds at most ``hwm`` batches of this server's memory. With ``curve``, only
    subscribers with a key it allows get through the handshake.

    With ``topics`` the socket is an XPUB in manual mode: a subscription takes effect only as the
    topic ``topics(key, asked)`` maps it to (the subscriber asks for one thing and is given what
    its key or token entitles it to; nothing if None), so a subscriber can never choose another
    tenant's topic. Each topic numbers its batches (``seq``) on its own. The event loop only;
    :meth:`start` begins reading subscriptions (in the running loop)."""

    def __init__(self, url: str, hwm: int = 8, curve: ServerCurve | None = None, topics: Topics | None = None) -> None:
        self._ctx = zmq.Context()
        self._gate = Gate(self._ctx, curve) if curve is not None else None
        self._topics = topics
        self._sock = self._ctx.socket(zmq.XPUB if topics is not None else zmq.PUB)
        self._loop: asyncio.AbstractEventLoop | None = None
        try:
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.setsockopt(zmq.SNDHWM, hwm)
            self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_SUBSCRIPTION_BYTES)  # what subscribers send
            if topics is not None:
                self._sock.setsockopt(zmq.XPUB_MANUAL, 1)
            if curve is not None:
                apply_server(self._sock, curve)
            self._sock.bind(url)
        except BaseException:
            self.close()
            raise
        self.url = url
        self.seqs: dict[bytes, int] = {}  # topic -> the seq of its next batch

    @property
    def seq(self) -> int:
        """The next seq of the default topic."""
        return self.seqs.get(TOPIC, 0)

    def start(self) -> None:
        """Read subscriptions from now on (with ``topics`` only), in the running loop."""
        if self._topics is None:
            return
        self._loop = asyncio.get_running_loop()
        fd = self._sock.getsockopt(zmq.FD)
        assert isinstance(fd, int)
        self._loop.add_reader(fd, self._on_subscriptions)
        self._loop.call_soon(self._on_subscriptions)  # what came before the reader

    def _on_subscriptions(self) -> None:
        assert self._topics is not None
        sock = self._sock
        for _ in range(MAX_SUBSCRIPTIONS_PER_TURN):
            if sock.closed or not int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                return  # (reading ZMQ_EVENTS rearmed the edge-triggered FD)
            frame = sock.recv(zmq.NOBLOCK, copy=False)
            data = frame.bytes
            if not data or data[0] not in (0, 1):
                continue  # not a (un)subscription: a subscriber may send nothing else
            key = b""
            if self._gate is not None:
                with contextlib.suppress(zmq.ZMQError):
                    key = str(frame.get("User-Id")).encode()
            topic = self._topics(key, data[1:])
            if topic is not None:  # applies to the pipe the message came from
                sock.setsockopt(zmq.SUBSCRIBE if data[0] == 1 else zmq.UNSUBSCRIBE, topic)
        if self._loop is not None:
            self._loop.call_soon(self._on_subscriptions)  # more may wait, and no edge will say so

    def publish(self, batch: KVEventBatch, topic: bytes = TOPIC) -> None:
        seq = self.seqs.get(topic, 0)
        self.seqs[topic] = seq + 1
        frames = [topic, seq.to_bytes(8, "big"), encode_batch(batch)]
        with contextlib.suppress(zmq.Again):  # PUB drops rather than blocks: a gap in seq
            self._sock.send_multipart(frames, flags=zmq.NOBLOCK)
        # the send may have taken the edge of a subscription that arrived meanwhile
        if self._loop is not None and int(self._sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            self._loop.call_soon(self._on_subscriptions)

    def close(self) -> None:
        if self._loop is not None and not self._loop.is_closed() and not self._sock.closed:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(int(self._sock.getsockopt(zmq.FD)))
        self._sock.close(linger=0)
        if self._gate is not None:
            self._gate.stop()
        self._ctx.term()


class EventSubscriber:
    """A SUB socket connected to a server's event URL (a CURVE client with ``curve``). ``token``
    (a tenant's, or the admin token) travels in the subscription, for a server with tenants: it
    gets that tenant's events (every tenant's for the admin token)."""

    def __init__(self, url: str, curve: ClientCurve | None = None, token: str = "") -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            apply_client(self._sock, curve)
        # a SUB filters what it receives by its own subscriptions too: TOPIC takes in every topic
        # the server lets through; the token travels in a second subscription, for the server only
        if token:
            self._sock.setsockopt(zmq.SUBSCRIBE, TOPIC + b"\0" + token.encode())
        self._sock.setsockopt(zmq.SUBSCRIBE, TOPIC)
        self._sock.connect(url)
        self.topic = b""  # the topic of the last batch received

    def receive(self, timeout_s: float | None = None) -> tuple[int, KVEventBatch] | None:
        """The next batch and its seq; None if none came within ``timeout_s`` (None: wait).
        ProtocolError for a malformed message."""
        if not self._sock.poll(None if timeout_s is None else int(timeout_s * 1000)):
            return None
        frames = self._sock.recv_multipart()
        if len(frames) != 3 or len(frames[1]) != 8:
            sizes = [len(f) for f in frames]
            raise ProtocolError(f"a KV event message has frames of {sizes} bytes, not [topic, seq, batch]")
        self.topic = frames[0]
        return int.from_bytes(frames[1], "big"), decode_batch(frames[2])

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()

"""The channels a :class:`~kvdock.transport.client.ControlClient` drives: the ``Channel`` interface,
the zmq DEALER (``ZmqChannel``, any zmq URL, a CURVE client when given keys) and
:func:`open_channel`, which picks it or the local UNIX socket (``transport.local.LocalChannel``)
by the URL."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Protocol

import zmq
from zmq.utils.monitor import parse_monitor_message

from kvdock.errors import ControlTimeout, HandshakeRefused
from kvdock.transport.curve import ClientCurve, apply_client
from kvdock.transport.local import SCHEME, LocalChannel

Buffer = bytes | memoryview


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

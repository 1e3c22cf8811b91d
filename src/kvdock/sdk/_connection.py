"""Connection: the SDK's control-plane client for one server, over the local socket or zmq."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import msgspec

from kvdock.errors import (
    ConfigError,
    InvalidInputError,
    KVCacheSDKError,
    PermissionDeniedError,
    ProtocolError,
    ServerUnavailableError,
)
from kvdock.protocol import messages as m
from kvdock.protocol.codes import sdk_error
from kvdock.reach import probe
from kvdock.sdk import _validate as validate
from kvdock.transport.client import ConnectionLost, ControlClient, ControlTimeout, HandshakeRefused, Response
from kvdock.transport.curve import ClientCurve, resolve_client
from kvdock.transport.local import PeerWatch

log = logging.getLogger("kvdock.sdk")


LOCAL_RETRY_S = 5.0  # how long a broken local channel waits before it is tried again
NOWAIT_LOCAL_S = 0.05  # how long a fire-and-forget message waits for room on the local socket

R = TypeVar("R", bound=m.ReplyBase)


KeyPath = str | os.PathLike[str] | None


def client_curve(server_key: KeyPath = None, client_key: KeyPath = None) -> ClientCurve | None:
    """CURVE settings from the server's public certificate and this client's secret one (both or
    neither), else from ``KVDOCK_CURVE_SERVER_KEY`` / ``KVDOCK_CURVE_CLIENT_KEY``; None: a plain
    connection. InvalidInputError for a missing or unreadable key file, or only one of them."""
    try:
        return resolve_client(server_key, client_key)
    except ConfigError as e:
        raise InvalidInputError(str(e)) from None


class Connection:
    """A control-plane client that turns timeouts and Error replies into SDK errors. Threads may
    share it: each call waits only for its own reply.

    Messages go over zmq, or over the server's local UNIX socket once :meth:`use_local` gave
    one (a shared-memory registration offers it). zmq stays the fallback: a request that could
    not leave over the local channel (it broke: the server restarted or dropped this client) is
    sent over zmq instead, and so is everything after it until the local socket, tried again
    every LOCAL_RETRY_S, takes connections again (or a new registration names another one).
    ``_lock`` guards which local client is current; the clients themselves are thread-safe."""

    def __init__(self, url: str, timeout: float, curve: ClientCurve | None = None) -> None:
        """Over zmq with CURVE when ``curve`` is given (the local socket needs none: it takes
        only this user's processes)."""
        self.url = validate.url(url)
        self.timeout = validate.timeout(timeout)
        try:
            self._client = ControlClient(url, self.timeout, curve)
        except ValueError as e:
            raise InvalidInputError(str(e)) from None
        self._lock = threading.Lock()
        self._local: ControlClient | None = None
        self._local_url = ""
        self._retry_at = 0.0
        self._closed = False
        # called (no lock held) each time a new local channel is in use, the first excepted: the
        # context then watches the server through it (the old channel's watch hung up with it)
        self.on_local: Callable[[], None] | None = None

    @property
    def channel(self) -> str:
        """``"local"`` or ``"zmq"``: where the next request goes."""
        local = self._local
        return "local" if local is not None and local.usable else "zmq"

    def use_local(self, local_url: str, *, retry: bool = False) -> None:
        """Send over ``local_url`` (a ``unix://`` socket; "" for none) from now on, or over zmq
        if it cannot be reached. A working client of the same URL is kept; one replaced is
        closed (its waiting callers fail: it belonged to a server that is gone). ``retry``: only
        try ``local_url`` again if it is still the one to use (a retry of a broken channel never
        undoes a registration that named another socket meanwhile)."""
        with self._lock:
            if self._serves(local_url) or (retry and local_url != self._local_url):
                return
            self._local_url = local_url
        new = None
        if local_url and not self._closed:
            try:
                new = ControlClient(local_url, self.timeout)
            except ValueError as e:
                log.info("cannot use the server's local socket (%s); staying on zmq", e)
        with self._lock:
            if self._closed or self._local_url != local_url or self._serves(local_url):  # closed, superseded, or
                old, new = new, None  # another thread's retry got there first: keep that one
            else:
                old, self._local = self._local, new
                self._retry_at = time.monotonic() + LOCAL_RETRY_S
        if old is not None:
            old.close()
        hook = self.on_local
        if new is not None and new is self._local and hook is not None:
            hook()

    def _serves(self, local_url: str) -> bool:  # under _lock
        current = self._local
        return current is not None and current.url == local_url and current.usable

    def _current(self) -> ControlClient:
        """The local client if it works, else zmq (trying a broken local socket again when due)."""
        local = self._local
        if local is not None and local.usable:
            return local
        if self._local_url and time.monotonic() >= self._retry_at:
            log.warning("the local control channel of %s is down; trying it again (zmq meanwhile)", self.url)
            with self._lock:
                if self._local is local:
                    self._local = None  # so that use_local does not keep it
            self.use_local(self._local_url, retry=True)
            local = self._local
            if local is not None and local.usable:
                return local
        return self._client

    def peer_watch(self) -> PeerWatch | None:
        """A watch of the server's end of the local channel in use (None when on zmq)."""
        local = self._local
        return local.peer_watch() if local is not None else None

    def call(self, msg: msgspec.Struct, payload: Sequence[memoryview] = (), timeout: float | None = None) -> Response:
        try:
            client = self._current()
            try:
                resp = client.call(msg, payload, timeout)
            except ConnectionLost as e:
                if e.sent or client is self._client:
                    raise
                resp = self._client.call(msg, payload, timeout)  # it never left: send it over zmq
        except HandshakeRefused as e:
            raise PermissionDeniedError(f"kvdock server at {self.url}: {e}") from None
        except ProtocolError as e:  # (a reply of another op's type: transport.client.check_reply)
            raise KVCacheSDKError(f"kvdock server at {self.url}: {e}") from None
        except ControlTimeout as e:
            if self._closed:
                raise KVCacheSDKError(f"the connection to {self.url} is closed (KVCacheContext.close())") from None
            raise ServerUnavailableError(f"kvdock server at {self.url}: {e}") from None
        if isinstance(resp.reply, m.Error):
            raise sdk_error(resp.reply.code, resp.reply.message)
        return resp

    def ask(self, msg: m.RequestBase[R], payload: Sequence[memoryview] = (), timeout: float | None = None) -> R:
        """:meth:`call`, typed: the reply of the type ``msg``'s op declares (an Error reply is
        raised, and a reply of another type is a KVCacheSDKError)."""
        return self.call(msg, payload, timeout).reply  # type: ignore[no-any-return]

    def send_nowait(self, msg: msgspec.Struct) -> None:
        """Send without waiting for a reply (best effort): over the local channel when it takes
        the message within NOWAIT_LOCAL_S, else over zmq."""
        client = self._current()
        if client is self._client or not client.send_nowait(msg, NOWAIT_LOCAL_S):
            self._client.send_nowait(msg)

    def send_report(self, msg: msgspec.Struct) -> bool:
        """Send a small message now or not at all (``ControlClient.try_send``): over the local
        channel if it takes it at once, else over zmq if that does. A thread that reads from the
        pool directory must wait neither for a server that does not read nor for another thread
        that is sending. Whether it was sent."""
        local = self._local
        if local is not None and local.usable and local.try_send(msg):
            return True
        return self._client.try_send(msg)

    def close(self, linger_s: float = 0.0) -> None:
        with self._lock:
            self._closed = True
            local, self._local = self._local, None
        if local is not None:
            local.close()  # what was written stays readable for the server
        self._client.close(linger_s)


def open_connection(url: str, timeout: float, server_key: KeyPath = None, client_key: KeyPath = None) -> Connection:
    """A control-plane connection to ``url``, once something listens there (``probe``)."""
    conn = Connection(url, timeout, client_curve(server_key, client_key))
    try:
        probe(conn.url, conn.timeout)
    except BaseException:
        conn.close()
        raise
    return conn

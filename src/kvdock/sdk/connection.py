"""Connection: the SDK's control-plane client for one server, over the local socket or zmq."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import msgspec

from kvdock.errors import InvalidInputError, KVCacheSDKError, ServerUnavailableError
from kvdock.protocol import messages as m
from kvdock.protocol.codes import sdk_error
from kvdock.sdk import validate
from kvdock.transport.client import ConnectionLost, ControlClient, ControlTimeout, Response

log = logging.getLogger("kvdock.sdk")


class Connection:
    """A control-plane client that turns timeouts and Error replies into SDK errors. Threads may
    share it: each call waits only for its own reply.

    Messages go over zmq, or over the server's local UNIX socket once :meth:`use_local` gave
    one (a shared-memory registration offers it); zmq stays the fallback: a local channel that
    broke before a request left (the server restarted, or dropped this client) sends it over
    zmq instead, as it does everything from then on."""

    def __init__(self, url: str, timeout: float) -> None:
        self.url = validate.url(url)
        self.timeout = validate.timeout(timeout)
        try:
            self._client = ControlClient(url, self.timeout)
        except ValueError as e:
            raise InvalidInputError(str(e)) from None
        self._local: ControlClient | None = None
        self._closed = False

    @property
    def channel(self) -> str:
        """``"local"`` or ``"zmq"``: where the next request goes."""
        local = self._local
        return "local" if local is not None and not local.lost else "zmq"

    def use_local(self, local_url: str) -> None:
        """Send over ``local_url`` (a ``unix://`` socket; "" for none) from now on, or over zmq
        if it cannot be reached. A local client replaced is closed."""
        new = None
        if local_url and not self._closed:
            try:
                new = ControlClient(local_url, self.timeout)
            except ValueError as e:
                log.info("cannot use the server's local socket (%s); staying on zmq", e)
        old, self._local = self._local, new
        if old is not None:
            old.close()

    def call(self, msg: msgspec.Struct, payload: Sequence[memoryview] = (), timeout: float | None = None) -> Response:
        local = self._local
        try:
            if local is not None and not local.lost:
                try:
                    resp = local.call(msg, payload, timeout)
                except ConnectionLost as e:
                    if e.sent:
                        raise
                    resp = self._client.call(msg, payload, timeout)
            else:
                resp = self._client.call(msg, payload, timeout)
        except ControlTimeout as e:
            if self._closed:
                raise KVCacheSDKError(f"the connection to {self.url} is closed (KVCacheContext.close())") from None
            raise ServerUnavailableError(f"kvdock server at {self.url}: {e}") from None
        if isinstance(resp.reply, m.Error):
            raise sdk_error(resp.reply.code, resp.reply.message)
        return resp

    def send_nowait(self, msg: msgspec.Struct) -> None:
        local = self._local
        if local is None or not local.send_nowait(msg):
            self._client.send_nowait(msg)

    def close(self, linger_s: float = 0.0) -> None:
        self._closed = True
        if self._local is not None:
            self._local.close()  # what was written stays readable for the server
        self._client.close(linger_s)

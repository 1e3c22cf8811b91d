"""What the commands that need no KV tensors use instead of the SDK (which imports torch): an HTTP
GET that never goes through a proxy to a loopback server, and registering a layout over the
control plane. ``kvdock status`` and ``kvdock register`` import neither torch nor numpy's users
beyond the wire (tests/cli/test_cli_light.py checks it in a fresh interpreter)."""

from __future__ import annotations

import os

from kvdock.config import TOKEN_ENV
from kvdock.errors import (
    InvalidInputError,
    KVCacheSDKError,
    PermissionDeniedError,
    ServerUnavailableError,
)
from kvdock.protocol import messages as m
from kvdock.protocol.codes import sdk_error
from kvdock.transport.client import ConnectionLost, ControlClient, ControlTimeout, HandshakeRefused
from kvdock.transport.curve import resolve_client


def register(
    url: str,
    lay: m.ModelLayout,
    timeout: float,
    admin_token: str,
    server_key: str | None = None,
    client_key: str | None = None,
    token: str | None = None,
) -> m.ModelRegistered:
    """Send RegisterModel for ``lay``; the SDK's errors (as ``kvdock.sdk.register_layout`` raises
    them) for a refusal or an unreachable server."""
    try:
        client = ControlClient(url, timeout, resolve_client(server_key, client_key))
    except ValueError as e:
        raise InvalidInputError(str(e)) from None
    tok = os.environ.get(TOKEN_ENV, "") if token is None else token
    try:
        resp = client.call(m.RegisterModel(m.PROTOCOL_VERSION, lay, admin_token, tok))
    except HandshakeRefused as e:
        raise PermissionDeniedError(f"kvdock server at {url}: {e}") from None
    except (ControlTimeout, ConnectionLost) as e:
        raise ServerUnavailableError(f"kvdock server at {url}: {e}") from None
    finally:
        client.close(0.0)
    if isinstance(resp.reply, m.Error):
        raise sdk_error(resp.reply.code, resp.reply.message)
    if not isinstance(resp.reply, m.ModelRegistered):
        raise KVCacheSDKError(f"kvdock server at {url} answered {type(resp.reply).__name__} to RegisterModel")
    return resp.reply

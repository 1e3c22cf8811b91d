"""What the commands that need no KV tensors use instead of the SDK (which imports torch): an HTTP
GET that never goes through a proxy to a loopback server, and registering a layout over the
control plane, and a lookup as a client of the inline transport. ``kvdock status``,
``kvdock register`` and ``kvdock lookup`` import neither torch nor numpy's users beyond the wire
(tests/cli/test_cli_light.py checks it in a fresh interpreter)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TypeVar

from kvdock import keying, reach
from kvdock.config import TOKEN_ENV
from kvdock.errors import (
    ConfigError,
    InvalidInputError,
    KVCacheSDKError,
    PermissionDeniedError,
    ProtocolError,
    ServerUnavailableError,
)
from kvdock.keys import normalize_tokens
from kvdock.protocol import messages as m
from kvdock.protocol.codes import sdk_error
from kvdock.shm.processes import proc_start_time
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


R = TypeVar("R", bound=m.ReplyBase)
ALL_RANKS = -1  # RegisterClient.kv_rank of a client of the whole model (server.registry.ALL_RANKS)


def _ask(client: ControlClient, url: str, msg: m.RequestBase[R]) -> R:
    """``msg``'s reply, with the errors the SDK's Connection raises (sdk/_connection.py)."""
    try:
        resp = client.call(msg)
    except HandshakeRefused as e:
        raise PermissionDeniedError(f"kvdock server at {url}: {e}") from None
    except ProtocolError as e:
        raise KVCacheSDKError(f"kvdock server at {url}: {e}") from None
    except ControlTimeout as e:
        raise ServerUnavailableError(f"kvdock server at {url}: {e}") from None
    if isinstance(resp.reply, m.Error):
        raise sdk_error(resp.reply.code, resp.reply.message)
    return resp.reply  # type: ignore[no-any-return]


def lookup(
    url: str,
    http_url: str | None,
    model_name: str,
    tokens: Sequence[int],
    cache_salt: str,
    timeout: float,
    server_key: str | None = None,
    client_key: str | None = None,
    token: str | None = None,
) -> int:
    """What ``kvdock.sdk.lookup`` answers for ``tokens`` after ``kvdock.sdk.connect`` with these
    arguments, with the same errors (unknown model, no server, a refused key or token, a wrong
    ``http_url``), as a client of the inline transport: Describe, RegisterClient, Lookup (of the
    tokens' whole chunks, keyed as the model's engine names them: kvdock.keying), CloseClient."""
    reach.url(url)
    http = reach.http_url(http_url)
    if not model_name:
        raise InvalidInputError(f"model_name must be a non-empty str, got str {model_name!r:.40}")
    tok = os.environ.get(TOKEN_ENV, "") if token is None else token
    try:
        curve = resolve_client(server_key, client_key)
    except ConfigError as e:
        raise InvalidInputError(str(e)) from None
    try:
        client = ControlClient(url, timeout, curve)
    except ValueError as e:
        raise InvalidInputError(str(e)) from None
    client_id = ""
    try:
        reach.probe(url, timeout)
        me, start = os.getpid(), proc_start_time(os.getpid()) or 0
        desc = _ask(client, url, m.Describe(m.PROTOCOL_VERSION, model_name, tok, pid=me, pid_start=start))
        lay = reach.described_layout(desc, model_name)
        reg = _ask(
            client,
            url,
            m.RegisterClient(
                m.PROTOCOL_VERSION, str(me), model_name, ALL_RANKS, "", pid=me, pid_start=start, token=tok
            ),
        )
        client_id = reg.client_id
        if reg.chunk_size != desc.chunk_size or reg.geometry != lay.geometry:
            raise KVCacheSDKError(f"{url} changed its chunk size or the layout of {model_name!r} meanwhile")
        if http is not None:
            reach.check_http(http, reg.chunk_size, timeout, tok, desc.shm_name)
        try:
            arr = normalize_tokens(tokens)
        except (TypeError, ValueError) as e:
            raise InvalidInputError(str(e)) from None
        salt = reach.cache_salt(cache_salt)
        if keying.scheme_of(lay.engine.name) == keying.SGLANG:  # (sdk._requests.keyed)
            arr, salt = keying.sglang_tokens(arr, reg.chunk_size, cache_salt=salt or None), ""
        whole = reach.whole_chunks(arr, reg.chunk_size, desc.max_request_tokens)
        if not whole:
            return 0
        return int(_ask(client, url, m.Lookup(client_id, whole, salt)).hit_tokens)
    finally:
        if client_id:
            client.send_nowait(m.CloseClient(client_id, idle=True))
        client.close(0.5 if client_id else 0.0)  # long enough for CloseClient to leave

"""Reaching a server without the SDK (which imports torch): the checks of the control-plane and
HTTP URLs and of a cache_salt, the probe of the control plane, the check of the HTTP API and the
wire's whole-chunk token bytes. The SDK (``kvdock.sdk._validate``, ``_connection``, ``_http``,
``_requests``) and the torch-free ``kvdock lookup`` (cli/light.py) share them, so both raise the
same errors with the same messages."""

from __future__ import annotations

import os
import socket
import urllib.parse

import numpy as np

from kvdock.config import MAX_SALT_LEN, is_loopback
from kvdock.errors import (
    InvalidInputError,
    KVCacheSDKError,
    PermissionDeniedError,
    ServerUnavailableError,
    UnknownModelError,
)
from kvdock.httpjson import get_json
from kvdock.protocol import messages as m
from kvdock.protocol.codes import ErrorCode, sdk_error

_ZMQ_SCHEMES = ("tcp://", "ipc://")
_HTTP_SCHEMES = ("http://", "https://")
PROBE_S = 3.0  # how long connect waits for the control plane's socket to take a connection
CHECK_S = 3.0  # how long connect waits for the HTTP API it was given


def url(value: object) -> str:
    """The server's ZMQ control-plane address: ``tcp://HOST:PORT`` or ``ipc://PATH``."""
    expected = "expected 'tcp://HOST:PORT' (e.g. 'tcp://127.0.0.1:5555') or 'ipc://PATH'"
    if not isinstance(value, str):
        raise InvalidInputError(f"url must be a str, {expected}; got {type(value).__name__}")
    if not value.startswith(_ZMQ_SCHEMES):
        hint = f"; did you mean 'tcp://{value}'?" if "://" not in value else ""
        raise InvalidInputError(f"url {value!r} has no supported scheme: {expected}{hint}")
    rest = value.split("://", 1)[1]
    if value.startswith("ipc://"):
        if not rest:
            raise InvalidInputError(f"url {value!r} names no path: {expected}")
        return value
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidInputError(f"url {value!r} needs a host and a port 1..65535: {expected}")
    return value


def http_url(value: object) -> str | None:
    """The server's HTTP address: ``http://HOST:PORT`` (or https), or None."""
    if value is None:
        return None
    expected = "expected 'http://HOST:PORT' (e.g. 'http://127.0.0.1:9000')"
    if not isinstance(value, str):
        raise InvalidInputError(f"http_url must be a str, {expected}; got {type(value).__name__}")
    if not value.startswith(_HTTP_SCHEMES) or len(value) <= value.index("://") + 3:
        hint = f"; did you mean 'http://{value}'?" if "://" not in value else ""
        raise InvalidInputError(f"http_url {value!r} is not an HTTP URL: {expected}{hint}")
    return value


def cache_salt(value: object) -> str:
    """A cache_salt: a str of valid text, at most MAX_SALT_LEN characters (InvalidInputError, or
    LimitExceededError: what the server's refusal of a longer one raises)."""
    if not isinstance(value, str):
        raise InvalidInputError(f'cache_salt must be a str ("" for none), got {type(value).__name__} {value!r:.40}')
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidInputError(f"cache_salt must be valid text (it is sent as UTF-8): {e.reason}") from None
    if len(value) > MAX_SALT_LEN:  # (LimitExceededError: what the server's refusal of it raises)
        raise sdk_error(
            ErrorCode.LIMIT, f"cache_salt has {len(value)} characters; at most {MAX_SALT_LEN} (hash a longer one)"
        )
    return value


def whole_chunks(arr: np.ndarray, chunk_size: int, cap: int) -> bytes:
    """``arr``'s whole chunks of ``chunk_size`` tokens as the wire's token bytes;
    LimitExceededError (an InvalidInputError, code ``limit``: what the server's own refusal
    raises) past the server's max_request_tokens ``cap`` (0: none advertised)."""
    n = len(arr) // chunk_size * chunk_size
    if cap and n > cap:
        raise sdk_error(
            ErrorCode.LIMIT,
            f"request of {n} tokens is over the server's limit of {cap} tokens "
            f"(max_request_tokens; raise it with --max-request-tokens)",
        )
    return arr[:n].tobytes()


def probe(url: str, timeout: float) -> None:
    """ServerUnavailableError naming ``url`` (a checked ``tcp://`` or ``ipc://`` URL) at once when
    nothing listens there, or when its socket does not take a connection within
    ``min(timeout, PROBE_S)``: zmq would wait for a reply the whole timeout (60 s by default)
    before saying anything. A server that takes the connection gets the whole timeout."""
    wait = min(timeout, PROBE_S)
    rest = url.split("://", 1)[1]
    try:
        if url.startswith("ipc://"):
            family, address = socket.AF_UNIX, rest
            if rest.startswith("@"):  # zmq's abstract namespace (Linux): no file to look for
                address = "\0" + rest[1:]
            elif not os.path.exists(rest):
                raise FileNotFoundError(f"no socket file {rest}")
        else:
            host, _, port = rest.rpartition(":")
            if ";" in host or host == "*":  # a source address (zmq's 'iface;host'), or a bind-all
                return
            family, address = socket.AF_INET, (host.strip("[]"), int(port))  # type: ignore[assignment]
            if ":" in host:
                family = socket.AF_INET6
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.settimeout(wait)
            sock.connect(address)
    except ConnectionRefusedError:
        raise ServerUnavailableError(
            f"nothing listens at {url} (connection refused): is the kvdock server running, with this address "
            f"(kvdock serve --port)?"
        ) from None
    except TimeoutError:
        raise ServerUnavailableError(
            f"{url} took no connection within {wait:g}s (a firewall, or a wrong host?)"
        ) from None
    except OSError as e:
        raise ServerUnavailableError(f"cannot reach {url}: {e.strerror or e}") from None


def check_http(http_url: str, chunk_size: int | None, timeout: float, token: str = "", shm_name: str = "") -> None:
    """What connect verifies of the ``http_url`` it was given: that a kvdock server's HTTP API
    answers there (within ``min(timeout, CHECK_S)``) and, when it shows its ``/config`` (a server
    with tenants shows it only with a token), that it is the server the control plane reached:
    its chunk size is ``chunk_size`` (None: not compared) and, given the named pool that server
    offered (``shm_name``; "": none, not compared), its pool is that one (two servers of the
    same settings differ there). ServerUnavailableError naming ``http_url`` otherwise.

    The tenant ``token`` is sent only to a loopback ``http_url``: this check must not hand it,
    in clear text, to a host the caller may have mistyped (a server with tenants elsewhere is then
    only checked to answer)."""
    if not is_loopback(urllib.parse.urlsplit(http_url).hostname or ""):
        token = ""
    hint = "(the server's HTTP API, kvdock serve --http-port; or pass http_url=None: connect does not need it)"
    try:
        doc = get_json(http_url, "/config", min(timeout, CHECK_S), token)
    except PermissionDeniedError:
        return  # a server with tenants: its HTTP API answers, and shows nothing more without a token
    except ServerUnavailableError as e:
        raise ServerUnavailableError(f"http_url {http_url!r} is unusable {hint}: {e}") from None
    if "chunk_size" not in doc or "protocol_version" not in doc:
        raise ServerUnavailableError(f"http_url {http_url!r} is not a kvdock server's HTTP API {hint}")
    if chunk_size is not None and doc["chunk_size"] != chunk_size:
        raise ServerUnavailableError(
            f"http_url {http_url!r} is another server's HTTP API {hint}: chunk size {doc['chunk_size']}, "
            f"not the {chunk_size} of the server that answered at the control-plane url"
        )
    l1 = doc.get("l1")
    theirs = l1.get("shm_name") if isinstance(l1, dict) else shm_name  # (no "l1": nothing to compare)
    if shm_name and theirs != shm_name:
        raise ServerUnavailableError(
            f"http_url {http_url!r} is another server's HTTP API {hint}: its pool is {theirs!r}, not the "
            f"{shm_name!r} of the server that answered at the control-plane url"
        )


def described_layout(desc: m.Described, model_name: str) -> m.ModelLayout:
    """``model_name``'s layout from the server's answer to Describe: UnknownModelError lists the
    models this client may use; KVCacheSDKError for a layout it cannot use."""
    if desc.layout is None:
        known = ", ".join(desc.models) or "none"
        raise UnknownModelError(f"model {model_name!r} is not registered with the server; registered models: {known}")
    try:
        desc.layout.geometry.check()
    except ValueError as e:
        raise KVCacheSDKError(f"cannot use the layout of {model_name!r}: {e}") from None
    if desc.layout.model_name != model_name:
        raise KVCacheSDKError(f"the server described {desc.layout.model_name!r} for {model_name!r}")
    return desc.layout

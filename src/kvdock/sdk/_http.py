"""Reading the server's HTTP discovery documents."""

from __future__ import annotations

# the codec getaddrinfo encodes host names with, loaded with the SDK: a process that drops its
# privileges after importing kvdock (to a user who cannot read the stdlib) still resolves hosts
import encodings.idna  # noqa: F401
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from kvdock.config import is_loopback
from kvdock.errors import PermissionDeniedError, ServerUnavailableError
from kvdock.httpjson import get_json


def server_config(http_url: str, timeout: float = 10.0, token: str = "") -> dict[str, Any]:
    """The server's ``GET /config`` document (chunk_size, transports, L1 pool); with tenants it
    needs a tenant's token or the admin token."""
    return get_json(http_url, "/config", timeout, token)


def server_status(http_url: str, timeout: float = 10.0, token: str = "") -> dict[str, Any]:
    """The server's ``GET /status`` document (registered models under ``cache_context_meta``);
    with tenants it needs a token, and a tenant's shows only its models."""
    return get_json(http_url, "/status", timeout, token)


CHECK_S = 3.0  # how long connect waits for the HTTP API it was given


def check(http_url: str, chunk_size: int | None, timeout: float, token: str = "", shm_name: str = "") -> None:
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

"""Reading the server's HTTP discovery documents."""

from __future__ import annotations

# the codec getaddrinfo encodes host names with, loaded with the SDK: a process that drops its
# privileges after importing kvdock (to a user who cannot read the stdlib) still resolves hosts
import encodings.idna  # noqa: F401
from typing import Any

from kvdock.httpjson import get_json
from kvdock.reach import CHECK_S as CHECK_S  # (torch-free: kvdock lookup uses it too)
from kvdock.reach import check_http


def server_config(http_url: str, timeout: float = 10.0, token: str = "") -> dict[str, Any]:
    """The server's ``GET /config`` document (chunk_size, transports, L1 pool); with tenants it
    needs a tenant's token or the admin token."""
    return get_json(http_url, "/config", timeout, token)


def server_status(http_url: str, timeout: float = 10.0, token: str = "") -> dict[str, Any]:
    """The server's ``GET /status`` document (registered models under ``cache_context_meta``);
    with tenants it needs a token, and a tenant's shows only its models."""
    return get_json(http_url, "/status", timeout, token)


check = check_http  # what connect verifies of its http_url (kvdock.reach: torch-free)

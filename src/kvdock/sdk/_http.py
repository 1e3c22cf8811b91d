"""Reading the server's HTTP discovery documents."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from kvdock.errors import PermissionDeniedError, ServerUnavailableError


def get_json(http_url: str, path: str, timeout: float, token: str = "") -> dict[str, Any]:
    """GET ``http_url + path`` as JSON (``token``: sent as ``Authorization: Bearer``);
    PermissionDeniedError for a 401/403, ServerUnavailableError (naming the URL) on any other
    failure."""
    url = http_url.rstrip("/") + path
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            doc = json.loads(resp.read())
    except urllib.error.HTTPError as e:
        if e.code in (401, 403):
            raise PermissionDeniedError(f"kvdock HTTP API at {url}: {e.read().decode(errors='replace')}") from None
        raise ServerUnavailableError(f"kvdock HTTP API at {url} answered {e.code} {e.reason}") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        raise ServerUnavailableError(f"cannot reach the kvdock HTTP API at {url}: {reason}") from None
    if not isinstance(doc, dict):
        raise ServerUnavailableError(f"{url} did not return a JSON object")
    return doc


def server_config(http_url: str, timeout: float = 10.0, token: str = "") -> dict[str, Any]:
    """The server's ``GET /config`` document (chunk_size, transports, L1 pool); with tenants it
    needs a tenant's token or the admin token."""
    return get_json(http_url, "/config", timeout, token)


def server_status(http_url: str, timeout: float = 10.0, token: str = "") -> dict[str, Any]:
    """The server's ``GET /status`` document (registered models under ``cache_context_meta``);
    with tenants it needs a token, and a tenant's shows only its models."""
    return get_json(http_url, "/status", timeout, token)

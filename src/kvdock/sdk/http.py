"""Reading the server's HTTP discovery documents."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from kvdock.errors import ServerUnavailableError


def get_json(http_url: str, path: str, timeout: float) -> dict[str, Any]:
    """GET ``http_url + path`` as JSON; ServerUnavailableError (naming the URL) on any failure."""
    url = http_url.rstrip("/") + path
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            doc = json.loads(resp.read())
    except urllib.error.HTTPError as e:
        raise ServerUnavailableError(f"kvdock HTTP API at {url} answered {e.code} {e.reason}") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        raise ServerUnavailableError(f"cannot reach the kvdock HTTP API at {url}: {reason}") from None
    if not isinstance(doc, dict):
        raise ServerUnavailableError(f"{url} did not return a JSON object")
    return doc


def server_config(http_url: str, timeout: float = 10.0) -> dict[str, Any]:
    """The server's ``GET /config`` document (chunk_size, transports, L1 pool)."""
    return get_json(http_url, "/config", timeout)


def server_status(http_url: str, timeout: float = 10.0) -> dict[str, Any]:
    """The server's ``GET /status`` document (registered models under ``cache_context_meta``)."""
    return get_json(http_url, "/status", timeout)

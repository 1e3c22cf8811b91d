"""A GET of the server's HTTP API as JSON, for the SDK and the commands that import no torch
(kvdock.cli.light): no proxy for a loopback server, errors that name the URL."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from kvdock.config import http_opener
from kvdock.errors import InvalidInputError, PermissionDeniedError, ServerUnavailableError

__all__ = ["get_json"]


def get_json(http_url: str, path: str, timeout: float, token: str = "") -> dict[str, Any]:
    """GET ``http_url + path`` as a JSON object (``token``: ``Authorization: Bearer``);
    PermissionDeniedError for a 401/403, ServerUnavailableError naming the URL otherwise."""
    url = http_url.rstrip("/") + path
    if urllib.parse.urlsplit(url).scheme not in ("http", "https"):
        raise InvalidInputError(f"not an HTTP URL: {http_url!r} (e.g. http://127.0.0.1:9000)")
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with http_opener(url).open(request, timeout=timeout) as resp:
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

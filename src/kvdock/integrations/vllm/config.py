"""The connector's settings, read from vLLM's ``kv_connector_extra_config`` (keys ``kvdock.*``).

====================  ========================================================  ==============
key                   meaning                                                    default
====================  ========================================================  ==============
kvdock.url            the server's ZMQ control address                           (required)
kvdock.http_url       the server's HTTP address (/config, /status)               (required)
kvdock.model_name     the name the layout is registered under                    served name
kvdock.cache_decode   also store chunks completed while decoding                 false
kvdock.timeout        seconds any one kvdock call may take before it is a miss   5.0
kvdock.lookup_wait    seconds per scheduler step the scheduler may wait for      0.05
                      lookups in flight (0: never wait, admit them a step later)
kvdock.retry_s        after a failed call, seconds before kvdock is tried again  2.0
kvdock.admin_token    the server's admin token, when it has one                  ""
kvdock.server_key     CURVE: the server's public certificate (kvdock keygen)     $KVDOCK_CURVE_SERVER_KEY
kvdock.client_key     CURVE: this engine's secret certificate                    $KVDOCK_CURVE_CLIENT_KEY
kvdock.token          a tenant's token (servers with tenants)                    $KVDOCK_TOKEN
kvdock.load_failure   vLLM's kv_load_failure_policy while kvdock is in use:      recompute
                      ``recompute`` (a failed load is recomputed) or ``fail``
kvdock.load_async     load hits in the background while vLLM runs other          true
                      requests (``load_kv_async``); false: before the forward
                      pass that needs them
kvdock.save_buffer_mb host memory (MiB) holding KV copied out of vLLM's pages     256
                      until kvdock has stored it; a save that does not fit is
                      dropped (and counted), never waited for
====================  ========================================================  ==============
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from kvdock.config import MAX_NAME_LEN
from kvdock.errors import ConfigError

PREFIX = "kvdock."


@dataclass(frozen=True)
class ConnectorConfig:
    url: str
    http_url: str
    model_name: str
    cache_decode: bool = False
    timeout: float = 5.0
    lookup_wait: float = 0.05
    retry_s: float = 2.0
    admin_token: str = ""
    load_failure: str = "recompute"
    server_key: str = ""
    client_key: str = ""
    token: str = ""
    load_async: bool = True
    save_buffer_mb: float = 256.0

    @property
    def keys(self) -> dict[str, str | None]:
        """The SDK's CURVE and tenant keyword arguments (None: from the environment)."""
        return {
            "server_key": self.server_key or None,
            "client_key": self.client_key or None,
            "token": self.token or None,
        }

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None, served_model_name: str) -> ConnectorConfig:
        """Parse ``kv_connector_extra_config``; ConfigError naming the key for anything wrong
        (unknown ``kvdock.*`` keys included: a typo must not silently fall back to a default)."""
        extra = dict(extra or {})
        ours = {k[len(PREFIX) :]: v for k, v in extra.items() if k.startswith(PREFIX)}
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(ours) - known)
        if unknown:
            raise ConfigError(f"unknown kv_connector_extra_config key(s) {[PREFIX + k for k in unknown]}")
        for key, schemes in (("url", ("tcp://", "ipc://")), ("http_url", ("http://", "https://"))):
            value = ours.get(key)
            if not isinstance(value, str) or not value:
                raise ConfigError(f"kv_connector_extra_config needs {PREFIX}{key} (a non-empty string)")
            if not value.startswith(schemes) or len(value) <= len(value.split("://")[0]) + 3:
                raise ConfigError(f"{PREFIX}{key} must be a {' or '.join(schemes)} URL, got {value!r}")
        name = ours.get("model_name", served_model_name)
        if not isinstance(name, str) or not name or len(name) > MAX_NAME_LEN:
            raise ConfigError(f"{PREFIX}model_name must be a string of 1 to {MAX_NAME_LEN} characters, got {name!r}")
        for key in ("admin_token", "server_key", "client_key", "token"):
            if not isinstance(ours.get(key, ""), str):
                raise ConfigError(f"{PREFIX}{key} must be a string, got {type(ours[key]).__name__}")
        cfg = cls(
            url=ours["url"],
            http_url=ours["http_url"],
            model_name=name,
            cache_decode=_bool(ours.get("cache_decode", False), "cache_decode"),
            timeout=_positive("timeout", ours.get("timeout", 5.0)),
            lookup_wait=_positive("lookup_wait", ours.get("lookup_wait", 0.05), zero=True),
            retry_s=_positive("retry_s", ours.get("retry_s", 2.0)),
            admin_token=ours.get("admin_token", ""),
            load_failure=str(ours.get("load_failure", "recompute")),
            server_key=ours.get("server_key", ""),
            client_key=ours.get("client_key", ""),
            token=ours.get("token", ""),
            load_async=_bool(ours.get("load_async", True), "load_async"),
            save_buffer_mb=_positive("save_buffer_mb", ours.get("save_buffer_mb", 256.0), zero=True, what="MiB"),
        )
        if cfg.load_failure not in ("recompute", "fail"):
            raise ConfigError(f"{PREFIX}load_failure must be 'recompute' or 'fail', got {cfg.load_failure!r}")
        return cfg


def _bool(value: object, key: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
        return value.lower() in ("true", "1", "yes")
    raise ConfigError(f"{PREFIX}{key} must be a boolean, got {value!r}")


def _positive(key: str, value: object, zero: bool = False, what: str = "seconds") -> float:
    """A finite number (of ``what``), > 0 (or >= 0 with ``zero``); ConfigError naming ``key``."""
    unit = what
    what = "a non-negative" if zero else "a positive"
    if isinstance(value, bool):
        raise ConfigError(f"{PREFIX}{key} must be {what} number of {unit}, got {value!r}")
    try:
        f = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        f = -1.0
    if not (f >= 0 if zero else f > 0) or f == float("inf"):
        raise ConfigError(f"{PREFIX}{key} must be {what} number of {unit}, got {value!r}")
    return f

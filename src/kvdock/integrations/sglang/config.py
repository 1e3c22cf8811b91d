"""The backend's settings, from SGLang's ``--hicache-storage-backend-extra-config`` JSON.

=========================  ==============================================================  =========================
key                        meaning                                                         default
=========================  ==============================================================  =========================
``kvdock.url``             the server's control plane                                      tcp://127.0.0.1:5555
``kvdock.http_url``        the server's HTTP                                               http://127.0.0.1:9000
``kvdock.model_name``      the registered name                                             SGLang's ``model_name``
``kvdock.timeout``         seconds a kvdock call may take before it is a miss              5
``kvdock.retry_s``         after a failure, seconds before kvdock is tried again           2
``kvdock.admin_token``     the server's admin token, if it has one                         ""
``kvdock.token``           the bearer token of the engine's tenant (``--tenants``)         ""
``kvdock.cache_salt``      the kvdock salt SGLang's pages are filed under (one the         ""
                           tenant owns; SGLang's own salts stay in its page hashes)
``kvdock.fingerprint``     the model's fingerprint (``ModelLayout.fingerprint``)           from SGLang's server args
``kvdock.total_kv_heads``  the model's KV heads over all TP ranks (GQA replicated          head_num * tp_size
                           over more ranks than heads)
``interface_v1``           SGLang's zero-copy path (``batch_get_v1`` / ``batch_set_v1``);  0 (SGLang's default)
                           what the SDK reads by token ids (see the package docs)
=========================  ==============================================================  =========================

``backend_name``, ``module_path``, ``class_name`` are SGLang's own (the ``dynamic`` backend).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvdock.errors import ConfigError

DEFAULT_URL = "tcp://127.0.0.1:5555"
DEFAULT_HTTP_URL = "http://127.0.0.1:9000"


@dataclass(frozen=True)
class BackendConfig:
    url: str
    http_url: str
    model_name: str
    timeout: float = 5.0
    retry_s: float = 2.0
    admin_token: str = ""
    total_kv_heads: int = 0
    interface_v1: bool = False
    token: str = ""
    cache_salt: str = ""
    fingerprint: str | None = None  # None: computed from SGLang's server args (.identity)

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None, model_name: str | None) -> BackendConfig:
        """The settings of one backend; ConfigError naming the key for a value of the wrong type
        or no model name at all (SGLang's ``model_name`` is None and ``kvdock.model_name`` unset)."""
        extra = dict(extra or {})
        name = extra.get("kvdock.model_name", model_name)
        if not isinstance(name, str) or not name:
            raise ConfigError("kvdock: no model name: set kvdock.model_name in the extra config")
        return cls(
            url=_str(extra, "kvdock.url", DEFAULT_URL),
            http_url=_str(extra, "kvdock.http_url", DEFAULT_HTTP_URL),
            model_name=name,
            timeout=_num(extra, "kvdock.timeout", 5.0),
            retry_s=_num(extra, "kvdock.retry_s", 2.0, zero=True),
            admin_token=_str(extra, "kvdock.admin_token", "", empty=True),
            total_kv_heads=int(_num(extra, "kvdock.total_kv_heads", 0, zero=True, integer=True)),
            interface_v1=bool(extra.get("interface_v1", 0)),
            token=_str(extra, "kvdock.token", "", empty=True),
            cache_salt=_str(extra, "kvdock.cache_salt", "", empty=True),
            fingerprint=_str(extra, "kvdock.fingerprint", "", empty=True) if "kvdock.fingerprint" in extra else None,
        )


def _str(extra: dict[str, Any], key: str, default: str, empty: bool = False) -> str:
    value = extra.get(key, default)
    if not isinstance(value, str) or (not value and not empty):
        raise ConfigError(f"kvdock: {key} must be a non-empty string, got {value!r}")
    return value


def _num(extra: dict[str, Any], key: str, default: float, zero: bool = False, integer: bool = False) -> float:
    value = extra.get(key, default)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (value > 0 or (zero and value == 0))
    if not ok or (integer and int(value) != value):
        kind = "an integer" if integer else "a number"
        raise ConfigError(f"kvdock: {key} must be {kind} {'>= 0' if zero else '> 0'}, got {value!r}")
    return float(value)


__all__ = ["BackendConfig", "DEFAULT_HTTP_URL", "DEFAULT_URL"]

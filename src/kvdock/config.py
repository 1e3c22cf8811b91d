"""Server configuration: one frozen dataclass, defaults here only, precedence CLI > env > file > default.

Every field ``name`` has an environment variable ``KVDOCK_<NAME>`` and a key ``name`` in the
optional TOML config file (``--config`` / ``KVDOCK_CONFIG``).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import os
import re
import tomllib
import urllib.parse
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from kvdock import __version__
from kvdock.errors import ConfigError
from kvdock.redisurl import check_redis_url

# byte sizes and the automatic L1 and L2 sizes (their own module, kvdock.sizes)
from kvdock.sizes import (
    DISK_DEFAULT,
    L1_AUTO_FRACTION,
    L1_AUTO_MAX,
    auto_disk_size,
    auto_l1_size,
    default_disk_dir,
    format_size,
    parse_size,
)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 5555
DEFAULT_HTTP_PORT = 9000
DEFAULT_URL = f"tcp://{DEFAULT_HOST}:{DEFAULT_PORT}"
DEFAULT_HTTP_URL = f"http://{DEFAULT_HOST}:{DEFAULT_HTTP_PORT}"
SIZE_FIELDS = ("l1_size", "disk_size", "redis_max_bytes")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

# Hard bounds on what one model registration or request may declare (checked by the server and the
# SDK): the wire limits, kept in kvdock.protocol.limits (these names stay importable from here).
import kvdock.protocol.limits as _limits  # noqa: E402

MAX_NUM_LAYERS = _limits.MAX_NUM_LAYERS
MAX_NUM_KV_HEADS = _limits.MAX_NUM_KV_HEADS
MAX_HEAD_DIM = _limits.MAX_HEAD_DIM
MAX_WORLD_SIZE = _limits.MAX_WORLD_SIZE
MAX_NAME_LEN = _limits.MAX_NAME_LEN
MAX_SALT_LEN = _limits.MAX_SALT_LEN
MAX_BATCH = _limits.MAX_BATCH
TOKEN_ENV = "KVDOCK_TOKEN"  # a client's tenant token, when it is given none
MAX_CLIENTS = 10_000  # live client registrations; past it RegisterClient fails with ErrorCode.LIMIT


def _parse_bool(text: str | bool) -> bool:
    if isinstance(text, bool):
        return text
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off", ""):
        return False
    raise ConfigError(f"not a boolean: {text!r}")


def _opt(default: Any, help: str, metavar: str | None = None) -> Any:
    """A ServerConfig field with its ``kvdock serve --help`` text (the flags are generated from the
    fields: :func:`kvdock.cli.serve.add_serve_flags`)."""
    return dataclasses.field(default=default, metadata={"help": help, "metavar": metavar})


@dataclass(frozen=True)
class ServerConfig:
    """Every server setting. A field's default is the only place that default is written; its
    ``metadata["help"]`` is its ``--help`` text (a 0 or "" that means "automatic" says so there)."""

    host: str = _opt(
        DEFAULT_HOST, "bind address for ZMQ and HTTP (a non-loopback one needs CURVE or --insecure-allow-remote)"
    )
    http_host: str = _opt(
        "", "bind address for HTTP (default: --host; loopback when only CURVE opens --host to the network)"
    )
    port: int = _opt(DEFAULT_PORT, "ZMQ control port")
    http_port: int = _opt(DEFAULT_HTTP_PORT, "HTTP port (/status, /config, /metrics, /healthz)")
    chunk_size: int = _opt(256, "tokens per stored chunk")
    l1_size: int = _opt(
        0,
        f"L1 shared-memory pool, e.g. 2GiB, allocated and pre-faulted at start (default: "
        f"{int(L1_AUTO_FRACTION * 100)}% of available memory, at most {L1_AUTO_MAX // 2**30} GiB)",
        "SIZE",
    )
    no_shm: bool = _opt(False, "share no memory: every client uses the inline transport")
    no_local_socket: bool = _opt(
        False, "offer shared-memory clients no local UNIX socket: their control messages go over ZMQ too"
    )
    no_fast_reads: bool = _opt(
        False, "publish no pool directory: shared-memory clients ask the server for every lookup and retrieve"
    )
    session_ttl: float = _opt(30.0, "seconds before a silent session's pins and reservations are released")
    client_ttl: float = _opt(300.0, "seconds before a silent client's registration is forgotten")
    max_models: int = _opt(64, "model registrations the server keeps")
    max_request_tokens: int = _opt(2**20, "token ids one request may name (a longer one is refused at once)")
    disk_dir: str = _opt(
        "", "L2 directory, kept across restarts (default: $XDG_CACHE_HOME/kvdock/l2, else ~/.cache/kvdock/l2)"
    )
    disk_size: int = _opt(
        0,
        f"L2 budget, e.g. 100GiB (default: {DISK_DEFAULT // 2**30} GiB, or half the free space there when "
        "less is free)",
        "SIZE",
    )
    no_disk: bool = _opt(False, "no L2 tier")
    redis_url: str = _opt(
        "",
        "L3 shared by servers: a Redis/Valkey (redis://[:PASSWORD@]HOST:PORT/DB, rediss://) or a Redis Cluster "
        "(redis+cluster://[:PASSWORD@]HOST:PORT,HOST:PORT/, rediss+cluster://); default: none",
    )
    redis_max_bytes: int = _opt(
        0,
        "L3 budget of this server's own writes, e.g. 50GiB: past it, its least recently used are deleted "
        "(default: none, Redis' maxmemory decides)",
        "SIZE",
    )
    l3_coherence_ms: float = _opt(
        100.0,
        "with an L3: within this many ms of an overwrite acknowledged by any server sharing it, no server serves "
        "the replaced version (it answers misses while it cannot tell)",
    )
    writeback_wait_s: float = _opt(
        2.0,
        "with a lower tier: how long a store waits for write-downs to free clean L1 room before it evicts "
        "chunks not written down yet, newest first (0: never wait; docs/architecture.md, 4)",
    )
    writeback_dirty_limit: float = _opt(
        0.5,
        "with a lower tier: the share of L1 (0-1] that chunks not written down yet may fill before a store waits "
        "for write-downs (at most --writeback-wait-s), so that L1 keeps clean room for reads promoted from below; "
        "1: a store waits only when it needs the room (docs/benchmarks.md: trace replay)",
    )
    eviction_policy: str = _opt(
        "s3fifo",
        "which evictable chunk goes first, in every tier: s3fifo (scan- and frequency-aware, prefix-aware), "
        "prefix-lru or lru (docs/benchmarks.md: trace replay)",
    )
    admin_token: str = _opt("", "token required (Authorization: Bearer) by HTTP admin actions and to register models")
    log_level: str = _opt("INFO", "DEBUG, INFO or WARNING")
    kv_events_port: int = _opt(0, "publish KV events (chunks stored / removed) on this port (default: off)")
    insecure_allow_remote: bool = _opt(
        False, "bind a non-loopback --host although clients are not authenticated (see docs/security.md)"
    )
    curve_secret_key: str = _opt(
        "", "the server's secret certificate (kvdock keygen): ZMQ clients and event subscribers must speak CURVE"
    )
    curve_authorized_dir: str = _opt("", "directory of the public certificates (*.key) CURVE lets in")
    tenants: str = _opt(
        "", "tenants file (TOML): each tenant's CURVE keys or tokens, models, cache_salt namespaces and quotas"
    )
    redis_timeout_s: float = _opt(
        5.0,
        "with an L3: seconds a connect or a reply of Redis may take before the L3 is taken as down (its reads "
        "are then misses, its write-downs dropped and counted, until a probe gets through)",
    )
    l3_floor_ttl_ms: int = _opt(
        60_000,
        "with an L3: how long an overwrite's floor lives there unrefreshed; a server holding an overwrite's version "
        "refreshes it every sixth of this and serves it only while its last refresh was sent less than half of this "
        "ago (docs/scale-out.md)",
    )

    @property
    def zmq_url(self) -> str:
        return f"tcp://{_url_host(self.host)}:{self.port}"

    @property
    def http_bind_host(self) -> str:
        """Where HTTP listens: ``http_host``, else ``host`` when it is loopback or the operator
        allowed remote clients, else loopback (CURVE protects zmq; plain HTTP stays local)."""
        if self.http_host:
            return self.http_host
        return self.host if self.insecure_allow_remote or is_loopback(self.host) else DEFAULT_HOST

    @property
    def curve(self) -> bool:
        """Whether zmq clients (control plane and KV events) must authenticate with CURVE."""
        return bool(self.curve_secret_key)

    @property
    def kv_events_url(self) -> str:
        """Where KV events are published; "" when they are off."""
        return f"tcp://{_url_host(self.host)}:{self.kv_events_port}" if self.kv_events_port else ""

    def validate(self) -> ServerConfig:
        """Return self, or raise ConfigError for values that cannot work."""
        if self.chunk_size <= 0:
            raise ConfigError(f"chunk_size must be positive, got {self.chunk_size}")
        for f in fields(self):  # nan passes every "> 0" check (a lease that never ends), inf never comes
            if str(f.type) == "float" and not math.isfinite(getattr(self, f.name)):
                raise ConfigError(f"{f.name} must be a finite number, got {getattr(self, f.name)}")
        if self.log_level.upper() not in LOG_LEVELS:
            raise ConfigError(f"log_level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        for name in SIZE_FIELDS:
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        check_redis_url(self.redis_url)
        positive = ("session_ttl", "client_ttl", "max_models", "max_request_tokens", "l3_coherence_ms")
        for name in (*positive, "l3_floor_ttl_ms"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.writeback_wait_s < 0:
            raise ConfigError(f"writeback_wait_s must be 0 or more, got {self.writeback_wait_s}")
        if not 0 < self.writeback_dirty_limit <= 1:
            raise ConfigError(f"writeback_dirty_limit must be in (0, 1], got {self.writeback_dirty_limit}")
        if self.redis_timeout_s <= 0:
            raise ConfigError(f"redis_timeout_s must be positive, got {self.redis_timeout_s}")
        for name in ("port", "http_port", "kv_events_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise ConfigError(f"{name} out of range: {getattr(self, name)}")
        if self.curve_authorized_dir and not self.curve_secret_key:
            raise ConfigError("curve_authorized_dir needs curve_secret_key (the server's own secret certificate)")
        if not self.insecure_allow_remote and not self.curve and not is_loopback(self.host):
            raise ConfigError(
                f"host {self.host!r} is not a loopback address: every client that reaches it could read any "
                "namespace's KV it can name, and the inline transport moves KV in plain TCP (docs/security.md). "
                "Require CURVE keys (--curve-secret-key and --curve-authorized-dir; make them with kvdock keygen), "
                "or bind it anyway with --insecure-allow-remote (KVDOCK_INSECURE_ALLOW_REMOTE=1) on a trusted network"
            )
        if self.http_host and not self.insecure_allow_remote and not is_loopback(self.http_host):
            raise ConfigError(
                f"http_host {self.http_host!r} is not a loopback address, and HTTP is plain text (tokens and admin "
                "actions): put it behind a TLS proxy on loopback, or bind it anyway with --insecure-allow-remote"
            )
        ports = [p for p in (self.port, self.http_port, self.kv_events_port) if p]
        if len(set(ports)) != len(ports):
            raise ConfigError(
                f"port {self.port}, http_port {self.http_port} and kv_events_port {self.kv_events_port} must differ"
            )
        return self


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address, or "localhost") is a loopback address; a name is not."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def http_opener(url: str) -> urllib.request.OpenerDirector:
    """urllib's opener for ``url``: the environment's proxies (``http_proxy``, ...), except for a
    loopback host, which no proxy can reach on this machine's behalf (a proxy would answer for
    another machine's loopback, or not at all)."""
    if is_loopback(urllib.parse.urlsplit(url).hostname or ""):
        return urllib.request.build_opener(urllib.request.ProxyHandler({}))
    return urllib.request.build_opener()


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


_ACCEPTED: dict[str, tuple[type, ...]] = {
    "int": (int, str),
    "float": (int, float, str),
    "str": (str,),
    "bool": (bool, str),
}


def _coerce(name: str, value: Any) -> Any:
    """Type-check one value from the CLI, env (strings) or TOML file (typed) for field ``name``."""
    kind = next(str(f.type) for f in fields(ServerConfig) if f.name == name)
    if name in SIZE_FIELDS:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        ok: tuple[type, ...] = (int, str)
    else:
        ok = _ACCEPTED[kind]
    if not isinstance(value, ok) or (isinstance(value, bool) and kind != "bool"):
        raise ConfigError(f"invalid value for {name}: {value!r} (expected {kind})")
    return _convert(name, kind, value)


def _convert(name: str, kind: str, value: Any) -> Any:
    try:
        if name in SIZE_FIELDS:
            return parse_size(value)
        if kind == "bool":
            return _parse_bool(value)
        return {"int": int, "float": float, "str": str}[kind](value)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"invalid value for {name}: {value!r} ({e})") from None


def load_server_config(
    cli: Mapping[str, Any], env: Mapping[str, str] | None = None, config_file: str | Path | None = None
) -> ServerConfig:
    """Merge CLI values (None = not given) over ``KVDOCK_*`` env over the TOML file over defaults."""
    env = os.environ if env is None else env
    names = {f.name for f in fields(ServerConfig)}
    merged: dict[str, Any] = {}
    path = config_file or env.get("KVDOCK_CONFIG")
    if path:
        try:
            data = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ConfigError(f"cannot read config file {path}: {e}") from None
        unknown = set(data) - names
        if unknown:
            raise ConfigError(f"unknown keys in {path}: {', '.join(sorted(unknown))}")
        merged.update({k: _coerce(k, v) for k, v in data.items()})
    for name in names:
        if f"KVDOCK_{name.upper()}" in env:
            merged[name] = _coerce(name, env[f"KVDOCK_{name.upper()}"])
    merged.update({k: _coerce(k, v) for k, v in cli.items() if v is not None and k in names})
    return dataclasses.replace(ServerConfig(), **merged).validate()


def with_sizes(config: ServerConfig) -> ServerConfig:
    """``config`` with its automatic sizes (``l1_size``, ``disk_size`` 0) made concrete, so that the
    server and the startup line (:func:`startup_line`) use the same numbers."""
    l1 = config.l1_size or auto_l1_size()
    disk = config.disk_size
    if not config.no_disk and not disk:
        disk = auto_disk_size(Path(config.disk_dir) if config.disk_dir else default_disk_dir())
    return dataclasses.replace(config, l1_size=l1, disk_size=disk)


def startup_line(config: ServerConfig, given: ServerConfig) -> str:
    """One log line saying what the server takes from the machine: ``config`` as resolved by
    :func:`with_sizes`, ``given`` as the operator gave it (to say which sizes were automatic)."""
    # with tenants the rest of the pool is private; tenants with an l1 quota get pools of their own
    kind = "private" if config.no_shm else "tenants' pools and private" if config.tenants else "shared"
    auto_l1 = f"auto: {int(L1_AUTO_FRACTION * 100)}% of available memory, at most {format_size(L1_AUTO_MAX)}"
    how = f"{auto_l1}; --l1-size to choose" if not given.l1_size else "given"
    l1 = f"L1 size: {format_size(config.l1_size)} ({how}) of {kind} memory, pre-faulted"
    if config.no_disk:
        l2 = "L2 off"
    else:
        where = config.disk_dir or str(default_disk_dir())
        auto_l2 = "auto: --disk-size to choose" if not given.disk_size else "given"
        l2 = f"L2 disk: {format_size(config.disk_size)} ({auto_l2}) in {where}, kept across restarts (--no-disk: none)"
    l3 = "L3 " + (_redact(config.redis_url) if config.redis_url else "off")
    http = f"{config.http_bind_host}:{config.http_port}"
    return f"kvdock {__version__}: ZMQ {config.zmq_url}, HTTP {http}; {l1}; {l2}; {l3}"


def _redact(url: str) -> str:
    """``url`` without its password."""
    return re.sub(r"(://[^@/]*:)[^@/]*@", r"\1***@", url)

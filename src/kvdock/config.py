"""Server configuration: one frozen dataclass, defaults here only, precedence CLI > env > file > default.

Every field ``name`` has an environment variable ``KVDOCK_<NAME>`` and a key ``name`` in the
optional TOML config file (``--config`` / ``KVDOCK_CONFIG``).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from kvdock.errors import ConfigError

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 5555
DEFAULT_HTTP_PORT = 9000
DEFAULT_URL = f"tcp://{DEFAULT_HOST}:{DEFAULT_PORT}"
DEFAULT_HTTP_URL = f"http://{DEFAULT_HOST}:{DEFAULT_HTTP_PORT}"
L1_AUTO_FRACTION = 0.25  # of available memory, when --l1-size is not given
DISK_AUTO_FRACTION = 0.2  # of the free space in the disk dir, when --disk-size is not given
SIZE_FIELDS = ("l1_size", "disk_size", "redis_max_bytes")

# Hard bounds on what one model registration may declare (checked by the server and the SDK).
MAX_NUM_LAYERS = 4096
MAX_NUM_KV_HEADS = 4096
MAX_HEAD_DIM = 16384
MAX_WORLD_SIZE = 1024
MAX_NAME_LEN = 200  # characters of a model name and of each engine string
MAX_SALT_LEN = 256  # characters of a cache_salt (it is written into the header of every chunk)
MAX_BATCH = 4096  # prompts in one LookupMany / PrepareRetrieveMany (the SDK splits larger batches)
TOKEN_ENV = "KVDOCK_TOKEN"  # a client's tenant token, when it is given none
MAX_CLIENTS = 10_000  # live client registrations; past it RegisterClient fails with ErrorCode.LIMIT

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "m": 10**6,
    "g": 10**9,
    "t": 10**12,
    "ki": 2**10,
    "mi": 2**20,
    "gi": 2**30,
    "ti": 2**40,
}


def parse_size(text: str | int) -> int:
    """Parse ``"2GiB"``, ``"512MiB"``, ``"1.5G"``, ``"4096"`` into bytes; ConfigError otherwise."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*", text.lower())
    if not m:
        raise ConfigError(f"not a size: {text!r} (try 2GiB, 512MiB, 1G)")
    return int(float(m.group(1)) * _UNITS[m.group(2) or ""])


def format_size(n: int) -> str:
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n} B"


def _parse_bool(text: str | bool) -> bool:
    if isinstance(text, bool):
        return text
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off", ""):
        return False
    raise ConfigError(f"not a boolean: {text!r}")


@dataclass(frozen=True)
class ServerConfig:
    host: str = DEFAULT_HOST
    http_host: str = ""  # "" = host, except that CURVE opens only zmq off loopback: then 127.0.0.1
    port: int = DEFAULT_PORT
    http_port: int = DEFAULT_HTTP_PORT
    chunk_size: int = 256
    l1_size: int = 0  # bytes; 0 = L1_AUTO_FRACTION of available memory
    no_shm: bool = False
    no_local_socket: bool = False  # shared-memory clients keep their control messages on zmq
    no_fast_reads: bool = False  # no pool directory: every lookup and retrieve asks the server
    session_ttl: float = 30.0
    client_ttl: float = 300.0  # seconds before a silent client's registration is forgotten
    max_models: int = 64  # model registrations the server keeps
    max_request_tokens: int = 2**20  # token ids one request may name
    disk_dir: str = ""  # L2 directory; "" = DEFAULT_DISK_DIR
    disk_size: int = 0  # bytes; 0 = DISK_AUTO_FRACTION of the free space there
    no_disk: bool = False
    redis_url: str = ""  # L3: one Redis, or a cluster (redis+cluster://H:P,H:P/); "" = off
    redis_max_bytes: int = 0  # bytes of this server's own writes kept in L3 (LRU); 0 = Redis' maxmemory decides
    l3_coherence_ms: float = 100.0  # servers sharing L3 stop serving a version overwritten elsewhere within this
    admin_token: str = ""
    log_level: str = "INFO"
    kv_events_port: int = 0  # PUB socket of KV events (protocol/events.py); 0 = off
    insecure_allow_remote: bool = False  # bind a non-loopback host although nothing authenticates clients
    curve_secret_key: str = ""  # the server's secret certificate (kvdock keygen): zmq clients must speak CURVE
    curve_authorized_dir: str = ""  # public certificates (*.key) of the clients CURVE lets in
    tenants: str = ""  # a tenants file (server/tenants.py): clients bound to their models, salts and quotas

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
        for name in SIZE_FIELDS:
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        _check_redis_url(self.redis_url)
        for name in ("session_ttl", "client_ttl", "max_models", "max_request_tokens", "l3_coherence_ms"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
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


def auto_l1_size() -> int:
    """The default L1 size: a fraction of available memory, bounded by free space in /dev/shm."""
    avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        meminfo = Path("/proc/meminfo").read_text()
        avail = int(re.search(r"MemAvailable:\s+(\d+) kB", meminfo).group(1)) * 1024  # type: ignore[union-attr]
    except (OSError, AttributeError):
        pass
    st = os.statvfs("/dev/shm")
    size = min(int(avail * L1_AUTO_FRACTION), int(st.f_bavail * st.f_frsize * 0.9))
    return size // 2**20 * 2**20


def default_disk_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvdock" / "l2"


def auto_disk_size(directory: Path) -> int:
    """The default L2 budget: a fraction of the free space where ``directory`` lives."""
    probe = directory
    while not probe.exists():
        probe = probe.parent
    st = os.statvfs(probe)
    return int(st.f_bavail * st.f_frsize * DISK_AUTO_FRACTION) // 2**20 * 2**20


REDIS_SCHEMES = ("redis://", "rediss://", "unix://", "redis+cluster://", "rediss+cluster://")
CLUSTER_SCHEMES = ("redis+cluster://", "rediss+cluster://")


@dataclass(frozen=True)
class ClusterURL:
    """A ``redis+cluster://[[USER]:PASSWORD@]HOST:PORT[,HOST:PORT...][/]`` URL, taken apart."""

    nodes: tuple[tuple[str, int], ...]  # the start nodes (the client discovers the others)
    username: str | None
    password: str | None
    tls: bool


def parse_cluster_url(url: str) -> ClusterURL:
    """ConfigError if ``url`` is not a cluster URL naming HOST:PORT start nodes."""
    if not url.startswith(CLUSTER_SCHEMES):
        raise ConfigError(f"{url!r} is not a Redis Cluster URL ({' or '.join(CLUSTER_SCHEMES)})")
    auth, _, hosts = url.split("://", 1)[1].rpartition("@")
    user, _, password = auth.partition(":")
    nodes = []
    for part in hosts.rstrip("/").split(","):
        host, sep, port = part.rpartition(":")
        bracketed = host.startswith("[") and host.endswith("]")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536 or (":" in host and not bracketed):
            raise ConfigError(
                f"redis_url {url!r}: {part!r} is not HOST:PORT "
                "(a cluster URL lists its start nodes: redis+cluster://HOST:PORT,[IPV6]:PORT/)"
            )
        nodes.append((host[1:-1] if bracketed else host, int(port)))
    return ClusterURL(tuple(nodes), unquote(user) or None, unquote(password) or None, url.startswith("rediss"))


def _check_redis_url(url: str) -> None:
    """ConfigError unless ``url`` is empty, a Redis URL, or a well-formed cluster URL."""
    if not url:
        return
    if not url.startswith(REDIS_SCHEMES):
        raise ConfigError(f"redis_url must start with one of {', '.join(REDIS_SCHEMES)}, got {url!r}")
    if url.startswith(CLUSTER_SCHEMES):
        parse_cluster_url(url)

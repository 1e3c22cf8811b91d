"""Redis URLs as kvdock takes them (configuration: ``--redis-url``): one server, or a Redis
Cluster from its start nodes (``redis+cluster://``). Pure parsing, no redis-py."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import unquote

from kvdock.errors import ConfigError

__all__ = ["CLUSTER_SCHEMES", "REDIS_SCHEMES", "ClusterURL", "check_redis_url", "parse_cluster_url", "redacted"]

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


def check_redis_url(url: str) -> None:
    """ConfigError unless ``url`` is empty, a Redis URL, or a well-formed cluster URL."""
    if not url:
        return
    if not url.startswith(REDIS_SCHEMES):
        raise ConfigError(f"redis_url must start with one of {', '.join(REDIS_SCHEMES)}, got {url!r}")
    if url.startswith(CLUSTER_SCHEMES):
        parse_cluster_url(url)


def redacted(url: str) -> str:
    """``url`` without its password (for logs and /status)."""
    if "@" in url:
        scheme, rest = url.split("://", 1)
        return f"{scheme}://***@{rest.rsplit('@', 1)[1]}"
    return url

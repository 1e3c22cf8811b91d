"""The server's L1 watcher: it counts evictions and, with ``--kv-events-port``, collects KV
events (:mod:`kvdock.protocol.events`) that :meth:`ChunkEvents.flush` publishes in batches."""

from __future__ import annotations

import hmac
import socket
import time
from collections import deque

from kvdock.config import ServerConfig
from kvdock.keys import ObjectKey, namespace
from kvdock.protocol.events import TOPIC, AllChunksCleared, ChunkRemoved, ChunkStored, Event, KVEventBatch
from kvdock.server.metrics import Metrics
from kvdock.server.tenants import Tenants
from kvdock.storage.memory import L1Object
from kvdock.transport.events import EventPublisher

# chunk hashes kept between two flushes (a batch is at most ~0.6 MB): past it the oldest events
# are dropped and counted; with the PUB socket's high-water mark of 8 batches, a subscriber that
# stops reading holds at most a few MB
MAX_PENDING = 16_384
FLUSH_S = 0.05  # how often pending events are published


def advertised_url(config: ServerConfig) -> str:
    """The ZMQ URL that names this server in its events: with a wildcard bind (0.0.0.0, ::), the
    host's name instead of the address, so that routers can tell hosts apart."""
    host = config.host if config.host not in ("0.0.0.0", "::", "") else socket.getfqdn()
    return f"tcp://{f'[{host}]' if ':' in host else host}:{config.port}"


UNOWNED = TOPIC + b"//"  # with tenants: the topic of objects whose salt no tenant owns (admins only)


def tenant_topic(name: str) -> bytes:
    """The topic of tenant ``name``'s events (a subscription to TOPIC, an admin's, gets them all)."""
    return TOPIC + b"/" + name.encode() + b"/"


def subscription_topic(tenants: Tenants, admin_token: str, key: bytes, asked: bytes) -> bytes | None:
    """The topic a subscriber gets for asking ``asked`` with CURVE key ``key``: ``TOPIC`` then,
    optionally, a NUL and a token. The admin token gets every topic; a tenant (by key or token)
    its own; anyone else nothing (None)."""
    if not asked.startswith(TOPIC):
        return None
    rest = asked[len(TOPIC) :]
    token = rest[1:].decode(errors="replace") if rest[:1] == b"\0" else ""
    if admin_token and token and hmac.compare_digest(token.encode(), admin_token.encode()):
        return TOPIC
    tenant = tenants.identify(key, token)
    return tenant_topic(tenant.name) if tenant is not None else None


class ChunkEvents:
    """L1Watcher of the server's L1 store. The event loop only (as the store).

    Consecutive chunks of one kind, model, rank and namespace go in one event (a store of a long
    prefix is one ChunkStored with all its hashes); events are built at flush time. With
    ``tenants``, each tenant's events are a batch of their own on its topic (:func:`tenant_topic`),
    which only its subscribers get."""

    def __init__(
        self,
        metrics: Metrics,
        chunk_size: int,
        publisher: EventPublisher | None = None,
        tenants: Tenants | None = None,
    ) -> None:
        self.metrics = metrics
        self.chunk_size = chunk_size
        self.publisher = publisher
        self.tenants = tenants
        # (kind, model, rank, namespace or "", hashes, topic): the events being gathered, oldest first
        self.pending: deque[tuple[str, str, int, str, list[bytes], bytes]] = deque()
        self.hashes = 0  # chunk hashes in pending
        self.dropped: dict[bytes, int] = {}  # topic -> chunk hashes (or clears) dropped since its last batch

    def stored(self, obj: L1Object) -> None:
        if self.publisher is not None:
            self._add("stored", obj.key)

    def removed(self, obj: L1Object, evicted: bool) -> None:
        if evicted:
            self.metrics.evictions.inc()
        if self.publisher is not None:
            self._add("removed", obj.key)

    def cleared(self) -> None:
        if self.publisher is not None:
            self.pending.clear()  # superseded: everything is gone now
            self.hashes = 0
            for topic in self._topics():
                self.pending.append(("cleared", "", 0, "", [], topic))

    def _topics(self) -> list[bytes]:
        if self.tenants is None:
            return [TOPIC]
        return [tenant_topic(name) for name in self.tenants.all] + [UNOWNED]

    def _topic(self, salt: str) -> bytes:
        if self.tenants is None:
            return TOPIC
        owner = self.tenants.owner(salt)
        return tenant_topic(owner.name) if owner is not None else UNOWNED

    def _add(self, kind: str, key: ObjectKey) -> None:
        ns = namespace(key.model, key.rank, key.salt)
        topic = self._topic(key.salt)
        while self.hashes >= MAX_PENDING and self.pending:
            lost = self.pending.popleft()
            self.hashes -= len(lost[4])
            self.dropped[lost[5]] = self.dropped.get(lost[5], 0) + max(len(lost[4]), 1)
        self.hashes += 1
        last = self.pending[-1] if self.pending else None
        if last is not None and last[:4] == (kind, key.model, key.rank, ns) and last[5] == topic:
            last[4].append(key.chunk)
        else:
            self.pending.append((kind, key.model, key.rank, ns, [key.chunk], topic))

    def flush(self, server: str) -> int:
        """Publish what is pending, one batch per topic (one without tenants); returns how many
        events they held."""
        if self.publisher is None or not self.pending:
            return 0
        batches: dict[bytes, list[Event]] = {}
        for kind, model, rank, ns, hashes, topic in self.pending:
            events = batches.setdefault(topic, [])
            if kind == "stored":
                events.append(ChunkStored(hashes, model, rank, ns, self.chunk_size))
            elif kind == "removed":
                events.append(ChunkRemoved(hashes, model, rank, ns))
            else:
                events.append(AllChunksCleared())
        self.pending.clear()
        self.hashes = 0
        now = time.time()
        for topic, events in batches.items():
            self.publisher.publish(KVEventBatch(now, server, events, self.dropped.pop(topic, 0)), topic)
        return sum(len(events) for events in batches.values())

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()

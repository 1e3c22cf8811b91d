"""The server's L1 watcher: it counts evictions and, with ``--kv-events-port``, collects KV
events (:mod:`kvdock.protocol.events`) that :meth:`ChunkEvents.flush` publishes in batches."""

from __future__ import annotations

import socket
import time
from collections import deque

from kvdock.config import ServerConfig
from kvdock.keys import ObjectKey, namespace
from kvdock.protocol.events import AllChunksCleared, ChunkRemoved, ChunkStored, Event, KVEventBatch
from kvdock.server.metrics import Metrics
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


class ChunkEvents:
    """L1Watcher of the server's L1 store. The event loop only (as the store).

    Consecutive chunks of one kind, model, rank and namespace go in one event (a store of a long
    prefix is one ChunkStored with all its hashes); events are built at flush time."""

    def __init__(self, metrics: Metrics, chunk_size: int, publisher: EventPublisher | None = None) -> None:
        self.metrics = metrics
        self.chunk_size = chunk_size
        self.publisher = publisher
        # (kind, model, rank, namespace or "", hashes): the events being gathered, oldest first
        self.pending: deque[tuple[str, str, int, str, list[bytes]]] = deque()
        self.hashes = 0  # chunk hashes in pending
        self.dropped = 0  # chunk hashes (or clears) dropped since the last batch

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
            self.pending.append(("cleared", "", 0, "", []))

    def _add(self, kind: str, key: ObjectKey) -> None:
        ns = namespace(key.model, key.rank, key.salt)
        last = self.pending[-1] if self.pending else None
        while self.hashes >= MAX_PENDING and self.pending:
            lost = self.pending.popleft()
            self.hashes -= len(lost[4])
            self.dropped += max(len(lost[4]), 1)
        self.hashes += 1
        last = self.pending[-1] if self.pending else None
        if last is not None and last[:4] == (kind, key.model, key.rank, ns):
            last[4].append(key.chunk)
        else:
            self.pending.append((kind, key.model, key.rank, ns, [key.chunk]))

    def flush(self, server: str) -> int:
        """Publish what is pending as one batch; returns how many events it held."""
        if self.publisher is None or not self.pending:
            return 0
        events: list[Event] = []
        for kind, model, rank, ns, hashes in self.pending:
            if kind == "stored":
                events.append(ChunkStored(hashes, model, rank, ns, self.chunk_size))
            elif kind == "removed":
                events.append(ChunkRemoved(hashes, model, rank, ns))
            else:
                events.append(AllChunksCleared())
        self.pending.clear()
        self.hashes = 0
        self.publisher.publish(KVEventBatch(time.time(), server, events, self.dropped))
        self.dropped = 0
        return len(events)

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()

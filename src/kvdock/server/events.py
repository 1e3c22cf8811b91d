"""The server's L1 watcher: it counts evictions and, with ``--kv-events-port``, collects KV
events (:mod:`kvdock.protocol.events`) that :meth:`ChunkEvents.flush` publishes in batches."""

from __future__ import annotations

import time

from kvdock.protocol.events import ChunkRemoved, ChunkStored, Event, KVEventBatch
from kvdock.server.metrics import Metrics
from kvdock.storage.memory import L1Object
from kvdock.transport.events import EventPublisher

MAX_PENDING = 100_000  # events kept between two flushes; past it the oldest are dropped (counted)
FLUSH_S = 0.05  # how often pending events are published


class ChunkEvents:
    """L1Watcher of the server's L1 store. The event loop only (as the store).

    Consecutive chunks of one model, rank and salt go in one event (a store of a long prefix is
    one ChunkStored with all its hashes)."""

    def __init__(self, metrics: Metrics, chunk_size: int, publisher: EventPublisher | None = None) -> None:
        self.metrics = metrics
        self.chunk_size = chunk_size
        self.publisher = publisher
        self.pending: list[Event] = []
        self.dropped = 0

    def stored(self, obj: L1Object) -> None:
        if self.publisher is not None:
            k = obj.key
            last = self.pending[-1] if self.pending else None
            if isinstance(last, ChunkStored) and (last.model, last.rank, last.cache_salt) == (k.model, k.rank, k.salt):
                last.chunk_hashes.append(k.chunk)
            else:
                self._add(ChunkStored([k.chunk], k.model, k.rank, k.salt, self.chunk_size))

    def removed(self, obj: L1Object, evicted: bool) -> None:
        if evicted:
            self.metrics.evictions.inc()
        if self.publisher is not None:
            k = obj.key
            last = self.pending[-1] if self.pending else None
            if isinstance(last, ChunkRemoved) and (last.model, last.rank, last.cache_salt) == (k.model, k.rank, k.salt):
                last.chunk_hashes.append(k.chunk)
            else:
                self._add(ChunkRemoved([k.chunk], k.model, k.rank, k.salt))

    def _add(self, event: Event) -> None:
        if len(self.pending) >= MAX_PENDING:
            lost = self.pending.pop(0)
            self.dropped += len(getattr(lost, "chunk_hashes", ())) or 1
        self.pending.append(event)

    def flush(self, server: str) -> int:
        """Publish what is pending as one batch; returns how many events it held."""
        if self.publisher is None or not self.pending:
            return 0
        events, self.pending = self.pending, []
        self.publisher.publish(KVEventBatch(time.time(), server, events, self.dropped))
        self.dropped = 0
        return len(events)

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()

"""What every handler shares: the server's state, and the reply a handler returns."""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvdock.server.metrics import Metrics
from kvdock.server.registry import Registry
from kvdock.shm import PoolSegment
from kvdock.storage import StorageManager

Payload = list[memoryview]


@dataclass(frozen=True)
class Reply:
    """A reply message and the raw payload frames sent after it (private buffers, never slot
    memory: slots can be reused as soon as the handler returns)."""

    message: msgspec.Struct
    frames: Sequence[Any] = ()


Outcome = Reply | Awaitable[Reply]


@dataclass
class ServerState:
    """Owned by the event loop; ``copier`` threads copy inline payloads between frames and slots
    (slots they touch are reserved or pinned by a busy session meanwhile)."""

    chunk_size: int
    segment: PoolSegment
    shm_enabled: bool
    manager: StorageManager
    registry: Registry
    metrics: Metrics = field(default_factory=Metrics)
    copier: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(2, "kvdock-copy"))
    max_unsent_bytes: int = 1 << 30  # per client: inline reply bytes not yet read; past it, BUSY
    unsent: dict[bytes, int] = field(default_factory=dict)  # zmq identity -> reply bytes not yet sent

    @property
    def unsent_bytes(self) -> int:
        return sum(self.unsent.values())

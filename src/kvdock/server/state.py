"""What every handler shares: the server's state, and the reply a handler returns."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvdock.server.metrics import Metrics
from kvdock.server.registry import Registry
from kvdock.shm import PoolSegment
from kvdock.storage import StorageManager

Payload = list[memoryview]
FAULT_COPY_ENV = "KVDOCK_FAULT_COPY_DELAY_S"


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
    # fault injection for tests: each inline copy sleeps first (a copy can't be made slow on demand)
    fault_copy_delay_s: float = field(default_factory=lambda: float(os.environ.get(FAULT_COPY_ENV, "0") or 0))

    async def copy(self, fn: Callable[..., None], *args: object) -> None:
        """Run an inline copy ``fn(*args)`` on a copier thread (the caller holds the slots)."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self.copier, self._copy, fn, args)

    def _copy(self, fn: Callable[..., None], args: tuple[object, ...]) -> None:
        if self.fault_copy_delay_s:
            time.sleep(self.fault_copy_delay_s)
        fn(*args)

    @property
    def unsent_bytes(self) -> int:
        return sum(self.unsent.values())

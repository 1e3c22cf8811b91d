"""What every handler shares: the server's state, and the reply a handler returns."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from kvdock import faults
from kvdock.protocol.messages import ReplyBase
from kvdock.server.events import ChunkEvents
from kvdock.server.metrics import Metrics
from kvdock.server.pools import Tickets
from kvdock.server.registry import Registry
from kvdock.server.tenants import Tenants
from kvdock.shm.pool import Pool
from kvdock.storage import StorageManager
from kvdock.transport.door import PoolDoor

Payload = list[memoryview]
FAULT_COPY_ENV = faults.COPY_DELAY_ENV  # (the names black-box tests set: kvdock.faults)
FAULT_RETRIEVE_MISS_ENV = faults.RETRIEVE_MISS_ENV


@dataclass(frozen=True)
class Reply:
    """A reply message and the raw payload frames sent after it (private buffers, never slot
    memory: slots can be reused as soon as the handler returns). ``pooled``: the frames were
    taken from ``ServerState.reply_buffers`` and go back there once zmq has sent them."""

    message: ReplyBase  # the op's declared reply type (RequestBase[R]), or Error
    frames: Sequence[Any] = ()
    pooled: bool = False


class ReplyBuffers:
    """Inline reply buffers, kept for reuse once zmq has sent them: a fresh buffer per reply pays
    a page fault per 4 KiB, which halves inline retrieve throughput. At most ``max_bytes`` are
    kept, by exact size (a reused buffer is always overwritten whole). The event loop only."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._free: dict[int, list[bytearray]] = {}
        self.kept_bytes = 0

    def take(self, size: int) -> bytearray:
        free = self._free.get(size)
        if free:
            self.kept_bytes -= size
            return free.pop()
        return bytearray(size)

    def give(self, buf: bytearray) -> None:
        if self.kept_bytes + len(buf) > self.max_bytes:
            self._free.clear()  # keep the sizes in use now, not those of long ago
            self.kept_bytes = 0
        if len(buf) <= self.max_bytes:
            self._free.setdefault(len(buf), []).append(buf)
            self.kept_bytes += len(buf)


Outcome = Reply | Awaitable[Reply]


def fault_retrieve_miss() -> bool:
    """Whether the retrieve-miss fault is on (:func:`kvdock.faults.current`)."""
    return faults.current().retrieve_miss


@dataclass
class ServerState:
    """Owned by the event loop; ``copier`` threads copy inline payloads between frames and slots
    (slots they touch are reserved or pinned by a busy session meanwhile)."""

    chunk_size: int
    pool: Pool
    manager: StorageManager
    registry: Registry
    metrics: Metrics = field(default_factory=Metrics)
    events: ChunkEvents | None = None  # the L1 store's watcher (KV events when they are on)
    copier: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(2, "kvdock-copy"))
    local_url: str = ""  # the control plane's local UNIX socket, offered to shared-memory clients
    door: PoolDoor | None = None  # where tenants' clients get their pools (server.pools)
    tickets: Tickets = field(default_factory=Tickets)  # to the tenants' pools (server.pools)
    tenants: Tenants | None = None  # with a tenants file: every client is one tenant's (server.access)
    max_unsent_bytes: int = 1 << 30  # per client: inline reply bytes not yet read; past it, BUSY
    max_total_unsent_bytes: int = 4 << 30  # the same for all clients together (many sockets)
    unsent: dict[tuple[int, bytes], int] = field(default_factory=dict)  # Incoming.peer -> reply bytes not yet sent
    reply_buffers: ReplyBuffers = field(default_factory=lambda: ReplyBuffers(1 << 30))
    # fault injection for tests: each inline copy sleeps first (a copy can't be made slow on demand)
    fault_copy_delay_s: float = field(default_factory=lambda: faults.current().copy_delay_s)
    fault_copy_gate: str = field(default_factory=lambda: faults.current().copy_gate)  # ... and waits at a gate
    # ... and every retrieve finds nothing, as if evicted right after a lookup found it (an
    # engine's lookup and load cannot be split apart on demand)
    fault_retrieve_miss: bool = field(default_factory=fault_retrieve_miss)

    async def copy(self, fn: Callable[..., None], *args: object) -> None:
        """Run an inline copy ``fn(*args)`` on a copier thread (the caller holds the slots)."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self.copier, self._copy, fn, args)

    def _copy(self, fn: Callable[..., None], args: tuple[object, ...]) -> None:
        if self.fault_copy_delay_s:
            time.sleep(self.fault_copy_delay_s)
        faults.wait_at_gate(self.fault_copy_gate)
        fn(*args)

    @property
    def unsent_bytes(self) -> int:
        return sum(self.unsent.values())

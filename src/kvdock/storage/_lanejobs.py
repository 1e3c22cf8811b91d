"""The jobs of a TierLane's queue (storage.lane): a write-down, a batch of them, a queued call,
and the header block that the lanes of one object share."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvdock.keys import ObjectKey
from kvdock.layout import KVGeometry
from kvdock.storage import objfile
from kvdock.storage.memory import L1Object
from kvdock.storage.tier import Head

__all__ = ["SharedHeader", "_Batch", "_Call", "_Write"]


class SharedHeader:
    """An object's header block, computed once (it checksums the whole payload) by whichever
    lane's writer thread needs it first, while that lane pins the object."""

    def __init__(self, key: ObjectKey, geometry: KVGeometry, chunk_size: int, view: memoryview, head: Head) -> None:
        shape = list(geometry.chunk_shape(chunk_size))
        self._args = (key, geometry.dtype, shape, view, *head[:2], geometry.digest(chunk_size), head.overwrite)
        self._lock = threading.Lock()
        self._block: bytes | None = None

    def get(self) -> bytes:
        with self._lock:
            if self._block is None:
                self._block = objfile.encode_header(*self._args)
            return self._block


@dataclass(eq=False)
class _Write:
    obj: L1Object
    header: SharedHeader
    view: memoryview


@dataclass(eq=False)
class _Call:
    """A writer-thread call queued behind the writes before it (a deletion, a clear)."""

    what: str  # for logs; "delete" also counts in ``deletes``
    fn: Callable[[], Any]
    done: asyncio.Future[Any]
    default: Any  # the result when the tier is down or the call fails
    count: int = 1  # what it counts in ``deletes``: the keys a deletion removes
    keys: frozenset[ObjectKey] = frozenset()  # a deletion's keys


@dataclass(eq=False)
class _Batch:
    """Write-downs the writer runs in order in one call (see the module docstring: a busy event
    loop between two writes left the disk idle two thirds of the time)."""

    jobs: list[_Write]
    stop: threading.Event = field(default_factory=threading.Event)  # a deletion came: stop after this write
    done: int = 0  # writes finished (event loop side)

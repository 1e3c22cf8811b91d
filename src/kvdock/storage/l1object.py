"""L1's object record (:class:`L1Object`, its :class:`State`) and the :class:`L1Watcher` seam.

The record is plain data: :class:`kvdock.storage.memory.L1Store` owns every field's meaning and
changes them on the server's event loop only (see its module docstring for the invariants).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

from kvdock.keys import ObjectKey


class State(enum.Enum):
    RESERVED = 1
    READY = 2


@dataclass(eq=False, slots=True)
class L1Object:
    key: ObjectKey
    offset: int
    nbytes: int
    state: State = State.RESERVED
    pins: int = 0
    live: bool = True
    version: int = 0  # unique per stored version (see kvdock.storage.manager: the version chain)
    parent: int = 0  # the version of the previous chunk of its prefix when stored; 0 for the first
    epoch: int = 0  # the fleet's invalidations its server knew of when it became READY (storage.coherence)
    seen: int = 0  # an overwrite's reservation: the last other server's invalidation of its key applied meanwhile
    overwrite: int = 0  # an overwrite's version: its E2 (served while its floor is kept: storage.keeping); 0: plain
    entry: int = -1  # while READY: its directory entry (-1: none, or no room there)
    region: str | None = None  # the pool region its slot is in (a tenant's, or None: the shared rest)
    dirty: int = 0  # write-downs to lower tiers queued or in flight (storage.lane)
    seq: int = 0  # commit order (the newest dirty object is evicted first)
    depth: int = 0  # its chunk's index in its prompt, as far as L1 knows (0: a head)
    unit: int = 0  # a sharded store's chunk: the seq of its first shard's object (0: alone; dirty ones go together)
    uses: int = 0  # reads (unpins of a session's pin, fast reads) since it became READY
    holds: int = 0  # write-downs copying it now (storage.lane: L1Store.hold; not a session's pin)


class L1Watcher(Protocol):
    """Told when the set of readable keys changes (metrics, KV events). Called from inside the
    store's methods: it must not call back into the store."""

    def stored(self, obj: L1Object) -> None:
        """``obj`` became READY: a new key, or a new version of a key."""

    def removed(self, obj: L1Object, evicted: bool) -> None:
        """``obj``'s key has no READY object any more: evicted (LRU, for room) or deleted."""

    def cleared(self) -> None:
        """No key has a READY object any more (:meth:`L1Store.clear`; no ``removed`` calls)."""

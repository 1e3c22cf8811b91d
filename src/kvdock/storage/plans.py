"""The small records the storage manager answers with (storage.manager), and the version and
epoch values it stamps on objects."""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from kvdock.storage.memory import L1Object
from kvdock.storage.tier import Head

__all__ = ["OVERWRITING", "SUPERSEDED", "Chain", "Placement", "StorePlan", "new_version"]

SUPERSEDED = -1  # the epoch of a store reservation an invalidation came after: never committed
OVERWRITING = 1 << 200  # the epoch of an overwrite's reservation until its commit (above any position)


@dataclass(frozen=True)
class Placement:
    """An object stored under a key in tier ``tier`` (``"l1"``, or a lane's name), with its head."""

    tier: str
    head: Head


@dataclass(frozen=True)
class Chain:
    """The leading run of a key list held as one version chain (in L1, or in any tier), as it was
    when asked: its length and the version of its last object (0 for none), which the next chunk
    must chain to: the *tip* that names the whole run (a reader that finds the same version there
    has the same objects before it)."""

    count: int
    parent: int


@dataclass(frozen=True)
class StorePlan:
    """Outcome of a prepare-store, chunk by chunk: ``slots`` (chunk index, object) to fill;
    ``deduped`` already stored; ``in_flight`` being written by another client right now (neither
    stored nor reserved: the caller may retry); ``pool_full`` found no room."""

    slots: list[tuple[int, L1Object]]
    deduped: int
    in_flight: int
    pool_full: int


def new_version() -> int:
    """A version id for a newly stored object: random, so versions from other servers (sharing
    L3) or from before a restart never collide in practice; never 0 (the chain's start)."""
    return secrets.randbits(63) | 1

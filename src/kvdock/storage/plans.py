"""The small records the storage manager answers with (storage.manager), and the version and
epoch values it stamps on objects."""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import numpy as np

from kvdock.storage.memory import L1Object
from kvdock.storage.tier import Head

__all__ = [
    "DERIVED",
    "EDITED",
    "OVERWRITING",
    "SUPERSEDED",
    "Chain",
    "Placement",
    "StoreRun",
    "StorePlan",
    "depends_on_edit",
    "is_edited",
    "new_version",
    "random_bits",
    "write_limit",
]

SUPERSEDED = -1  # the epoch of a store reservation an invalidation came after: never committed
OVERWRITING = 1 << 200  # the epoch of an overwrite's reservation until its commit (above any position)
# The bit of a version id that marks an *edit*: bytes an overwrite committed, which the model would
# not compute for those tokens. Part of the id, so every tier's header and a restart keep it.
EDITED = 1 << 62
# The bit of a version id that marks a chunk chained (directly or not) onto an edit: its bytes were
# computed over edited KV. Not an edit itself (write_limit ignores it); an engine holding other
# bytes for the chunks before it must not load it after them (kvdock.integrations.vllm).
DERIVED = 1 << 61


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
    stored nor reserved: the caller may retry); ``pool_full`` found no room; ``diverged`` not
    written because they would extend an edited run the client did not compute over
    (:func:`write_limit`)."""

    slots: list[tuple[int, L1Object]]
    deduped: int
    in_flight: int
    pool_full: int
    diverged: int = 0


@dataclass(frozen=True)
class StoreRun:
    """The leading run of a plain store's keys that it would dedup (stored already, one chain):
    its length, the version of its last chunk (0 for none), and the versions of its chunks from
    its last EDITED one on (empty: no edit in it)."""

    count: int
    tip: int
    since_edit: tuple[int, ...] = ()

    @property
    def edited(self) -> bool:
        return bool(self.since_edit)


def write_limit(runs: list[StoreRun], over: list[int] | None, edited: bool = False) -> int | None:
    """The chunk index from which a plain store over shards' ``runs`` writes nothing (None: no
    limit). A store may extend a run holding an edit only with KV computed over that edit:
    ``over[s]``, the version of the last chunk the client loaded and computed over, must be a
    chunk of shard ``s``'s run at or after its last edit -- its tip, or an earlier chunk when the
    run was extended since by unedited chunks (the client's own earlier save of the same prompt,
    or another's: an edited run is extended only this way, so they too were computed over the
    edit). Otherwise the chunks past the run were computed over other bytes for the same tokens (a
    prompt computed before an overwrite, saved after it): chaining them to the edit would make a
    prefix of mixed versions. Of several shards, one that diverges stops them all at the shortest
    run, so no chunk is written in some shards only.

    An ``edited`` store (a user's tensor: its bytes may differ from what is stored for the same
    tokens, edited or not) extends a stored run only over exactly its tip (``over[s]`` is the
    run's last version, which the client read back and found byte-identical to its own first
    tokens: kvdock.sdk._edits): otherwise its later chunks would hang off bytes they were not
    made with (review of W-EDIT: a user's edit of P+Q over an engine's plain P kept the engine's
    P and chained the user's Q onto it)."""
    if edited and any(r.count and (over is None or over[s] != r.tip) for s, r in enumerate(runs)):
        return min(r.count for r in runs)
    if any(r.edited and (over is None or over[s] not in r.since_edit) for s, r in enumerate(runs)):
        return min(r.count for r in runs)
    return None


def new_version(edited: bool = False, parent: int = 0, bits: int | None = None) -> int:
    """A version id for a newly stored object: random, so versions from other servers (sharing
    L3) or from before a restart never collide in practice; never 0 (the chain's start); below
    2**63, with the :data:`EDITED` bit set exactly when ``edited`` (an overwrite's object), and
    :data:`DERIVED` when it is not and chains onto ``parent``, an edit or derived from one.
    ``bits``: its random part, one of :func:`random_bits` (default: drawn now)."""
    derived = not edited and bool(parent & (EDITED | DERIVED))
    random = secrets.randbits(61) if bits is None else bits & _RANDOM
    return random | 1 | (EDITED if edited else 0) | (DERIVED if derived else 0)


_RANDOM = (1 << 61) - 1  # the random bits of a version id (below DERIVED and EDITED)


def random_bits(n: int) -> list[int]:
    """``n`` random parts of :func:`new_version`, from one read of the OS's randomness (as
    ``secrets.randbits``, without a read for each of a store's chunks)."""
    words = np.frombuffer(secrets.token_bytes(8 * n), dtype="<u8") & np.uint64(_RANDOM)
    return list(words.tolist())  # (Python ints)


def depends_on_edit(version: int) -> bool:
    """Whether ``version`` is an edit's or chains onto one (:data:`EDITED`, :data:`DERIVED`)."""
    return bool(version & (EDITED | DERIVED))


def is_edited(version: int) -> bool:
    """Whether ``version`` is an edit's (see :data:`EDITED`)."""
    return bool(version & EDITED)

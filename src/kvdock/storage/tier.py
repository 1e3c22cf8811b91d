"""The seam between the storage manager and a lower tier (L2 disk, L3 Redis, ...).

A tier stores whole objects in the self-describing form of :mod:`kvdock.storage.objfile` and
knows nothing of L1, sessions or versions: the manager decides what to write, read and delete,
and in which order (see :class:`kvdock.storage.lane.TierLane`, which owns a tier's threads).

Threading contract, for every implementation:

* methods marked *[worker]* run on the tier's own threads, never on the event loop: one writer
  thread (``write_from``, ``delete``, ``clear``: applied in the order they were queued) and one
  reader thread (``read_into``, ``count_present``, ``probe``), so they may run concurrently with
  each other; they may block on I/O;
* methods marked *[any]* are cheap, never block on I/O, and may be called from any thread.

The server constructs its tiers directly (``DiskTier`` for L2, ``RedisTier`` for L3:
:mod:`kvdock.server.build`); the manager and the lanes know them only through this seam.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from kvdock.keys import ObjectKey
from kvdock.layout import KVGeometry

if TYPE_CHECKING:
    from kvdock.storage.stream import Fence


class Head(NamedTuple):
    """An object's place in its version chain: its own version and its predecessor's; an
    overwrite's version also names that overwrite (``overwrite``: its E2, from the object's
    header, as read by ``read_into``; "" for a plain store's, and in indexes)."""

    version: int
    parent: int
    overwrite: str = ""


@dataclass
class TierCounters:
    """Plain counters per tier, exported by the server's /metrics and /status."""

    hits: int = 0  # objects promoted into L1 from this tier
    bytes_read: int = 0
    read_seconds: float = 0.0
    writes: int = 0
    bytes_written: int = 0
    write_seconds: float = 0.0
    write_errors: int = 0
    writes_skipped: int = 0  # tier down, no room, or the object left L1 before its turn
    corrupted: int = 0  # torn or failing its checksum: deleted, never returned
    deletes: int = 0  # older versions removed for an overwrite
    fenced: int = 0  # write-downs refused as stale (another server's overwrite replaced them)


class StorageTier(abc.ABC):
    """One lower tier. ``name`` is how /status, /metrics and logs call it (``"l2"``, ``"l3"``)."""

    name: str

    @abc.abstractmethod
    def up(self) -> bool:
        """[any] Whether the tier is reachable now (a down tier is skipped, never waited for)."""

    indexed: bool = False  # knows() answers from a local index without I/O

    def knows(self, key: ObjectKey) -> Head | None:
        """[any] The head of ``key``'s object from the local index, None if absent. Only for
        ``indexed`` tiers; the others answer through :meth:`heads`."""
        raise NotImplementedError

    @abc.abstractmethod
    def heads(self, keys: list[ObjectKey]) -> list[Head]:
        """[worker] The heads of the leading ``keys`` the tier holds (shorter at the first absent)."""

    @abc.abstractmethod
    def read_into(self, key: ObjectKey, out: memoryview, geometry: KVGeometry, chunk_size: int) -> Head | None:
        """[worker] Copy ``key``'s payload, one canonical chunk of ``geometry`` (exactly
        ``geometry.chunk_nbytes(chunk_size)`` bytes, the size of ``out``), into ``out``, verified
        against its header (dtype and chunk shape) and checksum; returns the header's head, None if absent. A torn,
        foreign or corrupted object is removed from the tier (counted in
        ``counters.corrupted``) and reported as absent; errors reaching the tier itself raise
        (the lane marks the tier down)."""

    @abc.abstractmethod
    def write_from(self, key: ObjectKey, header: bytes, payload: memoryview, fence: Fence | None = None) -> int:
        """[worker, writer] Store ``header + payload`` as ``key``'s object atomically (readers see
        the old object or the new one, never a mix), making room within the budget by evicting
        least recently used objects. Returns the bytes it occupies. Raises on failure (the
        object is then absent or unchanged). ``fence``: a tier shared by servers refuses
        (WriteFenced) a write that an overwrite elsewhere made stale
        (:mod:`kvdock.storage.coherence`); a local tier ignores it."""

    stages: bool = False  # write_from may only stage a write: the lane calls settle() after each batch

    def settle(self) -> dict[ObjectKey, Exception]:
        """[worker, writer] Make readable the writes :meth:`write_from` only staged since the last
        call (a shared tier's plain versions: :mod:`kvdock.storage._redisstage`); those that did not
        land, with why (WriteFenced: stale, the object's server drops it; WriteLate: skipped).
        The lane calls it after each batch. A tier that stages nothing: none."""
        return {}

    @abc.abstractmethod
    def delete(self, key: ObjectKey) -> None:
        """[worker, writer] Remove ``key``'s object durably: when this returns, the object is gone
        and will not come back after a crash of this process. Absent keys are fine; failure to
        reach the tier raises."""

    def delete_keys(self, keys: list[ObjectKey]) -> int:
        """[worker, writer] An overwrite's deletions of ``keys`` (each as :meth:`delete`); returns
        the epoch its new versions get (a shared tier's invalidation, :mod:`kvdock.storage.coherence`;
        0 here)."""
        for key in keys:
            self.delete(key)
        return 0

    @abc.abstractmethod
    def clear(self) -> int:
        """[worker, writer] Remove every object this tier can clear (a shared tier may refuse:
        return 0). Returns how many."""

    def probe_due(self) -> bool:
        """[any] Whether a down tier should be probed now (its backoff has passed)."""
        return False

    def floored(self, keys: list[ObjectKey]) -> set[ObjectKey]:
        """[worker, reader] Keys a shared tier knows are being overwritten but holds no value of
        (kvdock.storage.redis); a local tier: none."""
        return set()

    def keep(self, items: list[tuple[ObjectKey, str, bytes]]) -> list[int]:
        """[worker] A shared tier's KEEP of overwrites' floors, one answer per item (kvdock.storage.keeping);
        a local tier: none."""
        return []

    def shards_kept(self, items: list[tuple[ObjectKey, str]]) -> list[int]:
        """[worker] A shared tier's check that each (key, an overwrite's E2) is still that
        overwrite's (kvdock.storage.keeping: 1, or -1); a local tier: all 1."""
        return [1] * len(items)

    def unkeep(self, items: list[tuple[ObjectKey, str]]) -> list[int]:
        """[worker] A shared tier's UNKEEP of an overwrite's version of a chunk's shards, (key, its
        overwrite's E2) each (kvdock.storage.keeping); a local tier: none."""
        return []

    def probe_soon(self) -> None:
        """[any] Make :meth:`probe_due` true now (the tier was seen answering again)."""
        return None

    def probe(self) -> None:
        """[worker, reader] Try to reach a down tier again (``up()`` turns True on success)."""
        return None

    def failed(self, err: BaseException) -> None:
        """[any] Note that an operation failed for lack of the tier (marks a remote tier down)."""
        return None

    def close(self) -> None:
        """Release files, locks and connections (after the lane's threads stopped)."""
        return None

    @abc.abstractmethod
    def status(self) -> dict[str, Any]:
        """[any] What /status shows of the tier (``up``, usage, ...), no secrets."""

    def check_integrity(self) -> None:
        """[any, quiescent] Assert the tier's own index invariants."""
        return None

"""Eviction policies: which evictable object of a set goes first (the seam of every tier's
eviction: L1's buckets, L2's index, L3's budget of this server's writes).

A policy orders *keys* (anything hashable); the tier keeps the objects. Its contract:

* :meth:`Policy.insert` a key that became evictable: a new object (``new=True``), or one that
  comes back after a use (an unpin, a read) that the policy counts as a hit;
* :meth:`Policy.access` a key that stays evictable but was used (a read without a pin);
* :meth:`Policy.remove` a key that stops being evictable (pinned, replaced, deleted);
* :meth:`Policy.victim` the key to evict next (still in the policy) and :meth:`Policy.evict` it
  (removed; a policy with history remembers it as a ghost);
* :meth:`Policy.order` every key, first to go first (tests and integrity checks only: O(n)).

Every operation is O(1) amortized (``victim`` of S3-FIFO moves keys between its queues, each at
most once per pass of a key), never a pass over all keys. ``depth`` (the chunk's index in its
prompt, 0 for a prompt's head) lets a prefix-aware policy keep heads over tails: a chunk is worth
something only while the chunks before it are cached.

Policies by name: :data:`POLICIES` (``--eviction-policy``).
"""

from __future__ import annotations

import abc
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Generic, TypeVar

from kvdock.errors import ConfigError

K = TypeVar("K", bound=Hashable)


class Policy(abc.ABC, Generic[K]):
    """One set of evictable keys and the order they go in (not thread-safe)."""

    name: str = ""

    @abc.abstractmethod
    def __len__(self) -> int: ...

    @abc.abstractmethod
    def __contains__(self, key: object) -> bool: ...

    @abc.abstractmethod
    def insert(self, key: K, new: bool = True, depth: int = 0) -> None:
        """``key`` (not in the policy) became evictable: a new object, or one used since."""

    @abc.abstractmethod
    def access(self, key: K) -> None:
        """``key`` (in the policy) was used and stays evictable."""

    @abc.abstractmethod
    def remove(self, key: K) -> None:
        """``key`` (in the policy) stops being evictable; no history is kept of it."""

    @abc.abstractmethod
    def victim(self) -> K | None:
        """The key to evict next (None: empty). It stays in the policy until :meth:`evict`."""

    def evict(self, key: K) -> None:
        """``key`` was evicted (usually the victim)."""
        self.remove(key)

    @abc.abstractmethod
    def order(self) -> list[K]:
        """Every key, in the order they would be evicted (O(n): tests and checks only)."""

    def first(self, may: Callable[[K], bool]) -> K | None:
        """The first key in eviction order that ``may`` lets go (a tenant's quota: storage.shares);
        the victim itself when ``may`` takes it, else a walk in :meth:`order`."""
        found = self.victim()
        if found is None or may(found):
            return found
        return next((k for k in self.order() if may(k)), None)

    def check(self) -> None:
        """Assert the policy's own invariants."""
        assert len(self.order()) == len(self), f"{self.name}: order and size disagree"


class LRU(Policy[K]):
    """Least recently used first; an insert or access makes a key most recently used. The tails of
    a prompt, inserted after its head, go after it (plain LRU, as kvdock always had)."""

    name = "lru"

    def __init__(self) -> None:
        self._keys: OrderedDict[K, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __iter__(self) -> Iterator[K]:
        return iter(self._keys)

    def insert(self, key: K, new: bool = True, depth: int = 0) -> None:
        assert key not in self._keys, "inserted twice"
        self._keys[key] = None

    def access(self, key: K) -> None:
        self._keys.move_to_end(key)

    def remove(self, key: K) -> None:
        del self._keys[key]

    def victim(self) -> K | None:
        return next(iter(self._keys), None)

    def first(self, may: Callable[[K], bool]) -> K | None:
        return next((k for k in self._keys if may(k)), None)

    def order(self) -> list[K]:
        return list(self._keys)


POLICIES: dict[str, Callable[[], Policy[Hashable]]] = {"lru": LRU}
DEFAULT_POLICY = "lru"


def make_policy(name: str) -> Policy[Hashable]:
    """A fresh policy of ``name`` (ConfigError naming the known ones otherwise)."""
    try:
        return POLICIES[name]()
    except KeyError:
        raise ConfigError(f"unknown eviction policy {name!r}: known are {', '.join(sorted(POLICIES))}") from None

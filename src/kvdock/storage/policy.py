"""Eviction policies: which evictable object of a set goes first (the seam of every tier's
eviction: L1's buckets, L2's index, L3's budget of this server's writes).

A policy orders *keys* (anything hashable); the tier keeps the objects. Its contract:

* :meth:`Policy.insert` a key that became evictable: a new object (``new=True``), or one that
  comes back after a use (an unpin, a read) that the policy counts as a hit; ``before``: the key
  of the chunk before it in its prompt, when the policy holds it;
* :meth:`Policy.access` a key that stays evictable but was used (a read without a pin);
* :meth:`Policy.demote` a key whose prompt lost the chunk before it (an *orphan*: useless until
  that chunk comes back) goes next;
* :meth:`Policy.remove` a key that stops being evictable (pinned, replaced, deleted);
* :meth:`Policy.victim` the key to evict next (still in the policy) and :meth:`Policy.evict` it
  (removed; a policy with history remembers it as a ghost);
* :meth:`Policy.order` every key, first to go first (tests and integrity checks only: O(n)).

Every operation is O(1) amortized (``victim`` of S3-FIFO moves keys between its queues, each
move paid by an earlier hit), never a pass over all keys.

**Prefix-aware** policies (all but ``lru``) use ``before`` and :meth:`Policy.demote`: a chunk is
worth something only while the chunk before it is cached (every hit on a chunk is a hit on its
predecessor), so a chunk is never placed to stay longer than its predecessor (it goes in just
ahead of it in eviction order) and an orphan goes first. A request touches its chunks head
first; plain LRU therefore evicts a prompt's head before its tails, and the tails it keeps are
useless.

Policies by name: :data:`POLICIES` (``--eviction-policy``).
"""

from __future__ import annotations

import abc
import itertools
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
    def insert(self, key: K, new: bool = True, before: K | None = None) -> None:
        """``key`` (not in the policy) became evictable: a new object, or one used since."""

    @abc.abstractmethod
    def access(self, key: K, before: K | None = None) -> None:
        """``key`` (in the policy) was used and stays evictable."""

    def demote(self, key: K) -> None:
        """``key`` (in the policy) is an orphan: evict it next (a prefix-aware policy)."""
        return None

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
        the victim itself when ``may`` takes it, else the first of :meth:`walk`."""
        found = self.victim()
        if found is None or may(found):
            return found
        return next((k for k in self.walk() if may(k)), None)

    def walk(self) -> Iterator[K]:
        """Every key, lazily, in eviction order or close to it (what :meth:`first` walks: it stops
        at the first key it may take, never building :meth:`order`)."""
        return iter(self.order())

    def check(self) -> None:
        """Assert the policy's own invariants."""
        assert len(self.order()) == len(self), f"{self.name}: order and size disagree"


class Queue(Generic[K]):
    """A doubly linked queue of keys: O(1) push at the back, insert before a key, move, remove."""

    def __init__(self) -> None:
        self._next: dict[K | None, K | None] = {None: None}  # None: the sentinel (front and back)
        self._prev: dict[K | None, K | None] = {None: None}

    def __len__(self) -> int:
        return len(self._next) - 1

    def __contains__(self, key: object) -> bool:
        return key is not None and key in self._next

    def __iter__(self) -> Iterator[K]:
        key = self._next[None]
        while key is not None:
            yield key
            key = self._next[key]

    def first(self) -> K | None:
        return self._next[None]

    def _link(self, key: K, nxt: K | None) -> None:
        prev = self._prev[nxt]
        self._next[prev], self._prev[key], self._next[key], self._prev[nxt] = key, prev, nxt, key

    def push(self, key: K, before: K | None = None) -> None:
        """Add ``key`` at the back (goes last), or just ahead of ``before`` if that is here."""
        assert key not in self._next, "pushed twice"
        self._link(key, before if before is not None and before in self._next else None)

    def push_front(self, key: K) -> None:
        self._link(key, self._next[None])

    def remove(self, key: K) -> None:
        prev, nxt = self._prev.pop(key), self._next.pop(key)
        self._next[prev], self._prev[nxt] = nxt, prev


class LRU(Policy[K]):
    """Least recently used first; an insert or access makes a key most recently used. Plain LRU,
    as kvdock always had: a prompt's head, touched before its tails, goes before them."""

    name = "lru"

    def __init__(self) -> None:
        self._keys: OrderedDict[K, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def insert(self, key: K, new: bool = True, before: K | None = None) -> None:
        assert key not in self._keys, "inserted twice"
        self._keys[key] = None

    def access(self, key: K, before: K | None = None) -> None:
        self._keys.move_to_end(key)

    def remove(self, key: K) -> None:
        del self._keys[key]

    def victim(self) -> K | None:
        return next(iter(self._keys), None)

    def first(self, may: Callable[[K], bool]) -> K | None:
        return next((k for k in self._keys if may(k)), None)

    def order(self) -> list[K]:
        return list(self._keys)


class PrefixLRU(Policy[K]):
    """LRU, prefix-aware: a use makes a key most recently used, but never more recent than the
    chunk before it (it goes just ahead of it), and an orphan goes first."""

    name = "prefix-lru"

    def __init__(self) -> None:
        self._q: Queue[K] = Queue()

    def __len__(self) -> int:
        return len(self._q)

    def __contains__(self, key: object) -> bool:
        return key in self._q

    def insert(self, key: K, new: bool = True, before: K | None = None) -> None:
        self._q.push(key, before)

    def access(self, key: K, before: K | None = None) -> None:
        self._q.remove(key)
        self._q.push(key, before)

    def demote(self, key: K) -> None:
        self._q.remove(key)
        self._q.push_front(key)

    def remove(self, key: K) -> None:
        self._q.remove(key)

    def victim(self) -> K | None:
        return self._q.first()

    def order(self) -> list[K]:
        return list(self._q)

    def walk(self) -> Iterator[K]:
        return iter(self._q)


class S3FIFO(Policy[K]):
    """S3-FIFO (Yang et al., SOSP'23), prefix-aware. New keys enter a small FIFO (10 % of the
    keys); one read there by the time it reaches the front moves a key to the main FIFO, else it
    is evicted and remembered in a ghost FIFO (as many keys as are held), from which a key that
    comes back goes to main directly. Main is a FIFO with reinsertion: a key read since it was
    last looked at (a frequency of up to 3, spent one per pass) goes to the back again. A key that
    comes back after a pin (a read) goes to main. So a scan of one-off prompts passes through the
    small FIFO without flushing main. Prefix-aware: a key placed in a queue goes just ahead of the
    chunk before it when that is in the same queue; an orphan goes to a third FIFO, evicted before
    both (a read there is not remembered: it stays useless until its predecessor is back)."""

    name = "s3fifo"
    SMALL = 0.1  # the small FIFO's share of the keys
    GHOST = 2.0  # the ghost's size, in keys held (2: measured on the traces, docs/benchmarks.md)

    def __init__(self) -> None:
        self._small: Queue[K] = Queue()
        self._main: Queue[K] = Queue()
        self._orphans: Queue[K] = Queue()
        self._freq: dict[K, int] = {}
        self._before: dict[K, K | None] = {}  # the chunk before each key (as last told)
        self._ghost: OrderedDict[K, None] = OrderedDict()
        self._peak = 0  # the most keys held at once (the ghost never outgrows GHOST times it)

    def __len__(self) -> int:
        return len(self._freq)

    def __contains__(self, key: object) -> bool:
        return key in self._freq

    def _queue(self, key: K) -> Queue[K]:
        if key in self._small:
            return self._small
        return self._orphans if key in self._orphans else self._main

    def insert(self, key: K, new: bool = True, before: K | None = None) -> None:
        assert key not in self._freq, "inserted twice"
        self._before[key] = before
        if len(self._freq) >= self._peak:
            self._peak = len(self._freq) + 1
        if not new:
            self._freq[key] = 1
            self._main.push(key, before)
        elif self._ghost.pop(key, 0) is None:
            self._freq[key] = 0
            self._main.push(key, before)
        else:
            self._freq[key] = 0
            self._small.push(key, before)

    def access(self, key: K, before: K | None = None) -> None:
        self._before[key] = before
        self._freq[key] = min(3, self._freq[key] + 1)

    def demote(self, key: K) -> None:
        self._queue(key).remove(key)
        self._orphans.push(key)
        self._freq[key] = 0

    def remove(self, key: K) -> None:
        self._queue(key).remove(key)
        del self._freq[key], self._before[key]

    def evict(self, key: K) -> None:
        if key in self._small:
            ghost = self._ghost
            ghost[key] = None
            bound = max(int(self.GHOST * len(self._freq)), 16)
            while len(ghost) > bound:
                ghost.popitem(last=False)
        self.remove(key)

    def victim(self) -> K | None:
        if len(self._orphans):
            return self._orphans.first()
        while self._freq:
            small = self._small.first()
            if small is not None and (len(self._small) > self.SMALL * len(self._freq) or not len(self._main)):
                if not self._freq[small]:
                    return small
                self._small.remove(small)  # read while in the small FIFO: to main
                self._freq[small] = 0
                self._main.push(small, self._before[small])
                continue
            key = self._main.first()
            assert key is not None
            if not self._freq[key]:
                return key
            self._freq[key] -= 1  # read since the last pass: once more round
            self._main.remove(key)
            self._main.push(key, self._before[key])
        return None

    def walk(self) -> Iterator[K]:
        """Orphans, then the small FIFO, then main, each front first (the passes that would
        reinsert keys read meanwhile are not simulated: see :meth:`order`)."""
        return itertools.chain(self._orphans, self._small, self._main)

    def order(self) -> list[K]:
        """The keys as the next evictions would take them if nothing were read meanwhile
        (simulated on a copy: O(n), tests and checks only)."""
        copy = S3FIFO[K]()
        for key in self._orphans:
            copy._orphans.push(key)
        for key in self._small:
            copy._small.push(key)
        for key in self._main:
            copy._main.push(key)
        copy._freq, copy._before = dict(self._freq), dict(self._before)
        out: list[K] = []
        while (gone := copy.victim()) is not None:
            out.append(gone)
            copy.remove(gone)
        return out

    def check(self) -> None:
        queues = (set(self._small), set(self._main), set(self._orphans))
        assert sum(len(q) for q in queues) == len(self._freq) == len(self._before), "s3fifo: sizes drifted"
        assert set.union(*queues) == set(self._freq), "s3fifo: queues and frequencies disagree"
        assert all(0 <= f <= 3 for f in self._freq.values()), "s3fifo: a frequency out of range"
        assert len(self._ghost) <= max(int(self.GHOST * self._peak), 16), "s3fifo: the ghost outgrew its bound"


POLICIES: dict[str, Callable[[], Policy[Hashable]]] = {"lru": LRU, "prefix-lru": PrefixLRU, "s3fifo": S3FIFO}
DEFAULT_POLICY = "lru"  # an L1Store or tier made directly; the server's --eviction-policy defaults to s3fifo


def make_policy(name: str) -> Policy[Hashable]:
    """A fresh policy of ``name`` (ConfigError naming the known ones otherwise)."""
    try:
        return POLICIES[name]()
    except KeyError:
        raise ConfigError(f"unknown eviction policy {name!r}: known are {', '.join(sorted(POLICIES))}") from None

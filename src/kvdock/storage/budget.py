"""One tier's byte budget: its objects' sizes and owners (tenants' quotas, :mod:`kvdock.storage.shares`),
the order they go in (an eviction policy, :mod:`kvdock.storage.policy`), and which to evict so
that an owner's new object fits. The one quota-aware eviction of the tiers that evict by bytes:
L2's files (:class:`kvdock.storage.disk.DiskTier`) and this server's writes to L3
(:class:`kvdock.storage.redis.RedisTier`, ``--redis-max-bytes``).

The rule (:meth:`Budget.next_victim`), for ``nbytes`` more of ``owner``:

1. while the owner would be over its quota, evict its own objects, first in policy order;
2. while the tier would be over its capacity, evict the first object in policy order that
   ``owner`` may evict (its own, or of owners without a quota: a quota is a share nobody else
   can take);
3. what can never fit (more than the capacity or the owner's whole quota, or nothing left that
   may go) is :class:`~kvdock.errors.NoRoom`.

Prefix-aware, as L1 is (:mod:`kvdock.storage.prefixes`): each object comes with its ``version`` and
``parent`` (the version of the chunk before it in its prompt, 0 for a head; an object's header).
The policy is told the key of the object of version ``parent`` when the budget holds it (a tail
goes just ahead of its head), and an object whose predecessor is not held, or leaves, is an
*orphan*: :meth:`Policy.demote`, evicted first. So a tier never evicts a head while keeping a tail
that hangs from it (unreachable bytes). Version 0 (objects before version chains) has no place.

Not thread-safe: the tier's own lock guards it. Keys are whatever the tier names objects by.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from typing import Generic, NamedTuple, TypeVar, cast

from kvdock.errors import NoRoom
from kvdock.storage.policy import LRU, Policy
from kvdock.storage.shares import Owner, Shares

K = TypeVar("K", bound=Hashable)


class Charge(NamedTuple):
    nbytes: int
    owner: Owner


class Budget(Generic[K]):
    """The objects of one tier by key: sizes, owners, order (see the module docstring)."""

    def __init__(self, shares: Shares | None = None, policy: Policy[Hashable] | None = None, tier: str = "") -> None:
        self.shares = shares
        self.tier = tier  # for messages: "L2", "L3"
        self.policy = cast(Policy[K], policy if policy is not None else LRU())
        self._charges: dict[K, Charge] = {}
        self.used = 0
        self._heads: dict[K, tuple[int, int]] = {}  # key -> (version, parent) of a chained object
        self._versions: dict[int, K] = {}  # version -> the key holding it
        self._children: dict[int, set[K]] = {}  # parent version -> keys of the objects after it

    def __len__(self) -> int:
        return len(self._charges)

    def __contains__(self, key: object) -> bool:
        return key in self._charges

    def __iter__(self) -> Iterator[K]:
        return iter(self._charges)

    def get(self, key: K) -> Charge | None:
        return self._charges.get(key)

    def add(self, key: K, nbytes: int, owner: Owner, charge: bool = True, version: int = 0, parent: int = 0) -> None:
        """``key`` (absent) holds ``nbytes`` of ``owner`` now, last in eviction order but never
        after the chunk before it (``version``, ``parent``: see the module docstring; an orphan
        goes first). ``charge``: charge the owner's share here (False: the tier charged it
        already, for a write in flight)."""
        assert key not in self._charges, "added twice"
        self._charges[key] = Charge(nbytes, owner)
        self.used += nbytes
        if charge and self.shares is not None:
            self.shares.charge(owner, nbytes)
        before = self._versions.get(parent) if parent else None
        self.policy.insert(key, before=before)
        if version or parent:
            self._heads[key] = (version, parent)
            if version:
                self._versions[version] = key
            if parent:
                self._children.setdefault(parent, set()).add(key)
                if before is None:
                    self.policy.demote(key)  # its predecessor is not here: useless until it comes back

    def remove(self, key: K, evicted: bool = False) -> Charge | None:
        """Forget ``key`` (its share released); its charge, None if absent. ``evicted``: for room
        (a policy with history remembers it)."""
        found = self._charges.pop(key, None)
        if found is None:
            return None
        self.used -= found.nbytes
        if self.shares is not None:
            self.shares.release(found.owner, found.nbytes)
        if evicted:
            self.policy.evict(key)
        else:
            self.policy.remove(key)
        version, parent = self._heads.pop(key, (0, 0))
        if parent:
            siblings = self._children[parent]
            siblings.discard(key)
            if not siblings:
                del self._children[parent]
        if version and self._versions.get(version) == key:
            del self._versions[version]
            for orphan in self._children.get(version, ()):
                self.policy.demote(orphan)  # the chunk they hang from is gone: they go first
        return found

    def _before(self, key: K) -> K | None:
        parent = self._heads.get(key, (0, 0))[1]
        return self._versions.get(parent) if parent else None

    def touch(self, key: K) -> None:
        """``key`` was read (if it is here)."""
        if key in self._charges:
            self.policy.access(key, before=self._before(key))

    def next_victim(
        self, nbytes: int, owner: Owner, capacity: int | None, pending: int = 0, replacing: K | None = None
    ) -> K | None:
        """The key to evict next so that ``nbytes`` more of ``owner`` fit (see the module
        docstring); None when they fit now. ``capacity`` None: no budget, only quotas; ``pending``:
        bytes promised to writes in flight; ``replacing``: the key the new object replaces (its
        bytes are freed by the write itself, and it is never a victim). NoRoom if they never fit."""
        shares = self.shares
        if capacity is not None and nbytes > capacity:
            raise NoRoom(f"{nbytes} bytes do not fit in the {self.tier} budget of {capacity}")
        if shares is not None and shares.too_big(owner, nbytes):
            raise NoRoom(f"{nbytes} bytes do not fit in the {self.tier} quota of tenant {owner!r}")
        old = self._charges.get(replacing) if replacing is not None else None
        freed = old.nbytes if old is not None else 0
        if shares is not None and shares.over(owner, nbytes - (freed if old is not None and old.owner == owner else 0)):
            victim = self.policy.first(lambda k: k != replacing and self._charges[k].owner == owner)
            if victim is None:
                raise NoRoom(f"the {self.tier} quota of tenant {owner!r} is held by objects in use")
            return victim
        if capacity is not None and self.used - freed + pending + nbytes > capacity:
            victim = self.policy.first(
                lambda k: k != replacing and (shares is None or shares.may_evict(self._charges[k].owner, owner))
            )
            if victim is None:
                raise NoRoom(f"the {self.tier} budget of {capacity} is held by tenants' shares (or objects in use)")
            return victim
        return None

    def check(self, shares: bool = True) -> None:
        """Assert: bytes used add up, the policy orders exactly these keys, and (``shares``) the
        owners' charges are what they hold."""
        assert self.used == sum(c.nbytes for c in self._charges.values()), "budget bytes drifted"
        self.policy.check()
        assert set(self.policy.order()) == set(self._charges), "the policy orders other keys than the budget holds"
        assert self._heads.keys() <= self._charges.keys(), "a chained key the budget does not hold"
        assert all(self._heads[k][0] == v for v, k in self._versions.items()), "a version indexed under another key"
        kids = {k for c in self._children.values() for k in c}
        assert kids == {k for k, (_, p) in self._heads.items() if p}, "the successors index drifted"
        if shares and self.shares is not None:
            self.shares.check((c.owner, c.nbytes) for c in self._charges.values())

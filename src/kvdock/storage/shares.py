"""Per-tenant byte shares of one tier: whose each object is, and how many bytes each owner holds.

Every object has an owner (a tenant, from the object's ``cache_salt``; None: nobody's), and each
tier keeps each owner within its quota. L1 does it by place: a tenant with a quota has a region
of the pool of its own, exactly its quota (shm.slots.Partitions), and everyone else shares the
rest (L1 uses these shares only for :meth:`Shares.owner`; a region counts its own bytes). L2 and
L3 charge every object to its owner here and do it by eviction:

- before it makes room for an owner's object, the tier evicts that owner's own least recently
  used objects while the owner would be over its quota (a store that cannot get under it is
  refused);
- when the tier as a whole is full, it evicts only objects of owners without a quota (the
  shared remainder) or of the owner itself, and refuses the write if that is not enough: a quota
  is a share that nobody else can take.

The quotas must add up to at most the tier's capacity (checked at start, :func:`check_fits`). Not
thread-safe: the tier's own lock (or thread) guards it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from kvdock.errors import ConfigError
from kvdock.keys import ObjectKey

Owner = str | None
MAX_CACHED_SALTS = 1 << 16


class Shares:
    """``owner_of(salt)`` names a salt's tenant (None: nobody's); ``quotas``: tenant -> bytes (a
    tenant not in it has no quota)."""

    def __init__(self, owner_of: Callable[[str], Owner], quotas: Mapping[str, int]) -> None:
        self._owner_of = owner_of
        self.quotas = {t: q for t, q in quotas.items() if q > 0}
        self.used: dict[Owner, int] = {}
        self._cache: dict[str, Owner] = {}

    def owner(self, key: ObjectKey) -> Owner:
        owner = self._cache.get(key.salt, "")  # ("" is no tenant's name: tenants.NAME_RE)
        if owner == "":
            if len(self._cache) >= MAX_CACHED_SALTS:
                self._cache.clear()
            owner = self._cache[key.salt] = self._owner_of(key.salt)
        return owner

    def charge(self, owner: Owner, nbytes: int) -> None:
        self.used[owner] = self.used.get(owner, 0) + nbytes

    def release(self, owner: Owner, nbytes: int) -> None:
        left = self.used.get(owner, 0) - nbytes
        assert left >= 0, f"share of {owner!r} released below zero"
        if left:
            self.used[owner] = left
        else:
            self.used.pop(owner, None)

    def over(self, owner: Owner, nbytes: int) -> int:
        """How many bytes ``owner`` would be over its quota with ``nbytes`` more (0: within it,
        or no quota)."""
        quota = self.quotas.get(owner) if owner is not None else None
        if quota is None:
            return 0
        return max(0, self.used.get(owner, 0) + nbytes - quota)

    def too_big(self, owner: Owner, nbytes: int) -> bool:
        """Whether ``nbytes`` exceed ``owner``'s whole quota (no eviction can make them fit)."""
        quota = self.quotas.get(owner) if owner is not None else None
        return quota is not None and nbytes > quota

    def may_evict(self, victim: Owner, owner: Owner) -> bool:
        """Whether making room for ``owner`` may evict an object of ``victim``."""
        return victim == owner or victim is None or victim not in self.quotas

    def check(self, held: Iterable[tuple[Owner, int]]) -> None:
        """Assert that the charges equal what the tier holds (``(owner, bytes)`` per object)."""
        want: dict[Owner, int] = {}
        for owner, nbytes in held:
            want[owner] = want.get(owner, 0) + nbytes
        assert want == self.used, f"shares drifted: charged {self.used}, held {want}"


def check_fits(tier: str, capacity: int, quotas: Mapping[str, int]) -> None:
    """ConfigError if the quotas of ``tier`` add up to more than its ``capacity``."""
    total = sum(quotas.values())
    if total > capacity:
        raise ConfigError(
            f"the tenants' {tier} quotas add up to {total} bytes, more than the tier's {capacity}: "
            "a quota is a share nobody else can take, so they must fit together"
        )

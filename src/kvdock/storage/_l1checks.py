"""The invariants of :class:`kvdock.storage.memory.L1Store` (its module docstring) asserted over
its state, and the allocator's own: what :meth:`L1Store.check_integrity
<kvdock.storage.memory.L1Store.check_integrity>` runs (tests and debugging: O(n))."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvdock.shm.slots import Partitions, aligned
from kvdock.storage.l1object import State

if TYPE_CHECKING:
    from kvdock.storage.memory import L1Store


def check_store(store: L1Store) -> None:
    """Assert ``store``'s invariants (see :mod:`kvdock.storage.memory`)."""
    store.allocator.check_integrity()
    for key, obj in store._ready.items():
        assert obj.key == key and obj.state is State.READY and obj.live
        assert (obj in store._evictable) == (not obj.pins + obj.holds), "evictable membership wrong"
    if isinstance(store.allocator, Partitions):
        for obj in (*store._ready.values(), *store._reserved.values(), *store._retired, *store._detached):
            assert store.allocator.name_of(obj.offset) == obj.region, "an object's slot is outside its region"
            assert obj.region is None or store.shares is None or store.shares.owner(obj.key) == obj.region
    store._prefixes.check(store._ready.values())
    store._evictable.check(store._evictable_now)
    assert len(store._evictable) == sum(not o.pins + o.holds for o in store._ready.values()), "evictables drifted"
    for key, obj in store._reserved.items():
        assert obj.key == key and obj.state is State.RESERVED and obj.pins == 0
    for obj in store._retired:
        assert not obj.live and obj.pins + obj.holds > 0
    for obj in store._detached:
        assert obj.state is State.RESERVED and obj.pins == 0
    held = (*store._ready.values(), *store._reserved.values(), *store._retired, *store._detached)
    offsets = [o.offset for o in held]
    assert len(offsets) == len(set(offsets)), "two objects share a slot"
    total = sum(aligned(o.nbytes) for o in held)
    assert total == store.allocator.used_bytes, (
        f"objects hold {total} bytes, allocator says {store.allocator.used_bytes}"
    )
    store._listings.check(store._ready.values(), store.allocator.generation)

"""L1's READY objects as prompts: each object's predecessor (the object of the version it chains
to) and successors, for prefix-aware eviction (:mod:`kvdock.storage.policy`): a chunk is placed
to go no later than the chunk before it, and a chunk whose predecessor left L1 (an *orphan*)
goes first. Owned by :class:`kvdock.storage.memory.L1Store` (event loop). Objects of version 0
(stored before version chains) have no place here; duplicate versions (never made by the server,
possible in tests) only cost precision.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from kvdock.keys import ObjectKey

if TYPE_CHECKING:
    from kvdock.storage.memory import L1Object


class Prefixes:
    def __init__(self) -> None:
        self._versions: dict[int, L1Object] = {}  # READY objects by version
        self._children: dict[int, dict[ObjectKey, L1Object]] = {}  # parent version -> READY objects after it

    def parent(self, obj: L1Object) -> L1Object | None:
        """The READY object ``obj`` chains to (the chunk before it in its prompt), if L1 has it."""
        return self._versions.get(obj.parent) if obj.parent else None

    def parent_key(self, obj: L1Object) -> ObjectKey | None:
        found = self.parent(obj)
        return found.key if found is not None else None

    def add(self, obj: L1Object) -> bool:
        """``obj`` became READY; whether it is an orphan (its predecessor is not in L1)."""
        parent = obj.parent
        prev = self.parent(obj)
        obj.depth = prev.depth + 1 if prev is not None else 0
        if obj.version:
            self._versions[obj.version] = obj
        if parent:
            self._children.setdefault(parent, {})[obj.key] = obj
        return bool(parent) and prev is None

    def discard(self, obj: L1Object) -> list[L1Object]:
        """``obj`` stopped being READY; the objects it leaves orphaned."""
        if self._versions.get(obj.version) is obj:
            del self._versions[obj.version]
        siblings = self._children.get(obj.parent)
        if siblings is not None and siblings.get(obj.key) is obj:
            del siblings[obj.key]
            if not siblings:
                del self._children[obj.parent]
        if not obj.version or self._versions.get(obj.version) is not None:
            return []
        kids = self._children.get(obj.version)
        return [] if kids is None else list(kids.values())

    def clear(self) -> None:
        self._versions.clear()
        self._children.clear()

    def check(self, ready: Iterable[L1Object]) -> None:
        """Assert: exactly the READY objects are indexed (by version, and under their parent)."""
        objs = list(ready)
        assert all(self._versions.get(o.version) is not None for o in objs if o.version), "a version not indexed"
        ids = {id(o) for o in objs}
        assert all(id(o) in ids for o in self._versions.values()), "a stale version indexed"
        kids = [o for c in self._children.values() for o in c.values()]
        assert {id(o) for o in kids} == {id(o) for o in objs if o.parent}, "the successors index drifted"
        assert all(o.parent == p for p, c in self._children.items() for o in c.values()), "a successor misfiled"

"""StorageManager: store/retrieve bookkeeping over the L1 store, with sessions that own every pin
and reservation and lose them when their lease runs out.

A session lives from a prepare to its commit (or END_SESSION, or lease expiry). Each request on a
session renews its lease. Nothing here touches slot memory: callers copy bytes between the
prepare and the commit.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvdock.errors import SessionError
from kvdock.keys import ObjectKey
from kvdock.storage.memory import L1Object, L1Store


@dataclass(eq=False)
class Session:
    client_id: str
    session_id: str
    deadline: float
    reserved: dict[int, L1Object] = field(default_factory=dict)  # chunk index -> reservation
    pinned: list[L1Object] = field(default_factory=list)
    job: Any = None  # a prefetch job filling ``pinned`` from lower tiers (owned by the tiers)
    busy: bool = False  # a prefetch is running: the lease does not expire meanwhile
    keys: list[ObjectKey] = field(default_factory=list)  # what a retrieve session was opened for
    open: bool = True


@dataclass(frozen=True)
class StorePlan:
    """Outcome of a prepare-store: ``slots`` (chunk index, object) to fill; ``deduped`` chunks were
    already stored (or being stored by someone else); ``pool_full`` chunks found no room."""

    slots: list[tuple[int, L1Object]]
    deduped: int
    pool_full: int


class StorageManager:
    """Not thread-safe: call from the server's event loop only."""

    def __init__(self, l1: L1Store, session_ttl: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.l1 = l1
        self.session_ttl = session_ttl
        self._clock = clock
        self._sessions: dict[tuple[str, str], Session] = {}
        self.expired_sessions = 0
        self._bg_pins: dict[L1Object, int] = {}  # pins held by background copies to lower tiers
        self._loading: set[L1Object] = set()  # reservations being filled from lower tiers
        self.on_commit: Callable[[list[L1Object]], None] | None = None
        self.on_session_end: Callable[[Session], None] | None = None

    @property
    def session_count(self) -> int:
        return len(self._sessions)

    def lookup(self, keys: list[ObjectKey]) -> int:
        """Number of leading chunks of ``keys`` that are READY in L1."""
        n = 0
        for key in keys:
            if self.l1.get(key) is None:
                break
            n += 1
        return n

    def prepare_store(
        self, client_id: str, session_id: str, keys: list[ObjectKey], nbytes: int, overwrite: bool = False
    ) -> StorePlan:
        """Reserve slots for the chunks of ``keys`` that need writing, in order, until the pool is full.

        Chunks already stored are pinned until the commit, so that making room for the new chunks
        never evicts the prefix they extend. Opens a session when at least one slot is reserved.
        Raises SessionError if the session id is already in use."""
        sid = (client_id, session_id)
        if sid in self._sessions:
            raise SessionError(f"session {session_id!r} is already open")
        slots: list[tuple[int, L1Object]] = []
        kept: list[L1Object] = []  # stored chunks of this prefix, pinned so the store cannot evict them
        deduped = pool_full = 0
        for i, key in enumerate(keys):
            present = self.l1.get(key)
            if overwrite:
                self._supersede_load(key)
            if self.l1.is_reserved(key) or (not overwrite and present is not None):
                deduped += 1
                if present is not None and not pool_full:
                    self.l1.pin(present)
                    kept.append(present)
            elif pool_full:
                pool_full += 1
            else:
                obj = self.l1.reserve(key, nbytes)
                if obj is None:
                    pool_full += 1
                else:
                    slots.append((i, obj))
        if slots:
            self._sessions[sid] = Session(client_id, session_id, self._deadline(), reserved=dict(slots), pinned=kept)
        else:
            for obj in kept:
                self.l1.unpin(obj)
        return StorePlan(slots, deduped, pool_full)

    def reservations(self, client_id: str, session_id: str, indexes: list[int]) -> list[L1Object]:
        """The reserved objects for chunk ``indexes`` of a store session (renews its lease).

        Raises SessionError for an unknown session or an index it did not reserve."""
        session = self._get(client_id, session_id)
        if len(set(indexes)) != len(indexes):
            raise SessionError(f"chunk indexes repeat in {indexes}")
        try:
            return [session.reserved[i] for i in indexes]
        except KeyError as e:
            raise SessionError(f"chunk {e.args[0]} was not reserved by session {session_id!r}") from None

    def commit_store(self, client_id: str, session_id: str, indexes: list[int]) -> int:
        """Make the listed chunks READY, drop the session's other reservations, end the session."""
        objs = self.reservations(client_id, session_id, indexes)
        for obj in objs:
            self.l1.commit(obj)
        if self.on_commit and objs:
            self.on_commit(objs)
        committed = set(indexes)
        session = self._sessions[(client_id, session_id)]
        session.reserved = {i: o for i, o in session.reserved.items() if i not in committed}
        self.end_session(client_id, session_id)
        return len(objs)

    def prepare_retrieve(self, client_id: str, session_id: str, keys: list[ObjectKey]) -> list[L1Object]:
        """Pin the leading READY run of ``keys``; opens a session holding the pins when non-empty."""
        sid = (client_id, session_id)
        if sid in self._sessions:
            raise SessionError(f"session {session_id!r} is already open")
        hits: list[L1Object] = []
        for key in keys:
            obj = self.l1.get(key)
            if obj is None:
                break
            self.l1.pin(obj)
            hits.append(obj)
        if hits:
            self._sessions[sid] = Session(client_id, session_id, self._deadline(), pinned=list(hits))
        return hits

    def open_retrieve(self, client_id: str, session_id: str, keys: list[ObjectKey]) -> Session:
        """Open a retrieve session pinning the leading READY run of ``keys`` (possibly none: a
        prefetch may add more with :meth:`add_pin`). SessionError if the id is in use."""
        if (client_id, session_id) in self._sessions:
            raise SessionError(f"session {session_id!r} is already open")
        hits = self.prepare_retrieve(client_id, session_id, keys)
        session = self._sessions.get((client_id, session_id))
        if session is None:
            session = Session(client_id, session_id, self._deadline())
            self._sessions[(client_id, session_id)] = session
        assert session.pinned == hits
        session.keys = list(keys)
        return session

    def renew(self, session: Session) -> None:
        """Restart a session's lease (after a long wait on its behalf)."""
        session.deadline = self._deadline()

    def has_session(self, client_id: str, session_id: str) -> bool:
        return (client_id, session_id) in self._sessions

    def find(self, client_id: str, session_id: str) -> Session:
        """The open session (its lease renewed); SessionError if there is none."""
        return self._get(client_id, session_id)

    def add_pin(self, session: Session, obj: L1Object) -> bool:
        """Pin ``obj`` for an open session (appended to its pinned run); False if it has ended."""
        if not session.open:
            return False
        self.l1.pin(obj)
        session.pinned.append(obj)
        return True

    def pin_background(self, obj: L1Object) -> None:
        """Pin a READY object while a worker copies it to a lower tier."""
        self.l1.pin(obj)
        self._bg_pins[obj] = self._bg_pins.get(obj, 0) + 1

    def unpin_background(self, obj: L1Object) -> None:
        n = self._bg_pins.pop(obj)
        if n > 1:
            self._bg_pins[obj] = n - 1
        self.l1.unpin(obj)

    def _supersede_load(self, key: ObjectKey) -> None:
        """An overwrite wins over a load of the older version in flight: the load's slot is set
        aside (its worker may still be writing) and freed when the load finishes."""
        obj = self.l1.reservation(key)
        if obj is not None and obj in self._loading:
            self.l1.detach(obj)

    def reserve_load(self, key: ObjectKey, nbytes: int) -> L1Object | None:
        """Reserve a slot to fill from a lower tier; None if the key is being written or no room."""
        if self.l1.is_reserved(key):
            return None
        obj = self.l1.reserve(key, nbytes)
        if obj is not None:
            self._loading.add(obj)
        return obj

    def finish_load(self, obj: L1Object, ok: bool) -> L1Object | None:
        """Commit a filled slot (promotion into L1, most recently used) or drop it."""
        self._loading.remove(obj)
        if not ok or self.l1.reservation(obj.key) is not obj:  # failed, or superseded by an overwrite
            self.l1.abort(obj)
            return None
        self.l1.commit(obj)
        return obj

    @property
    def background_pins(self) -> int:
        return sum(self._bg_pins.values())

    def session_pins(self, client_id: str, session_id: str) -> int:
        """How many objects a session pins (SessionError if there is no such session)."""
        return len(self._get(client_id, session_id).pinned)

    def commit_retrieve(self, client_id: str, session_id: str) -> None:
        """Release a retrieve session's pins (its objects become most recently used)."""
        self._get(client_id, session_id)
        self.end_session(client_id, session_id)

    def end_session(self, client_id: str, session_id: str) -> bool:
        """Abort uncommitted reservations and release pins; False if there was no such session."""
        session = self._sessions.pop((client_id, session_id), None)
        if session is None:
            return False
        session.open = False
        if self.on_session_end:
            self.on_session_end(session)
        self._release(session)
        return True

    def end_client(self, client_id: str) -> int:
        """End every session of a client (it re-registered after a restart); returns how many."""
        mine = [s for s in self._sessions.values() if s.client_id == client_id]
        for s in mine:
            self.end_session(s.client_id, s.session_id)
        return len(mine)

    def expire(self) -> int:
        """End every session whose lease ran out; returns how many."""
        now = self._clock()
        dead = [s for s in self._sessions.values() if s.deadline < now and not s.busy]
        for s in dead:
            self.end_session(s.client_id, s.session_id)
        self.expired_sessions += len(dead)
        return len(dead)

    def _release(self, session: Session) -> None:
        for obj in session.reserved.values():
            self.l1.abort(obj)
        for obj in session.pinned:
            self.l1.unpin(obj)
        session.reserved.clear()
        session.pinned.clear()

    def _get(self, client_id: str, session_id: str) -> Session:
        session = self._sessions.get((client_id, session_id))
        if session is None:
            raise SessionError(f"no open session {session_id!r} (never opened, already ended, or its lease ran out)")
        session.deadline = self._deadline()
        return session

    def _deadline(self) -> float:
        return self._clock() + self.session_ttl

    def check_integrity(self) -> None:
        """Assert L1 invariants, and that pins and reservations are exactly those of open sessions."""
        self.l1.check_integrity()
        pins: dict[int, int] = {}
        for s in self._sessions.values():
            assert s.reserved or s.pinned or s.job is not None, "an open session holds nothing"
            assert s.open
            for obj in s.pinned:
                pins[id(obj)] = pins.get(id(obj), 0) + 1
            for obj in s.reserved.values():
                assert self.l1.is_reserved(obj.key)
        for obj, n in self._bg_pins.items():
            pins[id(obj)] = pins.get(id(obj), 0) + n
        for obj in self._loading:
            assert obj.live and obj.state.name == "RESERVED", "a load's slot is not reserved"
        for obj in self.l1.pinned_objects():
            assert pins.pop(id(obj), 0) == obj.pins, "pin count does not match the sessions holding it"
        assert not pins, "a session pins an object the store does not know"
        owned = sum(len(s.reserved) for s in self._sessions.values()) + len(self._loading)
        assert self.l1.reserved_count() == owned, "a reservation belongs to no session or load"

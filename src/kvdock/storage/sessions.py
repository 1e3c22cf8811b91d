"""Sessions: every pin and reservation a client holds belongs to one, and goes with its lease.

A session lives from a prepare to its commit (or END_SESSION, or lease expiry). Each request on a
session renews its lease. A session doing server-side work for its client (a prefetch, an inline
copy, waiting for an overwrite's deletions) is *busy*: it does not expire meanwhile, and if it is
ended anyway (END_SESSION, the client closes) its pins and slots are released only when the work
is over, so a copier thread never touches a slot that was handed to someone else.

Quarantine: a shared-memory client writes its reserved slots itself, so when its store session
expires the writer may still be alive (paused, swapped out) and write later. Those slots are not
freed but quarantined until the client ends the session itself (its CommitStore or EndSession
arrives: the SDK sends one only after its copy) or its process is gone. They are never handed to
anyone else meanwhile, so a slow writer's bytes can never land in another object.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvdock.errors import SessionError
from kvdock.keys import ObjectKey
from kvdock.shm.segment import process_alive
from kvdock.shm.slots import aligned
from kvdock.storage.memory import L1Object, L1Store


@dataclass(frozen=True)
class Writer:
    """The process of a shared-memory client, which writes slots itself (pid + start time, so a
    reused pid is not mistaken for it)."""

    pid: int
    start_time: int

    def alive(self) -> bool:
        return process_alive(self.pid, self.start_time)


@dataclass(eq=False)
class Session:
    client_id: str
    session_id: str
    deadline: float
    reserved: dict[int, L1Object] = field(default_factory=dict)  # chunk index -> reservation
    pinned: list[L1Object] = field(default_factory=list)
    keys: list[ObjectKey] = field(default_factory=list)  # what a retrieve session was opened for
    writer: Writer | None = None  # set when a shared-memory client writes the reservations itself
    overwrite: bool = False  # a store that replaces older versions
    deletes: list[asyncio.Future[int | None]] = field(default_factory=list)  # an overwrite's, awaited at commit
    busy: int = 0  # server-side work in progress for the session: the lease waits for it
    committing: bool = False  # a CommitStore is in progress: a second one is refused
    release_pending: bool | None = None  # ended while busy: released (quarantine or not) when idle
    job: Any = None  # the prefetch filling ``pinned`` from lower tiers (owned by the manager)
    open: bool = True


@dataclass(eq=False)
class PrefetchJob:
    """A prefetch filling a session's pinned run from the lower tiers (run by the manager)."""

    session: Session
    done: asyncio.Event = field(default_factory=asyncio.Event)
    cancelled: bool = False
    task: asyncio.Task[None] | None = None


@dataclass(eq=False)
class Quarantined:
    client_id: str
    session_id: str
    writer: Writer
    objs: list[L1Object]


class SessionTable:
    """Open sessions and quarantined slots, keyed by (client id, session id): the one owner of
    every pin and reservation a client holds, and the only code that releases them. Not
    thread-safe: the event loop only."""

    def __init__(self, l1: L1Store, ttl: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._l1 = l1
        self.ttl = ttl
        self._clock = clock
        self._open: dict[tuple[str, str], Session] = {}
        self.quarantine: dict[tuple[str, str], Quarantined] = {}
        self._ending: set[Session] = set()  # ended while busy: released when their work is over
        self.expired = 0

    def __len__(self) -> int:
        return len(self._open)

    def __iter__(self) -> Any:
        return iter(list(self._open.values()))

    def in_use(self, client_id: str, session_id: str) -> bool:
        """Whether a session of that id is open, quarantined, or ended but still busy: no new
        session may take the id (nor reserve anything for it) yet."""
        sid = (client_id, session_id)
        return (
            sid in self._open or sid in self.quarantine or any((s.client_id, s.session_id) == sid for s in self._ending)
        )

    def open(self, client_id: str, session_id: str, **kw: Any) -> Session:
        """A new session; SessionError if the id is in use (:meth:`in_use`)."""
        if self.in_use(client_id, session_id):
            raise SessionError(f"session {session_id!r} is already open")
        sid = (client_id, session_id)
        session = Session(client_id, session_id, self._clock() + self.ttl, **kw)
        self._open[sid] = session
        return session

    def has(self, client_id: str, session_id: str) -> bool:
        return (client_id, session_id) in self._open

    def get(self, client_id: str, session_id: str) -> Session:
        """The open session, its lease renewed; SessionError if there is none."""
        session = self._open.get((client_id, session_id))
        if session is None:
            raise SessionError(f"no open session {session_id!r} (never opened, already ended, or its lease ran out)")
        self.renew(session)
        return session

    def begin_commit(self, client_id: str, session_ids: list[str]) -> list[Session]:
        """The open sessions of one CommitStore (one per shard of its request), their leases
        renewed, marked ``committing``; SessionError if one is not open, or if a CommitStore of
        any of them is in progress already (a second one would copy into slots the first may
        free)."""
        sessions = [self.get(client_id, sid) for sid in session_ids]
        if any(s.committing for s in sessions):
            raise SessionError(f"session {session_ids[0]!r} is already being committed")
        for s in sessions:
            s.committing = True
        return sessions

    def renew(self, session: Session) -> None:
        session.deadline = self._clock() + self.ttl

    def pop(self, client_id: str, session_id: str) -> Session | None:
        session = self._open.pop((client_id, session_id), None)
        if session is not None:
            session.open = False
        return session

    def of_client(self, client_id: str) -> list[Session]:
        return [s for s in self._open.values() if s.client_id == client_id]

    def due(self) -> list[Session]:
        """Sessions whose lease ran out and that are not busy."""
        now = self._clock()
        return [s for s in self._open.values() if s.deadline < now and not s.busy]

    # --- ends --------------------------------------------------------------------------------

    def hold(self, session: Session) -> None:
        """Server-side work for ``session`` starts: its lease waits, and its pins and slots stay
        until :meth:`unhold`, even if the session is ended meanwhile."""
        session.busy += 1

    def unhold(self, session: Session) -> None:
        session.busy -= 1
        if not session.busy and session in self._ending:
            self._ending.remove(session)
            self._release(session, quarantine=bool(session.release_pending))

    def end(self, client_id: str, session_id: str) -> bool:
        """The client ended a session (or a handler aborts it): abort its reservations, release
        its pins and any slots quarantined for it. False if there was no such session."""
        released = self.release_quarantine(client_id, session_id)
        session = self.pop(client_id, session_id)
        if session is None:
            for ending in self._ending:  # ended already (its client closed) but still busy
                if (ending.client_id, ending.session_id) == (client_id, session_id):
                    ending.release_pending = False  # its copy is over: free, not quarantine
                    return True
            return released
        self._end(session, quarantine=False)
        return True

    def end_client(self, client_id: str, quarantine: bool = True) -> int:
        """End every session of a client that closed or was forgotten. Slots its process may still
        be writing (another thread of it) are quarantined, not freed, unless ``quarantine`` is
        False (the client said no copy of it is in progress). Returns how many."""
        mine = self.of_client(client_id)
        for s in mine:
            self.pop(s.client_id, s.session_id)
            self._end(s, quarantine=quarantine)
        return len(mine)

    def expire(self) -> int:
        """End every session whose lease ran out (not busy ones); returns how many."""
        dead = self.due()
        for s in dead:
            self.pop(s.client_id, s.session_id)
            self._end(s, quarantine=True)
        self.expired += len(dead)
        return len(dead)

    def reap_quarantine(self) -> int:
        """Free the quarantined slots of writers whose process is gone; returns how many slots."""
        gone = [q for q in self.quarantine.values() if not q.writer.alive()]
        for q in gone:
            self.release_quarantine(q.client_id, q.session_id)
        return sum(len(q.objs) for q in gone)

    def release_quarantined_group(self, client_id: str, session_id: str) -> int:
        """Release the quarantine of every session of one request's shards (``session_id`` and
        ``session_id/<shard>``, see server.shards), also for a client the server forgot; how many."""
        group = [sid for cid, sid in self.quarantine if cid == client_id and sid.startswith(session_id + "/")]
        return sum(self.release_quarantine(client_id, sid) for sid in [session_id, *group])

    def release_quarantine(self, client_id: str, session_id: str) -> bool:
        """Free the slots quarantined for a session (its writer is done); False if none were."""
        q = self.quarantine.pop((client_id, session_id), None)
        for obj in q.objs if q else []:
            self._l1.abort(obj)
        return q is not None

    def _end(self, session: Session, quarantine: bool) -> None:
        if isinstance(session.job, PrefetchJob):
            session.job.cancelled = True
        if session.busy:
            session.release_pending = quarantine
            self._ending.add(session)
        else:
            self._release(session, quarantine)

    def _release(self, session: Session, quarantine: bool) -> None:
        if quarantine and session.writer is not None and session.reserved:
            objs = list(session.reserved.values())
            for obj in objs:
                self._l1.detach(obj)
            key = (session.client_id, session.session_id)
            self.quarantine[key] = Quarantined(session.client_id, session.session_id, session.writer, objs)
        else:
            for obj in session.reserved.values():
                self._l1.abort(obj)
        for obj in session.pinned:
            self._l1.unpin(obj)
        session.reserved.clear()
        session.pinned.clear()

    def holdings(self) -> tuple[dict[int, int], int]:
        """For integrity checks: pins per object id, and the number of reservations, held by open,
        ending and quarantined sessions (asserting the sessions' own invariants)."""
        pins: dict[int, int] = {}
        held = 0
        for s in self._open.values():
            assert s.reserved or s.pinned or s.job is not None, "an open session holds nothing"
            assert s.open
            for obj in s.reserved.values():
                assert self._l1.reservation(obj.key) is obj, "a session's reservation is not the key's"
        for s in (*self._open.values(), *self._ending):
            held += len(s.reserved)
            for obj in s.pinned:
                pins[id(obj)] = pins.get(id(obj), 0) + 1
        for q in self.quarantine.values():
            held += len(q.objs)
        return pins, held

    def quarantined_bytes(self) -> int:
        """Pool bytes (whole slots) held in quarantine."""
        return sum(aligned(o.nbytes) for q in self.quarantine.values() for o in q.objs)

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
from kvdock.storage.memory import L1Object


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
    deletes: list[asyncio.Future[bool]] = field(default_factory=list)  # an overwrite's, awaited at commit
    busy: int = 0  # server-side work in progress for the session: the lease waits for it
    release_pending: bool | None = None  # ended while busy: released (quarantine or not) when idle
    job: Any = None  # the prefetch filling ``pinned`` from lower tiers (owned by the manager)
    open: bool = True


@dataclass(eq=False)
class Quarantined:
    client_id: str
    session_id: str
    writer: Writer
    objs: list[L1Object]


class SessionTable:
    """Open sessions and quarantined slots, keyed by (client id, session id). Not thread-safe:
    the event loop only. Releasing pins and slots is the manager's job; this table only decides
    who holds what and when a lease ran out."""

    def __init__(self, ttl: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl = ttl
        self._clock = clock
        self._open: dict[tuple[str, str], Session] = {}
        self.quarantine: dict[tuple[str, str], Quarantined] = {}
        self.expired = 0

    def __len__(self) -> int:
        return len(self._open)

    def __iter__(self) -> Any:
        return iter(list(self._open.values()))

    def open(self, client_id: str, session_id: str, **kw: Any) -> Session:
        """A new session; SessionError if the id is in use (or still quarantined)."""
        sid = (client_id, session_id)
        if sid in self._open or sid in self.quarantine:
            raise SessionError(f"session {session_id!r} is already open")
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

    def quarantined_bytes(self) -> int:
        """Pool bytes (whole slots) held in quarantine."""
        return sum(aligned(o.nbytes) for q in self.quarantine.values() for o in q.objs)

"""Handing a tenant's clients their tenant's pool (``shm.pool``), and nobody else's.

A client proves its tenant over the control plane (CURVE key or token: ``Describe``), naming
the process that will map the pool (pid and start time, which the server must see: the same PID
namespace, as for shared memory at all); the reply carries a ticket for that tenant's pool, good
for that process only (:class:`Tickets`). At the pool door (``transport.door``), where any local
user may knock, the ticket and the knocking process (``SO_PEERCRED``) say which pool's
descriptor to hand over (:func:`open_pool`). A ticket opens one pool, once, within ``TTL_S``, for
the process it was issued to: a ticket that leaks (a client that sent it to a socket squatting on
the door's path in another mount namespace) opens nothing for anyone else. The client then
proves in ``RegisterClient`` that it mapped the pool (its nonce), and only then gets the
shared-memory transport.

The event loop's thread only.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from kvdock.errors import ConfigError, ProtocolError
from kvdock.protocol import encode
from kvdock.protocol.codes import ErrorCode
from kvdock.protocol.door import PoolOpened, decode_open
from kvdock.protocol.messages import PROTOCOL_VERSION, Error
from kvdock.shm.pool import Pool
from kvdock.shm.processes import proc_start_time
from kvdock.transport.door import Caller, PoolDoor

log = logging.getLogger("kvdock.server")

TTL_S = 60.0
MAX_OPEN = 256  # tickets one tenant may have outstanding; past it its oldest lapse


@dataclass(frozen=True)
class Ticket:
    tenant: str
    pid: int
    pid_start: int
    expiry: float


class Tickets:
    """Single-use tickets, each naming a tenant and the process it is for, good for ``ttl_s``
    (``clock``: monotonic seconds). At most ``max_open`` per tenant are outstanding; issuing one
    more drops that tenant's oldest (so no tenant can crowd out another's)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, ttl_s: float = TTL_S, max_open: int = MAX_OPEN):
        self._clock = clock
        self._ttl = ttl_s
        self._max = max_open
        self._open: OrderedDict[str, Ticket] = OrderedDict()  # oldest first
        self._count: dict[str, int] = {}  # outstanding per tenant

    def __len__(self) -> int:
        return len(self._open)

    def issue(self, tenant: str, pid: int, pid_start: int) -> str:
        """A new ticket (128 random bits) to ``tenant``'s pool, for process ``pid`` started at
        ``pid_start``."""
        self._expire()
        if self._count.get(tenant, 0) >= self._max:
            oldest = next(t for t, v in self._open.items() if v.tenant == tenant)
            self._drop(oldest)
        ticket = secrets.token_hex(16)
        self._open[ticket] = Ticket(tenant, pid, pid_start, self._clock() + self._ttl)
        self._count[tenant] = self._count.get(tenant, 0) + 1
        return ticket

    def redeem(self, ticket: str, pid: int, pid_start: int) -> str | None:
        """The tenant ``ticket`` names, once, when presented by the process it was issued to;
        None for a ticket never issued, used, lapsed, or another process's (which it leaves for
        its own process)."""
        self._expire()
        entry = self._open.get(ticket)
        if entry is None or (entry.pid, entry.pid_start) != (pid, pid_start):
            return None
        self._drop(ticket)
        return entry.tenant

    def _drop(self, ticket: str) -> None:
        entry = self._open.pop(ticket)
        self._count[entry.tenant] -= 1
        if not self._count[entry.tenant]:
            del self._count[entry.tenant]

    def _expire(self) -> None:
        now = self._clock()
        while self._open:
            ticket, entry = next(iter(self._open.items()))
            if entry.expiry > now:
                return
            self._drop(ticket)

    def check_integrity(self) -> None:
        """At most ``max_open`` outstanding per tenant, counted right, in expiry order."""
        counts: dict[str, int] = {}
        for entry in self._open.values():
            counts[entry.tenant] = counts.get(entry.tenant, 0) + 1
        assert counts == self._count, f"tickets counted {self._count}, outstanding {counts}"
        assert all(n <= self._max for n in counts.values()), f"tickets outstanding {counts}"
        expiries = [e.expiry for e in self._open.values()]
        assert expiries == sorted(expiries), "tickets out of expiry order"


def open_door(pool: Pool) -> PoolDoor | None:
    """The pool door, when some tenant has a pool of its own to be handed (None otherwise);
    not yet started. ConfigError if its socket cannot be made."""
    if not any(t is not None for t in pool.shared_segments()):
        return None
    try:
        door = PoolDoor()
    except OSError as e:
        raise ConfigError(f"cannot open the pool door for the tenants' pools: {e}") from None
    return door


def open_pool(pool: Pool, tickets: Tickets, request: bytes, caller: Caller) -> tuple[bytes, tuple[int, ...]]:
    """The door's handler: the reply to ``request`` from ``caller`` and the descriptors to hand
    with it (the pool's metadata and slot area, or none). Anything but a current ticket of a
    tenant with a pool of its own, issued to the calling process, gets an Error and nothing else,
    the same for a ticket that never was as for one used, lapsed or another process's."""
    try:
        req = decode_open(request)
    except ProtocolError as e:
        return encode(Error(ErrorCode.MALFORMED, str(e))), ()
    if req.protocol_version != PROTOCOL_VERSION:
        msg = f"protocol version mismatch: server {PROTOCOL_VERSION}, client {req.protocol_version}"
        return encode(Error(ErrorCode.PROTOCOL_VERSION, msg)), ()
    start = proc_start_time(caller.pid) if caller.pid > 0 else None  # (0: not in our PID namespace)
    tenant = tickets.redeem(req.ticket, caller.pid, start) if start is not None else None
    segment = pool.segment_of(tenant) if tenant is not None else None
    if segment is None:
        msg = "this ticket opens no pool (used, lapsed, another process's or never issued: Describe gives another)"
        return encode(Error(ErrorCode.UNAUTHORIZED, msg)), ()
    log.debug("pool door: tenant %r's pool handed over", tenant)
    return encode(PoolOpened(segment.size)), segment.filenos()

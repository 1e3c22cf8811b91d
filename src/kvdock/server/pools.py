"""Handing a tenant's clients their tenant's pool (``shm.pool``), and nobody else's.

A client proves its tenant over the control plane (CURVE key or token: ``Describe``), which
answers with a ticket for that tenant's pool (:class:`Tickets`); at the pool door
(``transport.door``), where any local user may knock, the ticket alone says which pool's
descriptor to hand over (:func:`open_pool`). A ticket opens one pool, once, within ``TTL_S``:
a ticket that leaked after use, or that never reached its client, opens nothing later. The
client then proves in ``RegisterClient`` that it mapped the pool (its nonce), and only then
gets the shared-memory transport.

The event loop's thread only.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable

from kvdock.errors import ProtocolError
from kvdock.protocol import encode
from kvdock.protocol.codes import ErrorCode
from kvdock.protocol.door import PoolOpened, decode_open
from kvdock.protocol.messages import PROTOCOL_VERSION, Error
from kvdock.shm.pool import Pool

log = logging.getLogger("kvdock.server")

TTL_S = 60.0
MAX_OPEN = 4096  # tickets outstanding at once; past it the oldest lapse


class Tickets:
    """Single-use tickets, each naming a tenant, good for ``ttl_s`` (``clock``: monotonic
    seconds). At most ``max_open`` are outstanding; issuing one more drops the oldest."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, ttl_s: float = TTL_S, max_open: int = MAX_OPEN):
        self._clock = clock
        self._ttl = ttl_s
        self._max = max_open
        self._open: OrderedDict[str, tuple[str, float]] = OrderedDict()  # ticket -> (tenant, expiry), oldest first

    def __len__(self) -> int:
        return len(self._open)

    def issue(self, tenant: str) -> str:
        """A new ticket for ``tenant``'s pool (128 random bits)."""
        self._expire()
        while len(self._open) >= self._max:
            self._open.popitem(last=False)
        ticket = secrets.token_hex(16)
        self._open[ticket] = (tenant, self._clock() + self._ttl)
        return ticket

    def redeem(self, ticket: str) -> str | None:
        """The tenant ``ticket`` names, once; None for a ticket never issued, used or lapsed."""
        self._expire()
        entry = self._open.pop(ticket, None)
        return entry[0] if entry is not None else None

    def _expire(self) -> None:
        now = self._clock()
        while self._open:
            ticket, (_, expiry) = next(iter(self._open.items()))
            if expiry > now:
                return
            del self._open[ticket]

    def check_integrity(self) -> None:
        """At most ``max_open`` outstanding, in expiry order."""
        assert len(self._open) <= self._max, f"{len(self._open)} tickets outstanding"
        expiries = [e for _, e in self._open.values()]
        assert expiries == sorted(expiries), "tickets out of expiry order"


def open_pool(pool: Pool, tickets: Tickets, request: bytes) -> tuple[bytes, int]:
    """The door's handler: the reply to ``request`` and the descriptor to hand with it (-1: none).
    Anything but a current ticket of a tenant with a pool of its own gets an Error and nothing
    else, the same for a ticket that never was as for one used or lapsed."""
    try:
        req = decode_open(request)
    except ProtocolError as e:
        return encode(Error(ErrorCode.MALFORMED, str(e))), -1
    if req.protocol_version != PROTOCOL_VERSION:
        msg = f"protocol version mismatch: server {PROTOCOL_VERSION}, client {req.protocol_version}"
        return encode(Error(ErrorCode.PROTOCOL_VERSION, msg)), -1
    tenant = tickets.redeem(req.ticket) if isinstance(req.ticket, str) else None
    segment = pool.segment_of(tenant) if tenant is not None else None
    if segment is None or not segment.private:
        msg = "this ticket opens no pool (used, lapsed or never issued: ask Describe for another)"
        return encode(Error(ErrorCode.UNAUTHORIZED, msg)), -1
    log.debug("pool door: tenant %r's pool handed over", tenant)
    return encode(PoolOpened(segment.size)), segment.fileno()

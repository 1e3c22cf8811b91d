"""Tickets to the tenants' pools and the pool door's handler: a ticket opens its own tenant's
pool, once, within its lease; anything else gets an error and no descriptor."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from kvdock.protocol import encode
from kvdock.protocol import messages as m
from kvdock.protocol.codes import ErrorCode
from kvdock.protocol.door import OpenPool, PoolOpened, decode_door_reply
from kvdock.server.pools import Tickets, open_pool
from kvdock.shm.pool import Pool
from kvdock.shm.segment import proc_start_time
from kvdock.shm.slots import ALIGN
from kvdock.transport.door import Caller


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


ME = (os.getpid(), proc_start_time(os.getpid()) or 0)


def test_a_ticket_names_its_tenant_once_for_its_own_process_within_its_lease() -> None:
    clock = Clock()
    tickets = Tickets(clock, ttl_s=10.0)
    a, b = tickets.issue("a", 10, 5), tickets.issue("b", 10, 5)
    assert a != b and len(a) == 32 and len(tickets) == 2
    assert tickets.redeem(a, 11, 5) is None and tickets.redeem(a, 10, 6) is None  # another process's
    assert tickets.redeem(a, 10, 5) == "a"  # (left for its own)
    assert tickets.redeem(a, 10, 5) is None  # used
    assert tickets.redeem("0" * 32, 10, 5) is None and tickets.redeem("", 10, 5) is None  # never issued
    clock.now += 10.0
    assert tickets.redeem(b, 10, 5) is None  # lapsed
    assert len(tickets) == 0
    tickets.check_integrity()


def test_past_a_tenants_cap_its_oldest_tickets_lapse_and_no_other_tenants() -> None:
    clock = Clock()
    tickets = Tickets(clock, ttl_s=10.0, max_open=3)
    other = tickets.issue("b", 1, 1)
    issued = []
    for _ in range(5):  # a floods: only its own oldest go
        clock.now += 1
        issued.append(tickets.issue("a", 1, 1))
    assert len(tickets) == 4
    tickets.check_integrity()
    assert [tickets.redeem(t, 1, 1) for t in issued] == [None, None, "a", "a", "a"]
    assert tickets.redeem(other, 1, 1) == "b"
    tickets.check_integrity()


@pytest.fixture
def pool() -> Iterator[Pool]:
    p = Pool.create(8 * ALIGN, {"a": 2 * ALIGN, "b": 2 * ALIGN}, tenants=True)
    yield p
    p.close()


def _door(
    pool: Pool, tickets: Tickets, request: bytes, pid: int | None = None
) -> tuple[PoolOpened | m.Error, tuple[int, ...]]:
    reply, fds = open_pool(pool, tickets, request, Caller(ME[0] if pid is None else pid, os.getuid()))
    return decode_door_reply(reply), fds


def test_open_pool_hands_over_the_tickets_tenants_own_pool_and_nothing_else(pool: Pool) -> None:
    tickets = Tickets(Clock())
    ta, tb, tc = (tickets.issue(t, *ME) for t in "abc")  # c: no quota, no pool
    answer, fds = _door(pool, tickets, encode(OpenPool(m.PROTOCOL_VERSION, tb)), pid=1)
    assert isinstance(answer, m.Error) and fds == ()  # not the process it was issued to
    answer, fds = _door(pool, tickets, encode(OpenPool(m.PROTOCOL_VERSION, tb)))
    assert answer == PoolOpened(pool.own["b"].size) and fds == pool.own["b"].filenos()
    refused = [
        (encode(OpenPool(m.PROTOCOL_VERSION, tb)), ErrorCode.UNAUTHORIZED),  # used
        (encode(OpenPool(m.PROTOCOL_VERSION, tc)), ErrorCode.UNAUTHORIZED),  # a tenant without a pool
        (encode(OpenPool(m.PROTOCOL_VERSION, "f" * 32)), ErrorCode.UNAUTHORIZED),
        (encode(OpenPool(m.PROTOCOL_VERSION - 1, ta)), ErrorCode.PROTOCOL_VERSION),
        (b"\xc1garbage", ErrorCode.MALFORMED),
        (encode(m.Ping()), ErrorCode.MALFORMED),  # a control-plane message
        (b"", ErrorCode.MALFORMED),
    ]
    for request, code in refused:
        answer, fds = _door(pool, tickets, request)
        assert isinstance(answer, m.Error) and answer.code == code and fds == (), (request, answer)
    # the same words for a ticket used as for one never issued: nothing to learn from the refusal
    used, _ = _door(pool, tickets, encode(OpenPool(m.PROTOCOL_VERSION, tb)))
    never, _ = _door(pool, tickets, encode(OpenPool(m.PROTOCOL_VERSION, "e" * 32)))
    assert used == never
    # the version refusal did not spend a's ticket
    answer, fds = _door(pool, tickets, encode(OpenPool(m.PROTOCOL_VERSION, ta)))
    assert answer == PoolOpened(pool.own["a"].size) and fds == pool.own["a"].filenos()

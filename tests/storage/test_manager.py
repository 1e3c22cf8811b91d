"""kvdock.storage.manager: store/retrieve sessions, dedup, pool-full answers, leases and expiry,
quarantine and held sessions (unit tests over an L1Store, no lower tier); then, through the
tierworld harness (real DiskTier, and RedisTier where used), what the manager does with the lower
tiers: counting, prefetch and loads, and overwrites that delete older versions everywhere."""

from __future__ import annotations

import asyncio
import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

import tierworld
from helpers import RedisProc
from kvdock.errors import RequestError, SessionError
from kvdock.keys import ObjectKey
from kvdock.shm.segment import proc_start_time
from kvdock.shm.slots import ALIGN, SlotAllocator
from kvdock.storage.disk import DiskTier
from kvdock.storage.manager import Chain, StorageManager, StorePlan
from kvdock.storage.memory import L1Object, L1Store, State
from kvdock.storage.sessions import Writer
from kvdock.storage.tier import Head
from tierworld import FILE, SHAPE, World, head, legacy_header, payload, run, until
from tierworld import NB as WNB
from tierworld import K as WK

P = ALIGN
NB = 1000  # one page per slot
TTL = 10.0

NONE_IN_L1 = Chain(0, 0)  # count() from the first key


def K(i: int) -> ObjectKey:
    return ObjectKey("m", 0, "", bytes([i]) * 32)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Harness:
    def __init__(self, slots: int) -> None:
        self.clock = FakeClock()
        self.evicted: list[ObjectKey] = []
        self.l1 = L1Store(SlotAllocator(base=0, capacity=slots * P), watcher=self)
        self.mgr = StorageManager(self.l1, session_ttl=TTL, clock=self.clock)

    def stored(self, obj: L1Object) -> None:
        pass

    def removed(self, obj: L1Object, evicted: bool) -> None:
        if evicted:
            self.evicted.append(obj.key)

    def cleared(self) -> None:
        pass

    def check(self) -> None:
        self.mgr.check_integrity()

    def store(self, client: str, sid: str, keys: list[ObjectKey], overwrite: bool = False) -> StorePlan:
        plan = self.mgr.prepare_store(client, sid, keys, NB, overwrite)
        self.check()
        n = self.mgr.commit_store(client, sid, [i for i, _ in plan.slots])  # no lower tier: nothing to wait for
        self.check()
        assert n == len(plan.slots)
        return plan

    def retrieve(self, client: str, sid: str, keys: list[ObjectKey]) -> list[L1Object]:
        """Open a retrieve session, ending it at once when it pins nothing (as the server does when
        no prefetch can add more); returns a copy of what it pins."""
        session = self.mgr.open_retrieve(client, sid, keys)
        assert self.mgr.start_prefetch(session) is None  # no lower tier
        if not session.pinned:
            assert self.mgr.end_session(client, sid)
        self.check()
        return list(session.pinned)

    def pins(self, client: str, sid: str) -> int:
        return len(self.mgr.sessions.get(client, sid).pinned)

    @property
    def used(self) -> int:
        return self.l1.allocator.used_bytes


@pytest.fixture
def h() -> Harness:
    return Harness(slots=4)


def _idx(plan: StorePlan) -> list[int]:
    return [i for i, _ in plan.slots]


def _me() -> Writer:
    start = proc_start_time(os.getpid())
    assert start is not None
    return Writer(os.getpid(), start)


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    assert not Path(f"/proc/{p.pid}").exists()
    return p.pid


# ---------------------------------------------------------------- store


def test_prepare_store_reserves_every_new_chunk(h: Harness) -> None:
    plan = h.mgr.prepare_store("c", "s", [K(1), K(2), K(3)], NB)
    h.check()
    assert _idx(plan) == [0, 1, 2]
    assert [o.key for _, o in plan.slots] == [K(1), K(2), K(3)]
    assert all(o.state is State.RESERVED for _, o in plan.slots)
    assert (plan.deduped, plan.in_flight, plan.pool_full) == (0, 0, 0)
    assert h.mgr.session_count == 1
    assert h.mgr.lookup_l1([K(1), K(2), K(3)]) == 0  # invisible until commit
    assert h.mgr.reservations("c", "s", [2, 0]) == [plan.slots[2][1], plan.slots[0][1]]
    assert h.mgr.commit_store("c", "s", [0, 1, 2]) == 3
    h.check()
    assert h.mgr.session_count == 0
    assert h.mgr.lookup_l1([K(1), K(2), K(3)]) == 3
    assert h.l1.lru_keys() == [K(1), K(2), K(3)]


def test_lookup_l1_counts_the_leading_run_only(h: Harness) -> None:
    h.store("c", "s", [K(1), K(2), K(4)])
    assert h.mgr.lookup_l1([K(1), K(2), K(3), K(4)]) == 2
    assert h.mgr.lookup_l1([K(3), K(1)]) == 0
    assert h.mgr.lookup_l1([]) == 0
    assert h.mgr.lookup_l1([K(1)]) == 1


def test_dedup_of_stored_chunks(h: Harness) -> None:
    h.store("c", "s1", [K(1), K(2)])
    plan = h.mgr.prepare_store("c", "s2", [K(1), K(2), K(3)], NB)
    h.check()
    assert _idx(plan) == [2]
    assert (plan.deduped, plan.in_flight, plan.pool_full) == (2, 0, 0)
    assert h.mgr.commit_store("c", "s2", [2]) == 1
    h.check()


def test_everything_deduped_opens_no_session(h: Harness) -> None:
    h.store("c", "s1", [K(1), K(2)])
    plan = h.mgr.prepare_store("c", "s2", [K(1), K(2)], NB)
    h.check()
    assert plan == StorePlan([], 2, 0, 0)
    assert h.mgr.session_count == 0
    assert [o.pins for o in (h.l1.get(K(1)), h.l1.get(K(2)))] == [0, 0]  # type: ignore[union-attr]
    with pytest.raises(SessionError, match="no open session 's2'"):
        h.mgr.commit_store("c", "s2", [])


def test_chunks_reserved_by_another_session_are_in_flight(h: Harness) -> None:
    # changed on purpose: chunks another client is writing now are ``in_flight`` (the caller may
    # retry), no longer ``deduped`` (they are not stored, and may never be). Changed on purpose
    # again (version chains): every chunk after an in_flight one is in_flight too, as it could not
    # name its predecessor's version; K(2) used to be reserved behind the in_flight K(1)
    first = h.mgr.prepare_store("a", "s", [K(1)], NB)
    plan = h.mgr.prepare_store("b", "s", [K(1), K(2)], NB)
    h.check()
    assert _idx(first) == [0]
    assert plan == StorePlan([], 0, 2, 0)
    assert h.mgr.session_count == 1 and not h.l1.is_reserved(K(2))
    # behind a stored chunk: deduped, then the chunk being written and all after it in_flight
    h.mgr.commit_store("a", "s", [0])
    h.mgr.prepare_store("a", "s2", [K(1), K(2)], NB)
    plan = h.mgr.prepare_store("b", "s", [K(1), K(2), K(3)], NB)
    h.check()
    assert plan == StorePlan([], 1, 2, 0)
    assert h.mgr.session_count == 1 and not h.l1.is_reserved(K(3))
    assert h.l1.get(K(1)).pins == 1  # type: ignore[union-attr]  # a2's prefix pin only: b opened no session


def test_duplicate_key_in_one_request_is_in_flight(h: Harness) -> None:
    # changed on purpose: the repeat is reserved by this very request, so it is in_flight
    plan = h.mgr.prepare_store("c", "s", [K(1), K(1)], NB)
    h.check()
    assert _idx(plan) == [0] and (plan.deduped, plan.in_flight, plan.pool_full) == (0, 1, 0)


def test_overwrite_reserves_stored_chunks(h: Harness) -> None:
    h.store("c", "s1", [K(1)])
    plan = h.mgr.prepare_store("c", "s2", [K(1), K(2)], NB, overwrite=True)
    h.check()
    assert _idx(plan) == [0, 1] and (plan.deduped, plan.in_flight, plan.pool_full) == (0, 0, 0)
    assert h.l1.get(K(1)) is not None  # the old version stays visible until the commit


def test_overwrite_of_a_prefix_another_client_is_writing_reserves_nothing(h: Harness) -> None:
    # changed on purpose: an overwrite used to reserve the chunks around another client's
    # reservation (and count that one deduped); writing around it could commit a prefix of two
    # versions, so now nothing is reserved and every chunk is reported in_flight
    h.store("c", "s1", [K(1)])
    h.mgr.prepare_store("x", "s", [K(1), K(2)], NB)  # x extends the stored K(1) with K(2)
    plan = h.mgr.prepare_store("c", "s2", [K(1), K(2), K(3)], NB, overwrite=True)
    h.check()
    assert plan == StorePlan([], 0, 3, 0)
    assert h.mgr.session_count == 1 and h.l1.get(K(1)) is not None and not h.l1.is_reserved(K(3))


def test_pool_full_counts_exact(h: Harness) -> None:
    # 4 slots: K(1) stored and pinned, K(3) reserved by another session, room left for 2
    h.store("c", "s0", [K(1)])
    h.retrieve("r", "pin", [K(1)])
    h.mgr.prepare_store("o", "other", [K(3)], NB)
    # changed on purpose: K(3), reserved by another session, is in_flight (it used to count as
    # deduped). Changed on purpose again (version chains): the prefix no longer repeats keys (a
    # repeat of K(1) at chunk 7 is not the stored K(1), whose parent is none), and every chunk after
    # an in_flight one is in_flight: K(3) comes after the pool filled, so each outcome shows
    keys = [K(1), K(2), K(4), K(5), K(6), K(3), K(7)]
    plan = h.mgr.prepare_store("c", "s", keys, NB)
    h.check()
    assert _idx(plan) == [1, 2]  # K(2), K(4)
    assert plan.deduped == 1  # K(1)
    assert plan.pool_full == 2  # K(5), K(6)
    assert plan.in_flight == 2  # K(3), and K(7) after it
    assert h.evicted == []
    assert h.used == 4 * P
    assert h.l1.get(K(1)).pins == 2  # type: ignore[union-attr]  # the reader's, and the prefix pin


def test_pool_full_with_nothing_reserved_opens_no_session(h: Harness) -> None:
    for i in range(4):
        h.store("c", f"s{i}", [K(i)])
        h.retrieve("r", f"pin{i}", [K(i)])
    plan = h.mgr.prepare_store("c", "s", [K(7), K(8)], NB)
    h.check()
    assert plan == StorePlan([], 0, 0, 2)
    assert h.mgr.session_count == 4  # only the pinning sessions
    assert h.evicted == []


def test_prepare_store_evicts_lru_unpinned(h: Harness) -> None:
    for i in (1, 2, 3, 4):  # four independent objects (one-chunk prefixes), LRU in this order
        h.store("c", f"s0-{i}", [K(i)])
    h.retrieve("r", "pin", [K(1)])
    assert h.mgr.commit_retrieve("r", "pin") == 1  # K(1) now most recently used
    h.check()
    plan = h.mgr.prepare_store("c", "s", [K(5), K(6)], NB)
    h.check()
    assert _idx(plan) == [0, 1]
    assert h.evicted == [K(2), K(3)]
    assert h.mgr.lookup_l1([K(1)]) == 1 and h.mgr.lookup_l1([K(4)]) == 1


def test_store_never_evicts_the_prefix_it_extends() -> None:
    h = Harness(slots=2)
    h.store("c", "s0", [K(1), K(2)])  # LRU: K1, K2
    plan = h.mgr.prepare_store("c", "s", [K(1), K(3)], NB)  # K1 is pinned while K3 needs a slot
    h.check()
    assert (_idx(plan), plan.deduped, plan.pool_full) == ([1], 1, 0)
    assert h.evicted == [K(2)]
    h.mgr.commit_store("c", "s", [1])
    h.check()
    assert h.mgr.lookup_l1([K(1), K(3)]) == 2
    assert h.l1.lru_keys() == [K(3), K(1)]  # K1 released after K3 was committed
    # one slot, everything of the prefix kept: the new chunk does not fit
    h1 = Harness(slots=1)
    h1.store("c", "s0", [K(1)])
    plan = h1.mgr.prepare_store("c", "s", [K(1), K(2)], NB)
    assert (_idx(plan), plan.deduped, plan.pool_full) == ([], 1, 1)
    assert h1.mgr.session_count == 0 and h1.mgr.lookup_l1([K(1)]) == 1
    assert h1.l1.get(K(1)).pins == 0  # type: ignore[union-attr]  # no session: the prefix pin went too
    h1.check()


def test_overwrite_that_finds_no_room_removes_the_older_version() -> None:
    h = Harness(slots=3)
    h.store("c", "s0", [K(1), K(2), K(3)])
    pinned = h.retrieve("r", "pin", [K(1), K(2), K(3)])  # nothing can be evicted
    old = {o.key: o for o in pinned}
    plan = h.mgr.prepare_store("c", "s", [K(1), K(2)], NB, overwrite=True)
    h.check()
    assert plan == StorePlan([], 0, 0, 2)
    # neither older version may stay visible: a later store of the rest would mix versions
    assert h.mgr.lookup_l1([K(1), K(2), K(3)]) == 0 and h.l1.get(K(1)) is None and h.l1.get(K(2)) is None
    # changed on purpose (version chains): K(3) stays in L1 (it used to be found by a lookup of
    # [K(3)] alone, as if it began a prefix), but it names the older K(2) as its parent: no new
    # K(1), K(2) will ever lead to it
    assert h.l1.get(K(3)) is old[K(3)] and old[K(3)].parent == old[K(2)].version
    assert not old[K(1)].live and old[K(1)].pins == 1  # the reader's copy stays intact meanwhile
    assert h.used == 3 * P
    h.mgr.commit_retrieve("r", "pin")
    h.check()
    assert h.used == P and h.l1.lru_keys() == [K(3)]


def test_commit_store_of_a_subset_drops_the_rest(h: Harness) -> None:
    plan = h.mgr.prepare_store("c", "s", [K(1), K(2), K(3)], NB)
    dropped = plan.slots[1][1]
    assert h.mgr.commit_store("c", "s", [0, 2]) == 2
    h.check()
    assert h.mgr.session_count == 0
    assert h.l1.get(K(1)) is not None and h.l1.get(K(3)) is not None
    assert h.l1.get(K(2)) is None and not h.l1.is_reserved(K(2))
    assert not dropped.live
    assert h.used == 2 * P
    assert h.mgr.lookup_l1([K(1), K(2), K(3)]) == 1
    # K(2) can be stored again now (after the K(1) it follows) ...
    again = h.store("c", "s2", [K(1), K(2)])
    assert _idx(again) == [1] and again.deduped == 1
    # ... but the committed K(3) names the dropped K(2) as its parent: it does not follow the new one
    assert h.l1.get(K(3)).parent == dropped.version != again.slots[0][1].version  # type: ignore[union-attr]
    assert h.mgr.lookup_l1([K(1), K(2), K(3)]) == 2
    assert _idx(h.store("c", "s3", [K(1), K(2), K(3)])) == [2]  # so K(3) is written anew
    assert h.mgr.lookup_l1([K(1), K(2), K(3)]) == 3


def test_commit_store_of_nothing_aborts_everything(h: Harness) -> None:
    h.mgr.prepare_store("c", "s", [K(1), K(2)], NB)
    assert h.mgr.commit_store("c", "s", []) == 0
    h.check()
    assert h.used == 0 and h.l1.reserved_count() == 0 and h.mgr.session_count == 0


def test_commit_store_of_an_unreserved_chunk_is_a_session_error(h: Harness) -> None:
    h.mgr.prepare_store("c", "s", [K(1), K(2)], NB)
    with pytest.raises(SessionError, match="chunk 5 was not reserved by session 's'"):
        h.mgr.commit_store("c", "s", [0, 5])
    h.check()
    assert h.mgr.lookup_l1([K(1)]) == 0  # nothing was committed
    assert h.mgr.session_count == 1
    assert h.mgr.commit_store("c", "s", [0, 1]) == 2
    h.check()


def test_commit_store_with_a_repeated_index_keeps_integrity(h: Harness) -> None:
    # a client-supplied chunk list like [0, 0] is refused before anything changes
    h.mgr.prepare_store("c", "s", [K(1), K(2)], NB)
    with pytest.raises(SessionError, match=r"chunk indexes repeat in \[0, 0\]"):
        h.mgr.commit_store("c", "s", [0, 0])
    assert h.l1.reserved_count() == 2 and h.mgr.lookup_l1([K(1)]) == 0
    h.check()
    h.mgr.end_session("c", "s")
    h.check()
    assert h.l1.reserved_count() == 0
    assert h.mgr.session_count == 0


# ---------------------------------------------------------------- sessions


def test_duplicate_session_id_is_refused(h: Harness) -> None:
    h.mgr.prepare_store("c", "s", [K(1)], NB)
    with pytest.raises(SessionError, match="session 's' is already open"):
        h.mgr.prepare_store("c", "s", [K(2)], NB)
    with pytest.raises(SessionError, match="session 's' is already open"):
        h.mgr.open_retrieve("c", "s", [K(1)])
    h.check()
    assert not h.l1.is_reserved(K(2))  # the refused request reserved nothing
    # another client may use the same session id
    assert _idx(h.mgr.prepare_store("d", "s", [K(2)], NB)) == [0]
    h.check()


def test_unknown_session_errors(h: Harness) -> None:
    for call in (
        lambda: h.mgr.reservations("c", "nope", [0]),
        lambda: h.mgr.commit_store("c", "nope", [0]),
        lambda: h.mgr.commit_retrieve("c", "nope"),
        lambda: h.mgr.sessions.get("c", "nope"),
        lambda: asyncio.run(h.mgr.wait_deletes("c", "nope")),
    ):
        with pytest.raises(SessionError, match="no open session 'nope'"):
            call()
    assert h.mgr.end_session("c", "nope") is False
    assert not h.mgr.sessions.has("c", "nope")
    h.check()


def test_session_is_gone_after_commit(h: Harness) -> None:
    h.store("c", "s", [K(1)])
    with pytest.raises(SessionError):
        h.mgr.commit_store("c", "s", [0])
    with pytest.raises(SessionError):
        h.mgr.reservations("c", "s", [0])


def test_end_session_aborts_reservations_and_releases_pins(h: Harness) -> None:
    h.store("c", "s0", [K(1)])
    h.mgr.prepare_store("c", "st", [K(2), K(3)], NB)
    h.retrieve("c", "rt", [K(1)])
    assert h.l1.get(K(1)).pins == 1  # type: ignore[union-attr]
    assert h.mgr.end_session("c", "st") is True
    h.check()
    assert h.l1.reserved_count() == 0 and h.used == P
    assert h.mgr.end_session("c", "rt") is True
    h.check()
    assert h.l1.get(K(1)).pins == 0  # type: ignore[union-attr]
    assert h.l1.lru_keys() == [K(1)]
    assert h.mgr.end_session("c", "rt") is False


# ---------------------------------------------------------------- retrieve


def test_open_retrieve_pins_leading_run(h: Harness) -> None:
    h.store("c", "s", [K(1), K(2), K(4)])
    hits = h.retrieve("c", "r", [K(1), K(2), K(3), K(4)])
    assert [o.key for o in hits] == [K(1), K(2)]
    assert [o.pins for o in hits] == [1, 1]
    assert h.pins("c", "r") == 2
    assert h.l1.lru_keys() == [K(4)]
    assert h.mgr.commit_retrieve("c", "r") == 2
    h.check()
    assert [o.pins for o in hits] == [0, 0]
    assert h.l1.lru_keys() == [K(4), K(1), K(2)]  # retrieved objects become most recently used
    assert h.mgr.session_count == 0


def test_open_retrieve_of_a_miss(h: Harness) -> None:
    # changed on purpose: open_retrieve always opens the session (a prefetch may fill it); with
    # no lower tier there is no prefetch, and the caller ends a session that pins nothing
    h.store("c", "s", [K(2)])
    session = h.mgr.open_retrieve("c", "r", [K(1), K(2)])
    assert session.pinned == [] and session.keys == [K(1), K(2)]
    assert h.mgr.start_prefetch(session) is None
    with pytest.raises(AssertionError, match="an open session holds nothing"):
        h.check()
    assert h.mgr.end_session("c", "r") is True
    h.check()
    assert h.mgr.session_count == 0
    with pytest.raises(SessionError):
        h.pins("c", "r")


def test_two_sessions_pin_the_same_object(h: Harness) -> None:
    # changed on purpose (version chains): b retrieved [K(1), K(1)] and pinned K(1) twice; a repeat
    # of a key in a prefix is not the stored object (that one has no parent), so a retrieve can no
    # longer pin one object twice
    h.store("c", "s", [K(1)])
    h.retrieve("a", "r", [K(1)])
    assert [o.key for o in h.retrieve("b", "r", [K(1), K(1)])] == [K(1)]
    obj = h.l1.get(K(1))
    assert obj is not None and obj.pins == 2
    assert h.mgr.commit_retrieve("b", "r") == 1
    h.check()
    assert obj.pins == 1 and h.l1.lru_keys() == []
    h.mgr.commit_retrieve("a", "r")
    h.check()
    assert obj.pins == 0 and h.l1.lru_keys() == [K(1)]


def test_overwrite_while_pinned_by_a_retrieve(h: Harness) -> None:
    h.store("c", "s", [K(1)])
    old = h.l1.get(K(1))
    h.retrieve("r", "r", [K(1)])
    plan = h.store("w", "s", [K(1)], overwrite=True)
    new = plan.slots[0][1]
    assert h.l1.get(K(1)) is new and new is not old
    assert old is not None and not old.live and old.pins == 1
    assert h.used == 2 * P
    h.mgr.commit_retrieve("r", "r")
    h.check()
    assert h.used == P
    assert h.l1.lru_keys() == [K(1)] and h.l1.get(K(1)) is new


# ---------------------------------------------------------------- leases


def test_expire_releases_pins_and_reservations_with_injected_clock(h: Harness) -> None:
    h.store("c", "s0", [K(1)])
    h.clock.now = 100.0
    h.mgr.prepare_store("c", "st", [K(2), K(3)], NB)  # deadline 110
    h.retrieve("c", "rt", [K(1)])  # deadline 110
    h.clock.now = 105.0
    h.mgr.reservations("c", "st", [0])  # renews: deadline 115
    h.clock.now = 110.0
    assert h.mgr.sessions.expire() == 0  # deadline 110 is not yet past
    h.check()
    h.clock.now = 110.5
    assert h.mgr.sessions.expire() == 1  # the retrieve session
    h.check()
    assert h.l1.get(K(1)).pins == 0  # type: ignore[union-attr]
    assert h.l1.lru_keys() == [K(1)]
    with pytest.raises(SessionError):
        h.mgr.commit_retrieve("c", "rt")
    assert h.l1.reserved_count() == 2
    h.clock.now = 115.0
    assert h.mgr.sessions.expire() == 0
    h.clock.now = 115.01
    assert h.mgr.sessions.expire() == 1  # no writer (an inline client): its slots are freed at once
    h.check()
    assert h.l1.reserved_count() == 0 and h.used == P
    assert h.mgr.session_count == 0 and h.mgr.sessions.quarantine == {}
    assert h.mgr.sessions.expired == 2
    with pytest.raises(SessionError, match="lease ran out"):
        h.mgr.commit_store("c", "st", [0])
    assert h.mgr.lookup_l1([K(1), K(2)]) == 1
    # the keys are free to store again
    assert _idx(h.store("c", "st", [K(2), K(3)])) == [0, 1]


def test_session_pins_and_failed_commit_renew_the_lease(h: Harness) -> None:
    h.store("c", "s0", [K(1)])
    h.retrieve("c", "r", [K(1)])  # deadline 10
    h.clock.now = 8.0
    assert h.pins("c", "r") == 1  # sessions.get renews: deadline 18
    h.mgr.prepare_store("c", "s", [K(2)], NB)  # deadline 18
    h.clock.now = 9.0
    with pytest.raises(SessionError):
        h.mgr.commit_store("c", "s", [3])  # unknown chunk, but the session was touched: deadline 19
    h.clock.now = 18.5
    assert h.mgr.sessions.expire() == 1
    assert h.mgr.session_count == 1
    assert h.mgr.reservations("c", "s", [0])[0].key == K(2)
    h.check()


def test_expire_with_no_sessions(h: Harness) -> None:
    h.clock.now = 1e9
    assert h.mgr.sessions.expire() == 0
    assert h.mgr.sessions.expired == 0


def test_end_client_ends_only_that_clients_sessions(h: Harness) -> None:
    h.store("x", "s0", [K(1)])
    h.mgr.prepare_store("a", "s1", [K(2)], NB)
    h.retrieve("a", "r1", [K(1)])
    h.retrieve("b", "r1", [K(1)])
    assert h.mgr.session_count == 3
    assert h.mgr.sessions.end_client("a") == 2
    h.check()
    assert h.mgr.session_count == 1
    assert not h.l1.is_reserved(K(2))
    assert h.l1.get(K(1)).pins == 1  # type: ignore[union-attr]
    assert h.pins("b", "r1") == 1
    assert h.mgr.sessions.end_client("a") == 0
    assert h.mgr.sessions.end_client("nobody") == 0
    assert h.mgr.sessions.end_client("b") == 1
    h.check()
    assert h.mgr.session_count == 0 and h.used == P


# ---------------------------------------------------------------- quarantine of a shm writer's slots


def test_expire_quarantines_the_slots_of_a_writer(h: Harness) -> None:
    plan = h.mgr.prepare_store("c", "s", [K(1), K(2)], NB, writer=_me())
    offsets = {o.offset for _, o in plan.slots}
    h.clock.now = TTL + 1
    assert h.mgr.sessions.expire() == 1 and h.mgr.session_count == 0 and h.mgr.sessions.expired == 1
    h.check()
    # the slots stay allocated (the writer may still write them) but no longer block their keys
    assert h.used == 2 * P and h.l1.reserved_count() == 2
    assert list(h.mgr.sessions.quarantine) == [("c", "s")] and h.mgr.sessions.quarantined_bytes() == 2 * P
    assert not h.l1.is_reserved(K(1)) and h.mgr.lookup_l1([K(1)]) == 0
    again = h.mgr.prepare_store("d", "s", [K(1), K(2)], NB)
    assert len(again.slots) == 2 and offsets.isdisjoint(o.offset for _, o in again.slots)
    h.check()
    # quarantined slots are never handed out or evicted: the pool is full now
    assert h.mgr.prepare_store("e", "s", [K(3)], NB) == StorePlan([], 0, 0, 1)
    # the session id stays taken while quarantined
    with pytest.raises(SessionError, match="already open"):
        h.mgr.prepare_store("c", "s", [K(5)], NB)
    # the late writer's commit (its copy is over): refused, and its slots are freed
    with pytest.raises(SessionError, match="'s': its lease ran out before the commit; nothing was stored"):
        h.mgr.commit_store("c", "s", [0, 1])
    assert h.used == 2 * P and h.mgr.sessions.quarantine == {}
    assert h.mgr.commit_store("d", "s", [0, 1]) == 2
    h.check()
    assert h.mgr.lookup_l1([K(1), K(2)]) == 2


def test_end_session_releases_the_quarantine(h: Harness) -> None:
    h.mgr.prepare_store("c", "s", [K(1), K(2)], NB, writer=_me())
    h.clock.now = TTL + 1
    assert h.mgr.sessions.expire() == 1
    assert h.used == 2 * P
    assert h.mgr.end_session("c", "s") is True  # the client's EndSession after its copy
    h.check()
    assert h.used == 0 and h.l1.reserved_count() == 0 and h.mgr.sessions.quarantine == {}
    assert h.mgr.end_session("c", "s") is False


def test_end_client_quarantines_a_writers_reservations_and_releases_its_pins(h: Harness) -> None:
    h.store("x", "s0", [K(1)])
    h.mgr.prepare_store("a", "st", [K(2)], NB, writer=_me())
    h.mgr.prepare_store("a", "inline", [K(3)], NB)  # no writer: freed at once
    h.retrieve("a", "rt", [K(1)])
    assert h.mgr.sessions.end_client("a") == 3
    h.check()
    assert list(h.mgr.sessions.quarantine) == [("a", "st")]
    assert h.used == 2 * P and h.l1.get(K(1)).pins == 0  # type: ignore[union-attr]
    assert h.mgr.sessions.reap_quarantine() == 0  # this process is alive
    assert h.mgr.end_session("a", "st")
    assert h.used == P
    h.check()


def test_reap_quarantine_frees_only_the_slots_of_dead_writers(h: Harness) -> None:
    me = _me()
    h.mgr.prepare_store("a", "s", [K(1), K(2)], NB, writer=Writer(_dead_pid(), 0))
    h.mgr.prepare_store("b", "s", [K(3)], NB, writer=me)
    h.mgr.prepare_store("c", "s", [K(4)], NB, writer=Writer(me.pid, me.start_time + 1))  # pid reused
    h.clock.now = TTL + 1
    assert h.mgr.sessions.expire() == 3
    assert h.used == 4 * P and len(h.mgr.sessions.quarantine) == 3
    h.check()
    assert h.mgr.sessions.reap_quarantine() == 3  # slots of the dead process and of the pid's former owner
    h.check()
    assert list(h.mgr.sessions.quarantine) == [("b", "s")] and h.used == P
    assert h.mgr.sessions.reap_quarantine() == 0
    assert h.used == P  # a live writer keeps its slots
    assert h.mgr.end_session("b", "s") is True
    assert h.used == 0
    h.check()


# ---------------------------------------------------------------- held sessions


def test_end_session_of_a_held_session_releases_nothing_until_unhold(h: Harness) -> None:
    h.store("x", "s0", [K(1)])
    h.mgr.prepare_store("c", "s", [K(2), K(3)], NB)
    h.retrieve("c", "r", [K(1)])
    store, read = h.mgr.sessions.get("c", "s"), h.mgr.sessions.get("c", "r")
    h.mgr.sessions.hold(store)
    h.mgr.sessions.hold(read)
    h.mgr.sessions.hold(read)  # two pieces of work for one session
    h.clock.now = TTL + 1
    assert h.mgr.sessions.expire() == 0  # a busy session's lease waits
    assert h.mgr.end_session("c", "s") is True and h.mgr.end_session("c", "r") is True
    assert not store.open and not read.open and h.mgr.session_count == 0
    with pytest.raises(SessionError):
        h.mgr.reservations("c", "s", [0])
    h.check()  # what the ended sessions still hold is accounted for
    assert h.used == 3 * P and h.l1.reserved_count() == 2 and h.l1.get(K(1)).pins == 1  # type: ignore[union-attr]
    h.mgr.sessions.unhold(store)
    h.check()
    assert h.used == P and h.l1.reserved_count() == 0
    h.mgr.sessions.unhold(read)
    assert h.l1.get(K(1)).pins == 1  # type: ignore[union-attr]  # still held once
    h.check()
    h.mgr.sessions.unhold(read)
    h.check()
    assert h.l1.get(K(1)).pins == 0 and h.l1.lru_keys() == [K(1)]  # type: ignore[union-attr]


def test_a_held_writer_ended_by_its_client_closing_is_quarantined_at_unhold(h: Harness) -> None:
    h.mgr.prepare_store("c", "s", [K(1)], NB, writer=_me())
    session = h.mgr.sessions.get("c", "s")
    h.mgr.sessions.hold(session)
    assert h.mgr.sessions.end_client("c") == 1
    h.check()
    assert h.mgr.sessions.quarantine == {} and h.used == P
    h.mgr.sessions.unhold(session)
    h.check()
    assert list(h.mgr.sessions.quarantine) == [("c", "s")] and h.used == P
    assert h.mgr.end_session("c", "s") and h.used == 0


def test_end_session_after_end_client_of_a_held_writer_releases_its_slots(h: Harness) -> None:
    h.mgr.prepare_store("c", "s", [K(1)], NB, writer=_me())
    session = h.mgr.sessions.get("c", "s")
    h.mgr.sessions.hold(session)  # e.g. waiting for an overwrite's deletions
    assert h.mgr.sessions.end_client("c") == 1  # the client was forgotten meanwhile
    assert h.mgr.end_session("c", "s") is True  # ... and its EndSession arrives: its copy is over
    h.mgr.sessions.unhold(session)
    h.check()
    assert h.mgr.sessions.quarantine == {} and h.used == 0


def test_held_session_ended_by_end_session_is_not_quarantined(h: Harness) -> None:
    h.mgr.prepare_store("c", "s", [K(1)], NB, writer=_me())
    session = h.mgr.sessions.get("c", "s")
    h.mgr.sessions.hold(session)
    h.mgr.end_session("c", "s")  # the client ended it itself: its copy is over
    h.mgr.sessions.unhold(session)
    h.check()
    assert h.mgr.sessions.quarantine == {} and h.used == 0


# ---------------------------------------------------------------- corruption is detected


def test_integrity_passes_throughout_and_detects_a_wrong_pin_count(h: Harness) -> None:
    h.store("c", "s", [K(1), K(2)])
    h.retrieve("r", "r", [K(1)])
    h.mgr.prepare_store("w", "q", [K(3)], NB, writer=_me())
    h.clock.now = TTL + 1
    h.mgr.sessions.renew(h.mgr.sessions.get("r", "r"))
    assert h.mgr.sessions.expire() == 1  # the writer's: quarantined
    h.check()
    obj = h.l1.get(K(1))
    assert obj is not None and obj.pins == 1
    obj.pins += 1
    with pytest.raises(AssertionError, match="pin count does not match the sessions holding it"):
        h.check()
    obj.pins -= 1
    h.check()
    q = h.mgr.sessions.quarantine.pop(("w", "q"))
    with pytest.raises(AssertionError, match="belongs to no session, load or quarantine"):
        h.check()
    h.mgr.sessions.quarantine[("w", "q")] = q
    h.check()


def test_integrity_detects_pin_outside_any_session(h: Harness) -> None:
    h.store("c", "s", [K(1)])
    h.l1.pin(h.l1.get(K(1)))  # type: ignore[arg-type]
    with pytest.raises(AssertionError, match="pin count"):
        h.check()


def test_integrity_detects_orphan_reservation(h: Harness) -> None:
    h.l1.reserve(K(1), NB)
    with pytest.raises(AssertionError, match="belongs to no session"):
        h.check()


# ================================================================ with lower tiers (tierworld)

KEYS = [WK(i) for i in range(1, 4)]


def await_prefetch_started(w: World, keys: list[ObjectKey], sid: str = "r"):  # type: ignore[no-untyped-def]
    """Open a retrieve session and start its prefetch, without waiting for it."""
    session = w.mgr.open_retrieve("c", sid, keys)
    assert w.mgr.start_prefetch(session) is not None
    return session


# ---------------------------------------------------------------- count and prefetch


def test_prefetch_promotes_from_l2_after_l1_eviction(tmp_path: Path) -> None:
    async def body(w: World) -> None:
        w.store(KEYS)
        await w.drain()
        w.store([WK(7), WK(8), WK(9)])  # evicts KEYS from the 3-slot L1
        assert w.l1.evictions == 3 and all(w.l1.get(k) is None for k in KEYS)
        await w.drain()
        assert await w.mgr.count(KEYS, NONE_IN_L1) == 3
        assert await w.mgr.count([*KEYS, WK(50), WK(9)], NONE_IN_L1) == 3
        session = await w.prefetch("r", KEYS)
        assert [o.key for o in session.pinned] == KEYS and all(o.pins == 1 for o in session.pinned)
        for k in KEYS:
            assert w.l1_bytes(k) == payload(k)
        c = w.lanes["l2"].counters
        assert (c.hits, c.bytes_read, c.corrupted) == (3, 3 * WNB, 0)
        assert w.l1.reserved_count() == 0 and w.l1.lru_keys() == []
        assert w.mgr.commit_retrieve("c", "r") == 3
        assert w.l1.lru_keys() == KEYS

    run(tmp_path, body, slots=3)


def test_prefetch_stops_at_the_first_miss(tmp_path: Path) -> None:
    async def body(w: World) -> None:
        w.store([WK(1), WK(2), WK(4)])
        await w.drain()
        w.evict_l1([WK(1), WK(2), WK(4)])
        keys = [WK(1), WK(2), WK(3), WK(4)]
        assert await w.mgr.count(keys, NONE_IN_L1) == 2
        session = await w.prefetch("r", keys)
        assert [o.key for o in session.pinned] == [WK(1), WK(2)]
        assert w.l1.get(WK(4)) is None and w.lanes["l2"].counters.hits == 2
        w.mgr.end_session("c", "r")

    run(tmp_path, body)


def test_prefetch_continues_after_the_l1_run(tmp_path: Path) -> None:
    async def body(w: World) -> None:
        w.store(KEYS)
        await w.drain()
        w.evict_l1(KEYS[1:])
        assert await w.mgr.count(KEYS, w.mgr.l1_hit(KEYS)) == 3
        session = await w.prefetch("r", KEYS)
        assert [o.key for o in session.pinned] == KEYS
        assert w.lanes["l2"].counters.hits == 2  # the first was already in L1
        w.mgr.commit_retrieve("c", "r")
        # nothing past the pinned run: no prefetch job
        full = w.mgr.open_retrieve("c", "r2", KEYS)
        assert w.mgr.start_prefetch(full) is None and len(full.pinned) == 3
        w.mgr.commit_retrieve("c", "r2")

    run(tmp_path, body)


def test_prefetch_from_l3_where_l2_lacks(tmp_path: Path, redis_server: RedisProc) -> None:
    async def body(w: World) -> None:
        assert w.disk is not None
        keys = [*KEYS, WK(4)]
        w.store(keys)
        await w.drain()
        assert w.lanes["l3"].counters.writes == 4 and w.lanes["l2"].counters.writes == 4
        for k in keys[1:3]:
            w.disk.delete(k)
        w.evict_l1(keys)
        assert await w.mgr.count(keys, NONE_IN_L1) == 4
        assert await w.mgr.count([*keys, WK(5)], NONE_IN_L1) == 4
        session = await w.prefetch("r", keys)
        assert [o.key for o in session.pinned] == keys
        for k in keys:
            assert w.l1_bytes(k) == payload(k)
        l2, l3 = w.lanes["l2"].counters, w.lanes["l3"].counters
        assert (l2.hits, l3.hits, l3.bytes_read, l3.corrupted) == (2, 2, 2 * WNB, 0)
        w.mgr.commit_retrieve("c", "r")

    run(tmp_path, body, redis_url=redis_server.url)


def test_corrupt_disk_file_is_deleted_and_stops_the_prefetch(tmp_path: Path) -> None:
    async def body(w: World) -> None:
        assert w.disk is not None
        w.store(KEYS)
        await w.drain()
        w.evict_l1(KEYS)
        bad = w.disk.path_for(WK(2))
        with open(bad, "r+b") as f:
            f.seek(ALIGN + WNB - 1)
            last = f.read(1)
            f.seek(ALIGN + WNB - 1)
            f.write(bytes([last[0] ^ 0xFF]))
        assert await w.mgr.count(KEYS, NONE_IN_L1) == 3  # not known to be bad until read
        session = await w.prefetch("r", KEYS)
        assert [o.key for o in session.pinned] == [WK(1)]
        assert w.disk.counters.corrupted == 1 and w.disk.counters.hits == 1
        assert not bad.exists() and not w.disk.knows(WK(2)) and w.disk.knows(WK(3))
        assert w.l1.get(WK(2)) is None and w.l1.get(WK(3)) is None and w.l1.reserved_count() == 0
        assert w.disk.used_bytes == 2 * FILE
        assert await w.mgr.count(KEYS, w.mgr.l1_hit(KEYS[:1])) == 1
        w.mgr.commit_retrieve("c", "r")

    run(tmp_path, body)


def test_concurrent_prefetches_of_one_key_load_it_once(tmp_path: Path) -> None:
    async def body(w: World) -> None:
        w.store([WK(1)])
        await w.drain()
        w.evict_l1([WK(1)])
        gate = w.block("l2", 1)
        try:
            s1 = w.mgr.open_retrieve("c", "r1", [WK(1)])
            s2 = w.mgr.open_retrieve("c", "r2", [WK(1)])
            j1 = w.mgr.start_prefetch(s1)
            j2 = w.mgr.start_prefetch(s2)
            assert j1 is not None and j2 is not None
            await until(lambda: w.l1.reserved_count() == 1 and w.mgr.loads.loading(WK(1)))
            await asyncio.sleep(0.02)
            assert w.l1.reserved_count() == 1 and not j1.done.is_set() and not j2.done.is_set()
            w.check()
        finally:
            gate.set()
        await asyncio.wait_for(asyncio.gather(j1.done.wait(), j2.done.wait()), 10)
        obj = w.l1.get(WK(1))
        assert obj is not None and obj.pins == 2
        assert s1.pinned == [obj] and s2.pinned == [obj]
        assert w.lanes["l2"].counters.hits == 1 and w.lanes["l2"].counters.bytes_read == WNB
        assert bytes(w.l1.view(obj)) == payload(WK(1))
        w.check()
        w.mgr.commit_retrieve("c", "r1")
        w.mgr.commit_retrieve("c", "r2")
        assert obj.pins == 0 and w.l1.lru_keys() == [WK(1)]

    run(tmp_path, body)


def test_session_end_during_a_load_leaks_nothing(tmp_path: Path) -> None:
    async def body(w: World) -> None:
        w.store(KEYS)
        await w.drain()
        w.evict_l1(KEYS)
        gate = w.block("l2", 1)
        try:
            session = w.mgr.open_retrieve("c", "r", KEYS)
            job = w.mgr.start_prefetch(session)
            assert job is not None and session.busy == 1
            await until(lambda: w.l1.reserved_count() == 1)
            w.check()
            assert w.mgr.end_session("c", "r") and job.cancelled and not session.open
            w.check()  # the slot being filled is owned by the load, not the ended session
            assert w.l1.reserved_count() == 1
        finally:
            gate.set()
        await asyncio.wait_for(job.done.wait(), 10)
        w.check()
        assert w.l1.reserved_count() == 0 and session.pinned == [] and w.mgr.session_count == 0
        assert session.busy == 0
        first = w.l1.get(WK(1))  # the load that was in flight finished into L1, unpinned
        assert first is not None and first.pins == 0 and w.l1.lru_keys() == [WK(1)]
        assert w.l1.get(WK(2)) is None and w.lanes["l2"].counters.hits == 1
        assert w.l1.allocator.used_bytes == ALIGN  # exactly one slot in use: nothing leaked

    run(tmp_path, body)


def test_a_store_of_a_key_being_loaded_is_in_flight_not_deduped(tmp_path: Path) -> None:
    """The load may still fail (a corrupt file): until it commits, the key is not known stored."""

    async def body(w: World) -> None:
        w.store([WK(1)])
        await w.drain()
        w.evict_l1([WK(1)])
        gate = w.block("l2", 1)
        session = await_prefetch_started(w, [WK(1)])
        await until(lambda: w.l1.is_reserved(WK(1)))
        assert w.mgr.prepare_store("c", "s", [WK(1)], WNB) == StorePlan([], 0, 1, 0)
        gate.set()
        await asyncio.wait_for(session.job.done.wait(), 10)
        assert [o.key for o in session.pinned] == [WK(1)]
        w.mgr.commit_retrieve("c", "r")

    run(tmp_path, body)


def test_restore_of_a_key_whose_old_file_a_later_write_evicts(tmp_path: Path) -> None:
    """X is on disk (least recently used) but no longer in L1; a store of [X, Z] dedups X against
    L2 (it chains) and writes Z, whose eviction of the least recently used entry must not unlink
    X's file. (The rewrite of X this once exercised is covered by the DiskTier tests.)"""

    async def body(w: World) -> None:
        assert w.disk is not None
        w.store([WK(1)])
        await w.drain()
        w.evict_l1([WK(1)])
        w.store([WK(1), WK(2)], deduped=1)
        await w.drain()
        assert w.disk.knows(WK(1)) and w.disk.knows(WK(2))
        assert w.disk.path_for(WK(1)).exists(), "X is indexed on disk but its file was deleted"
        w.evict_l1([WK(2)])  # X was never loaded back into L1
        session = await w.prefetch("r", [WK(1), WK(2)])
        assert [o.key for o in session.pinned] == [WK(1), WK(2)]
        w.mgr.commit_retrieve("c", "r")

    run(tmp_path, body, disk_files=2)


def test_a_failed_load_leaks_no_reservation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: a load that failed with an exception (here: deleting the corrupted L2 file
    fails, the filesystem went read-only) left its slot reserved forever, and the key could then
    never be stored (always "deduped") nor loaded."""

    async def body(w: World) -> None:
        assert w.disk is not None
        w.store([WK(1)])
        await w.drain()
        w.evict_l1([WK(1)])
        path = w.disk.path_for(WK(1))
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF  # corrupted payload: checksum mismatch on read
        path.write_bytes(bytes(data))

        def ro_unlink(self: Path, missing_ok: bool = False) -> None:
            raise OSError(errno.EROFS, "Read-only file system", str(self))

        monkeypatch.setattr(Path, "unlink", ro_unlink)
        session = await w.prefetch("r", [WK(1)])
        assert session.pinned == []
        w.mgr.end_session("c", "r")
        monkeypatch.undo()
        assert not w.l1.is_reserved(WK(1)), "the load's slot is still reserved after the load ended"
        assert w.disk.counters.corrupted == 1 and not w.disk.knows(WK(1))
        plan = w.mgr.prepare_store("c", "again", [WK(1)], WNB)
        assert plan.slots, f"K1 can no longer be stored: {plan}"
        w.mgr.end_session("c", "again")

    run(tmp_path, body)


def test_a_load_whose_read_raises_leaks_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async def body(w: World) -> None:
        assert w.disk is not None
        w.store([WK(1)])
        await w.drain()
        w.evict_l1([WK(1)])

        def broken(*args: object) -> Head | None:
            raise RuntimeError("the disk controller caught fire")

        monkeypatch.setattr(w.disk, "read_into", broken)
        session = await w.prefetch("r", [WK(1)])
        assert session.pinned == [] and w.l1.reserved_count() == 0 and w.l1.allocator.used_bytes == 0
        w.mgr.end_session("c", "r")
        monkeypatch.undo()
        session = await w.prefetch("r2", [WK(1)])
        assert [o.key for o in session.pinned] == [WK(1)]
        w.mgr.commit_retrieve("c", "r2")

    run(tmp_path, body)


# ---------------------------------------------------------------- overwrites across tiers


def test_overwrite_deletes_the_older_version_from_every_tier(tmp_path: Path, redis_server: RedisProc) -> None:
    async def body(w: World) -> None:
        assert w.disk is not None and w.redis is not None
        old = w.store(KEYS, version=1)
        await w.drain()
        assert await w.store_async(KEYS[:2], version=2, overwrite=True) == 2
        for lane in w.lanes.values():
            assert lane.counters.deletes == 2
        assert w.mgr.deletions.counts == {}
        await w.drain()
        new = [w.l1.get(k) for k in KEYS[:2]]
        assert all(o is not None for o in new)
        w.evict_l1(KEYS)
        # both tiers hold the new versions of the first two chunks, and the third as it was
        assert w.disk.heads(KEYS) == w.redis.heads(KEYS) == [*(head(o) for o in new), head(old[2])]  # type: ignore[arg-type]
        # changed on purpose (version chains): the prefetch used to return new, new, OLD: the third
        # chunk, computed over the older first two, names the older second chunk as its parent, so
        # the prefix ends before it
        assert await w.mgr.count(KEYS, NONE_IN_L1) == 2
        session = await w.prefetch("r", KEYS)
        assert [bytes(w.l1.view(o)) for o in session.pinned] == [payload(KEYS[0], 2), payload(KEYS[1], 2)]
        assert w.lanes["l2"].counters.hits == 2
        w.mgr.commit_retrieve("c", "r")

    run(tmp_path, body, redis_url=redis_server.url)


def test_commit_store_before_wait_deletes_is_refused(tmp_path: Path) -> None:
    async def body(w: World) -> None:
        w.store([WK(1)], version=1)
        await w.drain()
        gate = w.block()
        plan = w.mgr.prepare_store("c", "s", [WK(1)], WNB, overwrite=True)
        assert len(plan.slots) == 1
        with pytest.raises(AssertionError, match="commit_store before wait_deletes"):
            w.mgr.commit_store("c", "s", [0])
        session = w.mgr.sessions.get("c", "s")
        waiting = asyncio.ensure_future(w.mgr.wait_deletes("c", "s"))
        await asyncio.sleep(0.02)
        assert session.busy == 1 and not waiting.done()  # the lease waits with it
        w.check()
        gate.set()
        assert await asyncio.wait_for(waiting, 10) is True and session.busy == 0
        assert w.mgr.commit_store("c", "s", [0]) == 1

    run(tmp_path, body)


def test_overwrite_refused_when_a_tier_cannot_delete(tmp_path: Path, redis_server: RedisProc) -> None:
    async def body(w: World) -> None:
        w.store([WK(1)], version=1)
        await w.drain()
        redis_server.stop()
        with pytest.raises(RequestError, match="overwrite refused: l3 could not delete the older version") as info:
            await w.store_async([WK(1)], version=2, overwrite=True)
        assert info.value.code == "tier_unavailable"
        assert "nothing was stored (retry when the tier is back)" in str(info.value)
        w.check()
        assert w.mgr.session_count == 0 and w.l1.reserved_count() == 0
        assert w.l1_bytes(WK(1)) == payload(WK(1), 1)  # nothing was stored
        # with the tier known to be down, the deletion is refused at once, and so is the overwrite
        with pytest.raises(RequestError) as info:
            await w.store_async([WK(1)], version=2, overwrite=True)
        assert info.value.code == "tier_unavailable"
        # deletes_ok=False refuses even without waiting for anything
        plan = w.mgr.prepare_store("c", "plain", [WK(5)], WNB)
        with pytest.raises(RequestError, match="overwrite refused") as info:
            w.mgr.commit_store("c", "plain", [i for i, _ in plan.slots], deletes_ok=False)
        assert info.value.code == "tier_unavailable" and w.l1.get(WK(5)) is None and w.mgr.session_count == 0

    run(tmp_path, body, redis_url=redis_server.url)


def test_overwrite_with_pool_full_chunks_never_leaves_a_mixed_prefix(tmp_path: Path) -> None:
    async def body(w: World) -> None:
        assert w.disk is not None
        w.store(KEYS, version=1)
        await w.drain()
        reader = await w.prefetch("reader", KEYS)  # pins all three: only one slot is free
        assert len(reader.pinned) == 3
        gate = w.block()  # the deletions stay queued
        plan = w.mgr.prepare_store("c", "s", KEYS, WNB, overwrite=True)
        assert _idx(plan) == [0] and (plan.deduped, plan.in_flight, plan.pool_full) == (0, 0, 2)
        w.l1.view(plan.slots[0][1])[:] = payload(KEYS[0], 2)
        w.check()
        # the older versions of the chunks that found no room are not visible anywhere any more
        assert w.mgr.lookup_l1(KEYS) == 1 and w.l1.get(KEYS[1]) is None and w.l1.get(KEYS[2]) is None
        assert w.disk.knows(KEYS[1])  # still on disk: its deletion is queued
        assert await w.mgr.count(KEYS, w.mgr.l1_hit(KEYS[:1])) == 1
        gate.set()
        assert await w.mgr.wait_deletes("c", "s") is True
        assert w.mgr.commit_store("c", "s", [0]) == 1
        assert w.mgr.lookup_l1(KEYS) == 1 and await w.mgr.count(KEYS, w.mgr.l1_hit(KEYS[:1])) == 1
        assert w.l1_bytes(KEYS[0]) == payload(KEYS[0], 2)
        assert bytes(w.l1.view(reader.pinned[1])) == payload(KEYS[1], 1)  # the reader's copy was intact
        w.mgr.commit_retrieve("c", "reader")
        await w.drain()
        w.evict_l1([KEYS[0]])
        session = await w.prefetch("r", KEYS)
        assert [bytes(w.l1.view(o)) for o in session.pinned] == [payload(KEYS[0], 2)]
        w.mgr.commit_retrieve("c", "r")

    run(tmp_path, body, slots=4)


def test_count_and_loads_skip_keys_being_deleted(tmp_path: Path) -> None:
    async def body(w: World) -> None:
        assert w.disk is not None
        w.store([WK(1)], version=1)
        await w.drain()
        w.evict_l1([WK(1)])
        w.store([WK(8), WK(9)])
        pin = await w.prefetch("pin", [WK(8), WK(9)])  # L1 full of pinned objects
        assert len(pin.pinned) == 2
        gate = w.block()
        # an overwrite that finds no room: no session, but its deletion is queued all the same
        assert w.mgr.prepare_store("c", "s", [WK(1)], WNB, overwrite=True) == StorePlan([], 0, 0, 1)
        assert w.mgr.deletions.counts == {WK(1): 1} and w.mgr.session_count == 1
        w.mgr.commit_retrieve("c", "pin")  # room for a load now
        assert w.disk.knows(WK(1))  # the older version is still on disk ...
        assert await w.mgr.count([WK(1)], NONE_IN_L1) == 0  # ... but not counted
        session = await w.prefetch("r", [WK(1)])
        assert session.pinned == [] and w.disk.counters.hits == 0  # ... nor loaded
        assert w.l1.get(WK(1)) is None and w.l1.reserved_count() == 0
        w.mgr.end_session("c", "r")
        gate.set()
        await until(lambda: not w.mgr.deletions.counts)
        assert not w.disk.knows(WK(1)) and await w.mgr.count([WK(1)], NONE_IN_L1) == 0
        assert w.disk.counters.deletes == 1

    run(tmp_path, body, slots=2)


def test_count_of_a_tier_without_index_stops_at_a_key_being_deleted(tmp_path: Path, redis_server: RedisProc) -> None:
    # changed on purpose (version chains): the overwrite was of [KEYS[1]] alone, as if the second
    # chunk began a prefix of its own; it is the prefix KEYS[:2] now. The older first chunk stays in
    # L1 (visible until the commit) and the older second one in Redis only; then the run used to
    # count 3 and prefetch old, new, OLD: the third chunk names the older second one as its parent
    async def body(w: World) -> None:
        assert w.redis is not None
        old = w.store(KEYS, version=1)
        await w.drain()
        w.evict_l1(KEYS)
        assert await w.mgr.count(KEYS, NONE_IN_L1) == 3  # Redis answers heads() for the whole run
        session = await w.prefetch("r0", KEYS[:1])  # the first chunk back in L1
        w.mgr.commit_retrieve("c", "r0")
        gate = w.block("l3")
        task = asyncio.create_task(w.store_async(KEYS[:2], version=2, overwrite=True))
        await until(lambda: KEYS[1] in w.mgr.deletions)
        assert w.redis.heads(KEYS) == [head(o) for o in old]  # the older versions are still there ...
        assert w.mgr.lookup_l1(KEYS) == 1  # (the older first chunk is still visible in L1)
        assert await w.mgr.count(KEYS, NONE_IN_L1) == 1  # ... and the run stops before the second
        assert await w.mgr.count(KEYS, w.mgr.l1_hit(KEYS[:1])) == 1
        gate.set()
        assert await asyncio.wait_for(task, 10) == 2
        assert await w.mgr.count(KEYS, NONE_IN_L1) == 2  # the new versions are in L1; the old third does not follow
        await w.drain()
        assert w.redis.heads(KEYS) == [head(w.l1.get(k)) for k in KEYS[:2]] + [head(old[2])]  # type: ignore[arg-type]
        session = await w.prefetch("r", KEYS)
        assert [bytes(w.l1.view(o)) for o in session.pinned] == [payload(KEYS[0], 2), payload(KEYS[1], 2)]
        w.mgr.commit_retrieve("c", "r")

    run(tmp_path, body, redis_url=redis_server.url, disk=False)


def test_an_overwrite_supersedes_a_load_in_flight(tmp_path: Path) -> None:
    """Regression: an overwrite of a key that a prefetch was loading from L2 was answered
    "deduped": the client's edit was dropped and the older version became READY."""

    async def body(w: World) -> None:
        assert w.disk is not None
        w.store([WK(1)], version=1)
        await w.drain()
        w.evict_l1([WK(1)])  # only L2 holds it now
        reader = w.block("l2", 1)  # the load stays in flight
        writer = w.block("l2", 0)  # and the overwrite's deletion does not run before it
        session = await_prefetch_started(w, [WK(1)])
        await until(lambda: w.l1.is_reserved(WK(1)))
        load = w.l1.reservation(WK(1))
        plan = w.mgr.prepare_store("c", "edit", [WK(1)], WNB, overwrite=True)
        assert len(plan.slots) == 1, f"overwrite=True was refused as a dedup while a load was in flight: {plan}"
        assert plan.slots[0][1] is not load and w.l1.reservation(WK(1)) is plan.slots[0][1]
        w.l1.view(plan.slots[0][1])[:] = payload(WK(1), 2)
        w.check()  # the load's slot is set aside, still owned by the load
        reader.set()
        await asyncio.wait_for(session.job.done.wait(), 10)
        assert session.pinned == [] and w.l1.get(WK(1)) is None  # the older bytes were thrown away
        assert load is not None and not load.live
        w.check()
        writer.set()
        assert await w.mgr.wait_deletes("c", "edit") is True
        assert w.mgr.commit_store("c", "edit", [0]) == 1
        assert w.l1_bytes(WK(1)) == payload(WK(1), 2)
        w.mgr.end_session("c", "r")
        await w.drain()
        assert w.l1.allocator.used_bytes == ALIGN  # the superseded load's slot was freed
        w.evict_l1([WK(1)])
        again = await w.prefetch("r2", [WK(1)])
        assert [bytes(w.l1.view(o)) for o in again.pinned] == [payload(WK(1), 2)]
        w.mgr.commit_retrieve("c", "r2")

    run(tmp_path, body)


def test_a_skipped_write_down_of_an_overwrite_leaves_no_older_version(tmp_path: Path) -> None:
    """Regression: when the write-down of an overwrite was skipped, the older version stayed in
    L2, and after L1 evicted the new one a retrieve returned the OLD bytes. Changed on purpose:
    the skip came from the write-down backlog cap, which is gone; a write-down is now skipped when
    its object leaves L1 before its turn, and the overwrite deleted the older version already."""

    async def body(w: World) -> None:
        assert w.disk is not None
        w.store([WK(1)], version=1)
        await w.drain()
        plan = w.mgr.prepare_store("c", "edit", [WK(1)], WNB, overwrite=True)
        w.l1.view(plan.slots[0][1])[:] = payload(WK(1), 2)
        assert await w.mgr.wait_deletes("c", "edit") is True
        assert not w.disk.knows(WK(1))
        gate = w.block()
        w.store([WK(5)])  # in flight behind the gate
        assert w.mgr.commit_store("c", "edit", [0]) == 1  # its write-down is queued behind
        w.evict_l1([WK(1)])  # L1 drops the new version before its turn
        gate.set()
        await w.drain()
        assert w.disk.counters.writes_skipped == 1
        session = await w.prefetch("r", [WK(1)])
        got = bytes(w.l1.view(session.pinned[0])) if session.pinned else None
        w.mgr.end_session("c", "r")
        assert got != payload(WK(1), 1), "retrieve after an overwrite returned the old version from L2"
        assert got is None

    run(tmp_path, body)


def test_check_integrity_passes_while_a_write_down_is_in_flight(tmp_path: Path) -> None:
    async def body(w: World) -> None:
        assert w.disk is not None
        w.disk.fault_write_delay_s = 1.0
        w.store([WK(1)])
        await until(lambda: w.disk is not None and w.disk.used_bytes > 0)  # the write promised its bytes
        w.mgr.check_integrity()

    run(tmp_path, body)


# ---------------------------------------------------------------- mixed versions, shared L3, quarantine


def _version_of(key: ObjectKey, data: bytes) -> int:
    for v in range(4):
        if data == payload(key, v):
            return v
    return -1


def test_prefetch_waiting_on_another_load_never_pins_a_mixed_prefix(tmp_path: Path) -> None:
    A, B, C = WK(1), WK(2), WK(3)

    async def body(w: World) -> None:
        w.store([A, B, C])
        await w.drain()
        w.evict_l1([C])  # A, B in L1; C only in L2
        gate = w.block("l2", 1)  # the L2 reader is slow
        try:
            sx = await_prefetch_started(w, [A, B, C], "x")  # x loads C
            await until(lambda: w.mgr.loads.loading(C))
            sy = await_prefetch_started(w, [A, B, C], "y")  # y pins A0, B0 and waits for x's load of C
            await asyncio.sleep(0.02)
            assert [o.key for o in sy.pinned] == [A, B]
            # an overwrite of the whole prefix, acknowledged while the load is in flight
            assert await w.store_async([A, B, C], version=1, overwrite=True) == 3
        finally:
            gate.set()
        await asyncio.wait_for(asyncio.gather(sx.job.done.wait(), sy.job.done.wait()), 10)
        versions = [_version_of(o.key, bytes(w.l1.view(o))) for o in sy.pinned]
        w.mgr.commit_retrieve("c", "x")
        w.mgr.commit_retrieve("c", "y")
        await w.drain()
        assert len(set(versions)) <= 1, f"session y pins versions {versions} of [A, B, C]"

    run(tmp_path, body)


def test_overwrite_leaves_no_continuation_of_the_old_prefix(tmp_path: Path) -> None:
    # was a strict xfail (wrong KV: an overwrite of [A, B, C] left [A, B, D], another continuation
    # of the overwritten prefix computed over the old A, B, cached; a retrieve of it gave new A, B +
    # old D). The version chain fixes it: D names the old B as its parent
    A, B, C, D = WK(1), WK(2), WK(3), WK(4)

    async def body(w: World) -> None:
        w.store([A, B, C])
        w.store([A, B, D], deduped=2)  # the sibling prefix [A, B, D]
        await w.drain()
        assert await w.store_async([A, B, C], version=1, overwrite=True) == 3
        await w.drain()
        session = await w.prefetch("r", [A, B, D])
        versions = [_version_of(o.key, bytes(w.l1.view(o))) for o in session.pinned]
        w.mgr.commit_retrieve("c", "r")
        assert len(set(versions)) <= 1, f"retrieve of [A, B, D] gives versions {versions}"
        assert versions == [1, 1]  # the new A, B; the old D does not follow them

    run(tmp_path, body)


def test_overwrite_committing_a_subset_leaves_no_mixed_prefix(tmp_path: Path) -> None:
    A, B = WK(1), WK(2)

    async def body(w: World) -> None:
        w.store([A, B])
        await w.drain()
        plan = w.mgr.prepare_store("c", "o", [A, B], WNB, overwrite=True)
        assert len(plan.slots) == 2
        for i, obj in plan.slots:
            w.l1.view(obj)[:] = payload([A, B][i], 1)
        assert await w.mgr.wait_deletes("c", "o")
        assert w.mgr.commit_store("c", "o", [0]) == 1  # acknowledged: chunk 0 only
        n = w.mgr.lookup_l1([A, B])
        versions = [_version_of(k, w.l1_bytes(k)) for k in [A, B][:n]]
        assert len(set(versions)) <= 1, f"lookup/retrieve of [A, B] sees versions {versions}"

    run(tmp_path, body)


def test_reap_quarantine_keeps_a_live_writer_when_proc_is_unreadable(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvdock.shm import segment

    h.mgr.prepare_store("c", "s", [K(1)], NB, writer=_me())
    h.clock.now = TTL + 1
    assert h.mgr.sessions.expire() == 1 and h.mgr.sessions.quarantine

    class NoFds:
        def __init__(self, *args: object) -> None:
            pass

        def read_text(self) -> str:
            raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(segment, "Path", NoFds)
    freed = h.mgr.sessions.reap_quarantine()
    monkeypatch.undo()
    assert freed == 0, "a live writer's quarantined slots were freed"


def test_dedup_against_a_load_that_fails_is_not_reported_stored(tmp_path: Path) -> None:
    A = WK(1)

    async def body(w: World) -> None:
        assert w.disk is not None
        w.store([A])
        await w.drain()
        w.evict_l1([A])
        gate = w.block("l2", 1)
        session = await_prefetch_started(w, [A])
        await until(lambda: w.l1.is_reserved(A))
        plan = w.mgr.prepare_store("c", "s", [A], WNB)
        with open(w.disk.path_for(A), "r+b") as f:  # the file turns out corrupt when read
            f.seek(ALIGN + 5)
            f.write(b"\xff\xff\xff")
        gate.set()
        await asyncio.wait_for(session.job.done.wait(), 10)
        w.mgr.end_session("c", "r")
        stored = w.l1.get(A) is not None or w.disk.knows(A) is not None
        assert plan.deduped == 0 or stored, f"{plan}: reported as already stored, but it is nowhere"

    run(tmp_path, body)


# ---------------------------------------------------------------- the version chain


def test_prepare_store_chains_the_versions_of_its_chunks() -> None:
    h = Harness(slots=8)
    keys = [K(1), K(2), K(3)]
    plan = h.mgr.prepare_store("c", "s", keys, NB)
    objs = [o for _, o in plan.slots]
    assert _idx(plan) == [0, 1, 2]
    assert all(o.version != 0 for o in objs) and len({o.version for o in objs}) == 3
    assert [o.parent for o in objs] == [0, objs[0].version, objs[1].version]
    assert h.mgr.commit_store("c", "s", [0, 1, 2]) == 3
    assert [h.l1.get(k) for k in keys] == objs  # committed as reserved
    # extending the stored prefix: the first new chunk follows the last deduped one
    plan = h.mgr.prepare_store("c", "s2", [*keys, K(4), K(5)], NB)
    more = [o for _, o in plan.slots]
    assert _idx(plan) == [3, 4] and plan.deduped == 3
    assert all(o.version != 0 for o in more) and more[0].version != more[1].version
    assert [o.parent for o in more] == [objs[2].version, more[0].version]
    assert h.mgr.commit_store("c", "s2", [3, 4]) == 2
    assert h.mgr.lookup_l1([*keys, K(4), K(5)]) == 5
    # an overwrite gives every chunk it writes a new version, chained from the first again
    plan = h.mgr.prepare_store("c", "s3", keys[:2], NB, overwrite=True)
    new = [o for _, o in plan.slots]
    assert all(o.version not in (0, objs[0].version, objs[1].version) for o in new)
    assert [o.parent for o in new] == [0, new[0].version]
    h.mgr.commit_store("c", "s3", [0, 1])
    h.check()
    # K(3) names the replaced K(2) as its parent: the prefix ends before it
    assert h.l1.get(K(3)) is objs[2] and objs[2].parent == objs[1].version != new[1].version
    assert h.mgr.lookup_l1([*keys, K(4), K(5)]) == 2


def test_an_overwrite_ends_a_sibling_prefix_after_the_chunks_it_replaced(tmp_path: Path) -> None:
    """[A, B, D] was stored after [A, B, C]; an overwrite of [A, B, C] replaces A and B, so D
    (computed over the older A, B) is no longer readable after them: not in L1, not counted from
    L2, not loaded by a prefetch."""
    A, B, C, D = WK(1), WK(2), WK(3), WK(4)

    async def body(w: World) -> None:
        assert w.disk is not None
        w.store([A, B, C])
        (d0,) = w.store([A, B, D], deduped=2)
        await w.drain()
        assert w.mgr.lookup_l1([A, B, D]) == 3 and await w.mgr.count([A, B, D], NONE_IN_L1) == 3
        assert await w.store_async([A, B, C], version=1, overwrite=True) == 3
        await w.drain()
        a1, b1 = w.l1.get(A), w.l1.get(B)
        assert a1 is not None and b1 is not None
        # D is still in L1 and on L2 as it was stored: after the older B
        assert w.l1.get(D) is d0 and w.disk.knows(D) == head(d0) and d0.parent not in (0, b1.version)
        assert w.mgr.lookup_l1([A, B, D]) == 2  # L1
        assert await w.mgr.count([A, B, D], w.mgr.l1_hit([A, B])) == 2  # neither L1's D nor L2's follows the new B
        w.evict_l1([A, B, C, D])
        assert w.disk.heads([A, B, D]) == [head(a1), head(b1), head(d0)]
        assert await w.mgr.count([A, B, D], NONE_IN_L1) == 2  # L2
        session = await w.prefetch("r", [A, B, D])  # a prefetch
        assert [o.key for o in session.pinned] == [A, B]
        assert [bytes(w.l1.view(o)) for o in session.pinned] == [payload(A, 1), payload(B, 1)]
        assert [head(o) for o in session.pinned] == [head(a1), head(b1)]
        assert w.l1.get(D) is None and w.l1.reserved_count() == 0
        assert w.disk.counters.hits == 2  # D was never read
        w.mgr.commit_retrieve("c", "r")

    run(tmp_path, body)


def test_a_store_after_an_overwrite_writes_the_sibling_chunk_anew(tmp_path: Path) -> None:
    """After the overwrite of [A, B, C], a plain store of [A, B, D] dedups the new A, B but not the
    D stored after the older ones: it writes a new D, and [A, B, D] reads back that one."""
    A, B, C, D = WK(1), WK(2), WK(3), WK(4)

    async def body(w: World) -> None:
        assert w.disk is not None
        w.store([A, B, C])
        (d0,) = w.store([A, B, D], deduped=2)
        await w.drain()
        assert await w.store_async([A, B, C], version=1, overwrite=True) == 3
        await w.drain()
        b1 = w.l1.get(B)
        assert b1 is not None
        (d2,) = w.store([A, B, D], version=2, deduped=2)  # D is written, not deduped
        assert d2.parent == b1.version and d2.version not in (0, d0.version)
        assert w.l1.get(D) is d2 and not d0.live
        assert w.mgr.lookup_l1([A, B, D]) == 3 and w.l1_bytes(D) == payload(D, 2)
        await w.drain()
        assert w.disk.knows(D) == head(d2)  # the new D replaced the older one on L2 too
        w.evict_l1([A, B, C, D])
        assert await w.mgr.count([A, B, D], NONE_IN_L1) == 3
        session = await w.prefetch("r", [A, B, D])
        assert [bytes(w.l1.view(o)) for o in session.pinned] == [payload(A, 1), payload(B, 1), payload(D, 2)]
        assert head(session.pinned[2]) == head(d2)
        w.mgr.commit_retrieve("c", "r")

    run(tmp_path, body)


def test_objects_written_before_geometry_digests_are_a_miss(tmp_path: Path) -> None:
    """Files of a previous run whose headers name no geometry (written before digests; here also
    before version chains) cannot say which split of the model's heads their bytes are: with the
    index filtered as the server wires it (DiskTier.identity_of), they are never counted, read or
    deduped against; a new store writes those chunks anew, and they read back."""
    keys = [WK(1), WK(2), WK(3)]
    previous = DiskTier(tmp_path / "l2", capacity=32 * FILE)  # the previous run's L2
    for k in keys:
        data = payload(k)
        previous.write_from(k, legacy_header(k, "float32", SHAPE, data), memoryview(data))
    previous.close()

    async def body(w: World) -> None:
        assert w.disk is not None
        assert w.disk.heads(keys) == [Head(0, 0)] * 3  # unfiltered, the index lists them
        w.disk.identity_of = lambda model: tierworld.GEO.digest(tierworld.CHUNK) if model == "tiny" else None
        assert w.disk.heads(keys) == [] and w.disk.knows(keys[0]) is None
        assert await w.mgr.count(keys, NONE_IN_L1) == 0
        session = await w.prefetch("r", keys)
        assert session.pinned == [] and w.disk.counters.hits == 0
        w.mgr.commit_retrieve("c", "r")
        written = w.store(keys, deduped=0)  # nothing deduped against them: every chunk written anew
        assert len(written) == 3
        await w.drain()
        w.evict_l1(keys)
        assert await w.mgr.count(keys, NONE_IN_L1) == 3
        session = await w.prefetch("r2", keys)
        assert [bytes(w.l1.view(o)) for o in session.pinned] == [payload(k) for k in keys]
        w.mgr.commit_retrieve("c", "r2")

    run(tmp_path, body, preloaded=3)


def test_a_load_that_finds_an_object_of_another_chain_is_not_a_hit(tmp_path: Path, redis_server: RedisProc) -> None:
    A, B, C, D = WK(1), WK(2), WK(3), WK(4)

    async def body(w: World) -> None:
        w.store([A, B, C])
        w.store([A, B, D], deduped=2)
        await w.drain()
        assert await w.store_async([A, B, C], version=1, overwrite=True) == 3
        await w.drain()
        w.evict_l1([A, B, C, D])
        assert await w.mgr.count([A, B, D], NONE_IN_L1) == 2
        session = await w.prefetch("r", [A, B, D])
        assert [o.key for o in session.pinned] == [A, B]  # D, after the older B, is refused
        w.mgr.commit_retrieve("c", "r")
        l3 = w.lanes["l3"].counters
        assert (l3.hits, l3.bytes_read) == (2, 2 * WNB), "an object thrown away counts as promoted into L1"

    run(tmp_path, body, redis_url=redis_server.url, disk=False)


def test_a_count_goes_on_from_the_l1_run_taken_even_if_it_was_evicted_since(tmp_path: Path) -> None:
    """A lookup takes L1's run in its handler and asks the lower tiers in a task that starts
    later: the run's last object may be evicted by then (it used to raise AttributeError)."""

    async def body(w: World) -> None:
        w.store(KEYS)
        await w.drain()
        w.evict_l1(KEYS[1:])
        hit = w.mgr.l1_hit(KEYS)
        assert hit.count == 1 and hit.parent == w.l1.get(KEYS[0]).version  # type: ignore[union-attr]
        w.evict_l1(KEYS[:1])  # before the count runs
        assert await w.mgr.count(KEYS, hit) == 3  # L2's chunks 1 and 2 chain to the version taken
        w.check()

    run(tmp_path, body)

"""kvdock.storage.manager: store/retrieve sessions, dedup, pool-full answers, leases and expiry."""

from __future__ import annotations

import pytest

from kvdock.errors import SessionError
from kvdock.keys import ObjectKey
from kvdock.shm.slots import ALIGN, SlotAllocator
from kvdock.storage.manager import StorageManager, StorePlan
from kvdock.storage.memory import L1Object, L1Store, State

P = ALIGN
NB = 1000  # one page per slot
TTL = 10.0


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
        self.l1 = L1Store(SlotAllocator(base=0, capacity=slots * P), on_evict=lambda o: self.evicted.append(o.key))
        self.mgr = StorageManager(self.l1, session_ttl=TTL, clock=self.clock)

    def check(self) -> None:
        self.mgr.check_integrity()

    def store(self, client: str, sid: str, keys: list[ObjectKey], overwrite: bool = False) -> StorePlan:
        plan = self.mgr.prepare_store(client, sid, keys, NB, overwrite)
        self.check()
        n = self.mgr.commit_store(client, sid, [i for i, _ in plan.slots])
        self.check()
        assert n == len(plan.slots)
        return plan

    def retrieve(self, client: str, sid: str, keys: list[ObjectKey]) -> list[L1Object]:
        hits = self.mgr.prepare_retrieve(client, sid, keys)
        self.check()
        return hits

    @property
    def used(self) -> int:
        return self.l1.allocator.used_bytes


@pytest.fixture
def h() -> Harness:
    return Harness(slots=4)


def _idx(plan: StorePlan) -> list[int]:
    return [i for i, _ in plan.slots]


# ---------------------------------------------------------------- store


def test_prepare_store_reserves_every_new_chunk(h: Harness) -> None:
    plan = h.mgr.prepare_store("c", "s", [K(1), K(2), K(3)], NB)
    h.check()
    assert _idx(plan) == [0, 1, 2]
    assert [o.key for _, o in plan.slots] == [K(1), K(2), K(3)]
    assert all(o.state is State.RESERVED for _, o in plan.slots)
    assert (plan.deduped, plan.pool_full) == (0, 0)
    assert h.mgr.session_count == 1
    assert h.mgr.lookup([K(1), K(2), K(3)]) == 0  # invisible until commit
    assert h.mgr.reservations("c", "s", [2, 0]) == [plan.slots[2][1], plan.slots[0][1]]
    assert h.mgr.commit_store("c", "s", [0, 1, 2]) == 3
    h.check()
    assert h.mgr.session_count == 0
    assert h.mgr.lookup([K(1), K(2), K(3)]) == 3
    assert h.l1.lru_keys() == [K(1), K(2), K(3)]


def test_lookup_counts_the_leading_run_only(h: Harness) -> None:
    h.store("c", "s", [K(1), K(2), K(4)])
    assert h.mgr.lookup([K(1), K(2), K(3), K(4)]) == 2
    assert h.mgr.lookup([K(3), K(1)]) == 0
    assert h.mgr.lookup([]) == 0
    assert h.mgr.lookup([K(1)]) == 1


def test_dedup_of_stored_chunks(h: Harness) -> None:
    h.store("c", "s1", [K(1), K(2)])
    plan = h.mgr.prepare_store("c", "s2", [K(1), K(2), K(3)], NB)
    h.check()
    assert _idx(plan) == [2]
    assert (plan.deduped, plan.pool_full) == (2, 0)
    assert h.mgr.commit_store("c", "s2", [2]) == 1
    h.check()


def test_everything_deduped_opens_no_session(h: Harness) -> None:
    h.store("c", "s1", [K(1), K(2)])
    plan = h.mgr.prepare_store("c", "s2", [K(1), K(2)], NB)
    h.check()
    assert plan == StorePlan([], 2, 0)
    assert h.mgr.session_count == 0
    with pytest.raises(SessionError, match="no open session 's2'"):
        h.mgr.commit_store("c", "s2", [])


def test_dedup_of_chunks_reserved_by_another_session(h: Harness) -> None:
    first = h.mgr.prepare_store("a", "s", [K(1)], NB)
    plan = h.mgr.prepare_store("b", "s", [K(1), K(2)], NB)
    h.check()
    assert _idx(first) == [0]
    assert _idx(plan) == [1] and plan.slots[0][1].key == K(2)
    assert (plan.deduped, plan.pool_full) == (1, 0)
    assert h.mgr.session_count == 2


def test_duplicate_key_in_one_request_is_deduped(h: Harness) -> None:
    plan = h.mgr.prepare_store("c", "s", [K(1), K(1)], NB)
    h.check()
    assert _idx(plan) == [0] and (plan.deduped, plan.pool_full) == (1, 0)


def test_overwrite_reserves_stored_chunks_but_not_reserved_ones(h: Harness) -> None:
    h.store("c", "s1", [K(1)])
    h.mgr.prepare_store("x", "s", [K(2)], NB)
    plan = h.mgr.prepare_store("c", "s2", [K(1), K(2), K(3)], NB, overwrite=True)
    h.check()
    assert _idx(plan) == [0, 2]
    assert (plan.deduped, plan.pool_full) == (1, 0)


def test_pool_full_counts_exact(h: Harness) -> None:
    # 4 slots: K(1) stored and pinned, K(3) reserved by another session, room left for 2
    h.store("c", "s0", [K(1)])
    h.retrieve("r", "pin", [K(1)])
    h.mgr.prepare_store("o", "other", [K(3)], NB)
    keys = [K(1), K(2), K(3), K(4), K(5), K(6), K(3), K(1)]
    plan = h.mgr.prepare_store("c", "s", keys, NB)
    h.check()
    assert _idx(plan) == [1, 3]  # K(2), K(4)
    assert plan.deduped == 4  # K(1), K(3), and their repeats after the pool filled
    assert plan.pool_full == 2  # K(5), K(6)
    assert h.evicted == []
    assert h.used == 4 * P


def test_pool_full_with_nothing_reserved_opens_no_session(h: Harness) -> None:
    for i in range(4):
        h.store("c", f"s{i}", [K(i)])
        h.retrieve("r", f"pin{i}", [K(i)])
    plan = h.mgr.prepare_store("c", "s", [K(7), K(8)], NB)
    h.check()
    assert plan == StorePlan([], 0, 2)
    assert h.mgr.session_count == 4  # only the pinning sessions
    assert h.evicted == []


def test_prepare_store_evicts_lru_unpinned(h: Harness) -> None:
    h.store("c", "s0", [K(1), K(2), K(3), K(4)])
    h.retrieve("r", "pin", [K(1)])
    h.mgr.commit_retrieve("r", "pin")  # K(1) now most recently used
    h.check()
    plan = h.mgr.prepare_store("c", "s", [K(5), K(6)], NB)
    h.check()
    assert _idx(plan) == [0, 1]
    assert h.evicted == [K(2), K(3)]
    assert h.mgr.lookup([K(1)]) == 1 and h.mgr.lookup([K(4)]) == 1


def test_store_never_evicts_the_prefix_it_extends() -> None:
    h = Harness(slots=2)
    h.store("c", "s0", [K(1), K(2)])  # LRU: K1, K2
    plan = h.mgr.prepare_store("c", "s", [K(1), K(3)], NB)  # K1 is pinned while K3 needs a slot
    h.check()
    assert (_idx(plan), plan.deduped, plan.pool_full) == ([1], 1, 0)
    assert h.evicted == [K(2)]
    h.mgr.commit_store("c", "s", [1])
    h.check()
    assert h.mgr.lookup([K(1), K(3)]) == 2
    assert h.l1.lru_keys() == [K(3), K(1)]  # K1 released after K3 was committed
    # one slot, everything of the prefix kept: the new chunk does not fit
    h1 = Harness(slots=1)
    h1.store("c", "s0", [K(1)])
    plan = h1.mgr.prepare_store("c", "s", [K(1), K(2)], NB)
    assert (_idx(plan), plan.deduped, plan.pool_full) == ([], 1, 1)
    assert h1.mgr.session_count == 0 and h1.mgr.lookup([K(1)]) == 1
    h1.check()


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
    assert h.mgr.lookup([K(1), K(2), K(3)]) == 1
    # K(2) can be stored again now
    assert _idx(h.store("c", "s2", [K(2)])) == [0]


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
    assert h.mgr.lookup([K(1)]) == 0  # nothing was committed
    assert h.mgr.session_count == 1
    assert h.mgr.commit_store("c", "s", [0, 1]) == 2
    h.check()


def test_commit_store_with_a_repeated_index_keeps_integrity(h: Harness) -> None:
    # a client-supplied chunk list like [0, 0] is refused before anything changes
    h.mgr.prepare_store("c", "s", [K(1), K(2)], NB)
    with pytest.raises(SessionError, match=r"chunk indexes repeat in \[0, 0\]"):
        h.mgr.commit_store("c", "s", [0, 0])
    assert h.l1.reserved_count() == 2 and h.mgr.lookup([K(1)]) == 0
    h.check()
    h.mgr.end_session("c", "s")
    h.check()
    assert h.l1.reserved_count() == 0
    assert h.mgr.session_count == 0


# ---------------------------------------------------------------- sessions


def test_duplicate_session_id_is_refused(h: Harness) -> None:
    h.mgr.prepare_store("c", "s", [K(1)], NB)
    with pytest.raises(SessionError, match="already open"):
        h.mgr.prepare_store("c", "s", [K(2)], NB)
    with pytest.raises(SessionError, match="already open"):
        h.mgr.prepare_retrieve("c", "s", [K(1)])
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
        lambda: h.mgr.session_pins("c", "nope"),
    ):
        with pytest.raises(SessionError, match="no open session 'nope'"):
            call()
    assert h.mgr.end_session("c", "nope") is False
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


def test_prepare_retrieve_pins_leading_run(h: Harness) -> None:
    h.store("c", "s", [K(1), K(2), K(4)])
    # copy: the returned list is the session's own and is cleared when the session ends
    hits = list(h.retrieve("c", "r", [K(1), K(2), K(3), K(4)]))
    assert [o.key for o in hits] == [K(1), K(2)]
    assert [o.pins for o in hits] == [1, 1]
    assert h.mgr.session_pins("c", "r") == 2
    assert h.l1.lru_keys() == [K(4)]
    h.mgr.commit_retrieve("c", "r")
    h.check()
    assert [o.pins for o in hits] == [0, 0]
    assert h.l1.lru_keys() == [K(4), K(1), K(2)]  # retrieved objects become most recently used
    assert h.mgr.session_count == 0


def test_prepare_retrieve_miss_opens_no_session(h: Harness) -> None:
    h.store("c", "s", [K(2)])
    assert h.retrieve("c", "r", [K(1), K(2)]) == []
    assert h.mgr.session_count == 0
    with pytest.raises(SessionError):
        h.mgr.session_pins("c", "r")


def test_two_sessions_pin_the_same_object(h: Harness) -> None:
    h.store("c", "s", [K(1)])
    h.retrieve("a", "r", [K(1)])
    h.retrieve("b", "r", [K(1), K(1)])
    obj = h.l1.get(K(1))
    assert obj is not None and obj.pins == 3
    h.mgr.commit_retrieve("b", "r")
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
    assert h.mgr.expire() == 0  # deadline 110 is not yet past
    h.check()
    h.clock.now = 110.5
    assert h.mgr.expire() == 1  # the retrieve session
    h.check()
    assert h.l1.get(K(1)).pins == 0  # type: ignore[union-attr]
    assert h.l1.lru_keys() == [K(1)]
    with pytest.raises(SessionError):
        h.mgr.commit_retrieve("c", "rt")
    assert h.l1.reserved_count() == 2
    h.clock.now = 115.0
    assert h.mgr.expire() == 0
    h.clock.now = 115.01
    assert h.mgr.expire() == 1
    h.check()
    assert h.l1.reserved_count() == 0 and h.used == P
    assert h.mgr.session_count == 0
    assert h.mgr.expired_sessions == 2
    with pytest.raises(SessionError, match="lease ran out"):
        h.mgr.commit_store("c", "st", [0])
    assert h.mgr.lookup([K(1), K(2)]) == 1
    # the keys are free to store again
    assert _idx(h.store("c", "st", [K(2), K(3)])) == [0, 1]


def test_session_pins_and_failed_commit_renew_the_lease(h: Harness) -> None:
    h.store("c", "s0", [K(1)])
    h.retrieve("c", "r", [K(1)])  # deadline 10
    h.clock.now = 8.0
    assert h.mgr.session_pins("c", "r") == 1  # deadline 18
    h.mgr.prepare_store("c", "s", [K(2)], NB)  # deadline 18
    h.clock.now = 9.0
    with pytest.raises(SessionError):
        h.mgr.commit_store("c", "s", [3])  # unknown chunk, but the session was touched: deadline 19
    h.clock.now = 18.5
    assert h.mgr.expire() == 1
    assert h.mgr.session_count == 1
    assert h.mgr.reservations("c", "s", [0])[0].key == K(2)
    h.check()


def test_expire_with_no_sessions(h: Harness) -> None:
    h.clock.now = 1e9
    assert h.mgr.expire() == 0
    assert h.mgr.expired_sessions == 0


def test_end_client_ends_only_that_clients_sessions(h: Harness) -> None:
    h.store("x", "s0", [K(1)])
    h.mgr.prepare_store("a", "s1", [K(2)], NB)
    h.retrieve("a", "r1", [K(1)])
    h.retrieve("b", "r1", [K(1)])
    assert h.mgr.session_count == 3
    assert h.mgr.end_client("a") == 2
    h.check()
    assert h.mgr.session_count == 1
    assert not h.l1.is_reserved(K(2))
    assert h.l1.get(K(1)).pins == 1  # type: ignore[union-attr]
    assert h.mgr.session_pins("b", "r1") == 1
    assert h.mgr.end_client("a") == 0
    assert h.mgr.end_client("nobody") == 0
    assert h.mgr.end_client("b") == 1
    h.check()
    assert h.mgr.session_count == 0 and h.used == P


# ---------------------------------------------------------------- corruption is detected


def test_integrity_detects_pin_outside_any_session(h: Harness) -> None:
    h.store("c", "s", [K(1)])
    h.l1.pin(h.l1.get(K(1)))  # type: ignore[arg-type]
    with pytest.raises(AssertionError, match="pin count"):
        h.check()


def test_integrity_detects_orphan_reservation(h: Harness) -> None:
    h.l1.reserve(K(1), NB)
    with pytest.raises(AssertionError, match="belongs to no session"):
        h.check()

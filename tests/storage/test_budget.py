"""kvdock.storage.budget: the one quota-aware eviction of L2's files and this server's L3 writes:
an owner's own objects while it is over its quota, then what it may evict while the tier is over
its capacity, in the policy's order; NoRoom for what can never fit."""

from __future__ import annotations

import pytest

from kvdock.errors import NoRoom
from kvdock.storage.budget import Budget
from kvdock.storage.policy import S3FIFO, make_policy
from kvdock.storage.shares import Shares

OWNERS = {"a": "a", "b": "b"}  # salt -> tenant; any other salt: nobody's


def budget(**quotas: int) -> Budget[str]:
    return Budget(Shares(lambda salt: OWNERS.get(salt), quotas), tier="L3")


def drain(b: Budget[str], nbytes: int, owner: str | None, capacity: int | None, **kw: object) -> list[str]:
    """Evict as the tiers do until ``nbytes`` of ``owner`` fit; the keys evicted, in order."""
    out = []
    while (victim := b.next_victim(nbytes, owner, capacity, **kw)) is not None:  # type: ignore[arg-type]
        b.remove(victim, evicted=True)
        out.append(victim)
    return out


def test_lru_order_within_capacity() -> None:
    b = budget()
    for k in "wxyz":
        b.add(k, 10, None)
    b.touch("w")
    assert drain(b, 20, None, 40) == ["x", "y"] and b.used == 20
    assert drain(b, 20, None, 40) == [] and b.next_victim(20, None, None) is None  # (no capacity: quotas only)
    b.check()


def test_an_owner_over_its_quota_evicts_its_own_first_and_never_anothers_share() -> None:
    b = budget(a=30, b=30)
    b.add("a1", 10, "a")
    b.add("n1", 10, None)
    b.add("b1", 20, "b")
    b.add("a2", 20, "a")
    assert drain(b, 10, "a", 100) == ["a1"]  # a: 30 + 10 > 30: its own least recently used
    assert drain(b, 20, None, 60) == ["n1"]  # nobody's: may evict nobody's only, then ...
    with pytest.raises(NoRoom, match="the L3 budget of 60 is held by tenants' shares"):
        b.next_victim(30, None, 60)
    with pytest.raises(NoRoom, match="40 bytes do not fit in the L3 quota of tenant 'b'"):
        b.next_victim(40, "b", 100)
    with pytest.raises(NoRoom, match="101 bytes do not fit in the L3 budget of 100"):
        b.next_victim(101, "b", 100)
    assert b.shares is not None and b.shares.used == {"a": 20, "b": 20}
    b.check()


def test_replacing_a_key_frees_its_bytes_and_never_evicts_it() -> None:
    b = budget()
    b.add("k", 30, None)
    b.add("j", 10, None)
    assert drain(b, 30, None, 40, replacing="k") == []  # k's 30 bytes are replaced by the write
    assert drain(b, 40, None, 40, replacing="k") == ["j"]
    with pytest.raises(NoRoom):
        b.next_victim(40, None, 40, pending=10, replacing="k")  # (only k is left, and it is not a victim)


def test_a_scan_resistant_policy_orders_the_budget() -> None:
    b: Budget[str] = Budget(policy=S3FIFO(), tier="L2")
    for k in "abcdefghij":
        b.add(k, 1, None)
    b.touch("a")  # read once while in the small FIFO: kept over the scan
    assert drain(b, 5, None, 10) == ["b", "c", "d", "e", "f"]
    b.check()
    b.used += 1
    with pytest.raises(AssertionError, match="budget bytes drifted"):
        b.check()


@pytest.mark.parametrize("policy", ["s3fifo", "prefix-lru"])
def test_a_tenant_over_its_quota_finds_its_victim_without_simulating_the_whole_order(policy: str) -> None:
    # (review R5) a tenant over its quota whose objects are not the policy's first victim: the
    # walk for its own went through order(), which S3FIFO builds by simulating every eviction on
    # a full copy (O(n), "tests and checks only") -- on every write of that tenant to L2/L3
    b: Budget[str] = Budget(Shares(lambda salt: OWNERS.get(salt), {"a": 30}), make_policy(policy), tier="L2")
    for i in range(2000):
        b.add(f"n{i}", 1, None)
    for i in range(3):
        b.add(f"a{i}", 10, "a")

    def no_order() -> list[str]:
        raise AssertionError("order() (O(n), tests and checks only) on an eviction")

    b.policy.order = no_order  # type: ignore[method-assign]
    assert b.next_victim(10, "a", None) == "a0"
    b.remove("a0", evicted=True)
    assert b.next_victim(10, "a", None) is None
    assert b.next_victim(10, "a", 2025) == "n0"  # over capacity: nobody's, in order


def _prompt(b: Budget[str], name: str, first_version: int, n: int = 4) -> None:
    """``n`` chunks ``name0``.. of one prompt, head first (versions first_version.., each chained)."""
    for i in range(n):
        b.add(f"{name}{i}", 1, None, version=first_version + i, parent=first_version + i - 1 if i else 0)


@pytest.mark.parametrize("policy", ["s3fifo", "prefix-lru"])
def test_a_prefix_aware_budget_evicts_a_prompts_tail_before_its_head(policy: str) -> None:
    # (issue 28 review R3) L2 and the L3 budget inserted keys without their parent: s3fifo and
    # prefix-lru evicted the heads of prompts first and kept their tails (unreachable orphans)
    b: Budget[str] = Budget(policy=make_policy(policy), tier="L2")
    _prompt(b, "p", 10)
    _prompt(b, "q", 20)
    assert b.policy.order() == ["p3", "p2", "p1", "p0", "q3", "q2", "q1", "q0"]
    assert drain(b, 2, None, 8) == ["p3", "p2"]
    b.check()


@pytest.mark.parametrize("policy", ["s3fifo", "prefix-lru"])
def test_a_budget_evicts_orphans_first(policy: str) -> None:
    b: Budget[str] = Budget(policy=make_policy(policy), tier="L3")
    _prompt(b, "p", 10)
    _prompt(b, "q", 20)
    b.remove("q1")  # deleted (an overwrite, a corrupt file): q2 hangs from nothing (and q3 from q2)
    assert b.next_victim(1, None, 7) == "q2"
    b.add("r1", 1, None, version=31, parent=30)  # written while its head is not held: an orphan
    gone = drain(b, 2, None, 7)
    assert set(gone) == {"q2", "q3", "r1"} and gone.index("q2") < gone.index("q3"), gone  # q3: once q2 is gone
    assert drain(b, 1, None, 5) == ["p3"]  # then tails before heads again
    b.check()


def test_a_read_keeps_a_tail_no_longer_than_its_head() -> None:
    b: Budget[str] = Budget(policy=make_policy("prefix-lru"), tier="L2")
    _prompt(b, "p", 10, n=2)
    _prompt(b, "q", 20, n=2)
    b.touch("p1")  # used, but never more recent than p0: it goes just ahead of it
    assert b.policy.order() == ["p1", "p0", "q1", "q0"]
    b.touch("p0")
    b.touch("p1")  # (as a request reads its prompt: head first)
    assert b.policy.order() == ["q1", "q0", "p1", "p0"]
    b.check()


def test_the_budgets_prefix_index_is_checked() -> None:
    b: Budget[str] = Budget(policy=make_policy("s3fifo"), tier="L2")
    _prompt(b, "p", 10, n=2)
    b.check()
    b._children[10].add("stray")
    with pytest.raises(AssertionError, match="successors index drifted"):
        b.check()

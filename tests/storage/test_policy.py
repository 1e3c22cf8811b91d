"""kvdock.storage.policy: the exact eviction order of each policy (LRU, prefix-aware LRU,
prefix-aware S3-FIFO), as an L1Store applies them (prefixes, orphans, pins, dirty objects), and
their integrity checks under random operations."""

from __future__ import annotations

import random

import pytest

from kvdock.errors import ConfigError
from kvdock.keys import ObjectKey
from kvdock.shm.slots import ALIGN, SlotAllocator
from kvdock.storage.memory import L1Object, L1Store
from kvdock.storage.policy import LRU, POLICIES, S3FIFO, PrefixLRU, Queue, make_policy


def test_queue_links() -> None:
    q: Queue[str] = Queue()
    for k in "abc":
        q.push(k)
    q.push("x", before="b")
    q.push("y", before="zzz")  # not here: at the back
    q.push_front("f")
    assert list(q) == ["f", "a", "x", "b", "c", "y"] and len(q) == 6 and q.first() == "f"
    q.remove("x")
    q.remove("f")
    assert list(q) == ["a", "b", "c", "y"] and "x" not in q and "a" in q


def test_lru_ignores_prefixes() -> None:
    p: LRU[str] = LRU()
    p.insert("h")
    p.insert("t1", before="h")
    p.insert("t2", before="t1")
    assert p.order() == ["h", "t1", "t2"]  # the head goes first: plain LRU
    p.access("h")
    assert p.order() == ["t1", "t2", "h"] and p.victim() == "t1"
    p.demote("h")  # no-op
    assert p.order() == ["t1", "t2", "h"]


def test_prefix_lru_keeps_heads_over_their_tails() -> None:
    p: PrefixLRU[str] = PrefixLRU()
    p.insert("x")
    p.insert("h")
    p.insert("t1", before="h")
    p.insert("t2", before="t1")
    assert p.order() == ["x", "t2", "t1", "h"]
    p.access("t2", before="t1")  # a tail read goes no later than its head
    assert p.order() == ["x", "t2", "t1", "h"]
    p.access("x")
    assert p.order() == ["t2", "t1", "h", "x"]
    p.demote("h")  # an orphan (its predecessor left) goes first
    assert p.victim() == "h"
    p.evict("h")
    assert len(p) == 3 and "h" not in p
    p.check()


def test_s3fifo_scan_goes_through_the_small_queue() -> None:
    p: S3FIFO[int] = S3FIFO()
    for k in range(1, 11):
        p.insert(k)
    assert p.victim() == 1
    p.evict(1)  # from the small queue: remembered in the ghost
    p.access(2)
    assert p.victim() == 3  # 2 was read in the small queue: moved to main
    p.evict(3)
    p.insert(1)  # back from the ghost: to main
    assert p.order() == [4, 5, 6, 7, 8, 9, 10, 2, 1]
    p.access(2)  # main reinserts a key read since its last pass
    assert p.order() == [4, 5, 6, 7, 8, 9, 10, 1, 2]
    p.insert(11, new=False)  # back after a pin (a read): main, with one pass
    assert p.order()[-3:] == [1, 2, 11] and p.victim() == 4
    p.check()


def test_s3fifo_prefixes_and_orphans() -> None:
    p: S3FIFO[str] = S3FIFO()
    p.insert("h")
    p.insert("t1", before="h")
    p.insert("t2", before="t1")
    p.insert("x")
    assert p.order() == ["t2", "t1", "h", "x"]
    p.access("x")
    p.demote("x")  # an orphan: evicted before both queues, its reads forgotten
    p.demote("t1")
    assert p.order() == ["x", "t1", "t2", "h"]
    p.remove("x")
    assert p.order() == ["t1", "t2", "h"]
    p.check()


def test_unknown_policy_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="unknown eviction policy 'arc': known are lru, prefix-lru, s3fifo"):
        make_policy("arc")


# ---------------------------------------------------------------- through L1


P = ALIGN


def K(name: str) -> ObjectKey:
    return ObjectKey("m", 0, "", name.encode().ljust(32, b"."))


class Chains:
    """An L1Store of ``slots`` one-page slots under ``policy``, storing prompts as version chains."""

    def __init__(self, policy: str, slots: int = 8) -> None:
        self.store = L1Store(SlotAllocator(base=P, capacity=slots * P), policy=policy)
        self.version = 0

    def prompt(self, *names: str, parent: int = 0) -> list[L1Object]:
        out = []
        for name in names:
            obj = self.store.reserve(K(name), 100)
            assert obj is not None, f"no room for {name}"
            self.version += 1
            obj.version, obj.parent = self.version, parent
            self.store.commit(obj)
            parent = obj.version
            out.append(obj)
        self.store.check_integrity()
        return out

    def order(self) -> list[str]:
        return [k.chunk.rstrip(b".").decode() for k in self.store.lru_keys()]

    def read(self, objs: list[L1Object]) -> None:
        """A retrieve: pin the run, unpin it head first (as a session ends)."""
        for o in objs:
            self.store.pin(o)
        for o in objs:
            self.store.unpin(o)
        self.store.check_integrity()


@pytest.mark.parametrize(
    ("policy", "order"),
    [
        ("lru", ["a0", "a1", "a2", "b0", "b1"]),
        ("prefix-lru", ["a2", "a1", "a0", "b1", "b0"]),
        ("s3fifo", ["a2", "a1", "a0", "b1", "b0"]),
    ],
)
def test_l1_eviction_order_of_two_prompts(policy: str, order: list[str]) -> None:
    c = Chains(policy)
    c.prompt("a0", "a1", "a2")
    c.prompt("b0", "b1")
    assert c.order() == order
    assert c.store.policy == policy


@pytest.mark.parametrize(
    ("policy", "after_read", "after_orphan"),
    [
        ("lru", ["b0", "b1", "a0", "a1", "a2"], ["b0", "b1", "a1", "a2"]),
        ("prefix-lru", ["b1", "b0", "a2", "a1", "a0"], ["a1", "b1", "b0", "a2"]),
        ("s3fifo", ["b1", "b0", "a2", "a1", "a0"], ["a1", "b1", "b0", "a2"]),
    ],
)
def test_l1_reads_and_orphans(policy: str, after_read: list[str], after_orphan: list[str]) -> None:
    c = Chains(policy)
    a = c.prompt("a0", "a1", "a2")
    c.prompt("b0", "b1")
    c.read(a)  # prompt a is read again: it stays longer than b, its head longest
    assert c.order() == after_read
    c.store.remove(K("a0"))  # its head is gone (an overwrite, say): a1 is an orphan
    c.store.check_integrity()
    assert c.order() == after_orphan


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_l1_evicts_in_the_order_it_shows(policy: str) -> None:
    c = Chains(policy, slots=6)
    a = c.prompt("a0", "a1", "a2")
    c.prompt("b0", "b1", "b2")
    c.read(a[:2])
    shown = c.order()
    evicted = []
    for i in range(6):
        before = set(c.order())
        assert c.store.reserve(K(f"n{i}"), 100) is not None  # (reservations are not evictable)
        (gone,) = before - set(c.order())
        evicted.append(gone)
    assert evicted == shown and c.store.evictions == 6


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_random_operations_keep_every_invariant(policy: str) -> None:
    rng = random.Random(policy)
    c = Chains(policy, slots=12)
    heads: list[list[L1Object]] = []
    pinned: list[L1Object] = []
    for step in range(600):
        op = rng.random()
        if op < 0.4:
            names = [f"p{step}.{j}" for j in range(rng.randint(1, 4))]
            if c.store.room(K(names[0]), 100)[0] >= len(names):  # else: pool full (pinned or dirty)
                heads.append(c.prompt(*names))
        elif op < 0.55 and heads:
            run = [o for o in rng.choice(heads) if o.live and c.store.get(o.key) is o]
            c.read(run)
        elif op < 0.65 and heads:
            obj = rng.choice(rng.choice(heads))
            if obj.live and c.store.get(obj.key) is obj:
                c.store.pin(obj)
                pinned.append(obj)
        elif op < 0.75 and pinned:
            c.store.unpin(pinned.pop(rng.randrange(len(pinned))))
        elif op < 0.85 and heads:
            obj = rng.choice(rng.choice(heads))
            if c.store.get(obj.key) is obj:
                if obj.dirty:
                    c.store.mark_clean(obj)
                else:
                    c.store.mark_dirty(obj)
        elif op < 0.92 and heads:
            c.store.remove(rng.choice(rng.choice(heads)).key)
        else:
            obj = rng.choice(rng.choice(heads)) if heads else None
            if obj is not None and obj in c.store._evictable:
                c.store._evictable.access(obj)
        c.store.check_integrity()

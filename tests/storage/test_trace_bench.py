"""benchmarks/trace.py's offline pieces: the infinite cache, Belady's bound and the in-process
simulation over L1Store agree with each other where they must (the docs' table rests on them)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "trace.py"


@pytest.fixture(scope="module")
def trace():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("kvdock_trace_bench", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_hand_made_trace(trace) -> None:  # type: ignore[no-untyped-def]
    R = trace.Request
    reqs = [R((1, 2)), R((1, 2, 3)), R((4,)), R((1, 2, 3)), R((1, 5))]
    assert trace.input_tokens(reqs) == 11 * 512
    assert trace.infinite(reqs) == pytest.approx((2 + 3 + 1) / 11)  # 1,2 | 1,2,3 | 1
    assert trace.belady(reqs, 100) == trace.infinite(reqs)
    assert trace.belady(reqs, 3) == pytest.approx((2 + 3 + 1) / 11)  # 4 is never used again: it goes
    for policy in ("lru", "prefix-lru", "s3fifo"):
        assert trace.simulate(reqs, 100, policy) == trace.infinite(reqs)
        # one slot: a store keeps its head only (the rest finds no room), read again by 2 and 5
        assert trace.simulate(reqs, 1, policy) == pytest.approx(2 / 11)


@pytest.mark.parametrize("kind", ["scan", "agent"])
def test_no_policy_beats_belady_and_s3fifo_never_loses_to_lru(trace, kind: str) -> None:  # type: ignore[no-untyped-def]
    reqs = trace.synthetic(kind, n=1500)
    cap = 300
    bound, top = trace.belady(reqs, cap), trace.infinite(reqs)
    rates = {p: trace.simulate(reqs, cap, p) for p in ("lru", "prefix-lru", "s3fifo")}
    assert all(r <= bound + 1e-9 <= top + 1e-9 for r in rates.values()), (rates, bound, top)
    assert rates["s3fifo"] >= 0.97 * rates["lru"], rates


def test_admission_rules_on_a_hand_made_trace(trace) -> None:  # type: ignore[no-untyped-def]
    # L1 of 2 slots: R2 pushes R1's chunks out of L1; R3 asks for R1's prompt again
    R = trace.Request
    reqs = [R((1, 2)), R((3, 4)), R((1, 2))]
    got = {rule: trace.admission(reqs, 2, rule) for rule in trace.RULES}
    assert got["all"] == (pytest.approx(2 / 6), 4)  # both promoted from L2
    assert got["none"] == (0.0, 0)
    assert got["ghost"] == (0.0, 2)  # written only when stored again, after the miss
    assert got["reused"] == (0.0, 0)  # never read while in L1
    # read while in L1 (R2 = R1 again): "reused" writes it down, and it is there after L1 lost it
    reqs = [R((1, 2)), R((1, 2)), R((3, 4)), R((1, 2))]
    assert trace.admission(reqs, 2, "reused") == (pytest.approx(4 / 8), 2)

"""Adversarial regressions (H7) against the fleet coherence (storage.coherence): each test names
a way the invalidation stream can lose entries, or their order, without any server noticing, so
that a server keeps serving a version replaced through another server."""

from __future__ import annotations

import os
import signal
import time

import pytest
import redis as redis_py
import torch
from tests.helpers import CHUNK, MODEL, make_kv, make_tokens, wait_for
from tests.server.test_overwrite import versions_of

import kvdock.sdk as kvd

STREAM = b"kvdock:v2:{invalidations}"
BOUND_S = 0.1  # --l3-coherence-ms's default

# SIGSTOP needs a process of its own per server
pytestmark = pytest.mark.subprocess_server


def _status(srv) -> dict:
    return srv.get("/status")["tiers"]["l3"]["coherence"]


def _wait_vouched(srv) -> None:
    wait_for(lambda: _status(srv)["vouched"], "the server to vouch for its L1")


def _two_servers_sharing(make_server, url: str):
    a = make_server("--redis-url", url, "--no-disk")
    b = make_server("--redis-url", url, "--no-disk")
    for s in (a, b):
        _wait_vouched(s)
    return a, b


def _b_holds_v1_then_a_overwrites_while_b_is_stopped(a, b, tokens, versions, while_stopped) -> float:
    """B reads version 1 into its L1; B is stopped; A overwrites with version 2 (acknowledged);
    ``while_stopped()`` runs; B resumes. Returns when the overwrite was acknowledged
    (``time.monotonic()``)."""
    with (
        kvd.connect(a.url, a.http_url, MODEL, timeout=10) as ca,
        kvd.connect(b.url, b.http_url, MODEL, timeout=10) as cb,
    ):
        assert kvd.store(ca, versions[1], tokens)
        wait_for(lambda: a.get("/status")["tiers"]["writeback_backlog_bytes"] == 0, "A's write-downs")
        wait_for(lambda: versions_of(kvd.retrieve(cb, tokens), versions) == [1, 1], "B to read version 1")
    os.kill(b.proc.pid, signal.SIGSTOP)
    try:
        with kvd.connect(a.url, a.http_url, MODEL, timeout=10) as ca:
            assert kvd.store(ca, versions[2], tokens, overwrite=True)
        acked = time.monotonic()
        while_stopped()
        # B stays stopped for longer than the bound: a poll B sent before the overwrite (and
        # applies on resuming) may vouch for its L1 until bound after it was sent, which the
        # guarantee allows (a read starting less than bound after the acknowledgement may see
        # either version); every read B answers after resuming must then see version 2 or miss
        time.sleep(max(0.0, acked + 3 * BOUND_S - time.monotonic()))
    finally:
        os.kill(b.proc.pid, signal.SIGCONT)
    return acked


def _assert_b_never_serves_v1(b, tokens, versions, acked: float, seconds: float = 2.0) -> None:
    """Every read B answers from now on (more than the bound after the overwrite's
    acknowledgement) sees version 2 or misses."""
    _wait_vouched(b)
    assert _status(b)["bound_ms"] == BOUND_S * 1000
    deadline = time.monotonic() + seconds
    with kvd.connect(b.url, b.http_url, MODEL, timeout=10) as cb:
        while time.monotonic() < deadline:
            start = time.monotonic()
            assert start - acked > BOUND_S
            got = versions_of(kvd.retrieve(cb, tokens), versions)
            assert 1 not in got, (
                f"B serves the replaced version (chunks {got}) from a read started "
                f"{(start - acked) * 1000:.0f} ms after the overwrite's acknowledgement: {_status(b)}"
            )
            time.sleep(0.05)


def test_a_stream_trimmed_to_nothing_is_a_gap_not_an_empty_poll(make_server, redis_server) -> None:
    """XTRIM MAXLEN 0 (an operator's trim, or any trim that empties the stream) removes the
    overwrite's entries before B read them; B's gap check compares the first entry with its
    position only when there is a first entry, so it sees no gap, vouches, and serves the
    replaced version from L1 for as long as no new overwrite comes."""
    a, b = _two_servers_sharing(make_server, redis_server.url)
    tokens = make_tokens(2 * CHUNK, start=21_000_000)
    versions = {v: make_kv(2 * CHUNK, seed=700 + v) for v in (1, 2)}
    raw = redis_py.Redis.from_url(redis_server.url)
    try:
        acked = _b_holds_v1_then_a_overwrites_while_b_is_stopped(
            a, b, tokens, versions, lambda: raw.xtrim(STREAM, maxlen=0, approximate=False)
        )
        _assert_b_never_serves_v1(b, tokens, versions, acked)
    finally:
        raw.close()


def test_a_stream_deleted_and_started_again_is_a_gap(make_server, redis_server) -> None:
    """The stream is deleted (DEL; its incarnation key stays) after the overwrite's entries and
    before B read them, and a later overwrite of other keys starts a new stream: its
    entries-added equals what B had consumed, its first entry is after B's position, so B sees
    no gap, reads the new entries and serves the version the lost ones replaced."""
    a, b = _two_servers_sharing(make_server, redis_server.url)
    tokens, others = make_tokens(2 * CHUNK, start=22_000_000), make_tokens(2 * CHUNK, start=22_500_000)
    versions = {v: make_kv(2 * CHUNK, seed=710 + v) for v in (1, 2)}
    raw = redis_py.Redis.from_url(redis_server.url)
    try:
        with kvd.connect(a.url, a.http_url, MODEL, timeout=10) as ca:  # B consumes two entries
            assert kvd.store(ca, versions[1], others)
            assert kvd.store(ca, versions[2], others, overwrite=True)
        wait_for(lambda: _status(b)["entries_applied"] == 2, "B to apply the first overwrite")

        def delete_and_restart_the_stream() -> None:
            raw.delete(STREAM)
            with kvd.connect(a.url, a.http_url, MODEL, timeout=10) as ca:
                assert kvd.store(ca, versions[1], others, overwrite=True)  # two entries again

        acked = _b_holds_v1_then_a_overwrites_while_b_is_stopped(a, b, tokens, versions, delete_and_restart_the_stream)
        _assert_b_never_serves_v1(b, tokens, versions, acked)
    finally:
        raw.close()


def test_a_stream_id_whose_sequence_passes_2_to_the_20_keeps_its_order(make_server, redis_server) -> None:
    """Positions are kept as ``ms << 20 | seq``: a sequence of 2**20 or more (Redis numbers
    entries of one millisecond, and every entry after a backward step of its clock, by the
    sequence; here one entry with such an id, as a clock stepped back would make for a whole
    minute) ORs into the millisecond bits. B's position then reads back as a later
    millisecond, XRANGE from it skips every later entry, and B applies no overwrite again."""
    a, b = _two_servers_sharing(make_server, redis_server.url)
    tokens = make_tokens(2 * CHUNK, start=23_000_000)
    versions = {v: make_kv(2 * CHUNK, seed=720 + v) for v in (1, 2)}
    raw = redis_py.Redis.from_url(redis_server.url)
    try:
        ms = int(time.time() * 1000) + 60_000
        ms += ms % 2  # even: bit 20 of the position is free, seq 2**20 + 1 sets it
        raw.xadd(STREAM, {b"k": b""}, id=f"{ms}-{(1 << 20) + 1}")
        wait_for(lambda: _status(b)["entries_applied"] >= 1 and _status(b)["vouched"], "B to read that entry")
        acked = _b_holds_v1_then_a_overwrites_while_b_is_stopped(a, b, tokens, versions, lambda: None)
        _assert_b_never_serves_v1(b, tokens, versions, acked)
    finally:
        raw.close()


BIG = {"num_layers": 64, "num_kv_heads": 8, "head_dim": 128}  # 4 MiB chunks: a write-down takes a while


def _big_kv(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, BIG["num_layers"], CHUNK, BIG["num_kv_heads"] * BIG["head_dim"], generator=g).to(
        torch.bfloat16
    )


def test_a_write_down_issued_before_l3_was_flushed_cannot_bring_back_a_replaced_version(
    make_server, redis_server
) -> None:
    """B stores version 1 and is stopped before its write-down reaches L3; A overwrites with
    version 2 (acknowledged; its floor fences B's write); L3 loses everything (FLUSHALL here; a
    restart without persistence is the same: floors and stream gone). B resumes: its write-down
    carries a fence of the old stream, L3 has no floor left to refuse it, and version 1 lands in
    L3. Every server sees the gap and drops L1, then loads version 1 from L3 for good."""
    a = make_server("--redis-url", redis_server.url, "--no-disk", l1_size="256MiB", register=None)
    b = make_server("--redis-url", redis_server.url, "--no-disk", l1_size="256MiB", register=None)
    for s in (a, b):
        kvd.register_model(s.url, s.http_url, "big", dtype="bfloat16", **BIG, timeout=10)
        _wait_vouched(s)
    raw = redis_py.Redis.from_url(redis_server.url)
    ca = kvd.connect(a.url, a.http_url, "big", timeout=10)
    cb = kvd.connect(b.url, b.http_url, "big", timeout=10)
    served: list[int] = []
    try:
        for attempt in range(5):
            tokens = make_tokens(CHUNK, start=30_000_000 + attempt * 1000)
            v1, v2 = _big_kv(800 + 2 * attempt), _big_kv(801 + 2 * attempt)
            drops = [_status(s)["full_drops"] for s in (a, b)]
            assert kvd.store(cb, v1, tokens)
            os.kill(b.proc.pid, signal.SIGSTOP)
            try:
                assert kvd.store(ca, v2, tokens, overwrite=True)
                wait_for(lambda: a.get("/status")["tiers"]["writeback_backlog_bytes"] == 0, "A's write-downs")
                raw.flushall()
            finally:
                os.kill(b.proc.pid, signal.SIGCONT)
            wait_for(lambda: b.get("/status")["tiers"]["writeback_backlog_bytes"] == 0, "B's write-downs")
            for s, before in zip((a, b), drops, strict=True):  # both saw the gap and dropped their L1
                wait_for(lambda s=s, before=before: _status(s)["full_drops"] > before and _status(s)["vouched"], "gap")
            got = kvd.retrieve(ca, tokens)
            assert got is None or torch.equal(got, v1) or torch.equal(got, v2), "bytes of no version"
            if got is not None and torch.equal(got, v1):
                served.append(attempt)
    finally:
        kvd.close(ca)
        kvd.close(cb)
        raw.close()
    assert served == [], f"A served the replaced version 1 after the flush in attempts {served}"

"""Adversarial tests of issue 28's eviction (R3): real servers under write pressure, small lower
tiers and stalled clients (in this process, kvdock.inprocess; a `kvdock serve` process for the
tests that stop or kill it). Each xfail(strict=True) pins a bug found; the others are
attacks that held."""

from __future__ import annotations

import time

import pytest
import torch

import kvdock.sdk as kvd
from helpers import CHUNK, MODEL, make_kv, make_tokens

PROMPT_CHUNKS = 4


def _prompt(i: int) -> list[int]:
    return make_tokens(CHUNK * PROMPT_CHUNKS, start=50_000 * (i + 1))


def _status(srv, token: str = "") -> dict:  # type: ignore[no-untyped-def, type-arg]
    import json
    import urllib.request

    req = urllib.request.Request(srv.http_url + "/status")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read().decode())  # type: ignore[no-any-return]


def _idle(srv, deadline_s: float = 120.0, token: str = "") -> dict:  # type: ignore[no-untyped-def, type-arg]
    deadline = time.monotonic() + deadline_s
    while True:
        status = _status(srv, token)
        if status["tiers"]["writeback_backlog_bytes"] == 0:
            return status  # type: ignore[no-any-return]
        assert time.monotonic() < deadline, f"write-downs still queued after {deadline_s} s: {status['tiers']}"
        time.sleep(0.05)


@pytest.mark.parametrize("policy", ["s3fifo", "prefix-lru"])
def test_l2_never_keeps_a_tail_whose_head_it_evicted(make_server, tmp_path, policy: str) -> None:
    # L1 of four slots, an L2 of a few prompts: prompts pass through L1 into L2, and L2 must
    # evict for room. Whatever L2 keeps must be reachable (a prefix of its prompt), never a tail
    # whose head L2 already dropped (issue 28: prefix-aware in L1 *and* L2; orphans waste L2).
    srv = make_server(
        "--disk-dir", str(tmp_path / "l2"), "--disk-size", "48KiB", "--eviction-policy", policy, l1_size="16KiB"
    )
    kvs = [make_kv(CHUNK * PROMPT_CHUNKS, seed=i) for i in range(10)]
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=30) as c:
        for i, kv in enumerate(kvs):
            assert kvd.store(c, kv, _prompt(i))
            _idle(srv)
        status = _idle(srv)
        l2 = status["tiers"]["l2"]
        assert 0 < l2["objects"] < 10 * PROMPT_CHUNKS, l2  # L2 did evict
        hits = [kvd.lookup(c, _prompt(i)) // CHUNK for i in range(len(kvs))]  # before any read moves L1
        reachable = sum(hits)
        for i, (kv, n) in enumerate(zip(kvs, hits, strict=True)):
            if n:
                assert torch.equal(kvd.retrieve(c, _prompt(i)), kv[:, :, : n * CHUNK])
        assert kvd.check_server_integrity(c) == []
    # every object L2 holds is reachable from its prompt's head (L1 holds at most 4 more)
    assert reachable >= l2["objects"], f"L2 holds {l2['objects']} chunks, only {reachable} reachable: orphans ({hits})"


def _burst(srv, seed: int, prompts: range, out: dict, errors: list) -> None:  # type: ignore[no-untyped-def, type-arg]
    """One client storing ``prompts`` back to back; records (prompt -> stored chunks, seconds)."""
    try:
        with kvd.connect(srv.url, srv.http_url, MODEL, timeout=60) as c:
            for i in prompts:
                kv = make_kv(CHUNK * PROMPT_CHUNKS, seed=i)
                t0 = time.monotonic()
                r = kvd.store_chunks(c, kv, _prompt(i))
                out[i] = (r.stored_chunks, r.pool_full_chunks, r.in_flight_chunks, time.monotonic() - t0)
    except Exception as e:  # (reported by the test)
        errors.append(repr(e))


def _check_acknowledged(srv, stored: dict) -> tuple[dict, list[int]]:  # type: ignore[no-untyped-def, type-arg]
    """Every prompt's cached prefix is byte-exact; (status, hit chunks per prompt)."""
    status = _idle(srv)
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=60) as c:
        hits = {i: kvd.lookup(c, _prompt(i)) // CHUNK for i in stored}
        for i, n in hits.items():
            if n:
                kv = make_kv(CHUNK * PROMPT_CHUNKS, seed=i)
                assert torch.equal(kvd.retrieve(c, _prompt(i)), kv[:, :, : n * CHUNK]), f"prompt {i}: wrong bytes"
        assert kvd.check_server_integrity(c) == []
    return status, [hits[i] for i in sorted(hits)]


def test_a_reserver_that_never_commits_hangs_no_one_under_dirty_pressure(make_server, tmp_path) -> None:
    # 24 slots of L1, a disk taking 0.15 s a write, stores wait 0.5 s at most; one client reserves
    # 8 slots and never commits while three others store 4-chunk prompts back to back
    import threading

    from kvdock.keys import normalize_tokens
    from kvdock.protocol import messages as m

    srv = make_server(
        "--disk-dir",
        str(tmp_path / "l2"),
        "--writeback-wait-s",
        "0.5",
        "--session-ttl",
        "5",
        l1_size="96KiB",
        env={"KVDOCK_FAULT_L2_WRITE_DELAY_S": "0.15"},
    )
    squatter = kvd.connect(srv.url, srv.http_url, MODEL, timeout=60)
    held = make_tokens(CHUNK * 8, start=9_000_000)
    prep = squatter.call(m.PrepareStore(squatter.client_id, "squat", normalize_tokens(held).tobytes())).reply
    assert len(prep.slots) == 8
    stored: dict = {}  # type: ignore[type-arg]
    errors: list[str] = []
    threads = [
        threading.Thread(target=_burst, args=(srv, k, range(k * 6, k * 6 + 6), stored, errors)) for k in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    assert not any(t.is_alive() for t in threads), "a store hung"
    assert errors == []
    assert len(stored) == 18
    slowest = max(s[3] for s in stored.values())
    assert slowest < 60, f"a store took {slowest:.1f} s (bound: --writeback-wait-s 0.5)"
    status, hits = _check_acknowledged(srv, stored)
    l1, l2 = {**status["l1"], **status["l1"]["eviction"]}, status["tiers"]["l2"]
    acked = sum(s[0] for s in stored.values())
    for i, (s, n) in enumerate(zip([stored[k] for k in sorted(stored)], hits, strict=True)):
        assert n <= s[0] or s[0] == 0 or n == PROMPT_CHUNKS, (i, s, n)
    # every acknowledged chunk missing was dropped visibly (a dirty eviction, a skipped write-down)
    missing = acked - sum(hits)
    assert missing == l1["evicted_dirty"] == l2["writes_skipped"], (missing, l1, l2, stored, hits)
    assert l2["objects"] == sum(hits), "L2 holds chunks no prompt reaches (a tail without its head)"
    squatter.close()


def _start_burst(srv, prompts: range):  # type: ignore[no-untyped-def]
    import threading

    stored: dict = {}  # type: ignore[type-arg]
    errors: list[str] = []
    t = threading.Thread(target=_burst, args=(srv, 0, prompts, stored, errors), daemon=True)
    t.start()
    return t, stored, errors


def _wait_stored(stored: dict, n: int, deadline_s: float = 120.0) -> None:  # type: ignore[type-arg]
    deadline = time.monotonic() + deadline_s
    while len(stored) < n:
        assert time.monotonic() < deadline, f"only {len(stored)} stores in {deadline_s} s"
        time.sleep(0.01)


@pytest.mark.subprocess_server
def test_sigstop_mid_burst_then_sigcont_loses_nothing_silently(make_server, tmp_path) -> None:
    import signal

    srv = make_server(
        "--disk-dir",
        str(tmp_path / "l2"),
        "--writeback-wait-s",
        "0.3",
        l1_size="64KiB",
        env={"KVDOCK_FAULT_L2_WRITE_DELAY_S": "0.05"},
    )
    t, stored, errors = _start_burst(srv, range(24))
    _wait_stored(stored, 6)
    srv.proc.send_signal(signal.SIGSTOP)
    time.sleep(2.0)  # (longer than the wait bound: the clock runs on while the server is stopped)
    srv.proc.send_signal(signal.SIGCONT)
    t.join(240)
    assert not t.is_alive() and errors == [], errors
    assert len(stored) == 24 and max(s[3] for s in stored.values()) < 60
    status, hits = _check_acknowledged(srv, stored)
    l1, l2 = {**status["l1"], **status["l1"]["eviction"]}, status["tiers"]["l2"]
    missing = sum(s[0] for s in stored.values()) - sum(hits)
    assert missing == l1["evicted_dirty"] == l2["writes_skipped"], (missing, l1, l2, stored, hits)
    assert l2["objects"] == sum(hits), "L2 holds chunks no prompt reaches (a tail without its head)"


@pytest.mark.subprocess_server
def test_sigkill_under_write_pressure_then_restart_on_the_same_disk(make_server, tmp_path) -> None:
    import signal

    disk = str(tmp_path / "l2")
    srv = make_server(
        "--disk-dir",
        disk,
        "--writeback-wait-s",
        "0.3",
        l1_size="64KiB",
        env={"KVDOCK_FAULT_L2_WRITE_DELAY_S": "0.05"},
    )
    t, stored, _errors = _start_burst(srv, range(30))  # (the kill fails stores in flight)
    _wait_stored(stored, 10)
    srv.stop(signal.SIGKILL)
    t.join(240)
    assert not t.is_alive()
    again = make_server("--disk-dir", disk, l1_size="64KiB")
    status = again.get("/status")
    with kvd.connect(again.url, again.http_url, MODEL, timeout=60) as c:
        hits = [kvd.lookup(c, _prompt(i)) // CHUNK for i in range(30)]
        assert sum(hits) > 0, "nothing of the burst reached L2 before the crash"
        for i, n in enumerate(hits):
            if n:
                kv = make_kv(CHUNK * PROMPT_CHUNKS, seed=i)
                assert torch.equal(kvd.retrieve(c, _prompt(i)), kv[:, :, : n * CHUNK]), f"prompt {i}: wrong bytes"
        assert kvd.check_server_integrity(c) == []
    assert status["tiers"]["l2"]["objects"] == sum(hits), (status["tiers"]["l2"], hits)


def test_a_stopped_l3_under_write_pressure_hangs_no_store_and_drops_visibly(make_server, redis_server) -> None:
    # L2 off, L3 a redis-server that freezes (SIGSTOP) in the middle of a store burst: write-downs
    # time out, stores wait at most --writeback-wait-s, and what is dropped is counted
    import signal

    # (a short Redis timeout: write-downs to the stopped Redis fail after 1 s, not the default 5 s)
    srv = make_server(
        "--no-disk", "--redis-url", redis_server.url, "--redis-timeout-s", "1", "--writeback-wait-s", "0.3",
        l1_size="64KiB",
    )  # fmt: skip
    t, stored, errors = _start_burst(srv, range(24))
    _wait_stored(stored, 4)
    redis_server.proc.send_signal(signal.SIGSTOP)
    try:
        t.join(240)
    finally:
        redis_server.proc.send_signal(signal.SIGCONT)
    assert not t.is_alive() and errors == [], errors
    assert len(stored) == 24
    slowest = max(s[3] for s in stored.values())
    assert slowest < 60, f"a store took {slowest:.1f} s"
    deadline = time.monotonic() + 120
    while not ((st := _idle(srv)["tiers"]["l3"])["up"] and st["coherence"]["vouched"]):
        assert time.monotonic() < deadline, f"L3 not back 120 s after SIGCONT: {st}"
        time.sleep(0.1)
    status = _idle(srv)
    l1, l3 = {**status["l1"], **status["l1"]["eviction"]}, status["tiers"]["l3"]
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=60) as c:
        hits = [kvd.lookup(c, _prompt(i)) // CHUNK for i in sorted(stored)]
        for i, n in zip(sorted(stored), hits, strict=True):
            if n:
                kv = make_kv(CHUNK * PROMPT_CHUNKS, seed=i)
                got = kvd.retrieve(c, _prompt(i))
                if got is None:  # promotions from L3 of the prompts before evicted it (clean: never written)
                    continue
                assert torch.equal(got, kv[:, :, : got.shape[2]]), f"prompt {i}: wrong bytes"
        assert kvd.check_server_integrity(c) == []
    missing = sum(s[0] for s in stored.values()) - sum(hits)
    assert missing <= l1["evicted_dirty"] + l3["writes_skipped"], (missing, l1, l3)


def _versions_check(srv, prompts: range, overwritten: dict) -> list[int]:  # type: ignore[no-untyped-def, type-arg]
    """Each prompt's cached prefix is its last acknowledged version's, byte for byte, never the
    older one; hit chunks per prompt."""
    hits = []
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=60) as c:
        for i in prompts:
            got = kvd.retrieve(c, _prompt(i))
            n = 0 if got is None else got.shape[2] // CHUNK
            hits.append(n)
            if n:
                want = make_kv(CHUNK * PROMPT_CHUNKS, seed=overwritten.get(i, i))
                assert torch.equal(got, want[:, :, : n * CHUNK]), f"prompt {i}: not its last version's bytes"
        assert kvd.check_server_integrity(c) == []
    return hits


@pytest.mark.subprocess_server
@pytest.mark.parametrize("policy", ["s3fifo", "prefix-lru"])
def test_overwrites_of_dirty_objects_under_eviction_never_bring_back_the_old_version(
    make_server, tmp_path, policy: str
) -> None:
    import signal

    disk = str(tmp_path / "l2")
    srv = make_server(
        "--disk-dir",
        disk,
        "--writeback-wait-s",
        "0.2",
        "--eviction-policy",
        policy,
        l1_size="64KiB",
        env={"KVDOCK_FAULT_L2_WRITE_DELAY_S": "0.03"},
    )
    t, _stored, errors = _start_burst(srv, range(100, 124))  # pressure from another client
    overwritten: dict[int, int] = {}
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=60) as c:
        for i in range(10):
            kvd.store(c, make_kv(CHUNK * PROMPT_CHUNKS, seed=i), _prompt(i))
            kvd.store(c, make_kv(CHUNK * PROMPT_CHUNKS, seed=1000 + i), _prompt(i), overwrite=True)
            overwritten[i] = 1000 + i
            if i % 3 == 0:  # and a read in between, promoting what L2 holds
                got = kvd.retrieve(c, _prompt(i))
                if got is not None:
                    want = make_kv(CHUNK * PROMPT_CHUNKS, seed=1000 + i)
                    assert torch.equal(got, want[:, :, : got.shape[2]]), f"prompt {i}: old bytes after overwrite"
    t.join(240)
    assert not t.is_alive() and errors == [], errors
    _idle(srv)
    _versions_check(srv, range(10), overwritten)
    srv.stop(signal.SIGKILL)
    again = make_server("--disk-dir", disk, "--eviction-policy", policy, l1_size="64KiB")
    _versions_check(again, range(10), overwritten)
    _versions_check(again, range(100, 124), {})


def test_a_tenants_dirty_burst_evicts_only_its_own_l1_region(make_server, tmp_path) -> None:
    # acme (L1 quota: 16 slots) bursts faster than a slow disk, past its wait bound: its dirty
    # evictions stay in its region; beta (quota) and gamma (the shared rest) keep their L1 objects
    from helpers import GEOMETRY

    acme, beta, gamma, admin = (
        "acme-token-0123456789",
        "beta-token-0123456789",
        "gamma-token-012345678",
        "adm-0123456789",
    )
    slot = 4096
    path = tmp_path / "tenants.toml"
    path.write_text(
        "".join(
            f'[tenants.{n}]\ntokens = ["{tok}"]\nmodels = ["{MODEL}"]\nsalts = ["{n}"]\n{quota}\n'
            for n, tok, quota in (
                ("acme", acme, f"l1 = {16 * slot}"),
                ("beta", beta, f"l1 = {16 * slot}"),
                ("gamma", gamma, ""),
            )
        )
    )
    srv = make_server(
        "--tenants",
        str(path),
        "--admin-token",
        admin,
        "--disk-dir",
        str(tmp_path / "l2"),
        "--writeback-wait-s",
        "0.2",
        "--writeback-dirty-limit",  # (L1 may fill with dirty objects: the burst outruns the wait)
        "1",
        l1_size=f"{48 * slot}",
        register=None,
        env={"KVDOCK_FAULT_L2_WRITE_DELAY_S": "0.05"},
    )
    kvd.register_model(srv.url, srv.http_url, MODEL, dtype="bfloat16", **GEOMETRY, timeout=30, admin_token=admin)
    with (
        kvd.connect(srv.url, srv.http_url, MODEL, 30, token=acme) as a,
        kvd.connect(srv.url, srv.http_url, MODEL, 30, token=beta) as b,
        kvd.connect(srv.url, srv.http_url, MODEL, 30, token=gamma) as g,
    ):
        for i, (c, salt) in enumerate(((b, "beta"), (b, "beta"), (g, "gamma"), (g, "gamma"))):
            assert kvd.store(c, make_kv(CHUNK * PROMPT_CHUNKS, seed=200 + i), _prompt(200 + i), cache_salt=salt)
        _idle(srv, token=admin)
        acked = 0
        for i in range(16):  # 64 chunks into 16 slots, back to back
            r = kvd.store_chunks(a, make_kv(CHUNK * PROMPT_CHUNKS, seed=i), _prompt(i), cache_salt="acme")
            acked += r.stored_chunks
        status = _idle(srv, token=admin)
        l2_hits = status["tiers"]["l2"]["hits"]
        for i, (c, salt) in enumerate(((b, "beta"), (b, "beta"), (g, "gamma"), (g, "gamma"))):
            got = kvd.retrieve(c, _prompt(200 + i), cache_salt=salt)
            assert got is not None and torch.equal(got, make_kv(CHUNK * PROMPT_CHUNKS, seed=200 + i)), (i, salt)
        after = _status(srv, admin)
        assert after["tiers"]["l2"]["hits"] == l2_hits, "acme's burst evicted another tenant's L1 objects"
        hits = [kvd.lookup(a, _prompt(i), cache_salt="acme") // CHUNK for i in range(16)]
        for i, n in enumerate(hits):
            if n:
                got = kvd.retrieve(a, _prompt(i), cache_salt="acme")
                want = make_kv(CHUNK * PROMPT_CHUNKS, seed=i)
                assert got is not None and torch.equal(got, want[:, :, : got.shape[2]]), i
        l1 = status["l1"]["eviction"]
        assert l1["evicted_dirty"] > 0, l1  # the burst did outrun the wait bound
        assert acked - sum(hits) == l1["evicted_dirty"] == status["tiers"]["l2"]["writes_skipped"], (acked, hits, l1)
        assert status["tiers"]["l2"]["objects"] == sum(hits) + 16, "orphans in L2"
        assert kvd.check_server_integrity(a, admin) == []


def test_the_l3_budget_never_keeps_a_tail_whose_head_it_evicted(make_server, redis_server) -> None:
    srv = make_server("--no-disk", "--redis-url", redis_server.url, "--redis-max-bytes", "48KiB", l1_size="16KiB")
    kvs = [make_kv(CHUNK * PROMPT_CHUNKS, seed=i) for i in range(10)]
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=30) as c:
        for i, kv in enumerate(kvs):
            assert kvd.store(c, kv, _prompt(i))
            _idle(srv)
        hits = [kvd.lookup(c, _prompt(i)) // CHUNK for i in range(len(kvs))]
        for i, (kv, n) in enumerate(zip(kvs, hits, strict=True)):
            if n:
                got = kvd.retrieve(c, _prompt(i))
                assert got is not None and torch.equal(got, kv[:, :, : got.shape[2]])
        assert kvd.check_server_integrity(c) == []
    held = int(redis_server_dbsize(redis_server))
    assert 0 < held < 10 * PROMPT_CHUNKS, held  # L3's budget did evict
    # every chunk this server keeps in L3 is reachable from its prompt's head (L1 holds 4 more at most)
    assert sum(hits) >= held, f"L3 holds {held} chunks, only {sum(hits)} reachable: orphans ({hits})"


def redis_server_dbsize(redis_server) -> int:  # type: ignore[no-untyped-def]
    """Chunk objects in the L3 (keys of kvdock's objects, not its model records or streams)."""
    import re

    import redis

    chunk = re.compile(rb"^kvdock:v2:\{[0-9a-f]+:[0-9a-f]{64}\}$")  # (storage/redis.py's object keys)
    return sum(1 for k in redis.Redis.from_url(redis_server.url).scan_iter(count=1000) if chunk.match(k))


def test_an_overwrite_under_write_pressure_answers_within_a_bound(make_server, tmp_path) -> None:
    # a disk taking 2 s a write (and a delete), 16 dirty chunks queued: ~32 s of backlog
    srv = make_server(
        "--disk-dir",
        str(tmp_path / "l2"),
        "--writeback-wait-s",
        "0.5",
        l1_size="64KiB",
        env={"KVDOCK_FAULT_L2_WRITE_DELAY_S": "2"},
    )
    try:
        with kvd.connect(srv.url, srv.http_url, MODEL, timeout=60) as c:
            for i in range(4):
                assert kvd.store(c, make_kv(CHUNK * PROMPT_CHUNKS, seed=i), _prompt(i))
            assert _status(srv)["l1"]["eviction"]["dirty_objects"] >= 12
        new = make_kv(CHUNK * PROMPT_CHUNKS, seed=99)
        with kvd.connect(srv.url, srv.http_url, MODEL, timeout=15) as c:  # the bound asked: 15 s
            t0 = time.monotonic()
            try:
                kvd.store(c, new, _prompt(3), overwrite=True)
            except kvd.ServerUnavailableError as e:
                pytest.fail(f"the overwrite got no reply within {time.monotonic() - t0:.0f} s: {e}")
            except kvd.KVCacheSDKError:
                pass  # refused at once: a visible failure is fine
            else:
                got = kvd.retrieve(c, _prompt(3))
                assert got is None or torch.equal(got, new[:, :, : got.shape[2]])
    finally:
        srv.stop(timeout=1)  # then aborts the drain, as a second SIGTERM would (the backlog takes ~32 s)


def test_a_read_from_l2_while_l1_is_all_dirty_is_a_quick_miss_and_drops_nothing(make_server, tmp_path) -> None:
    srv = make_server(
        "--disk-dir",
        str(tmp_path / "l2"),
        "--writeback-wait-s",
        "30",
        "--writeback-dirty-limit",  # (L1 may fill with dirty objects: what this test reads past)
        "1",
        l1_size="64KiB",
        env={"KVDOCK_FAULT_L2_WRITE_DELAY_S": "0.25"},  # (the 16 slots take 4 s to write down)
    )
    first = make_kv(CHUNK * PROMPT_CHUNKS, seed=0)
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=60) as c:
        assert kvd.store(c, first, _prompt(0))
        _idle(srv)  # prompt 0 written down: clean
        with kvd.view(c, _prompt(0)) as v:  # pinned while the burst comes: kept, byte-exact
            for i in range(1, 4):
                assert kvd.store(c, make_kv(CHUNK * PROMPT_CHUNKS, seed=i), _prompt(i))
            assert torch.equal(v.tensor(), first)
        assert kvd.store(c, make_kv(CHUNK * PROMPT_CHUNKS, seed=4), _prompt(4))  # evicts prompt 0 (clean)
        status = _status(srv)
        assert status["l1"]["eviction"]["dirty_objects"] >= 12, status["l1"]
        t0 = time.monotonic()
        got = kvd.retrieve(c, _prompt(0))  # in L2 only; L1 holds dirty objects and free room
        took = time.monotonic() - t0
        assert got is None or torch.equal(got, first[:, :, : got.shape[2]])
        assert took < 20, f"a read took {took:.1f} s"
        status = _idle(srv)
        l1 = status["l1"]["eviction"]
        assert (l1["evicted_dirty"], status["tiers"]["l2"]["writes_skipped"]) == (0, 0), (l1, status["tiers"])
        for i in range(5):
            got = kvd.retrieve(c, _prompt(i))
            assert got is not None and torch.equal(got, make_kv(CHUNK * PROMPT_CHUNKS, seed=i)), i
        assert kvd.check_server_integrity(c) == []


@pytest.mark.parametrize("policy", ["s3fifo", "prefix-lru"])
def test_fast_readers_racing_dirty_evictions_and_overwrites_never_see_wrong_bytes(
    make_server, tmp_path, policy: str
) -> None:
    import threading

    srv = make_server(
        "--disk-dir",
        str(tmp_path / "l2"),
        "--writeback-wait-s",
        "0.02",
        "--eviction-policy",
        policy,
        l1_size="64KiB",
        env={"KVDOCK_FAULT_L2_WRITE_DELAY_S": "0.05"},
    )
    n = 10
    versions = {
        i: (make_kv(CHUNK * PROMPT_CHUNKS, seed=i), make_kv(CHUNK * PROMPT_CHUNKS, seed=1000 + i)) for i in range(n)
    }
    done = threading.Event()
    bad: list[str] = []
    reads = [0, 0]

    def reader() -> None:
        with kvd.connect(srv.url, srv.http_url, MODEL, timeout=60) as c:
            while not done.is_set():
                for i in range(n):
                    got = kvd.retrieve(c, _prompt(i))
                    reads[0] += 1
                    if got is None:
                        continue
                    reads[1] += 1
                    k = got.shape[2]
                    if not any(torch.equal(got, v[:, :, :k]) for v in versions[i]):
                        bad.append(f"prompt {i}: {k // CHUNK} chunk(s) of neither version (or of both)")

    threads = [threading.Thread(target=reader, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        burst, _stored, errors = _start_burst(srv, range(100, 130))  # plain stores: dirty pressure
        with kvd.connect(srv.url, srv.http_url, MODEL, timeout=60) as c:
            for i in range(n):
                kvd.store(c, versions[i][0], _prompt(i))
                kvd.store(c, versions[i][1], _prompt(i), overwrite=True)
        burst.join(240)
        assert errors == [], errors
    finally:
        done.set()
        for t in threads:
            t.join(120)
    assert bad == [], bad[:5]
    assert reads[1] > 0, reads
    status = _idle(srv)
    assert status["l1"]["eviction"]["evicted_dirty"] > 0, status["l1"]  # (the point: slots reused under readers)
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=60) as c:
        assert kvd.check_server_integrity(c) == []


def test_dirty_evictions_of_a_tensor_parallel_model_keep_whole_prefixes(make_server, tmp_path) -> None:
    # a model stored in two shards: a chunk is cached only when both shards hold it, so dirty
    # evictions (newest first) must never drop one shard's head while the other's tail stays
    srv = make_server(
        "--disk-dir",
        str(tmp_path / "l2"),
        "--writeback-wait-s",
        "0.05",
        l1_size="64KiB",
        register=None,
        env={"KVDOCK_FAULT_L2_WRITE_DELAY_S": "0.1"},
    )
    kvd.register_model(srv.url, srv.http_url, "tp", num_layers=3, num_kv_heads=2, head_dim=8,
                       dtype="bfloat16", world_size=2, timeout=30)  # fmt: skip

    def kv(seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return torch.randn(2, 3, CHUNK * PROMPT_CHUNKS, 32, generator=g).to(torch.bfloat16)

    acked = 0
    with kvd.connect(srv.url, srv.http_url, "tp", timeout=60) as c:
        for i in range(8):  # 64 shard objects into 16 slots, faster than the disk
            acked += kvd.store_chunks(c, kv(i), _prompt(i)).stored_chunks
        status = _idle(srv)
        hits = [kvd.lookup(c, _prompt(i)) // CHUNK for i in range(8)]
        for i, n in enumerate(hits):
            if n:
                got = kvd.retrieve(c, _prompt(i))
                assert got is not None and torch.equal(got, kv(i)[:, :, : got.shape[2]]), i
        assert kvd.check_server_integrity(c) == []
    l1, l2 = status["l1"]["eviction"], status["tiers"]["l2"]
    assert l1["evicted_dirty"] > 0, l1
    assert l2["objects"] == 2 * sum(hits), f"L2 holds {l2['objects']} shard objects, {2 * sum(hits)} reachable ({hits})"

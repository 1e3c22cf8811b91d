"""Clients at once: four processes storing and retrieving (no corruption, no leaked pins), and threads
sharing one context (their own results each; never a crash when another thread closes it)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

import kvdock.sdk as kvd
import zygote
from helpers import CHUNK, MODEL, make_tokens

WORKER = textwrap.dedent(
    """
    import sys, torch
    import kvdock.sdk as kvd
    url, http_url, model, wid = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    C = 16
    def kv_for(seed, n):
        g = torch.Generator().manual_seed(seed)
        return torch.randn(2, 3, n, 16, generator=g).to(torch.bfloat16)
    with kvd.connect(url, http_url, model, timeout=20) as ctx:
        for it in range(25):
            own_tokens = [(wid + 1) * 10**6 + it * 1000 + t for t in range(4 * C)]
            own = kv_for(wid * 1000 + it, 4 * C)
            assert kvd.store(ctx, own, own_tokens) is True
            shared_tokens = list(range(it * 7, it * 7 + 3 * C))  # every worker stores the same chunks
            shared = kv_for(10**6 + it, 3 * C)
            kvd.store(ctx, shared, shared_tokens)
            out = kvd.retrieve(ctx, own_tokens)
            assert out is not None and torch.equal(out, own), (wid, it)
            # another worker may still be writing some shared chunks (store said "already stored"):
            # whatever prefix is visible must be exact
            out = kvd.retrieve(ctx, shared_tokens)
            assert out is None or torch.equal(out, shared[:, :, : out.shape[2]]), ("shared", wid, it)
            # other workers' data, if already there, is theirs and intact
            other = (wid + 1) % 4
            tokens = [(other + 1) * 10**6 + it * 1000 + t for t in range(4 * C)]
            out = kvd.retrieve(ctx, tokens)
            if out is not None:
                assert torch.equal(out, kv_for(other * 1000 + it, 4 * C)[:, :, : out.shape[2]]), ("other", wid, it)
    print("ok", wid)
    """
)


@pytest.mark.parametrize("transport", ["shm", "inline"])
def test_four_concurrent_clients(make_server, transport: str) -> None:
    srv = make_server(*(["--no-shm"] if transport == "inline" else []))
    procs = [
        zygote.Popen(
            [sys.executable, "-c", WORKER, srv.url, srv.http_url, MODEL, str(w)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for w in range(4)
    ]
    outs = [p.communicate(timeout=240) for p in procs]
    for w, (p, (out, err)) in enumerate(zip(procs, outs, strict=False)):
        assert p.returncode == 0, f"worker {w} failed:\n{err}"
        assert out.strip() == f"ok {w}"
    deadline = time.monotonic() + 5  # each worker closed its context (CloseClient is not awaited)
    while (status := srv.get("/status"))["clients"]:
        assert time.monotonic() < deadline, status
        time.sleep(0.02)
    assert status["sessions"] == 0
    assert status["l1"]["objects"] == 4 * 25 * 4 + 25 * 3 - _shared_overlap()
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=5) as c:
        assert kvd.check_server_integrity(c) == []
        for it in range(25):
            g = torch.Generator().manual_seed(10**6 + it)
            shared = torch.randn(2, 3, 48, 16, generator=g).to(torch.bfloat16)
            assert torch.equal(kvd.retrieve(c, list(range(it * 7, it * 7 + 48))), shared)


def _shared_overlap() -> int:
    # shared sequences start at it*7 with 48 tokens: chunk keys are prefix-chained, so two
    # iterations share a chunk only if they start at the same token, which they never do
    return 0


# --------------------------------------------------------------------------------------------------
# Threads sharing one context. A copy through the shared-memory pool must never run on unmapped
# memory: close() or a re-registration after a server restart in another thread used to unmap the
# pool under a live tensor view (the process died of SIGSEGV). Each scenario runs in a child
# process, so that a crash is an exit status (-11) instead of the death of the test run.

BIG = {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128}  # 128 KiB per token, 2 MiB per chunk
BIG_TOKENS = 512  # 64 MiB of KV

COPIER = textwrap.dedent(
    """
    import random, sys, threading, time, traceback, torch
    import kvdock.sdk as kvd
    n = BIG_TOKENS
    kv = torch.randn(2, 32, n, 1024, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    tokens = list(range(n))
    counts = {"complete": 0, "sdk_error": 0}
    wrong = []  # anything but a complete result or a KVCacheSDKError

    def copy_until(ctx, stop, buf):
        i = 0
        while not stop():
            i += 1
            try:
                if i % 3 == 0:
                    kvd.store(ctx, kv, tokens, overwrite=True)  # the same bytes: reads stay exact
                else:
                    out = kvd.retrieve(ctx, tokens, out=buf if i % 3 == 1 else None)
                    if out is not None and not torch.equal(out, kv[:, :, : out.shape[2]]):
                        wrong.append("retrieve returned other bytes")
                counts["complete"] += 1
            except kvd.KVCacheSDKError:
                counts["sdk_error"] += 1
                time.sleep(0.01)
            except BaseException:
                wrong.append(traceback.format_exc())
                return
    """
).replace("BIG_TOKENS", str(BIG_TOKENS))

CLOSE_WORKER = COPIER + textwrap.dedent(
    """
    url, http_url, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
    rng = random.Random(0)
    buf = torch.empty_like(kv)
    with kvd.connect(url, http_url, "big", timeout=20) as ctx:
        kvd.store(ctx, kv, tokens)
    for r in range(rounds):
        ctx = kvd.connect(url, http_url, "big", timeout=20)
        t = threading.Thread(target=copy_until, args=(ctx, lambda: ctx.closed, buf))
        t.start()
        before, deadline = counts["complete"], time.monotonic() + 60
        while counts["complete"] == before and t.is_alive() and time.monotonic() < deadline:
            time.sleep(0.005)  # the thread is at work: its first copy of the round is done
        time.sleep(rng.uniform(0.0, 0.3))
        ctx.close()  # at a random moment of a copy, a prepare or a commit
        t.join(30)
        assert not t.is_alive(), "the copying thread hangs after close()"
        try:
            kvd.retrieve(ctx, tokens)
            wrong.append("a closed context still retrieves")
        except kvd.KVCacheSDKError as e:
            assert "closed" in str(e), e
    print(counts["complete"], counts["sdk_error"], repr(wrong))
    """
)


def _run(script: str, *args: str, timeout: float = 240) -> tuple[int, int]:
    p = zygote.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"the copying process exited with {p.returncode}:\n{p.stderr[-4000:]}"
    complete, sdk_errors, wrong = p.stdout.strip().split(" ", 2)
    assert wrong == "[]", wrong
    return int(complete), int(sdk_errors)


def test_close_while_another_thread_copies_never_crashes(make_server) -> None:
    srv = make_server(l1_size="256MiB", register=None)
    kvd.register_model(srv.url, srv.http_url, "big", dtype="bfloat16", **BIG, timeout=10)
    complete, sdk_errors = _run(CLOSE_WORKER, srv.url, srv.http_url, "12")
    # every round closed the context while its thread was copying (after one copy of the round:
    # under load a copy of 64 MiB can outlast the random wait, which alone left 12 of 12 rounds
    # closing before any copy was done)
    assert complete >= 12, (complete, sdk_errors)
    with kvd.connect(srv.url, srv.http_url, "big", timeout=5) as c:
        assert kvd.lookup(c, list(range(BIG_TOKENS))) == BIG_TOKENS


RESTART_WORKER = COPIER + textwrap.dedent(
    """
    from kvdock.testing import start_server
    restarts, log_dir = int(sys.argv[1]), sys.argv[2]
    rng = random.Random(0)
    flags = ("--no-disk",)
    def serve(**ports):
        s = start_server(*flags, l1_size="256MiB", chunk_size=16, timeout=60, **ports)
        kvd.register_model(s.url, s.http_url, "big", dtype="bfloat16",
                           num_layers=32, num_kv_heads=8, head_dim=128, timeout=10)
        return s
    srv = serve()
    ctx = kvd.connect(srv.url, srv.http_url, "big", timeout=20)
    kvd.store(ctx, kv, tokens)
    stop = threading.Event()
    threads = [threading.Thread(target=copy_until, args=(ctx, stop.is_set, torch.empty_like(kv))) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        for r in range(restarts):
            time.sleep(rng.uniform(0.2, 0.6))
            old_id = ctx.client_id
            srv.stop()
            srv = serve(port=srv.port, http_port=srv.http_port)
            deadline = time.monotonic() + 30
            while ctx.client_id == old_id:  # a copying thread registered again
                assert time.monotonic() < deadline, "the context did not register again"
                time.sleep(0.01)
            before = counts["complete"]
            while counts["complete"] < before + 4:  # and copies run again
                assert time.monotonic() < deadline, "no copy succeeds after the restart"
                time.sleep(0.01)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
        ctx.close()
        srv.stop()
    assert not any(t.is_alive() for t in threads), "a copying thread hangs"
    print(counts["complete"], counts["sdk_error"], repr(wrong))
    """
)


def test_server_restart_while_threads_copy_never_crashes(tmp_path) -> None:
    complete, sdk_errors = _run(RESTART_WORKER, "3", str(tmp_path))
    assert complete > 12, (complete, sdk_errors)


SHARED_WORKER = textwrap.dedent(
    """
    import sys, threading, torch
    import kvdock.sdk as kvd
    url, http_url = sys.argv[1], sys.argv[2]
    bad = []
    def work(ctx, w):
        for it in range(20):
            tokens = [w * 10**6 + it * 1000 + t for t in range(3 * 16)]
            kv = torch.randn(2, 3, 48, 16, generator=torch.Generator().manual_seed(w * 100 + it)).to(torch.bfloat16)
            if not kvd.store(ctx, kv, tokens):
                bad.append(("store", w, it))
            if kvd.lookup(ctx, tokens) != 48:
                bad.append(("lookup", w, it))
            out = kvd.retrieve(ctx, tokens)
            if out is None or not torch.equal(out, kv):
                bad.append(("retrieve", w, it))
    with kvd.connect(url, http_url, "tiny", timeout=20) as ctx:
        threads = [threading.Thread(target=work, args=(ctx, w)) for w in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        alive = [t for t in threads if t.is_alive()]
    print(0, 0, repr(bad + [("hangs", len(alive))] * bool(alive)))
    """
)


@pytest.mark.parametrize("transport", ["shm", "inline"])
def test_threads_sharing_a_context_each_get_their_own_results(make_server, transport: str) -> None:
    srv = make_server(*(["--no-shm"] if transport == "inline" else []))
    _run(SHARED_WORKER, srv.url, srv.http_url)
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=5) as c:
        assert kvd.check_server_integrity(c) == []


# The guard itself, step by step (ctx.transfer(): the only way ops.py reaches the pool).


def _record_close(transfer) -> list[float]:  # type: ignore[no-untyped-def]
    closed_at: list[float] = []
    original = transfer.close

    def close() -> None:
        closed_at.append(time.monotonic())
        original()

    transfer.close = close
    return closed_at


def _hold_transfer(ctx: kvd.KVCacheContext, seconds: float) -> tuple[threading.Thread, list[float]]:
    left: list[float] = []
    entered = threading.Event()

    def copy() -> None:
        with ctx.transfer():
            entered.set()
            time.sleep(seconds)
            left.append(time.monotonic())

    t = threading.Thread(target=copy)
    t.start()
    assert entered.wait(5)
    return t, left


def test_close_waits_for_a_copy_in_progress_and_unmaps_after_it(ctx) -> None:
    assert ctx.transport == "shm"
    closed_at = _record_close(ctx._transfer)
    t, left = _hold_transfer(ctx, 0.5)
    t0 = time.monotonic()
    ctx.close()
    assert time.monotonic() - t0 >= 0.4  # close() waited for the copy
    t.join(5)
    assert len(closed_at) == 1 and closed_at[0] >= left[0]
    with pytest.raises(kvd.KVCacheSDKError, match=r"^this KVCacheContext is closed$"), ctx.transfer():
        pass


def test_a_close_that_stops_waiting_leaves_the_unmapping_to_the_last_copy(ctx) -> None:
    closed_at = _record_close(ctx._transfer)
    t, left = _hold_transfer(ctx, 1.0)
    t0 = time.monotonic()
    ctx.close(wait_s=0.1)
    assert time.monotonic() - t0 < 0.8 and closed_at == []  # still mapped: a copy runs
    t.join(5)
    assert len(closed_at) == 1 and closed_at[0] >= left[0]


def test_a_copy_for_slots_of_an_older_registration_is_refused(ctx) -> None:
    ctx.fast_reads = False  # the lookups below must be answered by the server
    tokens = list(range(2 * 16))
    assert kvd.lookup(ctx, tokens) == 0  # this thread's last request was answered for the first client id
    old_id = ctx.client_id
    closed_at = _record_close(ctx._transfer)
    with ctx._reconnect_lock:
        ctx._reconnect()  # what a server restart makes another thread do
    assert ctx.client_id != old_id and len(closed_at) == 1  # nobody was copying: unmapped at once
    with pytest.raises(kvd.KVCacheSDKError, match="restarted during this transfer"), ctx.transfer():
        pass
    assert kvd.lookup(ctx, tokens) == 0
    with ctx.transfer() as t:  # answered for the current registration: fine
        assert t is ctx._transfer


def test_a_registration_is_one_frozen_object_swapped_whole(ctx: kvd.KVCacheContext) -> None:
    """Issue 25: the registration was copied field by field on reconnect (a thread could read
    one registration's client id with another's limits); the client id was held in three places."""
    import dataclasses

    reg = ctx.registration
    with pytest.raises(dataclasses.FrozenInstanceError):
        reg.client_id = "x"  # type: ignore[misc]
    assert (ctx.client_id, ctx.chunk_size, ctx.geometry, ctx.max_request_tokens) == (
        reg.client_id, reg.chunk_size, reg.geometry, reg.max_request_tokens,
    )  # fmt: skip
    ctx.fast_reads = False
    with ctx._reconnect_lock:
        ctx._reconnect()  # what a server restart makes a thread do
    new = ctx.registration
    assert new is not reg and new.client_id != reg.client_id and ctx.client_id == new.client_id
    assert new.layout is reg.layout and new.geometry == reg.geometry  # the first registration's layout
    assert ctx.reporter._client_id() == new.client_id  # the reporter reads the one place
    assert kvd.lookup(ctx, make_tokens(CHUNK)) == 0  # the new registration works

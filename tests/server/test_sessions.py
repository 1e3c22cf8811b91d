"""A client that dies mid-flow loses its pins and reservations when its lease runs out."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import kvdock.sdk as kvd
import zygote
from helpers import CHUNK, MODEL, make_kv, make_tokens

CHILD = textwrap.dedent(
    """
    import sys, time
    import kvdock.sdk as kvd
    from kvdock.keys import normalize_tokens
    from kvdock.protocol import messages as m
    url, http_url, model, what = sys.argv[1:5]
    ctx = kvd.connect(url, http_url, model, timeout=5)
    tokens = normalize_tokens(list(range(4 * {chunk}))).tobytes()
    if what == "store":
        reply = ctx.call(m.PrepareStore(ctx.client_id, "s1", tokens)).reply
        # scribble half of the first slot, as if killed in the middle of the copy
        if ctx.transport == "shm":
            ctx._transfer._slot(reply.slots[0].offset).view(-1)[:10].fill_(7)
    else:
        reply = ctx.call(m.PrepareRetrieve(ctx.client_id, "r1", tokens)).reply
    print(len(reply.slots), flush=True)
    time.sleep(600)
    """
).format(chunk=CHUNK)


def _run_child(srv, what: str) -> subprocess.Popen[str]:
    p = zygote.Popen(
        [sys.executable, "-c", CHILD, srv.url, srv.http_url, MODEL, what], stdout=subprocess.PIPE, text=True
    )
    assert p.stdout is not None
    assert p.stdout.readline().strip() == "4"
    return p


def _wait_sessions(srv, n: int, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while srv.get("/status")["sessions"] != n:
        assert time.monotonic() < deadline, f"sessions still {srv.get('/status')['sessions']}"
        time.sleep(0.1)


def test_killed_store_leaves_nothing_locked(make_server) -> None:
    srv = make_server("--session-ttl", "1", l1_size="16KiB")  # room for exactly the 4 chunks
    child = _run_child(srv, "store")
    assert srv.get("/status")["sessions"] == 1
    assert srv.get("/status")["l1"]["used_bytes"] == 4 * 4096
    child.send_signal(signal.SIGKILL)
    child.wait()
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=5) as c:
        tokens = make_tokens(4 * CHUNK)
        assert kvd.lookup(c, tokens) == 0  # reserved chunks were never visible
        _wait_sessions(srv, 0)
        assert srv.get("/status")["l1"]["used_bytes"] == 0
        kv = make_kv(4 * CHUNK, seed=3)
        assert kvd.store(c, kv, tokens) is True  # not deduped against the dead reservation
        assert torch.equal(kvd.retrieve(c, tokens), kv)
        assert kvd.check_server_integrity(c) == []
    assert "lease expired" in srv.log()


def test_killed_retrieve_releases_its_pins(make_server) -> None:
    srv = make_server("--session-ttl", "1", l1_size="16KiB")
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=5) as c:
        kv = make_kv(4 * CHUNK, seed=4)
        assert kvd.store(c, kv, make_tokens(4 * CHUNK))
        child = _run_child(srv, "retrieve")  # pins all four slots
        other = make_kv(CHUNK, seed=5)
        with pytest.raises(kvd.PoolFullError):
            kvd.store(c, other, make_tokens(CHUNK, start=10_000))
        child.send_signal(signal.SIGKILL)
        child.wait()
        _wait_sessions(srv, 0)
        assert kvd.store(c, other, make_tokens(CHUNK, start=10_000)) is True  # evicts an unpinned chunk now
        assert kvd.check_server_integrity(c) == []
    metrics = srv.text("/metrics")
    assert "kvdock_expired_sessions_total 1.0" in metrics


# --- a paused client never reads or writes another object's bytes -------------------------------

PAUSED = str(Path(__file__).parent.parent / "paused_client.py")


def _paused_child(srv, what: str, start: int, n: int, arg: str, fast_reads: bool = True) -> subprocess.Popen[str]:
    p = zygote.Popen(
        [sys.executable, PAUSED, srv.url, srv.http_url, MODEL, what, str(start), str(n), arg],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=os.environ | {"KVDOCK_FAST_READS": "1" if fast_reads else "0"},
    )
    assert p.stdout is not None
    line = p.stdout.readline().strip()
    assert line == "paused", (line, p.stderr.read() if p.poll() is not None else "")  # type: ignore[union-attr]
    _wait_stopped(p.pid)
    return p


def _wait_stopped(pid: int, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
        assert time.monotonic() < deadline, "the child did not stop"
        time.sleep(0.01)


def _wait_status(srv, pick, want, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while (got := pick(srv.get("/status"))) != want:
        assert time.monotonic() < deadline, f"status still {got}, want {want}"
        time.sleep(0.05)


def _finish(p: subprocess.Popen[str]) -> dict:
    out, err = p.communicate(timeout=30)
    assert p.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.parametrize("fast_reads", [False, True], ids=["session", "directory"])
def test_a_paused_reader_never_returns_reused_slots(make_server, tmp_path, fast_reads: bool) -> None:
    """A reader stopped between learning where the chunks are (PrepareRetrieve's slots, or the
    pool directory's entries) and copying them, while the slots are freed and reused."""
    srv = make_server("--session-ttl", "2")
    a, b = make_tokens(4 * CHUNK), make_tokens(4 * CHUNK, start=50_000)
    old, new, other = make_kv(4 * CHUNK, seed=1), make_kv(4 * CHUNK, seed=2), make_kv(4 * CHUNK, seed=3)
    out = tmp_path / "got.pt"
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=5) as c:
        assert kvd.store(c, old, a)
        child = _paused_child(srv, "read", 0, 4 * CHUNK, str(out), fast_reads)  # knows the old slots
        _wait_status(srv, lambda s: s["sessions"], 0)  # its lease ran out while it is stopped (or it has none)
        assert kvd.store(c, new, a, overwrite=True)  # the old slots are freed ...
        assert kvd.store(c, other, b)  # ... and handed to other tokens
        child.send_signal(signal.SIGCONT)
        assert _finish(child) == {"reads": 2}  # the stale copy was refused, the retry read anew
        assert torch.equal(torch.load(out), new)
        assert torch.equal(kvd.retrieve(c, b), other)
        assert kvd.check_server_integrity(c) == []


def test_a_paused_writer_never_writes_into_another_object(make_server) -> None:
    srv = make_server("--session-ttl", "2", l1_size="64KiB")  # 16 slots
    x, y = make_tokens(4 * CHUNK, start=10_000), make_tokens(8 * CHUNK, start=20_000)
    kv_x, kv_y = make_kv(4 * CHUNK, seed=6), make_kv(8 * CHUNK, seed=7)
    child = _paused_child(srv, "write", 0, 4 * CHUNK, "5")  # holds 4 reserved slots, not written
    _wait_status(srv, lambda s: s["sessions"], 0)
    assert srv.get("/status")["l1"]["quarantined_bytes"] == 4 * 4096  # kept from everyone else
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=5) as c:
        assert kvd.store(c, kv_x, x) and kvd.store(c, kv_y, y)  # the other 12 slots
        assert srv.get("/status")["l1"]["used_bytes"] == 16 * 4096  # every slot taken, none shared
        child.send_signal(signal.SIGCONT)  # it writes its slots now, then commits
        got = _finish(child)
        assert got["error"] == "LeaseExpiredError" and "lease ran out before the commit" in got["message"], got
        _wait_status(srv, lambda s: s["l1"]["quarantined_bytes"], 0)  # its CommitStore ended its copy
        assert torch.equal(kvd.retrieve(c, x), kv_x) and torch.equal(kvd.retrieve(c, y), kv_y)
        assert kvd.lookup(c, make_tokens(4 * CHUNK)) == 0
        assert kvd.check_server_integrity(c) == []


def test_a_killed_paused_writer_releases_its_quarantine(make_server) -> None:
    srv = make_server("--session-ttl", "1", l1_size="64KiB")
    child = _paused_child(srv, "write", 0, 4 * CHUNK, "5")
    _wait_status(srv, lambda s: s["l1"]["quarantined_bytes"], 4 * 4096)
    child.kill()
    child.wait()
    _wait_status(srv, lambda s: s["l1"]["quarantined_bytes"], 0)  # its process is gone
    _wait_status(srv, lambda s: s["l1"]["used_bytes"], 0)
    assert "quarantined slot(s) of dead client processes freed" in srv.log()


def test_store_never_claims_dedup_for_chunks_another_client_is_writing(make_server) -> None:
    srv = make_server("--session-ttl", "8")  # outlives both conflicting stores below
    tokens = make_tokens(4 * CHUNK)
    child = _run_child(srv, "store")  # reserves the four chunks, then is killed before its commit
    child.kill()
    child.wait()
    kv = make_kv(4 * CHUNK, seed=9)
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=5) as c:
        t0 = time.monotonic()
        result = kvd.store_chunks(c, kv, tokens)
        assert result == kvd.StoreResult(0, 0, 0, 4)  # neither stored nor "already stored"
        assert 1.5 < time.monotonic() - t0 < 5  # it waited for the other writer, boundedly
        with pytest.raises(kvd.StoreConflictError, match=r"^4 chunk\(s\) are being written by another client"):
            kvd.store(c, kv, tokens)
        assert kvd.lookup(c, tokens) == 0
        _wait_status(srv, lambda s: s["sessions"], 0)  # the dead writer's lease ran out
        assert kvd.store(c, kv, tokens) is True
        assert torch.equal(kvd.retrieve(c, tokens), kv)
        assert kvd.check_server_integrity(c) == []


# ---------------------------------------------------------------- regressions, over real processes


def test_inline_reply_is_not_read_from_slots_reused_after_lease_expiry(make_server) -> None:
    """Regression: inline retrieve replies were sent zero-copy straight out of the L1 slots while
    the pins only lasted as long as the session's lease. A client that read its reply slowly got
    the bytes of whatever object reused the slots after the lease ran out: silently wrong KV."""
    import urllib.request

    import zmq

    from kvdock.keys import normalize_tokens
    from kvdock.protocol import decode_reply, encode
    from kvdock.protocol import messages as m

    srv = make_server("--session-ttl", "1", l1_size="96MiB", register=None)
    big = {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128}  # 2 MiB per 16-token chunk
    kvd.register_model(srv.url, srv.http_url, "big", dtype="bfloat16", **big, timeout=10)
    n = 16 * CHUNK
    tokens = list(range(n))

    def kv(seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return torch.randn(2, 32, n, 8 * 128, generator=g).to(torch.bfloat16)

    kv_a = kv(1)
    with kvd.connect(srv.url, srv.http_url, "big", timeout=10) as b:
        assert kvd.store(b, kv_a, tokens)

        zctx = zmq.Context()
        a = zctx.socket(zmq.DEALER)
        a.setsockopt(zmq.LINGER, 0)
        a.setsockopt(zmq.RCVHWM, 1)
        a.setsockopt(zmq.RCVBUF, 4096)
        a.connect(srv.url)
        try:
            a.send_multipart([b"1", encode(m.RegisterClient(m.PROTOCOL_VERSION, "slow", "big"))])
            reg = decode_reply(a.recv_multipart()[1])
            assert reg.transport == "inline"
            for i in range(8):  # replies nobody reads yet: the client's queue is full
                a.send_multipart([b"p%d" % i, encode(m.Ping())])
            raw = normalize_tokens(tokens).tobytes()
            a.send_multipart([b"r", encode(m.PrepareRetrieve(reg.client_id, "slow-r", raw))])
            deadline = time.monotonic() + 10
            time.sleep(0.5)
            while srv.get("/status")["sessions"] != 0:  # the reply is built; any lease runs out
                assert time.monotonic() < deadline
                time.sleep(0.1)
            time.sleep(1.5)
            req = urllib.request.Request(srv.http_url + "/admin/clear?tier=l1", method="POST")
            urllib.request.urlopen(req, timeout=10).close()  # the unpinned chunks' slots are freed
            assert kvd.store(b, kv(2), list(range(10_000, 10_000 + n)))  # reuses the freed slots
            frames = []
            while True:
                got = a.recv_multipart(copy=True)
                if got[0] == b"r":
                    frames = got[2:]
                    break
        finally:
            a.close()
            zctx.term()
    data = bytearray(b"".join(frames))  # the chunks' bytes, one after the other
    nbytes = 2 * 32 * CHUNK * 8 * 128 * 2
    assert len(data) == 16 * nbytes
    out = torch.empty_like(kv_a)
    for j in range(16):
        chunk = torch.frombuffer(data[j * nbytes : (j + 1) * nbytes], dtype=torch.bfloat16)
        out[:, :, j * CHUNK : (j + 1) * CHUNK] = chunk.view(2, 32, CHUNK, 8 * 128)
    span = [slice(j * CHUNK, (j + 1) * CHUNK) for j in range(16)]
    bad = [j for j in range(16) if not torch.equal(out[:, :, span[j]], kv_a[:, :, span[j]])]
    assert not bad, f"chunks {bad} of the reply hold another object's bytes"


def test_prepare_retrieve_refuses_a_lookup_session_of_another_salt(ctx) -> None:
    """Regression: PrepareRetrieve reused a session opened by a prefetching Lookup without
    checking that it asks for the same tokens and cache_salt, handing out another namespace's KV."""
    from kvdock.keys import normalize_tokens
    from kvdock.protocol import messages as m

    tokens = make_tokens(2 * CHUNK)
    assert kvd.store(ctx, make_kv(2 * CHUNK), tokens, cache_salt="tenant-a")
    raw = normalize_tokens(tokens).tobytes()
    ctx.call(m.Lookup(ctx.client_id, raw, "tenant-a", prefetch=True, session_id="s"))
    with pytest.raises(kvd.ServerError, match="bad_request: session 's' was opened for other tokens or cache_salt"):
        ctx.call(m.PrepareRetrieve(ctx.client_id, "s", raw, cache_salt="tenant-b"))
    ctx.end_session("s")
    assert kvd.lookup(ctx, tokens, cache_salt="tenant-b") == 0


# ---------------------------------------------------------------- regressions, handlers in-process


CHUNK_IN = 16  # tokens per chunk of the in-process server


class _InProcess:
    """A ServerState over an anonymous segment, an L2 DiskTier with its lane, and model "tiny"
    registered; ``handle`` runs requests through the real dispatch."""

    def __init__(self, tmp_path, ttl: float = 60.0, clock=None) -> None:  # type: ignore[no-untyped-def]
        from kvdock.sdk.registration import make_layout
        from kvdock.server.registry import Registry
        from kvdock.server.state import ServerState
        from kvdock.shm.pool import Pool
        from kvdock.shm.slots import ALIGN
        from kvdock.storage import DiskTier, L1Store, StorageManager, TierLane

        self.pool = Pool.create(64 * ALIGN, shm=False)
        self.l1 = L1Store(self.pool.allocator, memory=self.pool)
        self.disk = DiskTier(tmp_path / "l2", 1 << 24)
        self.disk.scan()
        self.lane = TierLane(self.disk, self.l1)
        self.reg = Registry(CHUNK_IN)
        self.reg.register_model(make_layout("tiny", num_layers=3, num_kv_heads=2, head_dim=8, dtype="bfloat16"))
        kw = {"clock": clock} if clock is not None else {}
        self.mgr = StorageManager(self.l1, ttl, [self.lane], self.reg.geometry_of, CHUNK_IN, **kw)
        self.state = ServerState(CHUNK_IN, self.pool, self.mgr, self.reg)
        self.nbytes = self.reg.models["tiny"].slot_nbytes

    async def call(self, req, payload=()):  # type: ignore[no-untyped-def]
        import inspect

        from kvdock.server.dispatch import handle

        out = handle(self.state, req, list(payload))
        return await out if inspect.isawaitable(out) else out

    def block_reader(self):  # type: ignore[no-untyped-def]
        import threading

        gate = threading.Event()
        self.lane._reader.submit(gate.wait, 10)
        return gate

    def close(self) -> None:
        self.state.copier.shutdown(wait=True)
        self.mgr.close()
        self.pool.close()


def test_retrieve_waiting_for_a_prefetch_keeps_its_session_past_the_lease(tmp_path) -> None:
    """Regression: a PrepareRetrieve waiting on the server for a prefetch did not keep its
    session's lease alive: when loading took longer than session_ttl (but less than wait_s), the
    reaper ended the session mid-wait and the client got an empty reply for data that was loaded."""
    import asyncio

    from kvdock.keys import normalize_tokens
    from kvdock.protocol import messages as m
    from tierworld import until

    async def main() -> None:
        now = [0.0]
        srv = _InProcess(tmp_path, ttl=1.0, clock=lambda: now[0])
        try:
            cid = (await srv.call(m.RegisterClient(m.PROTOCOL_VERSION, "x", "tiny"))).message.client_id
            toks = normalize_tokens(list(range(CHUNK_IN))).tobytes()
            await srv.call(m.PrepareStore(cid, "s", toks))
            frame = memoryview(bytes(range(256)) * (srv.nbytes // 256))
            done = await srv.call(m.CommitStore(cid, "s", [0]), [frame])
            assert done.message == m.StoreCommitted(1)
            await until(lambda: srv.lane.idle and len(srv.disk) == 1)
            srv.l1.clear()  # only L2 holds the chunk now

            gate = srv.block_reader()  # a slow disk read
            task = asyncio.ensure_future(srv.call(m.PrepareRetrieve(cid, "r", toks, wait_s=10.0)))
            await asyncio.sleep(0.05)
            now[0] = 1.5  # 1.5 s into a 10 s wait: the reaper runs
            assert srv.mgr.sessions.expire() == 0
            gate.set()
            reply = await asyncio.wait_for(task, 10)
            assert isinstance(reply.message, m.RetrievePrepared), reply.message
            assert len(reply.message.slots) == 1, "the chunk was loaded within wait_s, but the reply is empty"
            assert b"".join(bytes(f) for f in reply.frames) == bytes(frame)
            srv.mgr.check_integrity()
        finally:
            srv.close()

    asyncio.run(main())


def test_inline_retrieve_after_a_prefetch_wait_survives_an_overwrite_of_a_pinned_chunk(tmp_path) -> None:
    """Regression: an inline PrepareRetrieve waited for a prefetch while another client overwrote
    a chunk that the session had already pinned (the old version is retired, still pinned); when
    the wait ended the reply pinned the retired object again, L1Store.pin asserted ``live``, and
    the client got Error("internal"). Now the reply is a clean miss: the overwrite was
    acknowledged before it, so the older version must not be handed out."""
    import asyncio

    from kvdock.keys import normalize_tokens
    from kvdock.protocol import messages as m
    from kvdock.server.handlers import client_of, keys_of
    from tierworld import until

    async def main() -> None:
        srv = _InProcess(tmp_path)
        frame = memoryview(bytes(range(256)) * (srv.nbytes // 256))
        other = memoryview(bytes(reversed(range(256))) * (srv.nbytes // 256))
        try:
            cid = (await srv.call(m.RegisterClient(m.PROTOCOL_VERSION, "x", "tiny"))).message.client_id
            assert client_of(srv.state, cid).transport == "inline"
            one = normalize_tokens(list(range(CHUNK_IN))).tobytes()
            two = normalize_tokens(list(range(2 * CHUNK_IN))).tobytes()
            await srv.call(m.PrepareStore(cid, "s1", two))
            assert (await srv.call(m.CommitStore(cid, "s1", [0, 1]), [frame, frame])).message == m.StoreCommitted(2)
            await until(lambda: srv.lane.idle and len(srv.disk) == 2)
            k1 = keys_of(srv.state, client_of(srv.state, cid), two, "")[1]
            assert srv.l1.remove(k1)  # chunk 0 in L1, chunk 1 only in L2

            gate = srv.block_reader()  # a slow disk read
            task = asyncio.ensure_future(srv.call(m.PrepareRetrieve(cid, "r", two, wait_s=10.0)))
            await asyncio.sleep(0.05)
            # someone overwrites chunk 0 while the retrieve waits (its old version stays pinned);
            # the overwrite's commit waits for the deletion of the older version in L2
            prep = (await srv.call(m.PrepareStore(cid, "s2", one, overwrite=True))).message
            assert len(prep.slots) == 1
            committed = await srv.call(m.CommitStore(cid, "s2", [0]), [other])
            assert committed.message == m.StoreCommitted(1)
            gate.set()
            reply = await asyncio.wait_for(task, 10)
            assert reply.message == m.RetrievePrepared([]) and not reply.frames
            await until(lambda: srv.lane.idle)
            srv.mgr.check_integrity()
        finally:
            srv.close()

    asyncio.run(main())


def test_a_second_inline_commit_store_of_a_session_is_refused() -> None:
    import asyncio

    from helpers import GEOMETRY
    from kvdock import keys as keymod
    from kvdock.config import ServerConfig
    from kvdock.keys import normalize_tokens
    from kvdock.protocol import messages as m
    from kvdock.sdk.registration import make_layout
    from kvdock.server import dispatch
    from kvdock.server.build import build_state

    state = build_state(ServerConfig(chunk_size=CHUNK, l1_size=4 * 4096, no_shm=True, no_disk=True))  # 4 slots
    try:
        state.registry.register_model(make_layout(MODEL, dtype="bfloat16", **GEOMETRY))

        def register(name: str) -> str:
            reply = dispatch.handle(state, m.RegisterClient(m.PROTOCOL_VERSION, name, MODEL, 0), []).message
            assert reply.transport == "inline"
            return reply.client_id

        a, b = register("a"), register("b")
        nb = state.registry.models[MODEL].slot_nbytes
        tb = list(range(1000, 1000 + CHUNK))
        kb = keymod.ObjectKey(MODEL, 0, "", keymod.chunk_hashes(normalize_tokens(tb), CHUNK)[0])

        async def main() -> bytes:
            ta = normalize_tokens(list(range(4 * CHUNK))).tobytes()
            assert len(dispatch.handle(state, m.PrepareStore(a, "s", ta), []).message.slots) == 4
            one = [memoryview(b"\x11" * nb)]
            four = [memoryview(b"\x22" * nb) for _ in range(4)]
            first = asyncio.ensure_future(dispatch.handle(state, m.CommitStore(a, "s", [0]), one))
            # a second commit of the same session while the first one's copy runs would copy into
            # slots the first may free when it commits: it is refused at once
            second = dispatch.handle(state, m.CommitStore(a, "s", [0, 1, 2, 3]), four)
            assert second.message == m.Error("session", "session 's' is already being committed")
            assert (await first).message == m.StoreCommitted(1)
            # client b: the pool is full, a's committed chunk 0 is evicted and its slot is b's now
            prep = dispatch.handle(state, m.PrepareStore(b, "t", normalize_tokens(tb).tobytes()), []).message
            assert len(prep.slots) == 1, prep
            done = dispatch.handle(state, m.CommitStore(b, "t", [0]), [memoryview(b"\x33" * nb)])
            assert (await done).message == m.StoreCommitted(1)
            obj = state.manager.l1.get(kb)
            assert obj is not None
            return bytes(state.manager.l1.view(obj))

        got = asyncio.run(main())
        assert got == b"\x33" * nb, "client b's committed object holds client a's bytes"
    finally:
        state.manager.close()
        state.copier.shutdown(wait=True)
        state.pool.close()


def _quarantine_drains(srv, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while srv.get("/status")["l1"]["quarantined_bytes"]:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_close_during_a_store_leaves_no_quarantine_behind(make_server) -> None:
    from kvdock.errors import KVCacheSDKError

    srv = make_server()
    ctx = kvd.connect(srv.url, srv.http_url, MODEL, timeout=5)
    assert ctx.transport == "shm"
    real = ctx.transfer

    def closed_by_another_thread():  # type: ignore[no-untyped-def]
        ctx.close()
        return real()

    ctx.transfer = closed_by_another_thread  # type: ignore[method-assign]
    with pytest.raises(KVCacheSDKError, match="closed"):
        kvd.store(ctx, make_kv(4 * CHUNK), make_tokens(4 * CHUNK))  # nothing was copied
    assert _quarantine_drains(srv, 5.0), srv.get("/status")["l1"]


def test_a_reregistration_during_a_copy_leaves_no_quarantine_behind(make_server, monkeypatch) -> None:
    import threading

    from kvdock.errors import KVCacheSDKError
    from kvdock.sdk._transfer import ShmTransfer

    srv = make_server("--client-ttl", "1")
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=5) as ctx:
        assert ctx.transport == "shm"
        ctx.fast_reads = False  # the lookup below must reach the server (and register again)
        old_id = ctx.client_id
        real = ShmTransfer.write

        def slow_write(self, slots, kv):  # type: ignore[no-untyped-def]
            time.sleep(2.5)  # a slow copy: the client's lease runs out, its store session is quarantined
            other = threading.Thread(target=kvd.lookup, args=(ctx, make_tokens(CHUNK, start=9000)))
            other.start()  # another thread registers again
            other.join()
            return real(self, slots, kv)

        monkeypatch.setattr(ShmTransfer, "write", slow_write)
        with pytest.raises(KVCacheSDKError):
            kvd.store(ctx, make_kv(4 * CHUNK), make_tokens(4 * CHUNK))
        monkeypatch.setattr(ShmTransfer, "write", real)
        assert ctx.client_id != old_id
        assert _quarantine_drains(srv, 5.0), srv.get("/status")["l1"]

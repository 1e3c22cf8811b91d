"""Regression tests from a code review of the storage tiers, sessions and transports: each test
failed before its fix (the comment above it says what the bug was)."""

from __future__ import annotations

import asyncio
import threading
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from kvdock.shm.slots import ALIGN, SlotAllocator
from kvdock.storage.disk import DiskStore
from kvdock.storage.manager import StorageManager
from kvdock.storage.memory import L1Store
from kvdock.storage.tiers import Tiers
from tierworld import NB, K, World, payload, until
from tierworld import run as run_world


def run(tmp_path: Path, body: Callable[[World], Awaitable[None]], **kw: object) -> None:
    run_world(tmp_path, body, check=False, **kw)


# --------------------------------------------------------------------------------------------------
# 1. L2: an older write of a key that finishes after an overwrite was queued re-indexes the path;
#    a later write evicts that entry and unlinks the path, deleting the overwrite's fresh file.


def test_l2_overwrite_file_deleted_by_eviction_of_reindexed_old_version(tmp_path: Path) -> None:
    async def body(w: World) -> None:
        gate1 = w.block()
        w.store([K(1)], version=1)  # W1 (old version) queued behind gate1
        gate2 = w.block()  # hold the writer between W1 and W2
        w.store([K(1)], version=2, overwrite=True)  # W2: disk.remove(K1) finds nothing yet
        gate1.set()
        await until(lambda: w.disk.contains(K(1)))  # W1 finished: its (stale) entry is indexed again
        w.store([K(2)])  # W3: make_room evicts K1's stale entry and will unlink K1's path
        gate2.set()
        await w.drain()
        # W2 renamed the new version onto K1's path, W3 then unlinked that same path
        w.tiers.check_integrity()  # "indexed file ... is missing"
        w.l1.remove(K(1))
        session = await w.prefetch("r", [K(1)])
        assert len(session.pinned) == 1, "the overwritten chunk was lost from L2"
        assert bytes(w.l1.view(session.pinned[0])) == payload(K(1), 2)

    run(tmp_path, body, disk_files=2)


# --------------------------------------------------------------------------------------------------
# 2. An overwrite store of a key that a prefetch is loading from L2 is answered "deduped": the
#    client's edit is silently dropped and the old version becomes READY.


def test_overwrite_during_prefetch_load_is_silently_dropped(tmp_path: Path) -> None:
    async def body(w: World) -> None:
        w.store([K(1)], version=1)
        await w.drain()
        w.l1.remove(K(1))  # only L2 holds it now
        gate = w.block("l2", 1)  # hold the reader thread so the load stays in flight
        session = w.mgr.open_retrieve("c", "r", [K(1)])
        job = w.tiers.start_prefetch(session, [K(1)])
        await until(lambda: w.l1.is_reserved(K(1)))
        plan = w.mgr.prepare_store("c", "edit", [K(1)], NB, overwrite=True)
        gate.set()
        await asyncio.wait_for(job.done.wait(), 10)
        w.mgr.commit_retrieve("c", "r")
        assert plan.slots, f"overwrite=True was refused as a dedup while a load was in flight: {plan}"

    run(tmp_path, body)


# --------------------------------------------------------------------------------------------------
# 3. When write-down of an overwrite is skipped (backlog full / object larger than the tier), the
#    older version stays indexed in L2, so after L1 evicts the new version a retrieve returns the
#    OLD bytes.


def test_skipped_write_down_of_overwrite_leaves_stale_version_in_l2(tmp_path: Path) -> None:
    async def body(w: World) -> None:
        w.store([K(1)], version=1)
        await w.drain()
        gate = w.block()
        w.store([K(5)])  # fills the write-down backlog (one object)
        w.store([K(1)], version=2, overwrite=True)  # its write-down is skipped
        assert w.tiers.counters["l2"].writes_skipped == 1
        gate.set()
        await w.drain()
        w.l1.remove(K(1))  # L1 evicts the new version
        session = await w.prefetch("r", [K(1)])
        got = bytes(w.l1.view(session.pinned[0])) if session.pinned else None
        w.mgr.commit_retrieve("c", "r")
        stale = got == payload(K(1), 1)
        assert not stale, "retrieve after an overwrite returned the old version from L2"

    run(tmp_path, body, max_backlog_bytes=NB)


# --------------------------------------------------------------------------------------------------
# 4. L2 budget: make_room promises ALIGN + nbytes per file, but the header is padded to a multiple
#    of 4 KiB and grows with the cache_salt (client input), so used_bytes exceeds the capacity.


def test_l2_budget_exceeded_with_long_cache_salt(tmp_path: Path) -> None:
    async def body(w: World) -> None:
        salt = "s" * 5000
        w.store([K(1, salt), K(2, salt)])
        await w.drain()
        assert w.disk.used_bytes <= w.disk.capacity, (w.disk.used_bytes, w.disk.capacity)

    run(tmp_path, body, disk_files=2)


# --------------------------------------------------------------------------------------------------
# 5. Inline retrieve replies are sent zero-copy straight out of the L1 slots, but the pins only
#    last as long as the session's lease. A client that reads its reply slowly (slow link, busy
#    process) gets the bytes of whatever object reused the slots after the lease ran out: silently
#    wrong KV, no error anywhere.


def test_inline_zero_copy_reply_reads_slots_reused_after_lease_expiry(make_server) -> None:
    import time

    import torch
    import zmq

    import kvdock.sdk as kvd
    from helpers import CHUNK
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
            while srv.get("/status")["sessions"] != 1:  # the server pinned the chunks and replied
                assert time.monotonic() < deadline
                time.sleep(0.01)
            while srv.get("/status")["sessions"] != 0:  # the lease runs out while the reply is queued
                assert time.monotonic() < deadline
                time.sleep(0.1)
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
    assert len(frames) == 16
    out = torch.empty_like(kv_a)
    for j, f in enumerate(frames):
        out[:, :, j * CHUNK : (j + 1) * CHUNK] = torch.frombuffer(bytearray(f), dtype=torch.bfloat16).view(
            2, 32, CHUNK, 8 * 128
        )
    span = [slice(j * CHUNK, (j + 1) * CHUNK) for j in range(16)]
    bad = [j for j in range(16) if not torch.equal(out[:, :, span[j]], kv_a[:, :, span[j]])]
    assert not bad, f"chunks {bad} of the reply hold another object's bytes"


# --------------------------------------------------------------------------------------------------
# 6. A PrepareRetrieve that waits on the server for a prefetch does not keep its session's lease
#    alive: when loading takes longer than session_ttl (but less than the client's wait_s), the
#    reaper ends the session mid-wait and the client gets an empty reply for data that was loaded.


def test_retrieve_waiting_for_prefetch_loses_its_session_to_the_reaper(tmp_path: Path) -> None:
    from kvdock.keys import normalize_tokens
    from kvdock.protocol import messages as m
    from kvdock.sdk.registration import make_layout
    from kvdock.server.dispatch import handle
    from kvdock.server.handlers import ServerState
    from kvdock.server.registry import Registry
    from kvdock.shm import HEADER_SIZE, PoolSegment

    chunk = 16

    async def main() -> None:
        now = [0.0]
        segment = PoolSegment.anonymous(64 * ALIGN)
        l1 = L1Store(SlotAllocator(HEADER_SIZE, 64 * ALIGN), memory=segment.buf)
        mgr = StorageManager(l1, session_ttl=1.0, clock=lambda: now[0])
        disk = DiskStore(tmp_path / "l2", 1 << 24)
        disk.scan()
        reg = Registry(chunk)
        reg.register_model(make_layout("tiny", num_layers=3, num_kv_heads=2, head_dim=8, dtype="bfloat16"))
        tiers = Tiers(mgr, reg.layout_of, disk, None)
        state = ServerState(chunk, segment, False, mgr, reg, tiers)
        try:
            cid = handle(state, m.RegisterClient(m.PROTOCOL_VERSION, "x", "tiny"), [])[0].client_id
            toks = normalize_tokens(list(range(chunk))).tobytes()
            prep = handle(state, m.PrepareStore(cid, "s", toks), [])[0]
            nb = reg.models["tiny"].slot_nbytes
            done = handle(state, m.CommitStore(cid, "s", [0]), [memoryview(bytes(range(256)) * (nb // 256))])
            assert done[0] == m.StoreCommitted(1), (prep, done)
            await until(lambda: tiers.backlog_bytes == 0 and len(disk) == 1)
            l1.clear()  # only L2 holds the chunk now

            gate = threading.Event()
            tiers._pools["l2"][1].submit(gate.wait, 10)  # a slow disk read
            pending = handle(state, m.PrepareRetrieve(cid, "r", toks, wait_s=10.0), [])
            task = asyncio.ensure_future(pending)
            await asyncio.sleep(0.05)
            now[0] = 1.5  # 1.5 s into a 10 s wait: the reaper runs
            mgr.expire()
            gate.set()
            reply, _ = await asyncio.wait_for(task, 10)
            assert len(reply.slots) == 1, "the chunk was loaded within wait_s, but the reply is empty"
        finally:
            tiers.close()
            segment.close()

    asyncio.run(main())


# --------------------------------------------------------------------------------------------------
# 7. Tiers._load only releases its reserved slot through finish_load(); any exception out of _fill
#    (here: deleting a corrupted L2 file fails because the filesystem went read-only) leaves the
#    slot reserved forever, and the key can then never be stored (always "deduped") nor loaded.


def test_failed_load_leaks_its_reservation_forever(tmp_path: Path, monkeypatch) -> None:
    import errno

    async def body(w: World) -> None:
        w.store([K(1)])
        await w.drain()
        w.l1.remove(K(1))
        path = w.disk.path_for(K(1))
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF  # corrupted payload: checksum mismatch on read
        path.write_bytes(bytes(data))

        def ro_unlink(self, missing_ok=False):
            raise OSError(errno.EROFS, "Read-only file system", str(self))

        monkeypatch.setattr(Path, "unlink", ro_unlink)
        session = await w.prefetch("r", [K(1)])
        assert session.pinned == []
        w.mgr.end_session("c", "r")
        monkeypatch.undo()
        assert not w.l1.is_reserved(K(1)), "the load's slot is still reserved after the load ended"
        plan = w.mgr.prepare_store("c", "again", [K(1)], NB)
        assert plan.slots, f"K1 can no longer be stored: {plan}"

    run(tmp_path, body)


# --------------------------------------------------------------------------------------------------
# 8. PrepareRetrieve reuses a session opened by a prefetching Lookup without checking that it asks
#    for the same tokens and cache_salt: it hands out the other namespace's KV (salts are supposed
#    to be invisible to each other) instead of an error.


def test_prepare_retrieve_reuses_lookup_session_across_salts(ctx) -> None:
    import kvdock.sdk as kvd
    from helpers import CHUNK, make_kv, make_tokens
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


# --------------------------------------------------------------------------------------------------
# 9. DiskStore.make_room stops evicting when the index is empty but still promises the bytes, so
#    writes in flight together overshoot the L2 budget (by up to the write-down backlog, i.e. the
#    L1 size) until some later write happens to evict enough.


def test_l2_budget_exceeded_by_concurrent_writes(tmp_path: Path) -> None:
    async def body(w: World) -> None:
        gate = w.block()
        w.store([K(1), K(2), K(3), K(4)])  # four writes in flight, room for two files
        gate.set()
        await w.drain()
        assert w.disk.used_bytes <= w.disk.capacity, (w.disk.used_bytes, w.disk.capacity, len(w.disk))

    run(tmp_path, body, disk_files=2)

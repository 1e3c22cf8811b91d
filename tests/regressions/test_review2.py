"""Regression tests from a second review (zero-copy inline replies, CloseClient, re-registration,
retrieve(out=)). Each test failed before the fix of the bug its comment describes."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest
import torch

import kvdock.sdk as kvd
from helpers import CHUNK, MODEL, make_kv, make_tokens
from kvdock.shm.slots import ALIGN, SlotAllocator
from kvdock.storage.disk import DiskStore
from kvdock.storage.manager import StorageManager
from kvdock.storage.memory import L1Store
from kvdock.storage.tiers import Tiers
from tierworld import until

# --------------------------------------------------------------------------------------------------
# 1. An inline PrepareRetrieve that waits for a prefetch: meanwhile another client overwrites a
#    chunk that the session already pinned (the old version is retired, still pinned). When the
#    wait ends, _retrieve_reply calls pin_background() on the retired object, L1Store.pin asserts
#    `obj.live`, and the client gets Error("internal") instead of the KV that is pinned and intact.


def test_inline_retrieve_after_prefetch_wait_survives_an_overwrite_of_a_pinned_chunk(tmp_path: Path) -> None:
    from kvdock.keys import normalize_tokens
    from kvdock.protocol import messages as m
    from kvdock.sdk.registration import make_layout
    from kvdock.server.dispatch import handle
    from kvdock.server.handlers import ServerState, client_of, keys_of
    from kvdock.server.registry import Registry
    from kvdock.shm import HEADER_SIZE, PoolSegment

    chunk = 16

    async def main() -> None:
        segment = PoolSegment.anonymous(64 * ALIGN)
        l1 = L1Store(SlotAllocator(HEADER_SIZE, 64 * ALIGN), memory=segment.buf)
        mgr = StorageManager(l1, session_ttl=60.0)
        disk = DiskStore(tmp_path / "l2", 1 << 24)
        disk.scan()
        reg = Registry(chunk)
        reg.register_model(make_layout("tiny", num_layers=3, num_kv_heads=2, head_dim=8, dtype="bfloat16"))
        tiers = Tiers(mgr, reg.layout_of, disk, None)
        state = ServerState(chunk, segment, False, mgr, reg, tiers)
        nb = reg.models["tiny"].slot_nbytes
        frame = memoryview(bytes(range(256)) * (nb // 256))
        try:
            cid = handle(state, m.RegisterClient(m.PROTOCOL_VERSION, "x", "tiny"), [])[0].client_id
            assert client_of(state, cid).transport == "inline"
            one = normalize_tokens(list(range(chunk))).tobytes()
            two = normalize_tokens(list(range(2 * chunk))).tobytes()
            handle(state, m.PrepareStore(cid, "s1", two), [])
            assert handle(state, m.CommitStore(cid, "s1", [0, 1]), [frame, frame])[0] == m.StoreCommitted(2)
            await until(lambda: tiers.backlog_bytes == 0 and len(disk) == 2)
            k1 = keys_of(state, client_of(state, cid), two, "")[1]
            assert l1.remove(k1)  # chunk 0 in L1, chunk 1 only in L2

            gate = threading.Event()
            tiers._pools["l2"][1].submit(gate.wait, 10)  # a slow disk read
            pending = handle(state, m.PrepareRetrieve(cid, "r", two, wait_s=10.0), [])
            task = asyncio.ensure_future(pending)
            await asyncio.sleep(0.05)
            # someone overwrites chunk 0 while the retrieve waits (its old version stays pinned)
            prep = handle(state, m.PrepareStore(cid, "s2", one, overwrite=True), [])[0]
            assert len(prep.slots) == 1
            assert handle(state, m.CommitStore(cid, "s2", [0]), [frame])[0] == m.StoreCommitted(1)
            gate.set()
            reply, payload = await asyncio.wait_for(task, 10)
            assert isinstance(reply, m.RetrievePrepared), f"retrieve failed: {reply}"
            assert len(reply.slots) == 2
            payload.release()
        finally:
            await asyncio.sleep(0.1)
            tiers.close()
            segment.close()

    asyncio.run(main())


# --------------------------------------------------------------------------------------------------
# 2. retrieve(..., out=buf) only checks shape, dtype and device: a buffer whose elements overlap
#    (an expand()ed tensor) or that requires grad passes _check_out and then fails inside copy_
#    with a bare RuntimeError, although the docstring promises InvalidInputError for an unusable
#    ``out`` and the README says every failure is a KVCacheSDKError.


@pytest.mark.parametrize("kind", ["overlapping", "requires_grad"])
def test_retrieve_out_unusable_buffer_is_an_invalid_input_error(ctx: kvd.KVCacheContext, kind: str) -> None:
    n = 2 * CHUNK
    tokens = make_tokens(n)
    assert kvd.store(ctx, make_kv(n), tokens)
    d = ctx.geometry.hidden_dim
    if kind == "overlapping":
        out = torch.zeros(2, ctx.geometry.num_layers, 1, d, dtype=ctx.dtype).expand(-1, -1, n, -1)
    else:
        out = torch.zeros(2, ctx.geometry.num_layers, n, d, dtype=ctx.dtype, requires_grad=True)
    match = "overlapping elements" if kind == "overlapping" else "must not require grad"
    with pytest.raises(kvd.InvalidInputError, match=match):
        kvd.retrieve(ctx, tokens, out=out)


# --------------------------------------------------------------------------------------------------
# 3. KVCacheContext._reconnect registers a new client with the restarted server (RegisterClient)
#    BEFORE it checks that the layout / chunk size still match; on a mismatch it raises but never
#    tells the server to forget that registration. Every later call of the context tries again and
#    leaks one more server-side client, and close() only sends CloseClient for the OLD id.


def test_failed_reregistration_leaks_no_server_side_clients(make_server, tmp_path: Path) -> None:
    from helpers import GEOMETRY
    from kvdock.server.process import start_server

    srv = make_server()
    kv, tokens = make_kv(4 * CHUNK), make_tokens(4 * CHUNK)
    c = kvd.connect(srv.url, srv.http_url, MODEL, timeout=5)
    try:
        assert kvd.store(c, kv, tokens)
        assert srv.stop() == 0
        again = start_server(
            "--no-disk",
            l1_size="64MiB",
            chunk_size=2 * CHUNK,  # restarted with another chunk size
            port=srv.port,
            http_port=srv.http_port,
            log_path=tmp_path / "again.log",
            timeout=30,
        )
        try:
            kvd.register_model(again.url, again.http_url, MODEL, dtype="bfloat16", **GEOMETRY, timeout=10)
            for _ in range(3):
                with pytest.raises(kvd.KVCacheSDKError, match="another layout"):
                    kvd.lookup(c, tokens)
            c.close()
            time.sleep(0.5)
            assert again.get("/status")["clients"] == 0, "failed re-registrations stay registered on the server"
        finally:
            assert again.stop() == 0
    finally:
        c.close()

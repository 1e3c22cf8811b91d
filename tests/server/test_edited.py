"""Edited prefixes (storage.plans.EDITED, PrepareStore.over) with real servers: an overwrite's
versions are marked edited in every tier and across restarts; a plain store extends an edited
prefix only with KV computed over that very prefix (``over`` naming its tip), otherwise it writes
nothing past it (counted ``diverged``, never an error); plain prefixes dedup and extend as before.
Bytes are asserted chunk by chunk."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import kvdock.sdk as kvd
from helpers import CHUNK, MODEL, make_kv, make_tokens
from kvdock.errors import BadRequestError, InvalidInputError
from kvdock.keys import normalize_tokens
from kvdock.layout import KVGeometry
from kvdock.protocol import messages as m
from kvdock.sdk.chunks import TensorChunks
from kvdock.sdk.engine import lookup_tips, retrieve_into
from kvdock.storage.plans import EDITED


def wait_for(cond: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def edited_by_tier(c: kvd.KVCacheContext, tokens: list[int]) -> list[dict[str, bool]]:
    """Per chunk: each tier holding it -> whether its version there carries the EDITED bit."""
    found = c.ask(m.Locate(c.client_id, normalize_tokens(tokens).tobytes()))
    return [{s.tier: bool(s.version & EDITED) for s in row} for row in found.chunks]


def chunks_equal(got: torch.Tensor | None, want: torch.Tensor) -> bool:
    return got is not None and got.shape == want.shape and torch.equal(got, want)


def load_tips(c: kvd.KVCacheContext, tokens: list[int]) -> tuple[torch.Tensor, tuple[int, ...]]:
    """What an engine does: look up, load exactly the versions seen, and keep their tips."""
    seen = lookup_tips(c, tokens)
    assert seen.hit_tokens
    kv = torch.empty(c.geometry.chunk_shape(seen.hit_tokens), dtype=c.dtype)
    assert retrieve_into(c, tokens[: seen.hit_tokens], TensorChunks(kv, c.chunk_size), tips=seen.versions)
    return kv, seen.versions


def clear_l1(srv) -> None:
    urllib.request.urlopen(urllib.request.Request(srv.http_url + "/admin/clear?tier=l1", method="POST")).read()


def test_an_overwrite_and_a_users_store_mark_their_versions_edited_an_engines_not(make_server) -> None:
    srv = make_server()
    tokens = make_tokens(2 * CHUNK)
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as c:
        assert kvd.store(c, make_kv(2 * CHUNK, seed=1), tokens, edited=False)  # an engine's own KV
        assert edited_by_tier(c, tokens) == [{"l1": False}, {"l1": False}]
        assert kvd.store(c, make_kv(2 * CHUNK, seed=2), tokens, overwrite=True)
        assert edited_by_tier(c, tokens) == [{"l1": True}, {"l1": True}]
        users = make_tokens(2 * CHUNK, start=900)
        assert kvd.store(c, make_kv(2 * CHUNK, seed=3), users)  # the SDK's default: a user's KV
        assert edited_by_tier(c, users) == [{"l1": True}, {"l1": True}]


def test_a_store_extends_an_edited_prefix_only_over_its_tip(make_server) -> None:
    srv = make_server()
    tokens = make_tokens(3 * CHUNK)
    edit = make_kv(2 * CHUNK, seed=2)
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as c:
        assert kvd.store(c, make_kv(2 * CHUNK, seed=1), tokens[: 2 * CHUNK])
        assert kvd.store(c, edit, tokens[: 2 * CHUNK], overwrite=True)
        stale = make_kv(3 * CHUNK, seed=1)  # computed over the old chunks 0-1
        assert kvd.store_chunks(c, stale, tokens) == kvd.StoreResult(0, 2, 0, 0, 1)
        assert not kvd.store(c, stale, tokens)  # not written: a False return, never an error
        assert kvd.lookup(c, tokens) == 2 * CHUNK

        loaded, tips = load_tips(c, tokens)  # an engine loads the edit, computes chunk 2 over it
        assert torch.equal(loaded, edit)
        mine = torch.cat([loaded, make_kv(3 * CHUNK, seed=3)[:, :, 2 * CHUNK :]], dim=2)
        assert kvd.store_chunks(c, mine, tokens, over=tips, edited=False) == kvd.StoreResult(1, 2, 0, 0, 0)
        assert chunks_equal(kvd.retrieve(c, tokens), mine)

        # the same engine saves more of the prompt later (chunked prefill): the run grew by its
        # own unedited chunk 2, and the tips of what it loaded still vouch (no edit after them)
        longer = make_tokens(4 * CHUNK)
        four = torch.cat([mine, make_kv(4 * CHUNK, seed=4)[:, :, 3 * CHUNK :]], dim=2)
        assert kvd.store_chunks(c, four, longer, over=tips, edited=False) == kvd.StoreResult(1, 3, 0, 0, 0)
        assert chunks_equal(kvd.retrieve(c, longer), four)
        assert edited_by_tier(c, longer) == [{"l1": True}, {"l1": True}, {"l1": False}, {"l1": False}]
        # a version before the run's last edit does not: chunk 1 (edited) was not computed over
        first = lookup_tips(c, longer[:CHUNK]).versions
        five = make_tokens(5 * CHUNK)
        kv5 = torch.cat([four, make_kv(5 * CHUNK, seed=5)[:, :, 4 * CHUNK :]], dim=2)
        assert kvd.store_chunks(c, kv5, five, over=first, edited=False) == kvd.StoreResult(0, 4, 0, 0, 1)
        assert kvd.lookup(c, five) == 4 * CHUNK
        assert kvd.check_server_integrity(c) == []


def test_a_plain_store_over_an_unedited_prefix_is_unchanged(make_server) -> None:
    srv = make_server()
    tokens = make_tokens(3 * CHUNK)
    kv = make_kv(3 * CHUNK, seed=5)
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as c:
        assert kvd.store(c, kv[:, :, : 2 * CHUNK], tokens[: 2 * CHUNK], edited=False)  # model KV
        # ``over`` changes nothing over a prefix no edit wrote (even one naming no version)
        assert kvd.store_chunks(c, kv, tokens, over=[12345], edited=False) == kvd.StoreResult(1, 2, 0, 0, 0)
        assert chunks_equal(kvd.retrieve(c, tokens), kv)
        more = make_tokens(4 * CHUNK)
        kv4 = torch.cat([kv, make_kv(4 * CHUNK, seed=6)[:, :, 3 * CHUNK :]], dim=2)
        assert kvd.store(c, kv4, more, edited=False)  # no over at all: dedups and extends as ever
        assert chunks_equal(kvd.retrieve(c, more), kv4)


def test_over_is_one_version_per_shard(make_server) -> None:
    srv = make_server()
    tokens = make_tokens(2 * CHUNK)
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as c:
        with pytest.raises(InvalidInputError, match="1 version"):
            kvd.store(c, make_kv(2 * CHUNK, seed=1), tokens, over=[1, 2])
        with pytest.raises(BadRequestError, match="names 2 over versions"):
            c.ask(m.PrepareStore(c.client_id, "s", normalize_tokens(tokens).tobytes(), over=[1, 2]))


def test_the_edited_mark_survives_l2_and_a_restart(make_server, tmp_path: Path) -> None:
    disk = str(tmp_path / "l2")
    srv = make_server("--disk-dir", disk)
    tokens = make_tokens(3 * CHUNK)
    edit, stale = make_kv(2 * CHUNK, seed=2), make_kv(3 * CHUNK, seed=1)
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as c:
        assert kvd.store(c, stale[:, :, : 2 * CHUNK], tokens[: 2 * CHUNK])
        assert kvd.store(c, edit, tokens[: 2 * CHUNK], overwrite=True)
        wait_for(lambda: srv.get("/status")["tiers"]["writeback_backlog_bytes"] == 0, "the write-downs")
        wait_for(lambda: all(row.get("l2") for row in edited_by_tier(c, tokens[: 2 * CHUNK])), "L2 holds both")
    assert srv.stop() == 0
    srv = make_server("--disk-dir", disk)  # a restart: L1 empty, L2's index read from the headers
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as c:
        assert edited_by_tier(c, tokens[: 2 * CHUNK]) == [{"l2": True}, {"l2": True}]
        assert kvd.store_chunks(c, stale, tokens) == kvd.StoreResult(0, 2, 0, 0, 1)  # deduped in L2
        assert kvd.lookup(c, tokens) == 2 * CHUNK
        loaded, tips = load_tips(c, tokens)
        assert torch.equal(loaded, edit)
        mine = torch.cat([loaded, make_kv(3 * CHUNK, seed=3)[:, :, 2 * CHUNK :]], dim=2)
        assert kvd.store_chunks(c, mine, tokens, over=tips) == kvd.StoreResult(1, 2, 0, 0, 0)
        assert chunks_equal(kvd.retrieve(c, tokens), mine)


def test_the_edited_mark_survives_l3_for_another_server(make_server, redis_server) -> None:
    s1 = make_server("--redis-url", redis_server.url)
    tokens = make_tokens(3 * CHUNK, start=7_000_000)
    edit, stale = make_kv(2 * CHUNK, seed=2), make_kv(3 * CHUNK, seed=1)
    with kvd.connect(s1.url, s1.http_url, MODEL, timeout=10) as c:
        assert kvd.store(c, stale[:, :, : 2 * CHUNK], tokens[: 2 * CHUNK])
        assert kvd.store(c, edit, tokens[: 2 * CHUNK], overwrite=True)
        wait_for(lambda: s1.get("/status")["tiers"]["writeback_backlog_bytes"] == 0, "the write-downs")
        clear_l1(s1)
        assert edited_by_tier(c, tokens[: 2 * CHUNK]) == [{"l3": True}, {"l3": True}]
        assert kvd.store_chunks(c, stale, tokens) == kvd.StoreResult(0, 2, 0, 0, 1)  # deduped in L3
    s2 = make_server("--redis-url", redis_server.url)  # another server: only the shared L3
    with kvd.connect(s2.url, s2.http_url, MODEL, timeout=10) as c:
        assert kvd.store_chunks(c, stale, tokens) == kvd.StoreResult(0, 2, 0, 0, 1)
        loaded, tips = load_tips(c, tokens)
        assert torch.equal(loaded, edit)
        mine = torch.cat([loaded, make_kv(3 * CHUNK, seed=3)[:, :, 2 * CHUNK :]], dim=2)
        assert kvd.store_chunks(c, mine, tokens, over=tips) == kvd.StoreResult(1, 2, 0, 0, 0)
        assert chunks_equal(kvd.retrieve(c, tokens), mine)
        assert kvd.check_server_integrity(c) == []


TP_LAYERS, TP_HEADS, TP_DIM = 3, 2, 8  # per rank: 2 of the model's 4 KV heads at TP=2


def test_a_sharded_store_applies_over_in_every_shard(make_server) -> None:
    srv = make_server(register=None)
    kvd.register_model(srv.url, srv.http_url, "tp", num_layers=TP_LAYERS, num_kv_heads=TP_HEADS,
                       head_dim=TP_DIM, dtype="bfloat16", world_size=2, rank=1, timeout=10)  # fmt: skip
    tokens = make_tokens(3 * CHUNK)
    with (
        kvd.connect(srv.url, srv.http_url, "tp", timeout=10) as whole,
        kvd.connect(srv.url, srv.http_url, "tp", timeout=10, kv_rank=0) as rank0,
    ):
        geo: KVGeometry = whole.geometry

        def kv(seed: int) -> torch.Tensor:
            return torch.randn(geo.chunk_shape(3 * CHUNK), generator=torch.Generator().manual_seed(seed)).bfloat16()

        stale, edit = kv(1), kv(2)[:, :, : 2 * CHUNK]
        assert kvd.store(whole, stale[:, :, : 2 * CHUNK], tokens[: 2 * CHUNK])
        assert kvd.store(whole, edit, tokens[: 2 * CHUNK], overwrite=True)
        assert kvd.store_chunks(whole, stale, tokens) == kvd.StoreResult(0, 4, 0, 0, 2)  # 2 shards x 1 chunk
        assert kvd.lookup(whole, tokens) == 2 * CHUNK
        loaded, tips = load_tips(whole, tokens)
        assert len(tips) == 2 and torch.equal(loaded, edit)
        # a rank's own store is held to its own shard's tip
        rank_tip = lookup_tips(rank0, tokens).versions
        assert rank_tip == tips[:1]
        assert kvd.store_chunks(whole, stale, tokens, over=[tips[0], tips[1] ^ 1]) == kvd.StoreResult(0, 4, 0, 0, 2)
        mine = torch.cat([loaded, kv(3)[:, :, 2 * CHUNK :]], dim=2)
        assert kvd.store_chunks(whole, mine, tokens, over=tips) == kvd.StoreResult(2, 4, 0, 0, 0)
        assert chunks_equal(kvd.retrieve(whole, tokens), mine)
        assert kvd.check_server_integrity(whole) == []


def test_the_async_store_takes_over_too(make_server) -> None:
    import asyncio

    from kvdock.sdk import aio

    srv = make_server()
    tokens = make_tokens(2 * CHUNK, start=3_000_000)
    edit = make_kv(CHUNK, seed=2)
    kv = torch.cat([edit, make_kv(2 * CHUNK, seed=3)[:, :, CHUNK:]], dim=2)
    stale = torch.cat([make_kv(CHUNK, seed=1), kv[:, :, CHUNK:]], dim=2)  # computed over the old chunk
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as c:
        assert kvd.store(c, make_kv(CHUNK, seed=1), tokens[:CHUNK])
        assert kvd.store(c, edit, tokens[:CHUNK], overwrite=True)
        tips = lookup_tips(c, tokens).versions

    async def go() -> None:
        a = await aio.connect(srv.url, srv.http_url, MODEL, timeout=10)
        try:
            assert await aio.store_chunks(a, stale, tokens) == kvd.StoreResult(0, 1, 0, 0, 1)
            assert await aio.store(a, kv, tokens, over=tips, edited=False)
            assert chunks_equal(await aio.retrieve(a, tokens), kv)
        finally:
            await aio.close(a)

    asyncio.run(go())

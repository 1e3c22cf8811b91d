"""A user's KV is an edit (PrepareStore.edited; docs/architecture.md "Edited prefixes"): the SDK's
stores and bundle imports mark their versions EDITED, engines' saves do not; an engine's save that
computed the same tokens itself never extends the user's bytes with KV computed over its own; the
SDK's later store of the same tensor, longer, does (it reads the stored prefix back and stores over
its tips when the bytes are identical), and one of other bytes writes nothing past it, even when an
overwrite lands between that read and its store. Bytes are asserted chunk by chunk."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import kvdock.sdk as kvd
from helpers import CHUNK, MODEL, make_kv, make_tokens
from kvdock.sdk import _edits
from kvdock.sdk.chunks import TensorChunks
from kvdock.sdk.engine import lookup_tips, store_from
from kvdock.storage.plans import DERIVED, EDITED

T = make_tokens(2 * CHUNK, start=500)  # the prompt a user stores edited KV under
TX = make_tokens(3 * CHUNK, start=500)  # T and one chunk more (an engine's prompt + continuation)


def wait_for(cond: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def tip(c: kvd.KVCacheContext, tokens: list[int]) -> int:
    seen = lookup_tips(c, tokens)
    assert seen.hit_tokens == len(tokens), (seen, len(tokens))
    (version,) = seen.versions
    return version


def retrieved(c: kvd.KVCacheContext, tokens: list[int]) -> torch.Tensor:
    got = kvd.retrieve(c, tokens)
    assert got is not None
    return got


def engine_save(c: kvd.KVCacheContext, kv: torch.Tensor, tokens: list[int]) -> kvd.StoreResult:
    """What an engine's connector does with KV it computed itself: a plain store through the
    engines' seam (edited=False), naming no loaded prefix (no ``over``)."""
    return store_from(c, TensorChunks(kv, c.chunk_size), tokens)


@pytest.mark.subprocess_server
def test_an_engine_save_never_extends_a_users_store_with_kv_computed_over_other_bytes(make_server) -> None:
    srv = make_server()
    user = make_kv(2 * CHUNK, seed=1)  # e.g. another prompt's KV remapped onto T
    model = make_kv(3 * CHUNK, seed=2)  # what the engine computed for T+X (its T differs)
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as c:
        assert kvd.store(c, user, T)
        assert engine_save(c, model, TX) == kvd.StoreResult(0, 2, 0, 0, 1)  # X diverged, not written
        assert kvd.lookup(c, TX) == 2 * CHUNK
        got = retrieved(c, TX)
        assert got.shape[2] == 2 * CHUNK and torch.equal(got, user)
        assert kvd.check_server_integrity(c) == []


def test_sdk_stores_are_edited_engine_saves_are_not(server) -> None:
    with kvd.connect(server.url, server.http_url, MODEL, timeout=10) as c:
        assert kvd.store(c, make_kv(CHUNK, seed=1), make_tokens(CHUNK, start=100))
        assert tip(c, make_tokens(CHUNK, start=100)) & (EDITED | DERIVED) == EDITED
        assert kvd.store_chunks(c, make_kv(CHUNK, seed=1), make_tokens(CHUNK, start=200)).stored_chunks == 1
        assert tip(c, make_tokens(CHUNK, start=200)) & (EDITED | DERIVED) == EDITED
        assert engine_save(c, make_kv(CHUNK, seed=1), make_tokens(CHUNK, start=300)).stored_chunks == 1
        assert tip(c, make_tokens(CHUNK, start=300)) & (EDITED | DERIVED) == 0
        assert kvd.store(c, make_kv(CHUNK, seed=1), make_tokens(CHUNK, start=400), edited=False)
        assert tip(c, make_tokens(CHUNK, start=400)) & (EDITED | DERIVED) == 0
        with pytest.raises(kvd.InvalidInputError, match="edited must be True or False"):
            kvd.store(c, make_kv(CHUNK, seed=1), make_tokens(CHUNK, start=500), edited="yes")  # type: ignore[arg-type]


def test_storing_a_prefix_then_more_of_the_same_tensor_extends_it(server) -> None:
    kv = make_kv(4 * CHUNK, seed=3)
    longer = make_tokens(4 * CHUNK, start=500)
    with kvd.connect(server.url, server.http_url, MODEL, timeout=10) as c:
        assert kvd.store(c, kv[:, :, : 2 * CHUNK], T)
        assert kvd.store_chunks(c, kv[:, :, : 3 * CHUNK], TX) == kvd.StoreResult(1, 2, 0, 0, 0)
        assert torch.equal(retrieved(c, TX), kv[:, :, : 3 * CHUNK])
        assert kvd.store(c, kv, longer)  # and again, over a run of edits
        assert torch.equal(retrieved(c, longer), kv)
        assert tip(c, longer) & EDITED  # the user's chunks are edits, each of them
        # an engine that loaded the user's prefix (its tips) computes the next chunk over it
        seen = lookup_tips(c, longer)
        five = make_tokens(5 * CHUNK, start=500)
        kv5 = torch.cat([kv, make_kv(5 * CHUNK, seed=4)[:, :, 4 * CHUNK :]], dim=2)
        assert store_from(c, TensorChunks(kv5, CHUNK), five, over=seen.versions).stored_chunks == 1
        assert tip(c, five) & (EDITED | DERIVED) == DERIVED
        # and the user stores more of that very KV again (the prefix's tip is DERIVED now)
        six = make_tokens(6 * CHUNK, start=500)
        kv6 = torch.cat([kv5, make_kv(6 * CHUNK, seed=5)[:, :, 5 * CHUNK :]], dim=2)
        assert kvd.store_chunks(c, kv6, six) == kvd.StoreResult(1, 5, 0, 0, 0)
        assert torch.equal(retrieved(c, six), kv6)
        assert kvd.check_server_integrity(c) == []


def test_a_longer_store_of_other_bytes_writes_nothing_past_the_stored_prefix(server) -> None:
    first, other = make_kv(2 * CHUNK, seed=5), make_kv(3 * CHUNK, seed=6)
    with kvd.connect(server.url, server.http_url, MODEL, timeout=10) as c:
        assert kvd.store(c, first, T)
        assert not kvd.store(c, other, TX)  # a False return, never an error
        assert kvd.store_chunks(c, other, TX) == kvd.StoreResult(0, 2, 0, 0, 1)
        # one differing value in the last token of the prefix is other bytes too
        almost = torch.cat([first, other[:, :, 2 * CHUNK :]], dim=2).clone()
        almost[1, 0, 2 * CHUNK - 1, 0] += 1
        assert kvd.store_chunks(c, almost, TX) == kvd.StoreResult(0, 2, 0, 0, 1)
        got = retrieved(c, TX)
        assert got.shape[2] == 2 * CHUNK and torch.equal(got, first)


def test_a_users_store_over_an_engines_prefix_of_other_bytes_writes_nothing_past_it(server) -> None:
    """Lead's review of W-EDIT: a user's tensor for T+X over an engine's plain (unedited) T of
    other bytes kept the engine's T and chained the user's X onto it (a prefix of two versions).
    An edited store extends any stored run only over its exact tip (read back, byte-identical)."""
    model, user = make_kv(3 * CHUNK, seed=7), make_kv(3 * CHUNK, seed=8)
    with kvd.connect(server.url, server.http_url, MODEL, timeout=10) as c:
        assert engine_save(c, model[:, :, : 2 * CHUNK], T).stored_chunks == 2
        assert kvd.store_chunks(c, user, TX) == kvd.StoreResult(0, 2, 0, 0, 1)
        got = retrieved(c, TX)
        assert got.shape[2] == 2 * CHUNK and torch.equal(got, model[:, :, : 2 * CHUNK])
        # the same bytes as the engine's (a user storing the model's own KV, longer) extend it
        same = torch.cat([model[:, :, : 2 * CHUNK], user[:, :, 2 * CHUNK :]], dim=2)
        assert kvd.store_chunks(c, same, TX) == kvd.StoreResult(1, 2, 0, 0, 0)
        assert torch.equal(retrieved(c, TX), same)
        assert kvd.check_server_integrity(c) == []


def test_an_overwrite_between_the_read_back_and_the_store_is_a_miss_never_a_mix(
    server, monkeypatch: pytest.MonkeyPatch
) -> None:
    kv = make_kv(3 * CHUNK, seed=7)
    edit = make_kv(2 * CHUNK, seed=8)
    vouch = _edits.vouch
    with (
        kvd.connect(server.url, server.http_url, MODEL, timeout=10) as c,
        kvd.connect(server.url, server.http_url, MODEL, timeout=10) as other,
    ):
        assert kvd.store(c, kv[:, :, : 2 * CHUNK], T)
        calls: list[list[int] | None] = []

        def overwritten_after(*args: object) -> list[int] | None:
            tips = vouch(*args)  # type: ignore[arg-type]
            calls.append(tips)
            assert kvd.store(other, edit, T, overwrite=True)  # another client, right after the read
            return tips

        monkeypatch.setattr(_edits, "vouch", overwritten_after)
        assert kvd.store_chunks(c, kv, TX) == kvd.StoreResult(0, 2, 0, 0, 1)
        assert len(calls) == 1 and calls[0] is not None  # the read found the same bytes: it vouched
        got = retrieved(c, TX)
        assert got.shape[2] == 2 * CHUNK and torch.equal(got, edit)  # the overwrite's, and no chunk 2
        assert kvd.check_server_integrity(c) == []


def test_a_bundle_import_marks_its_chunks_edited(server, make_server, tmp_path: Path) -> None:
    kv = make_kv(3 * CHUNK, seed=9)
    path = tmp_path / "p.kvb"
    with kvd.connect(server.url, server.http_url, MODEL, timeout=10) as c:
        assert kvd.store(c, kv, TX)
        assert kvd.export_bundle(c, TX, path) is not None
    fresh = make_server()
    with kvd.connect(fresh.url, fresh.http_url, MODEL, timeout=10) as c:
        assert kvd.import_bundle(c, path).stored.stored_chunks == 3
        assert tip(c, TX) & EDITED
        assert tip(c, TX[:CHUNK]) & EDITED
        # an engine's own KV for those tokens does not extend the imported bytes...
        four = make_tokens(4 * CHUNK, start=500)
        assert engine_save(c, make_kv(4 * CHUNK, seed=10), four) == kvd.StoreResult(0, 3, 0, 0, 1)
        # ...the importer's same KV, longer, does
        kv4 = torch.cat([kv, make_kv(4 * CHUNK, seed=11)[:, :, 3 * CHUNK :]], dim=2)
        assert kvd.store_chunks(c, kv4, four) == kvd.StoreResult(1, 3, 0, 0, 0)
        assert torch.equal(retrieved(c, four), kv4)


def test_a_plain_edited_store_stays_edited_in_l2_and_across_a_restart(make_server, tmp_path: Path) -> None:
    disk = str(tmp_path / "l2")
    srv = make_server("--disk-dir", disk)
    user = make_kv(2 * CHUNK, seed=12)
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as c:
        assert kvd.store(c, user, T)
        wait_for(lambda: srv.get("/status")["tiers"]["writeback_backlog_bytes"] == 0, "the write-downs")
    assert srv.stop() == 0
    srv = make_server("--disk-dir", disk)  # a restart: L1 empty, L2's index read from the headers
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as c:
        assert tip(c, T) & EDITED
        assert engine_save(c, make_kv(3 * CHUNK, seed=13), TX) == kvd.StoreResult(0, 2, 0, 0, 1)
        more = torch.cat([user, make_kv(3 * CHUNK, seed=14)[:, :, 2 * CHUNK :]], dim=2)
        assert kvd.store_chunks(c, more, TX) == kvd.StoreResult(1, 2, 0, 0, 0)  # read back from L2
        assert torch.equal(retrieved(c, TX), more)


def test_a_sharded_models_stores_are_edited_in_every_shard_and_extend_over_the_same_bytes(make_server) -> None:
    srv = make_server(register=None)
    kvd.register_model(srv.url, srv.http_url, "tp", num_layers=3, num_kv_heads=2, head_dim=8, dtype="bfloat16",
                       world_size=2, rank=1, timeout=10)  # fmt: skip
    with (
        kvd.connect(srv.url, srv.http_url, "tp", timeout=10) as whole,
        kvd.connect(srv.url, srv.http_url, "tp", timeout=10, kv_rank=1) as rank1,
    ):
        g = torch.Generator().manual_seed(15)
        kv = torch.randn(whole.geometry.chunk_shape(3 * CHUNK), generator=g).bfloat16()
        assert kvd.store(whole, kv[:, :, : 2 * CHUNK], T)
        seen = lookup_tips(whole, T)
        assert len(seen.versions) == 2 and all(v & EDITED for v in seen.versions)
        # rank 1 of an engine, its own KV of T+X: nothing past the user's T in its shard
        mine = torch.randn(rank1.geometry.chunk_shape(3 * CHUNK), generator=g).bfloat16()
        assert engine_save(rank1, mine, TX) == kvd.StoreResult(0, 2, 0, 0, 1)
        # the user's same tensor, longer: read back from both shards, identical, stored over their tips
        assert kvd.store_chunks(whole, kv, TX) == kvd.StoreResult(2, 4, 0, 0, 0)
        assert torch.equal(retrieved(whole, TX), kv)
        other = kv.clone()
        other[0, 2, 0, 15] += 1  # one value of shard 1's heads in chunk 0
        four = make_tokens(4 * CHUNK, start=500)
        more = torch.cat([other, torch.randn(whole.geometry.chunk_shape(CHUNK), generator=g).bfloat16()], dim=2)
        assert kvd.store_chunks(whole, more, four) == kvd.StoreResult(0, 6, 0, 0, 2)
        assert kvd.lookup(whole, four) == 3 * CHUNK
        assert kvd.check_server_integrity(whole) == []

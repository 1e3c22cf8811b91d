"""store → retrieve through a real server, on both transports and in two dtypes."""

from __future__ import annotations

import pytest
import torch

import kvdock.sdk as kvd
from helpers import CHUNK, MODEL, make_kv, make_tokens
from kvdock.sdk.engine import lookup_tips


@pytest.fixture(params=["shm", "inline"])
def transport(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(params=["bfloat16", "float32"])
def dtype_name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def tctx(make_server, transport: str, dtype_name: str):
    srv = make_server(*(["--no-shm"] if transport == "inline" else []), register=dtype_name)
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as c:
        assert c.transport == transport
        assert c.dtype == getattr(torch, dtype_name)
        yield c


def test_round_trip_is_byte_exact(tctx: kvd.KVCacheContext) -> None:
    kv = make_kv(4 * CHUNK, tctx.dtype, seed=1)
    tokens = make_tokens(4 * CHUNK)
    assert kvd.store(tctx, kv, tokens) is True
    out = kvd.retrieve(tctx, tokens)
    assert out is not None and out.shape == (2, 3, 4 * CHUNK, 16) and out.dtype == tctx.dtype
    assert out.is_contiguous() and out.device.type == "cpu"
    assert torch.equal(out.view(torch.uint8), kv.view(torch.uint8))


def test_partial_trailing_chunk_is_dropped(tctx: kvd.KVCacheContext) -> None:
    n = 2 * CHUNK + 5
    kv = make_kv(n, tctx.dtype, seed=2)
    tokens = make_tokens(n, start=1000)
    assert kvd.store(tctx, kv, tokens)
    assert kvd.lookup(tctx, tokens) == 2 * CHUNK
    out = kvd.retrieve(tctx, tokens)
    assert out is not None and out.shape[2] == 2 * CHUNK
    assert torch.equal(out, kv[:, :, : 2 * CHUNK])


def test_dedup_overwrite_and_prefix(tctx: kvd.KVCacheContext) -> None:
    tokens = make_tokens(3 * CHUNK, start=50)
    kv1 = make_kv(3 * CHUNK, tctx.dtype, seed=3)
    kv2 = make_kv(3 * CHUNK, tctx.dtype, seed=4)
    assert kvd.store(tctx, kv1, tokens) is True
    assert kvd.store(tctx, kv2, tokens) is False  # all chunks already stored: dedup, nothing written
    assert torch.equal(kvd.retrieve(tctx, tokens), kv1)
    r = kvd.store_chunks(tctx, kv2, tokens)
    assert (r.stored_chunks, r.deduped_chunks, r.pool_full_chunks) == (0, 3, 0)
    assert kvd.store(tctx, kv2, tokens, overwrite=True) is True
    assert torch.equal(kvd.retrieve(tctx, tokens), kv2)
    # a longer sequence with the same prefix returns only the stored prefix
    longer = tokens + make_tokens(2 * CHUNK, start=9000)
    out = kvd.retrieve(tctx, longer)
    assert out is not None and torch.equal(out, kv2)
    assert kvd.lookup(tctx, longer) == 3 * CHUNK
    # extending the prefix stores only the new chunks; the prefix is an overwrite's (an edit): only
    # KV computed over that very prefix extends it (its bytes, or a store naming its tips: ``over``)
    kv_long = torch.cat([kv2, make_kv(2 * CHUNK, tctx.dtype, seed=5)], dim=2)
    over_kv1 = torch.cat([kv1, kv_long[:, :, 3 * CHUNK :]], dim=2)  # computed over the overwritten bytes
    r = kvd.store_chunks(tctx, over_kv1, longer)
    assert (r.stored_chunks, r.deduped_chunks, r.diverged_chunks) == (0, 3, 2)
    r = kvd.store_chunks(tctx, kv_long, longer, over=lookup_tips(tctx, tokens).versions)
    assert (r.stored_chunks, r.deduped_chunks) == (2, 3)
    assert torch.equal(kvd.retrieve(tctx, longer), kv_long)
    assert kvd.check_server_integrity(tctx) == []


def test_cache_salt_isolates(tctx: kvd.KVCacheContext) -> None:
    tokens = make_tokens(2 * CHUNK, start=7)
    a, b = make_kv(2 * CHUNK, tctx.dtype, seed=6), make_kv(2 * CHUNK, tctx.dtype, seed=7)
    assert kvd.store(tctx, a, tokens, cache_salt="alice") is True
    assert kvd.retrieve(tctx, tokens) is None
    assert kvd.retrieve(tctx, tokens, cache_salt="bob") is None
    assert kvd.store(tctx, b, tokens, cache_salt="bob") is True  # not deduped against alice's
    assert torch.equal(kvd.retrieve(tctx, tokens, cache_salt="alice"), a)
    assert torch.equal(kvd.retrieve(tctx, tokens, cache_salt="bob"), b)
    assert kvd.lookup(tctx, tokens, cache_salt="") == 0


def test_misses_and_empty_input(tctx: kvd.KVCacheContext) -> None:
    assert kvd.retrieve(tctx, []) is None
    assert kvd.retrieve(tctx, make_tokens(CHUNK - 1)) is None
    assert kvd.retrieve(tctx, make_tokens(4 * CHUNK, start=123456)) is None
    assert kvd.lookup(tctx, make_tokens(CHUNK - 1)) == 0
    assert kvd.store(tctx, make_kv(CHUNK - 1, tctx.dtype), make_tokens(CHUNK - 1)) is False
    assert kvd.retrieve(tctx, make_tokens(CHUNK - 1)) is None


def test_store_accepts_non_contiguous_kv_and_tensor_tokens(tctx: kvd.KVCacheContext) -> None:
    big = make_kv(4 * CHUNK, tctx.dtype, seed=8)
    kv = big[:, :, ::2]  # strided view of 2 chunks
    assert not kv.is_contiguous()
    tokens = torch.arange(2 * CHUNK, dtype=torch.int64) + 777
    assert kvd.store(tctx, kv, tokens)
    assert torch.equal(kvd.retrieve(tctx, tokens.tolist()), kv)


def test_retrieve_into_a_reused_buffer(tctx: kvd.KVCacheContext) -> None:
    kv = make_kv(3 * CHUNK, tctx.dtype, seed=11)
    tokens = make_tokens(3 * CHUNK, start=300)
    assert kvd.store(tctx, kv, tokens)
    buf = torch.full((2, 3, 5 * CHUNK, 16), 7, dtype=tctx.dtype)
    longer = tokens + make_tokens(2 * CHUNK, start=9_000)
    got = kvd.retrieve(tctx, longer, out=buf)
    assert got is not None and got.shape == (2, 3, 3 * CHUNK, 16)
    assert got.data_ptr() == buf.data_ptr()  # a view of the caller's buffer
    assert torch.equal(got, kv) and torch.equal(buf[:, :, 3 * CHUNK :], torch.full_like(buf[:, :, 3 * CHUNK :], 7))
    assert kvd.retrieve(tctx, make_tokens(CHUNK, start=123_456), out=buf) is None
    with pytest.raises(kvd.InvalidInputError, match="out holds 32 tokens, fewer than the 80 asked for"):
        kvd.retrieve(tctx, longer, out=buf[:, :, : 2 * CHUNK])
    with pytest.raises(kvd.InvalidInputError, match="out must be a CPU tensor of"):
        kvd.retrieve(tctx, tokens, out=buf.to(torch.float16))
    with pytest.raises(kvd.InvalidInputError, match=r"out must be \[2, 3, tokens, 16\], got \[3, 3, 80, 16\]"):
        kvd.retrieve(tctx, tokens, out=torch.zeros(3, 3, 80, 16, dtype=tctx.dtype))


def test_a_retrieved_prefix_stores_with_the_whole_prompts_ids(make_server) -> None:
    """Issue 27: retrieve → store of a prompt that does not end on a chunk boundary. The retrieve
    returns the cached whole chunks; storing them with the whole prompt's ids takes the first
    ``kv.shape[2]`` ids (it raised 'kv has 32 tokens but 37 token ids were given')."""
    prompt = make_tokens(2 * CHUNK + 5, start=7000)
    kv = make_kv(2 * CHUNK + 5, seed=41)
    a, b = make_server(), make_server()
    ca, cb = (kvd.connect(s.url, s.http_url, MODEL, timeout=10) for s in (a, b))
    with ca, cb:
        assert kvd.store(ca, kv, prompt)
        got = kvd.retrieve(ca, prompt)
        assert got is not None and got.shape[2] == 2 * CHUNK
        assert kvd.store(cb, got, prompt) is True
        assert kvd.lookup(cb, prompt) == 2 * CHUNK
        assert torch.equal(kvd.retrieve(cb, prompt), kv[:, :, : 2 * CHUNK])  # type: ignore[arg-type]
        # the ids past kv's tokens are not stored under: kv of 1 chunk + 3 tokens, ids of 3 chunks
        other = make_tokens(3 * CHUNK, start=8000)
        r = kvd.store_chunks(cb, make_kv(CHUNK + 3, seed=42), other)
        assert (r.stored_chunks, r.deduped_chunks) == (1, 0)
        assert kvd.lookup(cb, other) == CHUNK
        assert torch.equal(kvd.retrieve(cb, other), make_kv(CHUNK + 3, seed=42)[:, :, :CHUNK])  # type: ignore[arg-type]
        with pytest.raises(kvd.InvalidInputError, match=r"^kv has 37 tokens but 36 token ids were given"):
            kvd.store(cb, kv, prompt[:36])

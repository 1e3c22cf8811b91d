"""inspect_prefix / diff_prefixes / plot_norms against real servers: tiers, checksums and norms
are those of the stored bytes; diffs find exactly the edited layer and chunk."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import kvdock.sdk as kvd
from helpers import CHUNK, MODEL, ServerProc, make_kv, make_tokens, serving
from kvdock.sdk import inspection
from kvdock.sdk.bundle import digest

TOKENS = make_tokens(3 * CHUNK, start=60_000)


@pytest.fixture(scope="module", params=["shm", "inline"])
def disk_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    tmp = tmp_path_factory.mktemp("inspect")
    models = ((MODEL, "bfloat16"), ("tiny-fp32", "float32"))
    with serving(tmp, request.param, "--disk-dir", str(tmp / "l2"), models=models) as srv:
        yield srv


@pytest.fixture
def ictx(disk_server: ServerProc) -> Iterator[kvd.KVCacheContext]:
    with kvd.connect(disk_server.url, disk_server.http_url, MODEL, timeout=10) as c:
        yield c


def written_down(ctx: kvd.KVCacheContext, tokens: list[int]) -> kvd.Inspection:
    """Inspect until every cached chunk is in L2 too (the write-down runs behind the store)."""
    for _ in range(500):
        found = kvd.inspect_prefix(ctx, tokens)
        if all("l2" in c.tiers for c in found.chunks if c.blake3):
            return found
    raise AssertionError(f"not written down: {found}")


def test_inspect_reports_tiers_checksums_and_norms_of_the_stored_bytes(ictx) -> None:
    kv = make_kv(len(TOKENS), seed=21)
    kvd.store(ictx, kv, TOKENS)
    asked = [*TOKENS, *make_tokens(CHUNK + 5, start=90_000)]  # a 4th chunk that is not cached, and a tail
    found = written_down(ictx, asked)
    assert (found.model_name, found.chunk_size, found.tokens, found.hit_tokens) == (MODEL, CHUNK, 4 * CHUNK, 3 * CHUNK)
    assert [c.tiers for c in found.chunks] == [("l1", "l2")] * 3 + [()]
    assert [c.start for c in found.chunks] == [0, CHUNK, 2 * CHUNK, 3 * CHUNK]
    assert [c.blake3 for c in found.chunks] == [digest(kv[:, :, i * CHUNK : (i + 1) * CHUNK]) for i in range(3)] + [
        None
    ]
    assert {c.nbytes for c in found.chunks} == {2 * 3 * CHUNK * 16 * 2}
    l1, l2 = found.chunks[1].stored
    assert l1.version == l2.version and l1.parent == found.chunks[0].stored[0].version  # one chain, same version
    want = kv.float().square().sum(dim=(2, 3)).sqrt()
    assert found.k_norms == pytest.approx(want[0].tolist(), rel=1e-6)
    assert found.v_norms == pytest.approx(want[1].tolist(), rel=1e-6)
    doc = found.to_dict()
    assert doc["chunks"][1]["stored"][1] == {"tier": "l2", "version": l2.version, "parent": l2.parent}
    assert doc["hit_tokens"] == 3 * CHUNK and doc["chunks"][3]["blake3"] is None


def test_inspect_of_a_miss_and_of_no_whole_chunk(ictx) -> None:
    found = kvd.inspect_prefix(ictx, make_tokens(2 * CHUNK, start=95_000))
    assert found.hit_tokens == 0 and found.k_norms == () and found.v_norms == ()
    assert [(c.tiers, c.blake3) for c in found.chunks] == [((), None), ((), None)]
    empty = kvd.inspect_prefix(ictx, make_tokens(CHUNK - 1))
    assert (empty.tokens, empty.chunks) == (0, ())


def edited(kv: torch.Tensor, layer: int, chunk: int, delta: float) -> torch.Tensor:
    out = kv.clone()
    out[1, layer, chunk * CHUNK + 3, 5] += delta  # one V value
    return out


def test_diff_finds_the_edited_layer_and_chunk(ictx, monkeypatch: pytest.MonkeyPatch) -> None:
    toks, other = make_tokens(4 * CHUNK, start=61_000), make_tokens(4 * CHUNK, start=62_000)
    kv = make_kv(len(toks), seed=22)
    changed = edited(kv, layer=1, chunk=2, delta=4.0)
    kvd.store(ictx, kv, toks)
    kvd.store(ictx, changed, other)
    same = kvd.diff_prefixes(ictx, toks, toks)
    assert same.identical and same.first_differing_chunk is None and set(same.k_max_abs + same.v_max_abs) == {0.0}
    want_v = (changed[1].float() - kv[1].float()).abs().amax(dim=(1, 2)).tolist()
    for budget in (inspection.DIFF_BYTES, 1):  # all layers at once, and one layer at a time
        monkeypatch.setattr(inspection, "DIFF_BYTES", budget)
        d = kvd.diff_prefixes(ictx, toks, other)
        assert (d.tokens, d.other_tokens, d.compared_tokens) == (4 * CHUNK, 4 * CHUNK, 4 * CHUNK)
        assert d.first_differing_chunk == 2 and not d.identical
        assert d.k_max_abs == (0.0, 0.0, 0.0) and d.v_max_abs == pytest.approx(want_v)
        assert want_v[1] > 3.0 and want_v[0] == want_v[2] == 0.0


def test_diff_of_prefixes_of_other_lengths_salts_and_dtypes(disk_server: ServerProc, ictx) -> None:
    toks = make_tokens(3 * CHUNK, start=63_000)
    kv = make_kv(len(toks), seed=23)
    kvd.store(ictx, kv, toks, cache_salt="a")
    kvd.store(ictx, kv[:, :, : 2 * CHUNK], toks[: 2 * CHUNK], cache_salt="b")
    d = kvd.diff_prefixes(ictx, toks, toks, cache_salt="a", other_cache_salt="b")
    assert (d.tokens, d.other_tokens, d.compared_tokens, d.first_differing_chunk) == (
        3 * CHUNK,
        2 * CHUNK,
        2 * CHUNK,
        None,
    )
    assert not d.identical  # same bytes over what both have, but not the same length
    miss = kvd.diff_prefixes(ictx, toks, toks, cache_salt="a", other_cache_salt="nobody")
    assert (miss.other_tokens, miss.compared_tokens, miss.k_max_abs) == (0, 0, ())
    with kvd.connect(disk_server.url, disk_server.http_url, "tiny-fp32", timeout=10) as f32:
        kvd.store(f32, kv.float(), toks)
        assert kvd.diff_prefixes(ictx, toks, toks, "a", "", other_ctx=f32).identical  # same values
        kvd.store(f32, edited(kv.float(), 0, 1, 0.5), make_tokens(3 * CHUNK, start=64_000))
        d = kvd.diff_prefixes(ictx, toks, make_tokens(3 * CHUNK, start=64_000), "a", "", f32)
        assert d.first_differing_chunk == 1 and d.v_max_abs[0] == pytest.approx(0.5, rel=0.02)


def test_diff_refuses_unlike_geometries(make_server) -> None:
    srv = make_server()
    kvd.register_model(
        srv.url, srv.http_url, "wide", dtype="bfloat16", num_layers=3, num_kv_heads=4, head_dim=8, timeout=10
    )
    with (
        kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as a,
        kvd.connect(srv.url, srv.http_url, "wide", timeout=10) as b,
        pytest.raises(kvd.InvalidInputError, match=r"cannot compare 'tiny' \(\[2, 3, T, 16\]\) with 'wide'"),
    ):
        kvd.diff_prefixes(a, TOKENS, TOKENS, other_ctx=b)


def test_plot_norms_writes_a_png(ictx, tmp_path: Path) -> None:
    toks = make_tokens(2 * CHUNK, start=65_000)
    kvd.store(ictx, make_kv(len(toks), seed=24), toks)
    kvd.plot_norms(kvd.inspect_prefix(ictx, toks), tmp_path / "norms.png")
    data = (tmp_path / "norms.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    with pytest.raises(kvd.InvalidInputError, match="nothing of these tokens is cached"):
        kvd.plot_norms(kvd.inspect_prefix(ictx, make_tokens(CHUNK, start=66_000)), tmp_path / "none.png")
    assert not (tmp_path / "none.png").exists()


def test_a_prefix_that_changes_between_layer_groups_fails_the_diff(ictx, monkeypatch: pytest.MonkeyPatch) -> None:
    """One layer group at a time, a prefix evicted after the first group once made the later
    layers count as identical. (The eviction is simulated: it cannot be timed between two reads.)"""
    toks = make_tokens(2 * CHUNK, start=67_000)
    kvd.store(ictx, make_kv(len(toks), seed=25), toks)
    monkeypatch.setattr(inspection, "DIFF_BYTES", 1)  # one layer per group
    real, calls = inspection.retrieve, []

    def evicted_after_the_first_group(ctx, tokens, salt, **kw):  # type: ignore[no-untyped-def]
        calls.append(kw["layers"])
        return real(ctx, tokens, salt, **kw) if len(calls) <= 2 else None

    monkeypatch.setattr(inspection, "retrieve", evicted_after_the_first_group)
    with pytest.raises(
        kvd.KVCacheSDKError, match=r"a prefix changed during the diff \(cached tokens \(32, 32\) then \(0, 0\)\)"
    ):
        kvd.diff_prefixes(ictx, toks, toks)


def test_an_overwrite_between_layer_groups_fails_the_diff(ictx, monkeypatch: pytest.MonkeyPatch) -> None:
    toks = make_tokens(2 * CHUNK, start=68_000)
    kvd.store(ictx, make_kv(len(toks), seed=26), toks)
    monkeypatch.setattr(inspection, "DIFF_BYTES", 1)
    real, calls = inspection.retrieve, []

    def overwritten_midway(ctx, tokens, salt, **kw):  # type: ignore[no-untyped-def]
        calls.append(1)
        if len(calls) == 3:  # a real overwrite, by another writer, between two groups
            kvd.store(ctx, make_kv(len(toks), seed=27), toks, overwrite=True)
        return real(ctx, tokens, salt, **kw)

    monkeypatch.setattr(inspection, "retrieve", overwritten_midway)
    with pytest.raises(kvd.KVCacheSDKError, match="a prefix was overwritten during the diff"):
        kvd.diff_prefixes(ictx, toks, toks)


def test_digests_of_a_refused_attempt_are_not_reported(ictx, monkeypatch: pytest.MonkeyPatch) -> None:
    """A transfer whose bytes were refused (lease expired) and whose retry missed: the chunks it
    handed over are not the cached prefix. (The refusal is simulated.)"""
    toks = make_tokens(CHUNK, start=69_000)

    def refused_then_missed(ctx, tokens, sink, salt):  # type: ignore[no-untyped-def]
        sink.take(0, torch.zeros(2, 3, CHUNK, 16, dtype=torch.bfloat16))  # the garbage attempt
        return 0

    monkeypatch.setattr(inspection, "retrieve_into", refused_then_missed)
    found = kvd.inspect_prefix(ictx, toks)
    assert found.hit_tokens == 0 and [c.blake3 for c in found.chunks] == [None]


def test_two_misses_are_not_identical(ictx) -> None:
    d = kvd.diff_prefixes(ictx, make_tokens(CHUNK, start=97_000), make_tokens(CHUNK, start=98_000))
    assert (d.tokens, d.other_tokens, d.identical) == (0, 0, False)


def test_inspect_names_tiers_that_are_down(make_server, redis_server) -> None:
    srv = make_server("--redis-url", redis_server.url)
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as c:
        toks = make_tokens(CHUNK, start=99_000)
        kvd.store(c, make_kv(CHUNK, seed=28), toks)
        assert kvd.inspect_prefix(c, toks).unreachable_tiers == ()
        redis_server.stop()
        for _ in range(200):  # the write-down or a probe finds it gone
            found = kvd.inspect_prefix(c, toks)
            if found.unreachable_tiers:
                break
        assert found.unreachable_tiers == ("l3",) and found.chunks[0].tiers == ("l1",)


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("norms", "give a file name ending in one of .eps"),
        ("x.unknownext", "ending in one of"),
        ("no/x.png", "no directory"),
    ],
)
def test_plot_paths_that_cannot_be_written_are_refused(ictx, tmp_path: Path, name: str, message: str) -> None:
    toks = make_tokens(CHUNK, start=65_000)
    kvd.store(ictx, make_kv(len(toks), seed=24), toks)
    with pytest.raises(kvd.InvalidInputError, match=message):
        kvd.plot_norms(kvd.inspect_prefix(ictx, toks), tmp_path / name)
    assert list(tmp_path.iterdir()) == []

"""KV bundles: export from one server, import into another (other chunk sizes re-chunk), byte for
byte; every kind of bad bundle is refused before anything is stored."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import kvdock.sdk as kvd
import zygote
from helpers import (
    ALWAYS_PROCESS,
    CHUNK,
    GEOMETRY,
    MODEL,
    ServerProc,
    make_kv,
    make_tokens,
    start_inprocess,
    start_server,
)
from kvdock import __version__

# the servers a test starts itself: in this process (kvdock.inprocess), as make_server's
start_any = start_server if ALWAYS_PROCESS else start_inprocess

TOKENS = make_tokens(5 * CHUNK + 3, start=7000)  # 5 whole chunks of 16, and a tail


@pytest.fixture
def other(tmp_path: Path) -> Iterator[ServerProc]:
    """A second server with chunk size 32 and the same model registered."""
    srv = start_any(tmp_path, chunk_size=32)
    kvd.register_model(srv.url, srv.http_url, MODEL, dtype="bfloat16", **GEOMETRY, timeout=10)
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture
def bundle(ctx: kvd.KVCacheContext, tmp_path: Path) -> tuple[Path, torch.Tensor]:
    kv = make_kv(len(TOKENS), seed=3)
    kvd.store(ctx, kv, TOKENS, cache_salt="alice")
    path = tmp_path / "prompt.kvb"
    m = kvd.export_bundle(ctx, TOKENS, path, cache_salt="alice", note="dropped tokens 10..40")
    assert m is not None
    return path, kv[:, :, : 5 * CHUNK]


def test_export_writes_the_cached_prefix_and_its_manifest(ctx: kvd.KVCacheContext, bundle) -> None:
    path, kv = bundle
    b = kvd.read_bundle(path)
    manifest, got, ids = b.manifest, b.kv, b.tokens
    assert torch.equal(got, kv) and got.dtype == torch.bfloat16
    assert ids == TOKENS[: 5 * CHUNK]
    assert (manifest.model_name, manifest.chunk_size, manifest.tokens) == (MODEL, CHUNK, 5 * CHUNK)
    assert (manifest.cache_salt, manifest.note) == ("alice", "dropped tokens 10..40")
    assert manifest.kvdock_version == __version__
    assert manifest.geometry == ctx.geometry and len(manifest.chunk_blake3) == 5
    assert len(set(manifest.chunk_blake3)) == 5  # one checksum per chunk, of its own bytes
    assert not path.with_name(path.name + ".tmp").exists()


def test_import_into_a_server_with_another_chunk_size_rechunks(bundle, other: ServerProc) -> None:
    path, kv = bundle
    with kvd.connect(other.url, other.http_url, MODEL, timeout=10) as c:
        res = kvd.import_bundle(c, path)
        assert (res.tokens, res.dropped_tokens) == (64, 16)  # 80 tokens: 2 whole chunks of 32
        assert res.stored.stored_chunks == 2
        assert kvd.lookup(c, TOKENS) == 0  # the bundle's namespace is kept: "alice"
        got = kvd.retrieve(c, TOKENS, cache_salt="alice")
        assert got is not None and torch.equal(got, kv[:, :, :64])
        again = kvd.import_bundle(c, path)  # the same bundle again: all deduped
        assert (again.stored.stored_chunks, again.stored.deduped_chunks) == (0, 2)
        kvd.import_bundle(c, path, cache_salt="")
        plain = kvd.retrieve(c, TOKENS)
        assert plain is not None and torch.equal(plain, kv[:, :, :64])


def test_export_of_a_miss_writes_nothing(ctx: kvd.KVCacheContext, tmp_path: Path) -> None:
    path = tmp_path / "none.kvb"
    assert kvd.export_bundle(ctx, make_tokens(64, start=99_000), path) is None
    assert not path.exists()


def _corrupt_kv_byte(path: Path, chunk: int) -> None:
    raw = bytearray(path.read_bytes())
    header = int.from_bytes(raw[:8], "little")
    info = json.loads(raw[8 : 8 + header])["kv"]
    # kv is [2, L, T, D]: plane 0, layer 0, token (chunk * CHUNK) lies at this offset
    d = GEOMETRY["num_kv_heads"] * GEOMETRY["head_dim"]
    at = 8 + header + info["data_offsets"][0] + chunk * CHUNK * d * 2
    raw[at] ^= 0x40
    path.write_bytes(bytes(raw))


def _assert_nothing_stored(srv: ServerProc) -> None:
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as c:
        assert kvd.lookup(c, TOKENS, cache_salt="alice") == 0
        assert kvd.lookup(c, TOKENS) == 0


def test_a_flipped_byte_is_refused_naming_the_chunk_and_stores_nothing(bundle, other: ServerProc) -> None:
    path, _ = bundle
    _corrupt_kv_byte(path, chunk=3)
    with (
        kvd.connect(other.url, other.http_url, MODEL, timeout=10) as c,
        pytest.raises(kvd.InvalidInputError, match="chunk 3 does not match its blake3 checksum"),
    ):
        kvd.import_bundle(c, path)
    _assert_nothing_stored(other)


def test_a_truncated_bundle_is_refused(bundle, other: ServerProc) -> None:
    path, _ = bundle
    path.write_bytes(path.read_bytes()[:-100])
    with (
        kvd.connect(other.url, other.http_url, MODEL, timeout=10) as c,
        pytest.raises(kvd.InvalidInputError, match="not a readable bundle"),
    ):
        kvd.import_bundle(c, path)
    _assert_nothing_stored(other)


def _rewrite(path: Path, edit_manifest=None, edit_tensors=None) -> None:
    """Rewrite a bundle with its manifest dict and/or tensors edited (checksums left as they are)."""
    from safetensors.torch import load, save

    data = path.read_bytes()
    header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
    manifest = json.loads(header["__metadata__"]["kvdock.bundle"])
    tensors = load(data)
    if edit_manifest:
        edit_manifest(manifest)
    if edit_tensors:
        edit_tensors(tensors, manifest)
    path.write_bytes(save(tensors, metadata={"kvdock.bundle": json.dumps(manifest)}))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda m: m.update(tokens_blake3="0" * 64), "token ids do not match"),
        (lambda m: m.update(format=2), "bundle format 2; this kvdock reads format 1"),
        (lambda m: m.update(tokens=48), r"KV is \[2, 3, 80, 16\] torch.bfloat16; its manifest says \[2, 3, 48, 16\]"),
        (lambda m: m.update(chunk_size=0), "not whole chunks of 0"),
        (lambda m: m["geometry"].update(num_layers=-1), "malformed bundle manifest"),
        (lambda m: m.pop("chunk_blake3"), "malformed bundle manifest"),
        # wrong types are refused, never coerced (a None salt must not become the namespace "None")
        (lambda m: m.update(cache_salt=None), "malformed bundle manifest"),
        (lambda m: m.update(model_name=None), "malformed bundle manifest"),
        (lambda m: m.update(chunk_size=16.9), "malformed bundle manifest"),
        (lambda m: m.update(tokens="80"), "malformed bundle manifest"),
        (lambda m: m.update(format=True), "malformed bundle manifest"),
        (lambda m: m.update(chunk_blake3={h: 1 for h in m["chunk_blake3"]}), "malformed bundle manifest"),
        (lambda m: m.update(tokens=float("inf")), "malformed bundle manifest"),
        (lambda m: m.update(extra=1), "malformed bundle manifest"),
    ],
    ids=[
        "tokens-checksum", "format", "tokens", "chunk-size", "geometry", "missing-key", "salt-none", "model-none",
        "chunk-float", "tokens-str", "format-bool", "checksums-dict", "tokens-inf", "unknown-key",
    ],
)  # fmt: skip
def test_a_tampered_manifest_is_refused(bundle, other: ServerProc, edit, message: str) -> None:
    path, _ = bundle
    _rewrite(path, edit)
    with (
        kvd.connect(other.url, other.http_url, MODEL, timeout=10) as c,
        pytest.raises(kvd.InvalidInputError, match=message),
    ):
        kvd.import_bundle(c, path)
    _assert_nothing_stored(other)


def test_token_ids_out_of_range_are_refused_even_with_matching_checksums(bundle, other: ServerProc) -> None:
    from kvdock.sdk.bundle import digest

    def negative(tensors, manifest) -> None:
        tensors["tokens"][0] = -1
        manifest["tokens_blake3"] = digest(tensors["tokens"])

    path, _ = bundle
    _rewrite(path, edit_tensors=negative)
    with pytest.raises(kvd.InvalidInputError, match="token id out of range"):
        kvd.read_bundle(path)
    _assert_nothing_stored(other)


def test_what_is_stored_is_the_verified_copy_even_if_the_file_changes_after(bundle, other: ServerProc) -> None:
    path, kv = bundle
    b = kvd.read_bundle(path)
    path.write_bytes(b"\0" * path.stat().st_size)  # rewritten in place after the checks
    with kvd.connect(other.url, other.http_url, MODEL, timeout=10) as c:
        assert kvd.import_bundle(c, b).stored.stored_chunks == 2
        got = kvd.retrieve(c, TOKENS, cache_salt="alice")
        assert got is not None and torch.equal(got, kv[:, :, :64])


@pytest.mark.parametrize(("chunk", "block", "whole"), [(24, 8, 72), (8, 8, 80)])
def test_rechunking_into_chunks_that_do_not_divide_or_are_smaller(
    bundle, tmp_path: Path, chunk: int, block: int, whole: int
) -> None:
    path, kv = bundle
    srv = start_any(tmp_path, chunk_size=chunk)
    try:
        kvd.register_model(srv.url, srv.http_url, MODEL, dtype="bfloat16", tokens_per_block=block, **GEOMETRY)
        with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as c:
            res = kvd.import_bundle(c, path)
            assert (res.tokens, res.dropped_tokens, res.stored.stored_chunks) == (whole, 80 - whole, whole // chunk)
            got = kvd.retrieve(c, TOKENS, cache_salt="alice")
            assert got is not None and torch.equal(got, kv[:, :, :whole])
    finally:
        srv.stop()


def test_export_takes_any_token_sequence_once(ctx: kvd.KVCacheContext, bundle, tmp_path: Path) -> None:
    _, kv = bundle
    m = kvd.export_bundle(ctx, iter(TOKENS), tmp_path / "it.kvb", cache_salt="alice")  # an iterator: read once
    assert m is not None and m.tokens == 5 * CHUNK
    assert torch.equal(kvd.read_bundle(tmp_path / "it.kvb").kv, kv)


def test_export_to_an_unwritable_place_is_an_os_error_and_leaves_nothing(
    ctx: kvd.KVCacheContext, bundle, tmp_path: Path
) -> None:
    with pytest.raises(FileNotFoundError):
        kvd.export_bundle(ctx, TOKENS, tmp_path / "missing" / "p.kvb", cache_salt="alice")
    (tmp_path / "adir").mkdir()
    with pytest.raises(IsADirectoryError):
        kvd.export_bundle(ctx, TOKENS, tmp_path / "adir", cache_salt="alice")
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_a_file_that_is_not_a_bundle_is_refused(ctx: kvd.KVCacheContext, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    path = tmp_path / "weights.safetensors"
    save_file({"w": torch.zeros(4)}, str(path))
    with pytest.raises(kvd.InvalidInputError, match="is not a kvdock bundle"):
        kvd.import_bundle(ctx, path)
    (tmp_path / "junk.kvb").write_bytes(b"\xff" * 64)
    with pytest.raises(kvd.InvalidInputError, match="not a readable bundle"):
        kvd.import_bundle(ctx, tmp_path / "junk.kvb")


def test_a_bundle_of_another_geometry_or_model_is_refused(bundle, tmp_path: Path) -> None:
    path, kv = bundle
    srv = start_any(tmp_path)
    try:
        kvd.register_model(srv.url, srv.http_url, "wide", dtype="bfloat16", num_layers=3, num_kv_heads=4, head_dim=4)
        kvd.register_model(srv.url, srv.http_url, "twin", dtype="bfloat16", **GEOMETRY)
        with kvd.connect(srv.url, srv.http_url, "wide", timeout=10) as c:  # same chunk bytes, other KV
            with pytest.raises(kvd.InvalidInputError, match=r"the bundle's geometry .* is not 'wide'"):
                kvd.import_bundle(c, path)
            assert kvd.lookup(c, TOKENS, cache_salt="alice") == 0
        with kvd.connect(srv.url, srv.http_url, "twin", timeout=10) as c:
            with pytest.raises(kvd.InvalidInputError, match="holds KV of 'tiny', not 'twin'"):
                kvd.import_bundle(c, path)
            assert kvd.lookup(c, TOKENS, cache_salt="alice") == 0
            res = kvd.import_bundle(c, path, allow_other_model=True)  # the caller vouches for the weights
            assert res.tokens == 5 * CHUNK
            got = kvd.retrieve(c, TOKENS, cache_salt="alice")
            assert got is not None and torch.equal(got, kv)
    finally:
        srv.stop()


UNDER_A_MEMORY_LIMIT = """
import json, resource, sys
import kvdock.sdk as kvd
vm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmSize:")) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), resource.RLIM_INFINITY))  # 1 GiB more: not 4
for path in sys.argv[1:]:
    try:
        kvd.read_bundle(path)
        print(json.dumps(["read", ""]))
    except BaseException as e:
        print(json.dumps([type(e).__name__, str(e)]))
"""


def test_a_huge_sparse_file_is_refused_from_its_header_without_reading_it(bundle, tmp_path: Path) -> None:
    """Issue 29 (8): read_bundle read the whole file before looking at its header, so a 4 GiB
    sparse file gave a bare MemoryError under a memory limit. The header, the tensors it declares
    (against the manifest's geometry) and the file's size are checked before the data is read."""
    import sys

    path, _ = bundle
    zeros = tmp_path / "zeros.kvb"
    with open(zeros, "wb") as f:
        f.truncate(4 << 30)  # sparse: 4 GiB of zeros, no disk
    grown = tmp_path / "grown.kvb"  # a real bundle's header, then 4 GiB more than it declares
    grown.write_bytes(path.read_bytes())
    with open(grown, "r+b") as f:
        f.truncate(4 << 30)
    out = zygote.run(
        [sys.executable, "-c", UNDER_A_MEMORY_LIMIT, str(zeros), str(grown), str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = [json.loads(line) for line in out.stdout.splitlines()]
    assert got[0] == ["InvalidInputError", f"{zeros} is not a readable bundle (truncated or corrupted?)"]
    assert got[1][0] == "InvalidInputError" and got[1][1].startswith(f"{grown} is not a readable bundle"), got[1]
    assert f"the file holds {(4 << 30) - 8 - _header_len(path)} bytes of tensor data" in got[1][1], got[1]
    assert got[2] == ["read", ""]  # the real one reads under the same limit


def _header_len(path: Path) -> int:
    return int.from_bytes(path.read_bytes()[:8], "little")


def _edit_header(path: Path, edit) -> None:  # type: ignore[no-untyped-def]
    """Rewrite the safetensors header of ``path`` (its JSON, edited in place), data untouched."""
    raw = path.read_bytes()
    n = _header_len(path)
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n :])


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda h: h["kv"].update(shape=[2, 3, 1 << 40, 16]), r"KV is \[2, 3, 1099511627776, 16\] torch.bfloat16; "),
        (lambda h: h["kv"].update(dtype="F32"), r"KV is \[2, 3, 80, 16\] torch.float32; its manifest says"),
        (lambda h: h["kv"].update(dtype="Q4"), r"KV is \[2, 3, 80, 16\] Q4; its manifest says"),
        (lambda h: h["tokens"].update(shape=[81]), r"token ids are \[81\] torch.int64; want \[80\] int64"),
        (lambda h: h["kv"].update(data_offsets=[0, 1 << 40]), "declares tensor 'kv' of 15360 bytes at"),
        (lambda h: h["kv"].update(data_offsets="x"), "declares tensor 'kv' of 15360 bytes at"),
        (lambda h: h["tokens"].update(shape="80"), "not a readable bundle"),
        (lambda h: h.update(extra={"dtype": "BF16", "shape": [1], "data_offsets": [0, 2]}), "holds tensors"),
    ],
    ids=[
        "kv-shape-huge", "kv-dtype", "kv-dtype-unknown", "tokens-shape", "offsets-huge", "offsets-str", "shape-str",
        "extra",
    ],
)  # fmt: skip
def test_a_header_that_disagrees_with_the_manifest_or_the_file_is_refused_before_the_data_is_read(
    bundle, tmp_path: Path, edit, message: str
) -> None:
    path, _ = bundle
    _edit_header(path, edit)
    with pytest.raises(kvd.InvalidInputError, match=message):
        kvd.read_bundle(path)

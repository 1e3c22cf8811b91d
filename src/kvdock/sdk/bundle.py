"""KV bundles: a cached prefix as one portable, self-checking file.

A bundle is a safetensors file (no pickle: loading one runs no code) holding two tensors,
``kv`` (``[2, L, T, D]`` in the model's dtype) and ``tokens`` (``[T]`` int64), and a JSON
manifest (:class:`BundleManifest`) in its metadata under ``kvdock.bundle``: model name,
geometry, chunk size, token count, cache_salt, kvdock version, a free-form note, and blake3
checksums of the token ids and of each chunk's KV bytes.

``T`` is whole chunks of the exporting server's ``chunk_size``. Importing into a server with
another chunk size re-chunks: only whole chunks of the *target* size are stored (a tail shorter
than one target chunk is dropped and reported), because kvdock stores whole chunks only.

The header is checked first, before any data is read: its size, the manifest's types, and the
tensors it declares (names, dtypes, shapes against the manifest's geometry, byte ranges that
cover exactly the rest of the file), so a file that is not what it claims (a huge sparse one
included) is refused without reading it. Then the file is read into memory once, and every other
check -- safetensors' own, the shapes again, every checksum, the token range, then the geometry
and model -- runs on that copy before anything is stored: a bundle that fails one stores nothing
and raises InvalidInputError saying what is wrong. The checksums catch corruption, not intent:
anyone can write a bundle with matching checksums, so import only bundles you trust.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import blake3
import msgspec
import numpy as np
import torch

from kvdock import __version__
from kvdock.errors import InvalidInputError
from kvdock.keys import MAX_TOKEN_ID
from kvdock.layout import KVGeometry
from kvdock.sdk import _validate as validate
from kvdock.sdk.context import KVCacheContext
from kvdock.sdk.ops import StoreResult, retrieve, store_chunks

FORMAT = 1
MANIFEST_KEY = "kvdock.bundle"
_HEADER_LEN = 8  # safetensors: a little-endian u64, then that many bytes of JSON header
MAX_HEADER = 100_000_000  # safetensors' own limit on that header
# safetensors' dtype names of what a bundle holds (a KV dtype of kvdock.layout, the token ids)
_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
_DTYPES["I64"] = "int64"
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1, "int64": 8}


class BundleManifest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a bundle says about itself; decoded strictly (a wrong type is refused, not coerced)."""

    model_name: str
    geometry: KVGeometry
    chunk_size: int
    tokens: int
    cache_salt: str
    kvdock_version: str
    tokens_blake3: str
    chunk_blake3: tuple[str, ...]
    note: str = ""
    format: int = FORMAT


@dataclass(frozen=True)
class Bundle:
    """A verified bundle in memory: its manifest, KV ``[2, L, T, D]`` and token ids."""

    manifest: BundleManifest
    kv: torch.Tensor
    tokens: list[int]


@dataclass(frozen=True)
class ImportResult:
    """What :func:`import_bundle` did: ``tokens`` of the bundle's were offered to the server (its
    whole chunks of the target size; ``stored`` says chunk by chunk what became of them) and
    ``dropped_tokens`` did not fill a whole target chunk."""

    manifest: BundleManifest
    tokens: int
    dropped_tokens: int
    stored: StoreResult


def digest(t: torch.Tensor) -> str:
    """The blake3 hex digest of a tensor's bytes (a chunk's checksum in bundles and in ``kvdock inspect``)."""
    return blake3.blake3(t.contiguous().view(torch.uint8).numpy().data).hexdigest()


def _chunk_digests(kv: torch.Tensor, chunk: int) -> tuple[str, ...]:
    return tuple(digest(kv[:, :, i : i + chunk]) for i in range(0, kv.shape[2], chunk))


def export_bundle(
    ctx: KVCacheContext, tokens: object, path: str | os.PathLike[str], cache_salt: str = "", note: str = ""
) -> BundleManifest | None:
    """Write the cached prefix of ``tokens`` (whole chunks, as :func:`retrieve` returns it) to a
    bundle at ``path`` (written to a temporary file beside it, then renamed: never a half-written
    bundle). Returns its manifest, or None when nothing of ``tokens`` is cached (no file is
    written). Raises what :func:`retrieve` raises, and OSError when ``path`` cannot be written."""
    if not isinstance(note, str):
        raise InvalidInputError(f"note must be a string, got {type(note).__name__}")
    arr = validate.tokens(tokens)  # once: ``tokens`` may be an iterator
    kv = retrieve(ctx, arr, cache_salt)
    if kv is None:
        return None
    ids = torch.from_numpy(arr[: kv.shape[2]].astype(np.int64))
    manifest = BundleManifest(
        model_name=ctx.model_name,
        geometry=ctx.geometry,
        chunk_size=ctx.chunk_size,
        tokens=int(kv.shape[2]),
        cache_salt=cache_salt,
        kvdock_version=__version__,
        tokens_blake3=digest(ids),
        chunk_blake3=_chunk_digests(kv, ctx.chunk_size),
        note=note,
    )
    _write(Path(path), {"kv": kv.contiguous(), "tokens": ids}, msgspec.json.encode(manifest).decode())
    return manifest


def _write(target: Path, tensors: dict[str, torch.Tensor], manifest: str) -> None:
    from safetensors.torch import save

    data = save(tensors, metadata={MANIFEST_KEY: manifest})
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def read_bundle(path: str | os.PathLike[str]) -> Bundle:
    """Read a bundle into memory and verify it. InvalidInputError for a file that is not a kvdock
    bundle, is truncated or corrupted, or whose checksums, shapes, dtype or token ids disagree
    with its manifest (the header is checked before the data is read: see the module's
    docstring); OSError when it cannot be read. A valid bundle of N bytes needs N bytes of memory
    (and its tensors as much again)."""
    name = os.fspath(path)
    with open(name, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        header, meta = _header(name, f, size)
        manifest = _manifest(name, meta)
        _check_declared(name, manifest, header, size - _HEADER_LEN - len(header))
        f.seek(0)
        data = f.read(size + 1)  # one copy, checked and stored: the file may change meanwhile
    if len(data) != size:
        raise InvalidInputError(f"{name} is not a readable bundle (it changed while it was read)")
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        tensors = load(data)
    except (SafetensorError, ValueError, RuntimeError) as e:
        raise InvalidInputError(f"{name} is not a readable bundle (truncated or corrupted?): {e}") from None
    if set(tensors) != {"kv", "tokens"} or data[_HEADER_LEN : _HEADER_LEN + len(header)] != header:
        raise InvalidInputError(f"{name} is not a readable bundle (it changed while it was read)")
    _verify(name, manifest, tensors["kv"], tensors["tokens"])
    return Bundle(manifest, tensors["kv"], tensors["tokens"].tolist())


def _unreadable(name: str, why: str = "") -> InvalidInputError:
    return InvalidInputError(f"{name} is not a readable bundle ({why or 'truncated or corrupted?'})")


def _header(name: str, f: BinaryIO, size: int) -> tuple[bytes, str]:
    """The safetensors header of the open bundle ``f`` of ``size`` bytes (read, nothing more) and
    the manifest string in it."""
    raw = f.read(_HEADER_LEN)
    n = int.from_bytes(raw, "little") if len(raw) == _HEADER_LEN else -1
    if not 0 < n <= min(size - _HEADER_LEN, MAX_HEADER):
        raise _unreadable(name)
    header = f.read(n)
    try:
        if len(header) != n:
            raise ValueError("short read")
        parsed = json.loads(header)
        manifest = (parsed.get("__metadata__") or {}).get(MANIFEST_KEY)
    except (ValueError, AttributeError, RecursionError):
        raise _unreadable(name) from None
    if not isinstance(manifest, str):
        raise InvalidInputError(f"{name} is not a kvdock bundle (no {MANIFEST_KEY!r} manifest)")
    return header, manifest


def _manifest(name: str, meta: str) -> BundleManifest:
    try:
        manifest = msgspec.json.decode(meta, type=BundleManifest)
        manifest.geometry.check()
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError, RecursionError) as e:
        raise InvalidInputError(f"{name}: malformed bundle manifest: {e}") from None
    if manifest.format != FORMAT:
        raise InvalidInputError(f"{name}: bundle format {manifest.format}; this kvdock reads format {FORMAT}")
    if manifest.chunk_size <= 0 or manifest.tokens <= 0 or manifest.tokens % manifest.chunk_size:
        raise InvalidInputError(f"{name}: {manifest.tokens} tokens are not whole chunks of {manifest.chunk_size}")
    return manifest


def _check_declared(name: str, m: BundleManifest, header: bytes, data_bytes: int) -> None:
    """The tensors ``header`` declares are the manifest's (``kv`` and ``tokens``, their dtypes and
    shapes) and their byte ranges are their sizes and cover the ``data_bytes`` after the header
    exactly: checked before any of that data is read."""
    declared = {k: v for k, v in json.loads(header).items() if k != "__metadata__"}
    if set(declared) != {"kv", "tokens"}:
        raise InvalidInputError(f"{name}: a bundle holds tensors 'kv' and 'tokens', this has {sorted(declared)}")
    spans = []
    for key, want_shape, want_dtype in (
        ("kv", list(m.geometry.chunk_shape(m.tokens)), m.geometry.dtype),
        ("tokens", [m.tokens], "int64"),
    ):
        info = declared[key]
        if not isinstance(info, dict) or not isinstance(shape := info.get("shape"), list):
            raise _unreadable(name)
        if not all(type(d) is int and d >= 0 for d in shape):
            raise _unreadable(name)
        code = info.get("dtype")
        dtype = _DTYPES.get(code) if isinstance(code, str) else None
        if shape != want_shape or dtype != want_dtype:
            got = f"torch.{dtype}" if dtype else str(code)
            if key == "kv":
                raise InvalidInputError(f"{name}: KV is {shape} {got}; its manifest says {want_shape} {want_dtype}")
            raise InvalidInputError(f"{name}: token ids are {shape} {got}; want {want_shape} int64")
        nbytes = int(np.prod(shape, dtype=object)) * _ITEMSIZE[dtype]
        span = info.get("data_offsets")
        if not (isinstance(span, list) and len(span) == 2 and all(type(o) is int for o in span)) or (
            span[1] - span[0] != nbytes or not 0 <= span[0] <= span[1] <= data_bytes
        ):
            raise _unreadable(name, f"it declares tensor {key!r} of {nbytes} bytes at {str(span)[:64]}")
        spans.append((span[0], span[1]))
    (a0, a1), (b0, b1) = sorted(spans)
    if a0 != 0 or a1 != b0 or b1 != data_bytes:
        declared_bytes = a1 - a0 + b1 - b0
        why = f"its header declares {declared_bytes} bytes of tensors, the file holds {data_bytes} bytes of tensor data"
        raise _unreadable(name, why)


def _verify(name: str, m: BundleManifest, kv: torch.Tensor, ids: torch.Tensor) -> None:
    """The tensors as loaded against the manifest (:func:`_manifest` checked it): shapes, dtypes,
    checksums, token range."""
    want = tuple(m.geometry.chunk_shape(m.tokens))
    if tuple(kv.shape) != want or str(kv.dtype).removeprefix("torch.") != m.geometry.dtype:
        raise InvalidInputError(
            f"{name}: KV is {list(kv.shape)} {kv.dtype}; its manifest says {list(want)} {m.geometry.dtype}"
        )
    if ids.dtype != torch.int64 or tuple(ids.shape) != (m.tokens,):
        raise InvalidInputError(f"{name}: token ids are {list(ids.shape)} {ids.dtype}; want [{m.tokens}] int64")
    if digest(ids) != m.tokens_blake3:
        raise InvalidInputError(f"{name}: the token ids do not match the manifest's checksum (corrupted)")
    if int(ids.min()) < 0 or int(ids.max()) > MAX_TOKEN_ID:
        raise InvalidInputError(f"{name}: token id out of range 0..{MAX_TOKEN_ID}")
    digests = _chunk_digests(kv, m.chunk_size)
    if len(digests) != len(m.chunk_blake3):
        raise InvalidInputError(f"{name}: {len(digests)} chunks, the manifest lists {len(m.chunk_blake3)}")
    for i, (got, expected) in enumerate(zip(digests, m.chunk_blake3, strict=True)):
        if got != expected:
            raise InvalidInputError(f"{name}: chunk {i} does not match its blake3 checksum (corrupted)")


def import_bundle(
    ctx: KVCacheContext,
    bundle: str | os.PathLike[str] | Bundle,
    cache_salt: str | None = None,
    overwrite: bool = False,
    allow_other_model: bool = False,
) -> ImportResult:
    """Store a bundle's KV (a path, read and verified by :func:`read_bundle`, or a Bundle it
    returned) under its token ids in ``ctx``'s model, namespace ``cache_salt`` (default: the
    bundle's), whole chunks of ``ctx``'s chunk size. The bundle must have ``ctx``'s geometry and
    -- unless ``allow_other_model`` (same geometry, other name: the caller vouches for the
    weights) -- its model name. InvalidInputError before anything is stored when a check fails;
    otherwise what :func:`store_chunks` raises.

    The chunks are stored as :func:`store` stores a user's KV: marked edited (a bundle's bytes
    need not be what the model computes here), so an engine's save of the same tokens computed
    over other bytes never extends them; a stored prefix holding an edit is extended only when
    the bundle's bytes for it are identical (otherwise ``stored.diverged_chunks``)."""
    b = bundle if isinstance(bundle, Bundle) else read_bundle(bundle)
    m = b.manifest
    if m.geometry != ctx.geometry:
        raise InvalidInputError(f"the bundle's geometry {m.geometry} is not {ctx.model_name!r}'s {ctx.geometry}")
    if m.model_name != ctx.model_name and not allow_other_model:
        raise InvalidInputError(
            f"the bundle holds KV of {m.model_name!r}, not {ctx.model_name!r} "
            "(pass allow_other_model=True if the weights are the same)"
        )
    whole = len(b.tokens) // ctx.chunk_size * ctx.chunk_size
    salt = m.cache_salt if cache_salt is None else cache_salt
    stored = StoreResult(0, 0, 0)
    if whole:
        stored = store_chunks(ctx, b.kv[:, :, :whole], b.tokens[:whole], salt, overwrite, edited=True)
    return ImportResult(m, whole, len(b.tokens) - whole, stored)

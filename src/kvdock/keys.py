"""Chunk keys: prefix-chained blake3 hashes of token ids (pure, no I/O).

Contract (never change silently, stored objects depend on it):

* token ids are encoded as unsigned 32-bit little-endian integers;
* ``h_0 = blake3(b"kvdock/chunk-key/v1")`` and
  ``h_i = blake3(h_{i-1} || tokens of chunk i)`` (32-byte digests);
* so a chunk's hash names the whole prefix up to and including it.

An object's identity is ``ObjectKey(model, rank, salt, chunk)``; storage shared by several servers
also names the geometry it was written under (:func:`storage_namespace`).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Set
from typing import NamedTuple

import numpy as np
from blake3 import blake3

from kvdock import _native  # type: ignore[attr-defined]

TOKEN_DTYPE = np.dtype("<u4")
MAX_TOKEN_ID = 2**32 - 1
SEED = blake3(b"kvdock/chunk-key/v1").digest()


class ObjectKey(NamedTuple):
    """Identity of one stored chunk."""

    model: str
    rank: int
    salt: str
    chunk: bytes


def chunk_hashes(tokens: np.ndarray, chunk_size: int) -> list[bytes]:
    """Return one chained hash per whole chunk of ``tokens`` (a trailing partial chunk is ignored).

    ``tokens`` must be a 1-D array of dtype ``TOKEN_DTYPE``.
    """
    assert tokens.dtype == TOKEN_DTYPE and tokens.ndim == 1
    step = chunk_size * TOKEN_DTYPE.itemsize
    raw = tokens[: len(tokens) // chunk_size * chunk_size].tobytes()  # (one copy: no per-chunk views)
    prev = SEED
    out: list[bytes] = []
    h = blake3()  # (one hasher, reset for each chunk: cheaper than a new one each)
    for start in range(0, len(raw), step):
        h.reset()
        h.update(prev + raw[start : start + step])
        prev = h.digest()
        out.append(prev)
    return out


def namespace(model: str, rank: int, salt: str) -> str:
    """The 32-hex-digit name of a (model, rank, cache_salt) namespace: what L3 keys and KV events
    carry instead of the salt itself (a salt is a secret of its tenant)."""
    return blake3(model.encode() + b"\0" + str(rank).encode() + b"\0" + salt.encode()).hexdigest()[:32]


@functools.lru_cache(maxsize=4096)
def storage_namespace(model: str, rank: int, salt: str, identity: str) -> str:
    """The 32-hex-digit name of a (model, rank, cache_salt) namespace *of one geometry*
    (``identity``: :meth:`kvdock.layout.KVGeometry.digest`): what names objects in storage
    shared by several servers (L3 keys), so that objects written under another geometry of the
    same model name are never found. Each field is length-prefixed (no two namespaces share a
    digest input); the tag versions the encoding."""
    h = blake3(b"kvdock/storage-namespace/v2")
    for field in (model.encode(), str(rank).encode(), salt.encode(), identity.encode()):
        h.update(len(field).to_bytes(8, "little"))
        h.update(field)
    return str(h.hexdigest()[:32])


@functools.lru_cache(maxsize=4096)
def namespace_digest(model: str, rank: int, salt: str) -> bytes:
    """The 32-byte digest of a (model, rank, cache_salt) namespace: with a chunk hash, what names
    an object in the pool directory (:mod:`kvdock.shm.directory`). Each field is length-prefixed,
    so no two namespaces share a digest input."""
    h = blake3(b"kvdock/namespace/v1")
    for field in (model.encode(), str(rank).encode(), salt.encode()):
        h.update(len(field).to_bytes(8, "little"))
        h.update(field)
    return h.digest()


def tokens_from_bytes(data: bytes) -> np.ndarray:
    """Decode the wire form of token ids; raises ValueError on a ragged buffer."""
    if len(data) % TOKEN_DTYPE.itemsize:
        raise ValueError(f"token buffer of {len(data)} bytes is not a whole number of uint32")
    return np.frombuffer(data, dtype=TOKEN_DTYPE)


def normalize_tokens(tokens: object) -> np.ndarray:
    """Validate token ids (a sequence, numpy array or torch tensor of integers) into a uint32 array.

    Raises TypeError for non-integers (bools and floats included) and for mappings and sets (their
    order is not a token order), and ValueError for ids outside ``0 .. 2**32-1``, input that is not
    one-dimensional, or a tensor on the meta device (it holds no values).
    """
    if hasattr(tokens, "detach") and hasattr(tokens, "numpy"):  # torch.Tensor without importing torch
        if getattr(tokens, "is_meta", False):
            raise ValueError("token ids are on the meta device, which holds no values; pass a CPU or GPU tensor")
        tokens = tokens.detach().cpu().numpy()  # type: ignore[attr-defined]
    if isinstance(tokens, np.ndarray):
        arr = tokens
        if type(arr) is np.ndarray and arr.dtype == TOKEN_DTYPE and arr.ndim == 1 and arr.flags.c_contiguous:
            return arr  # (what _checked returns for it, without its min and max: every uint32 is in range)
        if arr.dtype.kind not in "iu":
            raise TypeError(f"token ids must be integers, got an array of {arr.dtype}")
    else:
        if isinstance(tokens, (str, bytes, bytearray)):
            raise TypeError(f"token ids must be a sequence of integers, got {type(tokens).__name__}")
        if isinstance(tokens, (Mapping, Set)):
            raise TypeError(
                f"token ids must be a sequence of integers, got a {type(tokens).__name__} "
                "(its order is not a token order; pass a list)"
            )
        packed = _native.pack_tokens(tokens)  # a list or tuple of plain ints: one pass in C
        if packed is not None:
            return np.frombuffer(packed, dtype=TOKEN_DTYPE)
        try:
            seq = list(tokens)  # type: ignore[call-overload]
        except TypeError:
            raise TypeError(f"token ids must be a sequence of integers, got {type(tokens).__name__}") from None
        if set(map(type, seq)) == {int}:  # the common case, checked in C: no per-token Python
            try:
                arr = np.array(seq, dtype=np.int64)
            except OverflowError:
                raise ValueError(f"token id out of range 0..{MAX_TOKEN_ID}") from None
            return _checked(arr)
        for t in seq:
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
                raise TypeError(f"token ids must be integers, got {type(t).__name__} {t!r}")
        if any(not 0 <= int(t) <= MAX_TOKEN_ID for t in seq):  # before numpy, which overflows on huge ints
            raise ValueError(f"token id out of range 0..{MAX_TOKEN_ID}")
        arr = np.array(seq, dtype=np.int64) if seq else np.zeros(0, dtype=np.int64)
    return _checked(arr)


def _checked(arr: np.ndarray) -> np.ndarray:
    if arr.ndim != 1:
        raise ValueError(f"token ids must be one-dimensional, got shape {tuple(arr.shape)}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > MAX_TOKEN_ID):
        raise ValueError(f"token id out of range 0..{MAX_TOKEN_ID}")
    return np.ascontiguousarray(arr, dtype=TOKEN_DTYPE)

"""Chunk-key schemes: how the token ids of a request name its stored chunks (pure, no I/O).

kvdock's own scheme (``"kvdock"``, :mod:`kvdock.keys`) chains the chunks' token ids. A model
that SGLang registered (its HiCache storage backend, :mod:`kvdock.integrations.sglang`) is keyed
the way SGLang keys it (``"sglang"``), because SGLang hands its storage backend page hashes, never
token ids:

* SGLang's page hash (``sglang.srt.mem_cache.utils.get_hash_str``, byte for byte):
  ``h_i = sha256(h_{i-1} || tokens of page i)``, token ids as little-endian uint32, ``h_{-1}``
  the request's namespace seed (:func:`sglang_namespace_seed`: sha256 over its ``extra_key``
  and ``cache_salt``), or nothing when it has neither; hex strings;
* each page hash becomes one chunk of *key tokens* (:func:`key_tokens`): its 32 bytes as 8
  uint32 words, then zeros up to the page size, so a page is a chunk (the server's chunk size
  must equal SGLang's page size, at least 8), and kvdock's own chain over those chunks names the
  same prefix as SGLang's last page hash;
* the namespace lives in the hashes: such chunks are stored under kvdock's ``cache_salt`` ""
  whatever the request's salt (the backend is never told the salt).

So an SDK context of an SGLang-keyed model turns ``(tokens, cache_salt)`` into
``(sglang_tokens(tokens, chunk_size, cache_salt=cache_salt or None), "")`` before asking the
server (:func:`kvdock.sdk.ops.keyed`), and retrieves, stores and looks up exactly what SGLang
stored and will look up. Contract: never change silently; stored objects depend on it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from kvdock.keys import TOKEN_DTYPE

KVDOCK = "kvdock"
SGLANG = "sglang"
SCHEMES = (KVDOCK, SGLANG)
KEY_WORDS = 8  # uint32 words of one page hash (sha256: 32 bytes)


def scheme_of(engine_name: str) -> str:
    """The key scheme of a model registered by the engine named ``engine_name``
    (``ModelLayout.engine.name``): SGLang's for ``"sglang"``, kvdock's for every other."""
    return SGLANG if engine_name == SGLANG else KVDOCK


def sglang_namespace_seed(extra_key: str | None, cache_salt: str | None) -> str | None:
    """SGLang's ``storage_namespace_seed``: the hex seed of a request's page-hash chain, None
    when it has neither an ``extra_key`` nor a ``cache_salt`` (``""`` is not None: another seed)."""
    if extra_key is None and cache_salt is None:
        return None
    digest = hashlib.sha256(b"sglang-cache-namespace-v1")
    for part in (extra_key, cache_salt):
        if part is None:
            digest.update(b"\x00")
            continue
        encoded = part.encode("utf-8")
        digest.update(b"\x01" + len(encoded).to_bytes(8, "little") + encoded)
    return digest.hexdigest()


def sglang_page_hashes(tokens: np.ndarray, page_size: int, prior_hash: str | None = None) -> list[str]:
    """SGLang's page hashes of the *whole* pages of ``tokens`` (uint32), chained from
    ``prior_hash`` (hex; a namespace seed or the previous page's hash; None: unseeded). SGLang
    hashes a trailing partial page too; HiCache never stores one, so it is left out here."""
    assert tokens.dtype == TOKEN_DTYPE and tokens.ndim == 1 and page_size > 0
    raw = np.ascontiguousarray(tokens).view(np.uint8)
    step = page_size * TOKEN_DTYPE.itemsize
    prior = bytes.fromhex(prior_hash) if prior_hash else b""
    out: list[str] = []
    for i in range(len(tokens) // page_size):
        h = hashlib.sha256(prior)
        h.update(raw[i * step : (i + 1) * step].data)
        prior = h.digest()
        out.append(h.hexdigest())
    return out


def key_tokens(keys: Sequence[str], page_size: int) -> np.ndarray:
    """The key tokens of SGLang page hashes ``keys`` (64 hex digits each): one ``page_size`` chunk
    per key, the hash's 32 bytes as 8 little-endian uint32 words, then zeros. ValueError for a
    page size under 8 or a key that is not a sha256 hex digest."""
    if page_size < KEY_WORDS:
        raise ValueError(f"SGLang keys need a page size of at least {KEY_WORDS} tokens, got {page_size}")
    out = np.zeros((len(keys), page_size), dtype=TOKEN_DTYPE)
    if keys:
        try:  # (one fromhex of them all: no whitespace passes, a key of it would be short)
            raw = bytes.fromhex("".join(keys)) if all(len(k) == 64 for k in keys) else b""
        except (TypeError, ValueError):
            raw = b""
        if len(raw) != 32 * len(keys):
            raise ValueError("SGLang page keys must be sha256 hex digests (64 hex digits)")
        out[:, :KEY_WORDS] = np.frombuffer(raw, dtype=TOKEN_DTYPE).reshape(len(keys), KEY_WORDS)
    return out.reshape(-1)


def sglang_tokens(
    tokens: np.ndarray, page_size: int, *, extra_key: str | None = None, cache_salt: str | None = None
) -> np.ndarray:
    """``tokens`` (uint32) as the key tokens SGLang's pages of them are stored under, of the same
    length: every whole page becomes its page hash's chunk (seeded by the request's namespace),
    a trailing partial page zeros (never stored)."""
    seed = sglang_namespace_seed(extra_key, cache_salt)
    whole = key_tokens(sglang_page_hashes(tokens, page_size, seed), page_size) if len(tokens) >= page_size else None
    out = np.zeros(len(tokens), dtype=TOKEN_DTYPE)
    if whole is not None:
        out[: len(whole)] = whole
    return out


__all__ = [
    "KVDOCK",
    "SCHEMES",
    "SGLANG",
    "key_tokens",
    "scheme_of",
    "sglang_namespace_seed",
    "sglang_page_hashes",
    "sglang_tokens",
]

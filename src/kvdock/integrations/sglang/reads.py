"""The SDK on the pages an SGLang engine stored, by token ids, whatever namespace they are in.

SGLang names a request's pages by a sha256 chain over their token ids seeded by the request's
namespace (its ``extra_key`` and ``cache_salt``: :func:`kvdock.keying.sglang_namespace_seed`),
and this backend files them in kvdock under the engine's kvdock salt (the extra config's
``kvdock.cache_salt``, "" by default; a tenant's engine uses a salt the tenant owns). The SDK's
plain calls on a model SGLang registered cover only the common case (kvdock salt "", the call's
``cache_salt`` as SGLang's, no ``extra_key``). :class:`SGLangKV` covers all three::

    import kvdock.sdk as kvd
    from kvdock.integrations.sglang import SGLangKV

    with kvd.connect(url, http_url, "llama", token=TENANT_TOKEN) as ctx:
        sg = SGLangKV.of_engine(ctx, extra_config)  # the engine's --hicache-storage-backend-extra-config
        kv = sg.retrieve(tokens, cache_salt="alice", extra_key="lora-7")  # [2, L, T, D] or None
        sg.store(edited, other_tokens, cache_salt="alice", extra_key="lora-7")  # SGLang then hits it

It turns ``(tokens, cache_salt, extra_key)`` into the key tokens of SGLang's page hashes
(:func:`key_tokens`: what the backend sends for those pages) and calls the SDK with them under
the engine's kvdock salt. The context becomes one of key tokens (``ctx.chunk_keys = "kvdock"``,
as the backend's own): give it a context of its own, not one the plain calls also use.
:func:`page_keys` are the hashes SGLang itself computes (the keys its HiCache hands a backend).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

import kvdock.sdk as kvd
from kvdock.errors import InvalidInputError
from kvdock.keying import KVDOCK, sglang_namespace_seed, sglang_page_hashes, sglang_tokens
from kvdock.keys import normalize_tokens


def page_keys(
    tokens: object, page_size: int, *, cache_salt: str | None = None, extra_key: str | None = None
) -> list[str]:
    """SGLang's page hashes (hex) of the whole pages of ``tokens`` in the namespace of a request
    with ``extra_key`` and ``cache_salt`` (None: the request has none; "" is another namespace):
    the keys SGLang's HiCache hands its storage backend for them."""
    seed = sglang_namespace_seed(extra_key, cache_salt)
    return sglang_page_hashes(normalize_tokens(tokens), page_size, seed)


def key_tokens(
    tokens: object, page_size: int, *, cache_salt: str | None = None, extra_key: str | None = None
) -> np.ndarray:
    """The key tokens kvdock holds those pages under (as long as ``tokens``; a trailing partial
    page is zeros, never stored): what a context with ``chunk_keys = "kvdock"`` is given."""
    return sglang_tokens(normalize_tokens(tokens), page_size, extra_key=extra_key, cache_salt=cache_salt)


class SGLangKV:
    """The SDK's store, retrieve and lookup of an SGLang engine's pages by token ids (module
    docs). ``kvdock_salt``: the engine's ``kvdock.cache_salt``. Sets ``ctx.chunk_keys``."""

    def __init__(self, ctx: kvd.KVCacheContext, kvdock_salt: str = "") -> None:
        if not isinstance(kvdock_salt, str):
            raise InvalidInputError(f"kvdock_salt must be a string, got {type(kvdock_salt).__name__}")
        self.ctx, self.kvdock_salt = ctx, kvdock_salt
        ctx.chunk_keys = KVDOCK  # type: ignore[attr-defined]  # (the calls below send key tokens)

    @classmethod
    def of_engine(cls, ctx: kvd.KVCacheContext, extra_config: Mapping[str, Any] | str) -> SGLangKV:
        """For the engine started with ``extra_config`` (its
        ``--hicache-storage-backend-extra-config``, a dict or the JSON text): its
        ``kvdock.cache_salt``. InvalidInputError when that is not a string."""
        extra = json.loads(extra_config) if isinstance(extra_config, str) else dict(extra_config)
        return cls(ctx, extra.get("kvdock.cache_salt", ""))

    def key_tokens(self, tokens: object, *, cache_salt: str | None = None, extra_key: str | None = None) -> np.ndarray:
        """:func:`key_tokens` at this context's chunk size (SGLang's page size)."""
        return key_tokens(tokens, self.ctx.chunk_size, cache_salt=cache_salt, extra_key=extra_key)

    def retrieve(
        self,
        tokens: object,
        *,
        cache_salt: str | None = None,
        extra_key: str | None = None,
        out: torch.Tensor | None = None,
        layers: range | None = None,
        start: int = 0,
    ) -> torch.Tensor | None:
        """:func:`kvdock.sdk.retrieve` of what SGLang stored for ``tokens`` in a request with
        ``cache_salt`` and ``extra_key``: ``[2, L, T, D]`` (``[1, L, T, C]`` for MLA), or None."""
        keys = self.key_tokens(tokens, cache_salt=cache_salt, extra_key=extra_key)
        return kvd.retrieve(self.ctx, keys, self.kvdock_salt, out=out, layers=layers, start=start)

    def store(
        self,
        kv: torch.Tensor,
        tokens: object,
        *,
        cache_salt: str | None = None,
        extra_key: str | None = None,
        overwrite: bool = False,
        over: Sequence[int] | None = None,
        edited: bool = True,
    ) -> bool:
        """:func:`kvdock.sdk.store` of ``kv`` where SGLang looks ``tokens`` up in a request with
        ``cache_salt`` and ``extra_key`` (its next prefetch of them hits it)."""
        keys = self.key_tokens(tokens, cache_salt=cache_salt, extra_key=extra_key)
        return kvd.store(self.ctx, kv, keys, self.kvdock_salt, overwrite, over=over, edited=edited)

    def lookup(self, tokens: object, *, cache_salt: str | None = None, extra_key: str | None = None) -> int:
        """:func:`kvdock.sdk.lookup`: how many leading tokens SGLang's pages cover."""
        keys = self.key_tokens(tokens, cache_salt=cache_salt, extra_key=extra_key)
        return kvd.lookup(self.ctx, keys, self.kvdock_salt)


__all__ = ["SGLangKV", "key_tokens", "page_keys"]

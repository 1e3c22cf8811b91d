"""The SDK reads and writes by token ids what an SGLang engine stored under its engine-level kvdock
salt (``kvdock.cache_salt``) and a request's SGLang namespace (``cache_salt``, ``extra_key``):
``SGLangKV``, against the backend SGLang's own factory builds, SGLang's own page hash and host
pools."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo
from sglang.srt.mem_cache.storage import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_hash_str, storage_namespace_seed

import kvdock.sdk as kvd
from conftest import PAGE, host_pool, pages_kv, prompt, storage_config
from kvdock.errors import InvalidInputError
from kvdock.integrations.sglang import KvdockHiCacheStorage, SGLangKV
from kvdock.integrations.sglang.reads import key_tokens, page_keys
from kvdock.testing import ServerProcess

SALT, USER, LORA = "engine-a", "alice", "lora-7"


def sglang_keys(tokens: np.ndarray, cache_salt: str | None, extra_key: str | None) -> list[str]:
    """SGLang's own page hashes of a request (its whole pages)."""
    seed = storage_namespace_seed(extra_key, cache_salt)
    return get_hash_str(tokens.tolist(), seed, page_size=PAGE)[: len(tokens) // PAGE]


@pytest.fixture
def engine(sgl_server: ServerProcess) -> Any:
    """A backend as SGLang builds it (its factory, the dynamic backend) with an engine salt."""
    cfg = storage_config(sgl_server, **{"kvdock.model_name": "sgl-ns", "kvdock.cache_salt": SALT})
    pool = host_pool(False, "page_first")
    b = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    assert isinstance(b, KvdockHiCacheStorage)
    b.register_mem_pool_host(pool)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=torch.Generator().manual_seed(50)).to(pool.dtype))
    yield b, cfg
    b.close()


def test_page_keys_are_sglangs_own() -> None:
    tokens = prompt(3, seed=51)
    for salt, extra in ((None, None), (USER, None), (None, LORA), (USER, LORA), ("", "")):
        assert page_keys(tokens, PAGE, cache_salt=salt, extra_key=extra) == sglang_keys(tokens, salt, extra)
    kt = key_tokens(tokens, PAGE, cache_salt=USER, extra_key=LORA)
    assert len(kt) == len(tokens) and not kt[3 * PAGE :].any()  # (the partial page: never stored)
    assert kt[:8].tobytes() == bytes.fromhex(sglang_keys(tokens, USER, LORA)[0])


def test_the_sdk_reads_and_writes_an_engines_salted_pages_by_token_ids(
    sgl_server: ServerProcess, engine: tuple[KvdockHiCacheStorage, Any]
) -> None:
    b, cfg = engine
    tokens = prompt(3, seed=52)
    keys = sglang_keys(tokens, USER, LORA)
    src = b.mem_pool_host.alloc(3 * PAGE)
    info = HiCacheStorageExtraInfo(prefix_keys=[])
    assert b.batch_set_v1(keys[:1], src[:PAGE], info) == [True]
    assert b.batch_set_v1(keys[1:], src[PAGE:], HiCacheStorageExtraInfo(prefix_keys=keys[:1])) == [True, True]
    want = pages_kv(b, src)

    with kvd.connect(sgl_server.url, sgl_server.http_url, "sgl-ns") as ctx:
        # the plain call cannot reach them (kvdock salt "", no extra_key)
        assert kvd.retrieve(ctx, tokens, cache_salt=USER) is None
    with kvd.connect(sgl_server.url, sgl_server.http_url, "sgl-ns") as ctx:
        sg = SGLangKV.of_engine(ctx, json.dumps(cfg.extra_config))  # the engine's own extra config
        assert sg.kvdock_salt == SALT
        kv = sg.retrieve(tokens, cache_salt=USER, extra_key=LORA)
        assert kv is not None and kv.shape[2] == 3 * PAGE and torch.equal(kv, want)
        assert sg.lookup(tokens, cache_salt=USER, extra_key=LORA) == 3 * PAGE
        part = sg.retrieve(tokens, cache_salt=USER, extra_key=LORA, layers=range(1, 2), start=PAGE)
        assert part is not None and torch.equal(part, want[:, 1:2, PAGE:])
        # another namespace of any of the three: nothing
        assert sg.retrieve(tokens, cache_salt=USER) is None
        assert sg.retrieve(tokens, extra_key=LORA) is None
        assert sg.retrieve(tokens, cache_salt="bob", extra_key=LORA) is None
        assert SGLangKV(ctx, "engine-b").retrieve(tokens, cache_salt=USER, extra_key=LORA) is None

        # an edit stored under other tokens, in the request's namespace: SGLang hits it there
        edited = kv.clone()
        edited[:, :, :PAGE] *= -1
        other = prompt(3, seed=53)
        assert sg.store(edited, other, cache_salt=USER, extra_key=LORA)
    okeys = sglang_keys(other, USER, LORA)
    assert b.batch_exists(sglang_keys(other, None, LORA), info) == 0
    assert b.batch_exists(okeys, info) == 3
    dst = b.mem_pool_host.alloc(3 * PAGE)
    assert b.batch_get_v1(okeys, dst, info) == [True] * 3
    assert torch.equal(pages_kv(b, dst), edited)


def test_a_salt_that_is_not_a_string_is_refused(sgl_server: ServerProcess, engine: Any) -> None:
    with (
        kvd.connect(sgl_server.url, sgl_server.http_url, "sgl-ns") as ctx,
        pytest.raises(InvalidInputError, match="kvdock_salt must be a string"),
    ):
        SGLangKV.of_engine(ctx, {"kvdock.cache_salt": 7})

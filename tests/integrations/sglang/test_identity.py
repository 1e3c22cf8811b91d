"""An SGLang engine as a kvdock tenant (its token, its pages under a salt the tenant owns) and the
model fingerprint it registers, against SGLang's real host pools and storage config."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import kvdock.sdk as kvd
from conftest import PAGE, extra, host_pool, pages_kv, prompt, storage_config
from kvdock.errors import PermissionDeniedError
from kvdock.integrations.sglang import KvdockHiCacheStorage, SGLangKV
from kvdock.integrations.sglang.identity import fingerprint_of, model_fingerprint
from kvdock.keying import sglang_page_hashes, sglang_tokens
from kvdock.testing import ServerProcess, start_server

Make = Callable[..., KvdockHiCacheStorage]
ACME, BETA, ADMIN = "acme-token-0123456789", "beta-token-0123456789", "admin-token-0123456789"
NAME = "sgl-tenant"


@pytest.fixture
def tenants_server(tmp_path: Path) -> ServerProcess:
    path = tmp_path / "tenants.toml"
    path.write_text(
        f"""
[tenants.acme]
tokens = ["{ACME}"]
models = ["{NAME}"]
salts = ["acme", "acme/*"]

[tenants.beta]
tokens = ["{BETA}"]
models = ["other"]
salts = ["beta"]
"""
    )
    srv = start_server(
        "--no-disk", "--tenants", str(path), "--admin-token", ADMIN, chunk_size=PAGE, l1_size="64MiB",
        log_path=tmp_path / "s.log",
    )  # fmt: skip
    yield srv
    srv.stop()


def test_an_engine_of_a_tenant_files_its_pages_under_its_salt(tenants_server: ServerProcess, backend: Make) -> None:
    srv = tenants_server
    acme = {"kvdock.model_name": NAME, "kvdock.token": ACME, "kvdock.cache_salt": "acme/sgl", "kvdock.retry_s": 0}
    pool = host_pool(False, "page_first")
    b = backend(storage_config(srv, **acme), pool)
    assert b.off == "" and b._ctx is not None
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=torch.Generator().manual_seed(1)))
    tokens = prompt(3, seed=2, tail=2)
    keys = sglang_page_hashes(tokens, PAGE)
    src = pool.alloc(3 * PAGE)
    assert b.batch_set_v1(keys, src, extra([])) == [True] * 3
    assert b.batch_exists(keys, extra([])) == 3
    dst = pool.alloc(3 * PAGE)
    assert b.batch_get_v1(keys, dst, extra([])) == [True] * 3
    assert torch.equal(pages_kv(b, dst), pages_kv(b, src))
    # the SDK, as the tenant: SGLang's key tokens under the engine's kvdock salt
    with kvd.connect(srv.url, srv.http_url, NAME, token=ACME) as ctx:
        with pytest.raises(PermissionDeniedError, match="not a namespace of tenant 'acme'"):
            kvd.retrieve(ctx, tokens, cache_salt="acme")  # the plain call reads kvdock's salt "", not acme's
        ctx.chunk_keys = "kvdock"  # type: ignore[attr-defined]
        kv = kvd.retrieve(ctx, sglang_tokens(tokens, PAGE), cache_salt="acme/sgl")
        assert kv is not None and torch.equal(kv, pages_kv(b, src))
        assert kvd.retrieve(ctx, sglang_tokens(tokens, PAGE), cache_salt="acme") is None
    with kvd.connect(srv.url, srv.http_url, NAME, token=ACME) as ctx:  # the same, by token ids (SGLangKV)
        sg = SGLangKV.of_engine(ctx, acme)
        got = sg.retrieve(tokens)
        assert got is not None and torch.equal(got, pages_kv(b, src))
        assert sg.lookup(tokens) == 3 * PAGE and sg.retrieve(tokens, cache_salt="") is None
    # another salt of the tenant: another namespace; a salt it does not own: refused, a counted miss
    other = backend(storage_config(srv, **{**acme, "kvdock.cache_salt": "acme/other"}), host_pool(False, "page_first"))
    assert other.batch_exists(keys, extra([])) == 0
    beta = backend(storage_config(srv, **{**acme, "kvdock.token": BETA}), host_pool(False, "page_first"))
    assert beta.batch_exists(keys, extra([])) == 0
    assert beta.batch_set_v1(keys, beta.mem_pool_host.alloc(3 * PAGE), extra([])) == [False] * 3
    assert beta.stats["exists_failed"] + beta.stats["exists_unavailable"] >= 1
    assert beta.stats["set_failed"] + beta.stats["set_unavailable"] >= 1
    # an engine without the tenant's token is refused everything: misses, never an exception
    anon = backend(
        storage_config(srv, **{"kvdock.model_name": NAME, "kvdock.retry_s": 0}), host_pool(False, "page_first")
    )
    assert anon.batch_exists(keys, extra([])) == 0
    assert b.batch_exists(keys, extra([])) == 3  # and the tenant's pages are still its own


def checkpoint(root: Path, seed: int, rope_theta: float = 10000.0) -> Path:
    root.mkdir()
    (root / "config.json").write_text(
        json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "rope_theta": rope_theta})
    )
    (root / "model.safetensors").write_bytes(np.random.default_rng(seed).bytes(70_000))
    return root


def test_the_fingerprint_names_the_checkpoint_its_config_and_the_kv_dtype(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = checkpoint(tmp_path / "a", seed=1)
    args = SimpleNamespace(model_path=str(a), revision=None, dtype="bfloat16", kv_cache_dtype="auto", quantization=None)
    fa = fingerprint_of(args)
    assert fa.startswith("sglang-v1:") and len(fa) == len("sglang-v1:") + 32
    assert fingerprint_of(SimpleNamespace(**vars(args))) == fa  # deterministic
    b = checkpoint(tmp_path / "b", seed=2)  # other weights, same config
    assert fingerprint_of(SimpleNamespace(**{**vars(args), "model_path": str(b)})) != fa
    c = checkpoint(tmp_path / "c", seed=1, rope_theta=500000.0)  # same weights, another RoPE
    assert fingerprint_of(SimpleNamespace(**{**vars(args), "model_path": str(c)})) != fa
    assert fingerprint_of(SimpleNamespace(**{**vars(args), "kv_cache_dtype": "fp8_e4m3"})) != fa
    override = json.dumps({"rope_theta": 500000.0})
    assert fingerprint_of(SimpleNamespace(**{**vars(args), "json_model_override_args": override})) != fa
    assert fingerprint_of(SimpleNamespace(model_path="")) == ""
    import sglang.srt.runtime_context as rc

    def unpublished() -> None:
        raise ValueError("Global server args is not set yet!")  # (SGLang's own words)

    monkeypatch.setattr(rc, "get_server_args", unpublished)
    assert model_fingerprint() == ""  # outside an engine: none
    monkeypatch.setattr(rc, "get_server_args", lambda: args)
    assert model_fingerprint() == fa  # inside one: its server arguments'


def test_a_name_kvdock_holds_with_another_fingerprint_turns_kvdock_off(
    sgl_server: ServerProcess, backend: Make
) -> None:
    name = "sgl-fingerprint"
    first = backend(
        storage_config(sgl_server, **{"kvdock.model_name": name, "kvdock.fingerprint": "sglang-v1:" + "a" * 32}),
        host_pool(False, "page_first"),
    )
    assert first.off == ""
    with kvd.connect(sgl_server.url, sgl_server.http_url, name) as ctx:
        assert ctx.layout.fingerprint == "sglang-v1:" + "a" * 32
    same = backend(
        storage_config(sgl_server, **{"kvdock.model_name": name, "kvdock.fingerprint": "sglang-v1:" + "a" * 32}),
        host_pool(False, "page_first"),
    )
    assert same.off == ""
    other = backend(
        storage_config(sgl_server, **{"kvdock.model_name": name, "kvdock.fingerprint": "sglang-v1:" + "b" * 32}),
        host_pool(False, "page_first"),
    )
    assert "another model" in other.off and "fingerprint" in other.off
    keys = sglang_page_hashes(prompt(1, seed=3, tail=2), PAGE)
    assert other.batch_set_v1(keys, other.mem_pool_host.alloc(PAGE), extra([])) == [False]
    assert other.batch_exists(keys, extra([])) == 0

"""The SDK's public surface, by audience (issue 25): pinned, so that it grows only on purpose."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import numpy as np
import pytest

import kvdock.sdk as kvd

USERS = [
    "KVCacheContext", "connect", "close",
    "lookup", "retrieve", "store", "store_chunks", "StoreResult", "view", "PrefixView", "lookup_many", "retrieve_many",
    "register_model", "ModelRegistration", "server_status", "server_config",
    "export_bundle", "import_bundle", "read_bundle", "Bundle", "ImportResult", "set_buffer_pool_bytes",
    "KVCacheSDKError", "InvalidInputError", "ServerError", "ServerUnavailableError", "UnknownModelError",
    "PermissionDeniedError", "PoolFullError", "StoreConflictError", "LeaseExpiredError",
]  # fmt: skip
ENGINE = [
    "ChunkSink", "ChunkSource", "StoreResult", "Tips", "describe_server", "dtype_name", "lookup_tips", "make_layout",
    "register_layout", "retrieve_into", "store_chunks", "store_from",
]  # fmt: skip
ADMIN = [
    "BufferPool", "Bundle", "BundleManifest", "ImportResult", "ModelRegistration", "PoolStats", "buffer_pool",
    "check_server_integrity", "describe_server", "export_bundle", "import_bundle", "make_layout", "read_bundle",
    "register_layout", "register_model", "server_config", "server_status", "set_buffer_pool_bytes",
]  # fmt: skip
ANALYSTS = ["ChunkInfo", "Inspection", "PrefixDiff", "check_plot_path", "diff_prefixes", "inspect_prefix", "plot_norms"]

# what kvdock.sdk.__all__ listed before the split (51 names): every one still resolves
BEFORE = sorted({*USERS, *ENGINE, *ADMIN, *ANALYSTS} - {"dtype_name", "check_plot_path"})


def test_the_users_surface_is_pinned() -> None:
    assert kvd.__all__ == USERS
    assert len(kvd.__all__) <= 32  # one screen
    assert dir(kvd) == sorted([*USERS, "admin", "aio", "engine", "inspection"])


def test_each_audience_module_is_pinned() -> None:
    for name, want in (("engine", ENGINE), ("admin", ADMIN), ("inspection", ANALYSTS)):
        module = importlib.import_module(f"kvdock.sdk.{name}")
        assert sorted(module.__all__) == sorted(want), name
        assert getattr(kvd, name) is module
        for attr in want:
            assert getattr(module, attr) is not None


def test_every_name_kvdock_sdk_had_still_resolves_to_the_same_object() -> None:
    assert len(BEFORE) == 51
    homes = [importlib.import_module(f"kvdock.sdk.{a}") for a in ("engine", "admin", "inspection")]
    for name in BEFORE:
        obj = getattr(kvd, name)
        assert all(getattr(h, name, obj) is obj for h in homes), name
    from kvdock.sdk import lookup_tips, retrieve_into, store_from  # the vLLM connector's names

    engine = kvd.engine
    assert (store_from, retrieve_into, lookup_tips) == (engine.store_from, engine.retrieve_into, engine.lookup_tips)


def test_plumbing_modules_are_private() -> None:
    sdk = Path(kvd.__file__).parent
    public = sorted(p.stem for p in sdk.glob("*.py") if not p.stem.startswith("_"))
    assert public == [
        "admin", "aio", "batch", "buffers", "bundle", "chunks", "context", "engine", "inspection", "ops",
        "registration", "views",
    ]  # fmt: skip


def _sdk_imports(module: str) -> set[str]:
    """The kvdock.sdk modules ``module`` imports, at any level of its code."""
    tree = ast.parse((Path(kvd.__file__).parent / f"{module}.py").read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvdock.sdk"):
            found |= {node.module} if node.module != "kvdock.sdk" else {f"kvdock.sdk.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("kvdock.sdk")}
    return found


def test_validate_and_context_import_no_circle() -> None:
    """_validate imported context (locally: context imports _validate): now it imports only the
    buffer pool's module, which imports no SDK module."""
    assert _sdk_imports("_validate") == {"kvdock.sdk.buffers"}
    assert _sdk_imports("buffers") == set()
    assert "kvdock.sdk._validate" in _sdk_imports("context")


def test_the_package_is_typed() -> None:
    assert (Path(kvd.__file__).parent.parent / "py.typed").is_file()


def test_a_request_is_answered_its_declared_reply_type(ctx: kvd.KVCacheContext, monkeypatch) -> None:
    """The typed call: ``ask`` of a ``RequestBase[R]`` returns an ``R``; a reply of another op's
    type (the transport's ProtocolError) is a KVCacheSDKError, like every SDK failure."""
    from kvdock.errors import ProtocolError
    from kvdock.protocol import messages as m

    reply = ctx.ask(m.Lookup(ctx.client_id, np.arange(32, dtype=np.uint32).tobytes(), ""))
    assert type(reply) is m.LookupResult and reply.hit_tokens == 0
    client = ctx._conn._client

    def answered_otherwise(*args: object, **kwargs: object) -> None:
        raise ProtocolError("a Lookup was answered Pong, not LookupResult")

    monkeypatch.setattr(client, "call", answered_otherwise)
    ctx.fast_reads = False
    monkeypatch.setattr(ctx._conn, "_local", None)  # (so the zmq client, patched, carries it)
    with pytest.raises(kvd.KVCacheSDKError, match=r"a Lookup was answered Pong, not LookupResult$"):
        kvd.lookup(ctx, list(range(32)))

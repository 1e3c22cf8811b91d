"""kvdock SDK: move KV caches in and out of a kvdock server from a CPU-only process.

import kvdock.sdk as kvd

ctx = kvd.connect("tcp://127.0.0.1:5555", "http://127.0.0.1:9000", "my-model")
kv = kvd.retrieve(ctx, tokens)          # [2, L, hit_tokens, D] or None
with kvd.view(ctx, tokens) as v:        # zero-copy, read-only: v.chunk(i) is a slot of the pool
    ...
ok = kvd.store(ctx, kv, other_tokens)   # True if anything new was stored
kvd.close(ctx)

The public surface, by audience (each module's ``__all__`` lists it):

* applications: this module (``__all__`` below); :mod:`kvdock.sdk.aio`, the same as coroutines;
* engine authors (connectors that move paged KV, tensor-parallel ranks): :mod:`kvdock.sdk.engine`;
* operators (registering models, integrity checks, bundles, the client's buffer pool):
  :mod:`kvdock.sdk.admin`;
* analysts (what is cached, how two prefixes differ): :mod:`kvdock.sdk.inspection`.

Modules whose names start with ``_`` are the SDK's plumbing (no contract outside it). The names
that moved to an audience's module stay reachable here for code written before (``kvd.store_from``
and the like), without being part of this module's surface.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvdock.errors import (
    InvalidInputError,
    KVCacheSDKError,
    LeaseExpiredError,
    PermissionDeniedError,
    PoolFullError,
    ServerError,
    ServerUnavailableError,
    StoreConflictError,
    UnknownModelError,
)
from kvdock.sdk._http import server_config, server_status
from kvdock.sdk.batch import lookup_many, retrieve_many
from kvdock.sdk.buffers import set_buffer_pool_bytes
from kvdock.sdk.bundle import Bundle, ImportResult, export_bundle, import_bundle, read_bundle
from kvdock.sdk.context import KVCacheContext, close, connect
from kvdock.sdk.ops import StoreResult, lookup, retrieve, store, store_chunks
from kvdock.sdk.registration import ModelRegistration, register_model
from kvdock.sdk.views import PrefixView, view

__all__ = [
    # connecting
    "KVCacheContext",
    "connect",
    "close",
    # moving KV
    "lookup",
    "retrieve",
    "store",
    "store_chunks",
    "StoreResult",
    "view",
    "PrefixView",
    "lookup_many",
    "retrieve_many",
    # models, servers, files
    "register_model",
    "ModelRegistration",
    "server_status",
    "server_config",
    "export_bundle",
    "import_bundle",
    "read_bundle",
    "Bundle",
    "ImportResult",
    "set_buffer_pool_bytes",
    # errors (kvdock.errors)
    "KVCacheSDKError",
    "InvalidInputError",
    "ServerError",
    "ServerUnavailableError",
    "UnknownModelError",
    "PermissionDeniedError",
    "PoolFullError",
    "StoreConflictError",
    "LeaseExpiredError",
]

AUDIENCES = ("aio", "engine", "admin", "inspection")

# names that live in an audience's module, reachable here too (see the module's docstring)
_MOVED = {
    "BufferPool": "admin",
    "BundleManifest": "admin",
    "PoolStats": "admin",
    "buffer_pool": "admin",
    "check_server_integrity": "admin",
    "describe_server": "admin",
    "make_layout": "engine",
    "register_layout": "engine",
    "ChunkSink": "engine",
    "ChunkSource": "engine",
    "Tips": "engine",
    "lookup_tips": "engine",
    "retrieve_into": "engine",
    "store_from": "engine",
    "ChunkInfo": "inspection",
    "Inspection": "inspection",
    "PrefixDiff": "inspection",
    "diff_prefixes": "inspection",
    "inspect_prefix": "inspection",
    "plot_norms": "inspection",
}

if TYPE_CHECKING:
    from kvdock.sdk.admin import BufferPool as BufferPool
    from kvdock.sdk.admin import BundleManifest as BundleManifest
    from kvdock.sdk.admin import PoolStats as PoolStats
    from kvdock.sdk.admin import buffer_pool as buffer_pool
    from kvdock.sdk.admin import check_server_integrity as check_server_integrity
    from kvdock.sdk.admin import describe_server as describe_server
    from kvdock.sdk.engine import ChunkSink as ChunkSink
    from kvdock.sdk.engine import ChunkSource as ChunkSource
    from kvdock.sdk.engine import Tips as Tips
    from kvdock.sdk.engine import lookup_tips as lookup_tips
    from kvdock.sdk.engine import make_layout as make_layout
    from kvdock.sdk.engine import register_layout as register_layout
    from kvdock.sdk.engine import retrieve_into as retrieve_into
    from kvdock.sdk.engine import store_from as store_from
    from kvdock.sdk.inspection import ChunkInfo as ChunkInfo
    from kvdock.sdk.inspection import Inspection as Inspection
    from kvdock.sdk.inspection import PrefixDiff as PrefixDiff
    from kvdock.sdk.inspection import diff_prefixes as diff_prefixes
    from kvdock.sdk.inspection import inspect_prefix as inspect_prefix
    from kvdock.sdk.inspection import plot_norms as plot_norms


def __getattr__(name: str) -> Any:
    """An audience's module (``kvd.engine``), or a name that moved to one (:data:`_MOVED`)."""
    if name in AUDIENCES:
        return importlib.import_module(f"kvdock.sdk.{name}")
    home = _MOVED.get(name)
    if home is None:
        raise AttributeError(f"module 'kvdock.sdk' has no attribute {name!r}")
    return getattr(importlib.import_module(f"kvdock.sdk.{home}"), name)


def __dir__() -> list[str]:
    return sorted([*__all__, *AUDIENCES])

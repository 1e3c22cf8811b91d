"""kvdock SDK: move KV caches in and out of a kvdock server from a CPU-only process.

import kvdock.sdk as kvd

ctx = kvd.connect("tcp://127.0.0.1:5555", "http://127.0.0.1:9000", "my-model")
kv = kvd.retrieve(ctx, tokens)          # [2, L, hit_tokens, D] or None
with kvd.view(ctx, tokens) as v:        # zero-copy, read-only: v.chunk(i) is a slot of the pool
    ...
ok = kvd.store(ctx, kv, other_tokens)   # True if anything new was stored
kvd.close(ctx)
"""

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
from kvdock.sdk.batch import lookup_many, retrieve_many
from kvdock.sdk.buffers import BufferPool, PoolStats, buffer_pool, set_buffer_pool_bytes
from kvdock.sdk.bundle import Bundle, BundleManifest, ImportResult, export_bundle, import_bundle, read_bundle
from kvdock.sdk.chunks import ChunkSink, ChunkSource
from kvdock.sdk.context import KVCacheContext, close, connect
from kvdock.sdk.http import server_config, server_status
from kvdock.sdk.inspection import ChunkInfo, Inspection, PrefixDiff, diff_prefixes, inspect_prefix, plot_norms
from kvdock.sdk.ops import (
    StoreResult,
    Tips,
    check_server_integrity,
    lookup,
    lookup_tips,
    retrieve,
    retrieve_into,
    store,
    store_chunks,
    store_from,
)
from kvdock.sdk.registration import ModelRegistration, describe_server, make_layout, register_layout, register_model
from kvdock.sdk.views import PrefixView, view

__all__ = [
    "BufferPool",
    "Bundle",
    "BundleManifest",
    "ImportResult",
    "ChunkInfo",
    "ChunkSink",
    "ChunkSource",
    "Inspection",
    "InvalidInputError",
    "KVCacheContext",
    "KVCacheSDKError",
    "LeaseExpiredError",
    "PermissionDeniedError",
    "ModelRegistration",
    "PoolFullError",
    "PoolStats",
    "PrefixView",
    "PrefixDiff",
    "ServerError",
    "ServerUnavailableError",
    "StoreConflictError",
    "StoreResult",
    "Tips",
    "UnknownModelError",
    "buffer_pool",
    "check_server_integrity",
    "close",
    "connect",
    "diff_prefixes",
    "export_bundle",
    "import_bundle",
    "inspect_prefix",
    "lookup",
    "lookup_tips",
    "lookup_many",
    "read_bundle",
    "make_layout",
    "plot_norms",
    "describe_server",
    "register_layout",
    "register_model",
    "retrieve",
    "retrieve_into",
    "retrieve_many",
    "server_config",
    "server_status",
    "set_buffer_pool_bytes",
    "store",
    "store_chunks",
    "store_from",
    "view",
]

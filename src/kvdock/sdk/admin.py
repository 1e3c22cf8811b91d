"""The SDK for operators: models, servers, bundles and this process's buffer pool.

* :func:`register_model` / :func:`register_layout` / :func:`make_layout`: register a model's
  KV layout (behind the server's admin token when it has one);
* :func:`describe_server`, :func:`server_config`, :func:`server_status`: what a server holds
  and allows; :func:`check_server_integrity`: its own consistency check;
* :func:`export_bundle` / :func:`import_bundle` / :func:`read_bundle`: a cached prefix as a file;
* :func:`buffer_pool` / :func:`set_buffer_pool_bytes`: the pool of pinned buffers retrieves
  reuse in this process.
"""

from kvdock.sdk._http import server_config, server_status
from kvdock.sdk.buffers import BufferPool, PoolStats, buffer_pool, set_buffer_pool_bytes
from kvdock.sdk.bundle import Bundle, BundleManifest, ImportResult, export_bundle, import_bundle, read_bundle
from kvdock.sdk.ops import check_server_integrity
from kvdock.sdk.registration import ModelRegistration, describe_server, make_layout, register_layout, register_model

__all__ = [
    "BufferPool",
    "Bundle",
    "BundleManifest",
    "ImportResult",
    "ModelRegistration",
    "PoolStats",
    "buffer_pool",
    "check_server_integrity",
    "describe_server",
    "export_bundle",
    "import_bundle",
    "make_layout",
    "read_bundle",
    "register_layout",
    "register_model",
    "server_config",
    "server_status",
    "set_buffer_pool_bytes",
]

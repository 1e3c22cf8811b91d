"""kvdock as SGLang's HiCache L3 storage backend (SGLang 0.5.23), and the SDK on the same KV.

Start SGLang with HiCache and this backend (kvdock started with ``--chunk-size`` equal to
SGLang's ``--page-size``, at least 8)::

    python -m sglang.launch_server --model-path MODEL --page-size 64 --enable-hierarchical-cache \\
      --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \\
      '{"backend_name": "kvdock", "module_path": "kvdock.integrations.sglang",
        "class_name": "KvdockHiCacheStorage", "interface_v1": 1,
        "hicache_storage_pass_prefix_keys": true,
        "kvdock.url": "tcp://127.0.0.1:5555", "kvdock.http_url": "http://127.0.0.1:9000"}'

The backend (:mod:`.backend`) registers the model (engine ``"sglang"``), and kvdock keys it the
way SGLang does (:mod:`kvdock.keying`): ``kvdock.sdk.retrieve(ctx, tokens)`` returns SGLang's
KV of a prompt as ``[2, L, T, D]``, and ``kvdock.sdk.store(ctx, kv, other_tokens)`` makes SGLang
hit it for ``other_tokens``. Pages in another namespace (the engine's ``kvdock.cache_salt``, a
request's ``extra_key``): :class:`~.reads.SGLangKV`. Settings: :mod:`.config`.
"""

from kvdock.integrations.sglang.backend import KvdockHiCacheStorage
from kvdock.integrations.sglang.pools import HostPages
from kvdock.integrations.sglang.reads import SGLangKV

__all__ = ["HostPages", "KvdockHiCacheStorage", "SGLangKV"]

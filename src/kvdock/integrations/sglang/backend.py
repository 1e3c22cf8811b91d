"""``KvdockHiCacheStorage``: kvdock as SGLang's HiCache L3 storage backend.

SGLang constructs it as ``cls(storage_config, {})`` (the ``dynamic`` backend), then calls
``register_mem_pool_host(host_pool)``: that reads the pool's geometry and layout
(:class:`~kvdock.integrations.sglang.pools.HostPages`: an unsupported pool raises there, at
engine start) and connects to kvdock, registering the model's layout when the server does not
know it (engine ``"sglang"``: the SDK then keys the model SGLang's way, :mod:`kvdock.keying`).
Tensor-parallel rank ``r`` of ``tp_size`` stores the KV heads it holds as its shard
(:func:`kvdock.sharding.place`: a rank of another degree than the stored one reads and writes
what it can); an MLA latent is one shard that rank 0 writes.

Keys: SGLang passes page hashes; each is one kvdock chunk of key tokens
(:func:`kvdock.keying.key_tokens`). On the zero-copy path (``"interface_v1": 1``) a call's pages
are chained after ``extra_info.prefix_keys`` (SGLang passes them with
``"hicache_storage_pass_prefix_keys": true``; without, a call's first key starts the chain), so
kvdock holds the prompt's chain and the SDK reads it by token ids. The generic path
(``get`` / ``set`` / ``batch_get`` / ``batch_set``, SGLang's default without ``interface_v1``)
has no prefixes: each key is a chain of its own there, which only this backend reads.

Tensor-parallel ranks load one version of a page or miss, and SGLang's continuations of a prefix
it loaded (an SDK edit) are stored: :mod:`.versions` (``tips`` from ``batch_exists`` to
``batch_get_v1``, ``over`` from gets to sets).

Salts and tenants: SGLang never tells a storage backend a request's ``cache_salt`` or
``extra_key`` (0.5.23: ``HiCacheStorageExtraInfo`` carries only ``prefix_keys``; the namespace
is the seed of the page-hash chain, ``get_storage_hash_str`` → ``storage_namespace_seed``, and a
hash cannot be undone), so SGLang's namespaces are kept apart by the hashes alone and every page
of an engine goes under one kvdock salt, ``kvdock.cache_salt`` ("" by default): a tenant's salt
policy applies per engine (its ``kvdock.token`` and a salt it owns), not per SGLang request.
The SDK reads and writes such pages by token ids with :class:`~.reads.SGLangKV` (the engine's
kvdock salt, a request's SGLang ``cache_salt`` and ``extra_key``); its plain calls
(``retrieve(ctx, tokens, cache_salt)``) cover kvdock salt "" and no ``extra_key``. The model's
fingerprint comes from SGLang's server arguments (:mod:`.identity`; ``kvdock.fingerprint``
overrides it): a name kvdock holds with another fingerprint turns kvdock off for the engine.

Never raises into SGLang (its storage threads treat an exception as fatal): a kvdock failure, a
server that is down or hung (``kvdock.timeout``), a refused registration, a chunk size other
than SGLang's page size, context parallelism (``attn_cp_size`` or ``dcp_size`` over 1: its ranks
hold different KV under one page hash), are misses (False / None / 0), logged and counted in :attr:`stats`;
after a failure kvdock is not tried again for ``kvdock.retry_s``. Wrong bytes never: a page is
reported loaded only when its whole copy was verified (the SDK's slot generations).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, NoReturn

import numpy as np
import torch

import kvdock.sdk as kvd
from kvdock.errors import KVCacheSDKError, PrefixMissingError, UnknownModelError
from kvdock.integrations.sglang.config import BackendConfig
from kvdock.integrations.sglang.ends import Flat, Pages
from kvdock.integrations.sglang.hybrid import NoExtraPools
from kvdock.integrations.sglang.identity import model_fingerprint
from kvdock.integrations.sglang.pools import HostPages
from kvdock.integrations.sglang.versions import Loaded, Seen
from kvdock.keying import KVDOCK, key_tokens
from kvdock.sdk.chunks import ChunkSink, ChunkSource
from kvdock.sharding import place
from kvdock.storage.plans import depends_on_edit

try:  # the base class when SGLang is installed; the module itself imports without it
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage as _Base
except ImportError:  # pragma: no cover - only without SGLang
    _Base = object  # type: ignore[assignment,misc]

log = logging.getLogger("kvdock.sglang")


class KvdockHiCacheStorage(NoExtraPools, _Base):  # type: ignore[misc,valid-type]
    """A HiCache storage backend over a kvdock server (see the module docs)."""

    def __init__(self, storage_config: Any, kwargs: Any = None) -> None:
        self.config = BackendConfig.from_extra(storage_config.extra_config, storage_config.model_name)
        self.tp_rank, self.tp_size = int(storage_config.tp_rank), int(storage_config.tp_size)
        self.pp_rank, self.pp_size = int(storage_config.pp_rank), int(storage_config.pp_size)
        self.is_mla = bool(storage_config.is_mla_model)
        self.writer = bool(getattr(storage_config, "is_storage_writer", not self.is_mla or self.tp_rank == 0))
        self.stats: collections.Counter[str] = collections.Counter()  # what happened, by name
        self.pages: HostPages | None = None
        self.off = ""  # why kvdock is off for good ("" while it is on)
        self._ctx: kvd.KVCacheContext | None = None
        self._writable = False
        self._down_until = float("-inf")
        self._lock = threading.Lock()
        self._last_log = 0.0
        self.ranks = self.tp_size * self.pp_size  # >1: ranks load only what their exists saw
        self.seen, self.loaded = Seen(), Loaded()
        # Context-parallel ranks (attention CP, MLA's decode CP) hold different KV under the same
        # page hashes (SGLang's own backends key them apart); kvdock has no shard for that: off.
        cp, dcp = int(getattr(storage_config, "attn_cp_size", 1) or 1), int(getattr(storage_config, "dcp_size", 1) or 1)
        if cp > 1 or dcp > 1:
            self.off = f"kvdock: context parallelism (attn_cp_size {cp}, dcp_size {dcp}) is not supported"
            self.stats["off"] += 1
            log.error("%s; kvdock is off for this engine (every lookup is a miss)", self.off)

    # -- setup ----------------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Read the host pool's geometry (UnsupportedLayoutError for one kvdock cannot hold: at
        engine start) and connect to kvdock now (a server that is down is tried again later)."""
        self.mem_pool_host = mem_pool_host
        self.pages = HostPages(mem_pool_host)
        cfg = self.config
        log.info("kvdock: %s for %r (rank %d of %d)", self.pages.describe(), cfg.model_name, self.tp_rank, self.tp_size)
        self._context()

    def _layout(self) -> Any:
        assert self.pages is not None
        try:
            import sglang

            version = str(sglang.__version__)
        except Exception:  # pragma: no cover
            version = ""
        ranks = (self.tp_size, self.tp_rank, self.pp_size, self.pp_rank)
        cfg = self.config
        found = cfg.fingerprint if cfg.fingerprint is not None else model_fingerprint()
        return self.pages.model_layout(cfg.model_name, version, ranks, cfg.total_kv_heads, found)

    def _context(self) -> kvd.KVCacheContext | None:
        """The SDK context, connecting (and registering) first if the retry time has come; None
        while kvdock is down or off."""
        ctx = self._ctx
        if ctx is not None or self.off or self.pages is None:
            return ctx
        with self._lock:
            if self._ctx is not None or self.off or time.monotonic() < self._down_until:
                return self._ctx
            try:
                self._ctx = self._connect()
            except KVCacheSDKError as e:
                self._down(f"cannot connect to kvdock at {self.config.url}: {e}")
            except Exception as e:  # never into SGLang's threads
                log.exception("kvdock: connecting failed")
                self._down(f"cannot connect to kvdock at {self.config.url}: {type(e).__name__}: {e}")
            return self._ctx

    def _connect(self) -> kvd.KVCacheContext:
        cfg, lay = self.config, self._layout()
        token = cfg.token or None
        stored = kvd.describe_server(cfg.url, cfg.model_name, cfg.timeout, token=token).layout
        if stored is None:
            try:
                kvd.register_layout(cfg.url, cfg.http_url, lay, cfg.timeout, cfg.admin_token, token=token)
                log.info("kvdock: registered %r at %s", cfg.model_name, cfg.url)
            except kvd.ServerError as e:
                if getattr(e, "code", "") == "registration":
                    self._off(f"kvdock holds {cfg.model_name!r} as another model: {e}")
                raise
            stored = kvd.describe_server(cfg.url, cfg.model_name, cfg.timeout, token=token).layout
            if stored is None:
                raise UnknownModelError(f"{cfg.model_name!r} is not registered with kvdock at {cfg.url}")
        if stored.fingerprint and lay.fingerprint and stored.fingerprint != lay.fingerprint:
            self._off(f"kvdock holds {cfg.model_name!r} as another model (fingerprint {stored.fingerprint})")
        try:
            placed = place(stored.geometry, lay.geometry)
        except ValueError as e:
            self._off(f"kvdock holds {cfg.model_name!r} as another model: {e} (use another kvdock.model_name)")
        ctx = kvd.connect(cfg.url, cfg.http_url, cfg.model_name, cfg.timeout, kv_rank=placed.kv_rank, token=token)
        ctx.chunk_keys = KVDOCK  # type: ignore[attr-defined]  # (this backend sends key tokens itself)
        if ctx.chunk_size != self.pages.page_size:  # type: ignore[union-attr]
            ctx.close(wait_s=0.0)
            self._off(
                f"kvdock's chunk_size {ctx.chunk_size} is not SGLang's page size {self.pages.page_size} "  # type: ignore[union-attr]
                "(start kvdock with --chunk-size equal to --page-size)"
            )
        if placed.dims is not None:
            ctx.close(wait_s=0.0)
            self._off(f"rank {self.tp_rank} holds part of a shard kvdock stores {cfg.model_name!r} in: not supported")
        self._writable = placed.writable and self.writer
        return ctx

    def _off(self, why: str) -> NoReturn:
        self.off = why
        self.stats["off"] += 1
        log.error("%s; kvdock is off for this engine (every lookup is a miss)", why)
        raise KVCacheSDKError(why)

    def _down(self, why: str) -> None:
        self.stats["down"] += 1
        self._down_until = time.monotonic() + self.config.retry_s
        old, self._ctx = self._ctx, None
        if old is not None:
            with contextlib.suppress(Exception):  # closing a broken context must not raise
                old.close(wait_s=0.0)
        now = time.monotonic()
        if now - self._last_log > 10.0:
            self._last_log = now
            log.warning("%s; misses for %.1fs", why, self.config.retry_s)

    def _run(self, what: str, fn: Any, miss: Any) -> Any:
        """``fn(ctx)``, or ``miss`` (counted) when kvdock is down, off or the call fails. Never
        raises."""
        try:
            ctx = self._context()
            if ctx is None:
                self.stats[f"{what}_unavailable"] += 1
                return miss
            return fn(ctx)
        except (kvd.PoolFullError, kvd.StoreConflictError, kvd.LeaseExpiredError) as e:
            self.stats[f"{what}_failed"] += 1
            log.info("kvdock %s: %s", what, e)
        except UnknownModelError as e:  # the server forgot the model (restarted): register again
            self.stats[f"{what}_failed"] += 1
            self._down(f"kvdock {what}: {e}")
            self._down_until = float("-inf")
        except KVCacheSDKError as e:
            self.stats[f"{what}_failed"] += 1
            self._down(f"kvdock {what} failed: {e}")
        except Exception as e:  # SGLang's threads die on any exception
            self.stats[f"{what}_failed"] += 1
            log.exception("kvdock %s: unexpected %s", what, type(e).__name__)
        return miss

    # -- the zero-copy path (interface_v1) ------------------------------------------------------

    def _chain(self, keys: list[str], prefix: list[str], more: list[str] | None = None) -> tuple[np.ndarray, int]:
        """The key tokens of ``prefix + keys + more`` and where ``keys`` start (in chunks)."""
        assert self.pages is not None
        return key_tokens(prefix + list(keys) + (more or []), self.pages.page_size), len(prefix)

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many of ``keys`` (from the first) kvdock holds, consecutively. The generic path
        (no ``interface_v1``: each key a chain of its own) asks key by key, each a batch of one."""
        if self.config.interface_v1:
            return self._exists(keys, _prefix(extra_info))
        n = 0
        while n < len(keys) and self._exists(keys[n : n + 1], []) == 1:
            n += 1
        return n

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Load the pages of ``keys`` into the host pool at ``host_indices``; True for each
        page loaded (a prefix of ``keys``). On a rank of several: only the versions this
        operation's ``batch_exists`` saw, else nothing (:mod:`.versions`)."""
        n = self._load(keys, _prefix(extra_info), lambda first: self._pages(len(keys), host_indices, first, into=True))
        return [True] * n + [False] * (len(keys) - n)

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        """Store the host pool's pages at ``host_indices`` under ``keys``; True for each page
        kvdock holds afterwards (written now or before)."""
        n = self._store(keys, _prefix(extra_info), lambda first: self._pages(len(keys), host_indices, first))
        return [True] * n + [False] * (len(keys) - n)

    def _host_pages(self) -> HostPages:
        assert self.pages is not None, "register_mem_pool_host was not called"
        return self.pages

    def _pages(self, n: int, host_indices: torch.Tensor, first: int, into: bool = False) -> Pages:
        """The pages at ``host_indices``; ``into``: a load writes them (no page may come twice)."""
        pages = self._host_pages()
        return Pages(pages, pages.starts(n, host_indices, distinct=into), first, checked=True)

    # -- the one exists, load and store of every call (a single page is a batch of one) ---------

    def _exists(self, keys: list[str], prefix: list[str]) -> int:
        """How many of ``keys`` (chained after ``prefix``) kvdock holds, consecutively, with the
        tips it saw recorded for the gets of this operation (:mod:`.versions`). Never raises."""
        if not keys:
            return 0

        def go(ctx: kvd.KVCacheContext) -> int:
            chain, first = self._chain(keys, prefix)
            seen = kvd.lookup_tips(ctx, chain, self.config.cache_salt)
            hit = max(0, min(seen.hit_tokens // ctx.chunk_size - first, len(keys)))
            self.seen.note(prefix, keys, hit, seen.versions)
            return hit

        n = int(self._run("exists", go, 0))
        self.stats["pages_found"] += n
        return n

    def _load(self, keys: list[str], prefix: list[str], sink_of: Callable[[int], ChunkSink]) -> int:
        """Load the pages of ``keys`` (chained after ``prefix``) into ``sink_of(first)`` (chunk
        ``first`` is ``keys[0]``); how many loaded, a prefix of ``keys``. Never raises. Every get
        does this: the versions its ``batch_exists`` saw (:mod:`.versions`), the record of what it
        loaded for the sets after it, the same counters."""
        if not keys:
            return 0

        def go(ctx: kvd.KVCacheContext) -> int:
            vouched = self.seen.vouch(prefix, keys)
            if vouched is None and self.ranks > 1:
                self.stats["get_unvouched"] += 1
                return 0
            if vouched is not None and self.ranks == 1 and not any(depends_on_edit(t) for t in vouched.tips):
                vouched = None  # one rank, no edit to extend (no over): the plain read, the pool directory first
            chain, first = self._chain(keys, prefix, vouched.extra if vouched else None)
            tips = vouched.tips if vouched else None
            hit = kvd.retrieve_into(ctx, chain, sink_of(first), self.config.cache_salt, tips=tips) // ctx.chunk_size
            n = max(0, min(hit - first, len(keys)))
            if vouched is not None:
                self.stats["get_vouched" if n else "get_stale"] += 1
                if n == len(keys) and not vouched.extra:
                    self.loaded.note(keys[-1], vouched.tips)
            return n

        n = int(self._run("get", go, 0))
        self.stats["pages_loaded"] += n
        return n

    def _store(self, keys: list[str], prefix: list[str], source_of: Callable[[int], ChunkSource]) -> int:
        """Store ``source_of(first)``'s chunks (``first``: ``keys[0]``) under ``keys`` chained
        after ``prefix``; how many of ``keys`` kvdock holds afterwards (a prefix of them). Never
        raises. Every set does this: ``over`` when this rank loaded the prefix from kvdock
        (:mod:`.versions`), a missing prefix or a diverged page a counted miss."""
        if not keys:
            return 0
        if not self.writer:  # another rank writes this shard (MLA: rank 0)
            return len(keys)

        def go(ctx: kvd.KVCacheContext) -> int:
            if not self._writable:
                return 0
            source = source_of(len(prefix))
            chain, first = self._chain(keys, prefix)
            over = self.loaded.over(prefix, keys)  # (None: SGLang computed the prefix)
            self.stats["set_over_loaded"] += over is not None
            try:
                r = kvd.store_from(ctx, source, chain, self.config.cache_salt, conflict_wait_s=0.0, over=over)
            except PrefixMissingError:
                self.stats["set_prefix_missing"] += 1
                return 0
            self.stats["pages_stored"] += r.stored_chunks
            self.stats["pages_diverged"] += r.diverged_chunks
            return max(0, min(r.stored_chunks + r.deduped_chunks - first, len(keys)))

        return int(self._run("set", go, 0))

    # -- the generic path (a key is a chain of its own; a page, a batch of one) -----------------

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        """Read ``key``'s page into ``target_location`` (a flat data page of the pool: SGLang's
        ``get_dummy_flat_data_page()``; a new one when None); None on a miss. A batch of one."""
        got: list[torch.Tensor] = []

        def sink(first: int) -> Flat:
            assert self.pages is not None
            target = target_location if target_location is not None else self.mem_pool_host.get_dummy_flat_data_page()
            got.append(target)
            return Flat(self.pages, target, first)

        return got[0] if self._load([key], [], sink) else None

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list[Any]:
        targets = list(target_locations) if target_locations is not None else [None] * len(keys)
        return [self.get(k, t) for k, t in zip(keys, targets, strict=False)]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        """Store ``value`` (a flat data page of the pool) under ``key``; True when kvdock holds
        it afterwards. A batch of one."""
        if value is None:
            return not self.writer
        return self._store([key], [], lambda first: Flat(self._host_pages(), value, first)) == 1

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        vals = list(values) if values is not None else [None] * len(keys)
        return all(self.set(k, v) for k, v in zip(keys, vals, strict=False))

    # -- the rest -------------------------------------------------------------------------------

    def clear(self) -> None:
        """Nothing: kvdock's tiers are shared (``kvdock`` ``POST /admin/clear`` clears them)."""

    def close(self) -> None:
        ctx, self._ctx = self._ctx, None
        if ctx is not None:
            with contextlib.suppress(Exception):
                ctx.close(wait_s=0.0)


def _prefix(extra_info: Any) -> list[str]:
    return list(getattr(extra_info, "prefix_keys", None) or [])


__all__ = ["KvdockHiCacheStorage"]

"""The worker side of the connector: register the layout, load planned chunks, save new ones.

``register_kv_caches`` reads what vLLM chose (:mod:`~kvdock.integrations.vllm.kvcaches`: the
codec for exactly that attention backend, layout and kernel, UnsupportedLayoutError at engine
start for anything no codec knows) and registers the layout with kvdock.

The model-runner thread never talks to kvdock during a step (:mod:`~kvdock.integrations.vllm.transfers`
has the threads that do): ``wait_for_save`` queues each save, which a copier thread copies out of
vLLM's pages (the request's blocks are kept until then: ``request_finished`` / ``get_finished``)
and a network thread stores; ``start_load_kv`` queues background loads (``load_kv_async``) or, in
the foreground mode (``kvdock.load_async`` false), has the network thread load before the forward
pass. Nothing runs per layer, so nothing runs inside a captured CUDA graph.

A load that kvdock cannot serve in full -- server down or restarted, chunks evicted since the
lookup, a lease that ran out mid-copy -- reports the blocks it did not fill through
``get_block_ids_with_load_errors`` (a background load's no later than ``get_finished`` reports
it), and vLLM recomputes them (``kv_load_failure_policy``). A save that fails, or finds staging
full, is dropped (a later miss), never an error for the request.

Threads: vLLM's model-runner thread calls the hooks; ``fetch``, ``store`` and ``_connected`` run
on the network thread, ``copy_out`` on the copier thread (``register`` connects first, before they
start).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch

import kvdock.sdk as kvd
from kvdock import faults
from kvdock.codecs import PagedCodec
from kvdock.errors import UnsupportedLayoutError
from kvdock.integrations.vllm.config import ConnectorConfig
from kvdock.integrations.vllm.geometry import _any_rank
from kvdock.integrations.vllm.groups import NULL_BLOCK, GroupMap, layer_rows, real_blocks
from kvdock.integrations.vllm.hybrid import GroupCopy
from kvdock.integrations.vllm.kvcaches import read_kv_caches
from kvdock.integrations.vllm.link import Link
from kvdock.integrations.vllm.plan import KvdockMetadata, LoadSpec, SaveSpec
from kvdock.integrations.vllm.sources import _Blocks, _Part, _Staged
from kvdock.integrations.vllm.staging import DeviceBridge, bridge_for, copy_out_for
from kvdock.integrations.vllm.transfers import Transfers
from kvdock.layout import KVGeometry
from kvdock.protocol.messages import ModelLayout
from kvdock.sharding import Placement, place

log = logging.getLogger("kvdock.vllm")


FAULT_FAIL_LOADS_ENV = faults.FAIL_LOADS_ENV
IDLE_WAIT_S = 0.05  # what a step without a forward pass waits for a background load to finish


class WorkerSide:
    def __init__(
        self,
        cfg: ConnectorConfig,
        vllm_config: Any,
        link: Link | None = None,
        fingerprint: str = "",
        groups: GroupMap | None = None,
    ) -> None:
        self.cfg = cfg
        # vLLM's KV cache groups, unless one full-attention group (then layers index their group's ids)
        self.groups = groups if groups is not None and not groups.plain else None
        self.group_of: list[int] = []  # per layer (in layer order): its group
        self.hybrid: GroupCopy | None = None  # the copy-out of several groups (register makes it)
        self._failed_recv: set[str] = set()  # background loads that failed (with groups), to report
        self.fingerprint = fingerprint  # the engine's model's (identity.model_fingerprint)
        self.vllm_config = vllm_config
        self.block_size = int(vllm_config.cache_config.block_size)
        self.link = link
        self.codec: PagedCodec
        self.bridge: Any = None
        self.blocks_per_chunk = 0
        self.off = False  # kvdock unusable for this engine (another layout under its name, ...)
        self.placement = Placement(None, None, True)  # where this rank's KV lies among the stored shards
        self._ctx: kvd.KVCacheContext | None = None  # the context the per-chunk state was made for
        self._load_errors: set[int] = set()  # this step's, until vLLM takes them
        # requests whose load failed (on this rank or another: see load), and those blocks: KV
        # computed over them is never saved
        self._poisoned: dict[str, set[int]] = {}
        self.agree: Callable[[list[bool]], list[bool]] = _any_rank  # (a seam for tests)
        self._loaded_now: set[str] = set()  # requests that loaded in this step
        # test-only fault: "salt@rank,...": loads under that cache_salt fail on that global rank
        # (an engine's ranks failing apart)
        self._faults = faults.current().fail_loads
        self.transfers: Transfers | None = None  # started by register
        self.layout: ModelLayout | None = None  # what register registers (the scheduler gets it too)
        self.bytes_per_token = 0
        self._load_stream: torch.cuda.Stream | None = None  # the network thread's uploads (GPU)
        self._idle = False  # this step has no forward pass
        self.recent: deque[SaveSpec] = deque(maxlen=64)  # the last saves queued (tests read pages through them)
        self.recent_loads: deque[LoadSpec] = deque(maxlen=64)  # and loads run

    # -- register_kv_caches ---------------------------------------------------------------------

    def register(self, kv_caches: dict[str, torch.Tensor]) -> ModelLayout:
        caches = read_kv_caches(self.vllm_config, kv_caches, self.block_size, self.cfg.model_name, self.fingerprint)
        if self.groups is not None:
            self.group_of = self.groups.group_of(caches.names)
        self.codec, lay = caches.codec, caches.layout
        self.link = self.link or Link(self.cfg, lay, fingerprint=self.fingerprint)
        self.link.layout = lay
        self.link.rank_for = self._rank_for
        log.info("kvdock: %s, codec %s, %s", self.cfg.model_name, caches.key, lay.geometry)
        self._connected(strict=True)  # register now; if kvdock is down, the first load or save retries
        self.layout = lay
        self.bytes_per_token = caches.bytes_per_token
        self.copier = copy_out_for(self.codec)
        if self.groups is not None:
            self.hybrid = GroupCopy(self.groups, self.group_of, self.codec, self.copier)
        if self.codec.device.type == "cuda":
            self._load_stream = torch.cuda.Stream(self.codec.device)
        budget = int(self.cfg.save_buffer_mb * (1 << 20))
        self.transfers = Transfers(self, budget, self.bytes_per_token)
        return lay

    def _rank_for(self, stored: KVGeometry) -> int | None:
        """The SDK context to connect through for a model the server stores as ``stored``."""
        try:
            return place(stored, self.codec.geometry).kv_rank
        except ValueError:
            return None  # refused by _connected, which says why

    def _connected(self, strict: bool = False) -> kvd.KVCacheContext | None:
        """The SDK context, or None (kvdock down, or off for good). Each new context (the first,
        and one after a server restart) is checked: the server must hold this engine's model
        under the name, in shards this rank's KV can be placed in (:func:`kvdock.sharding.place`),
        with a chunk size that is a multiple of the block size, and no other model's fingerprint
        (the link refuses it: :attr:`Link.refused`); the per-chunk staging follows the server's
        chunk size. A mismatch raises when ``strict`` (engine start) and otherwise turns kvdock off
        with an error in the log: never someone else's KV."""
        if self.link is None or self.off:
            return None
        ctx = self.link.context()
        problem = self.link.refused  # another model under the name: for good
        if not problem and (ctx is None or ctx is self._ctx):
            return ctx
        placed = self.placement
        if ctx is not None and not problem:
            try:
                placed = place(ctx.layout.geometry, self.codec.geometry)
                if placed.kv_rank != ctx.kv_rank and not strict:  # registered again meanwhile: connect again later
                    self.link.drop(f"kvdock connected as rank {ctx.kv_rank}; this rank's KV is now placed at {placed}")
                    return None
                if placed.kv_rank != ctx.kv_rank:
                    problem = f"kvdock connected as rank {ctx.kv_rank}; this rank's KV is placed at {placed}"
            except ValueError as e:
                problem = f"kvdock holds {self.cfg.model_name!r} as another model: {e} (use another kvdock.model_name)"
            if not problem and ctx.chunk_size % self.block_size:
                problem = (
                    f"kvdock's chunk_size {ctx.chunk_size} is not a multiple of vLLM's block_size {self.block_size}"
                )
        if problem:
            if strict:
                raise UnsupportedLayoutError(problem)
            log.error("%s; kvdock is off for this engine", problem)
            self.off = True
            self.link.close()
            return None
        assert ctx is not None
        self._ctx = ctx
        self.placement = placed
        if not placed.writable:
            log.warning(
                "kvdock: rank %d holds part of a shard %r is stored in: it loads, but never stores",
                self.codec.geometry.global_rank,
                self.cfg.model_name,
            )
        self.blocks_per_chunk = ctx.chunk_size // self.block_size
        self.bridge = bridge_for(self.codec.device, self.codec.geometry.chunk_shape(ctx.chunk_size), ctx.dtype)
        return ctx

    # -- start_load_kv / handle_preemptions ------------------------------------------------------

    def load(self, meta: KvdockMetadata, idle: bool = False) -> None:
        """This step's loads: background ones are queued (vLLM holds their requests back until
        :meth:`finished` reports them, with their failed blocks); the others are loaded before the
        forward pass (the network thread takes them first). With several tensor-parallel ranks, a
        request whose foreground load failed on any of them is poisoned on all: this rank's KV of
        the step is computed over the other's unfilled blocks too (row-parallel layers all-reduce
        them in), so no rank may save it. The ranks run the same plan in lockstep, so all take
        part in the agreement. Pipeline stages cannot agree within a step (see :meth:`save`). A
        background load needs none of this: vLLM learns of its failure before computing over it."""
        transfers = self.transfers
        if transfers is None:
            return
        self._idle = idle  # a step without a forward pass (vLLM only collects transfers)
        transfers.delay(meta.delayed)
        now = [spec for spec in meta.loads if not spec.is_async]
        for spec in meta.loads:
            if spec.is_async:
                transfers.load(spec)
        self._loaded_now = {spec.req_id for spec in now}
        if not now:
            return
        failed = transfers.load_now(now)
        for spec, bad in zip(now, failed, strict=True):
            if bad:
                self._load_errors |= bad
                self._poisoned.setdefault(spec.req_id, set()).update(bad)
        if self.codec.geometry.world_size > 1:
            for spec, any_bad in zip(now, self.agree([bool(f) for f in failed]), strict=True):
                if any_bad:
                    bs = self.block_size
                    self._poisoned.setdefault(spec.req_id, set()).update(
                        set(spec.block_ids[spec.start // bs : spec.end // bs]) - {NULL_BLOCK}  # (a window's)
                    )

    def preempted(self, meta: KvdockMetadata) -> None:
        """Before the forward pass: no save still reads the blocks vLLM took back by preempting."""
        if self.transfers is not None and meta.preempted:
            self.transfers.preempt(meta.preempted)

    # -- the network thread: loads and stores ------------------------------------------------------

    def fetch(self, spec: LoadSpec) -> tuple[set[int], int]:
        """Load one request's planned chunks (network thread): the planned blocks not filled, and
        the bytes loaded."""
        bs = self.block_size
        self.recent_loads.append(spec)
        wanted = set(spec.block_ids[spec.start // bs : spec.end // bs]) - ({NULL_BLOCK} if spec.groups else set())
        nbytes = 0
        try:
            link = self.link
            if (spec.cache_salt, str(self.codec.geometry.global_rank)) in self._faults:
                log.warning("kvdock: %s fails this load of %s", FAULT_FAIL_LOADS_ENV, spec.req_id)
            elif bool(spec.groups) != (self.groups is not None):  # (never one group's block ids for another's)
                log.error("kvdock: a load of %s names other KV cache groups than this worker's", spec.req_id)
            elif link is not None and self._connected() is not None:
                ids = layer_rows(self.group_of, spec.groups, 0, len(spec.block_ids)) if spec.groups else spec.block_ids
                blocks = _Blocks(self, ids, spec.start // bs)
                dims = self.placement.dims
                sink = blocks if dims is None else _Part(blocks, *dims)

                def fetch(ctx: kvd.KVCacheContext) -> int:
                    tips = self._tips(ctx, spec)
                    if tips == []:  # the lookup vouched for no version: nothing to load
                        return 0
                    return kvd.retrieve_into(ctx, spec.tokens, sink, spec.cache_salt, tips=tips)

                # on a GPU the upload runs on a side stream: a background load overlaps the forward
                # pass (its blocks are not the batch's), and is complete before it is reported
                # (also when the load raises midway: the blocks are then reported failed and vLLM
                # recomputes them at once, which an upload still in flight would overwrite)
                with torch.cuda.stream(self._load_stream) if self._load_stream is not None else nullcontext():
                    try:
                        hit = link.run("load", fetch, -1)
                    finally:
                        if isinstance(self.bridge, DeviceBridge):
                            self.bridge.synchronize()
                if hit >= 0:
                    loaded = set(spec.block_ids[spec.start // bs : hit // bs])
                    wanted -= loaded
                    nbytes = len(loaded) * bs * self.bytes_per_token
                    if spec.groups:  # (a window's layers fill only the blocks vLLM keeps)
                        per_layer = self.bytes_per_token // max(1, len(self.group_of))
                        rows = layer_rows(self.group_of, spec.groups, 0, len(spec.block_ids))
                        nbytes = real_blocks(rows, spec.start // bs, hit // bs) * bs * per_layer
        except Exception:  # whatever went wrong, the blocks are recomputed and vLLM runs on
            log.exception("kvdock load of %s failed", spec.req_id)
        if wanted:
            log.warning("kvdock: %d planned block(s) of %s not loaded; vLLM recomputes them", len(wanted), spec.req_id)
        return wanted, nbytes

    def _tips(self, ctx: kvd.KVCacheContext, spec: LoadSpec) -> list[int]:
        """What a rank loads: the versions the scheduler's lookup saw (in the shards ``ctx``
        reads), so every rank of a tensor-parallel engine loads the same KV, and a request's saves
        name what it loaded (SaveSpec.over); [] when the lookup named none (nothing to load)."""
        return _shards_of(ctx, spec.tips) or []

    def store(self, spec: SaveSpec, staged: torch.Tensor) -> int:
        """Store a save's staged KV (its tokens from ``spec.first`` on; network thread); the
        bytes written. PrefixMissingError (nothing written) when kvdock lacks a chunk before
        ``spec.first`` (see :class:`~kvdock.integrations.vllm.sources._Staged`)."""
        link = self.link
        ctx = self._connected() if link is not None else None
        if link is None or ctx is None or not self.placement.writable:
            return 0
        chunk = ctx.chunk_size
        end = len(spec.tokens) // chunk * chunk  # whole chunks of the server's chunk size (it may have changed)
        if not end:
            return 0
        source = _Staged(staged, chunk, spec.first)

        def store(ctx: kvd.KVCacheContext) -> int:
            # chunks another engine is writing right now are its to store: never wait for them
            over = _shards_of(ctx, spec.over)  # (None: it may not extend an edited prefix)
            res = kvd.store_from(ctx, source, spec.tokens[:end], spec.cache_salt, conflict_wait_s=0.0, over=over)
            return res.stored_chunks * chunk * self.bytes_per_token

        return link.run("save", store, 0)

    # -- wait_for_save: the copier thread reads the pages ---------------------------------------

    def save(self, meta: KvdockMetadata) -> None:
        """Queue this step's new whole chunks for saving (copied out of the pages and stored in
        the background) -- except KV computed over a failed load: vLLM learns of a foreground
        load's failure only after this step's forward pass, which attended to whatever the failed
        blocks held, so a request (or a block) with a failed load saves nothing until it ends."""
        if self.transfers is None or self.off:
            return
        bad = set().union(*self._poisoned.values()) if self._poisoned else set()
        staged = self.codec.geometry.pp_size > 1
        for spec in meta.saves:
            if bool(spec.groups) != (self.groups is not None):  # (never one group's block ids for another's)
                log.error("kvdock: not saving %s: its save names other KV cache groups than this worker's", spec.req_id)
                continue
            if staged and spec.req_id in self._loaded_now:
                # a later stage's KV of this step is computed from an earlier stage's hidden states,
                # over a load that may have failed there (stages cannot agree within a step): not
                # saved (a miss, never KV over garbage)
                log.info("kvdock: not saving %s: it loaded in this step of a pipeline-parallel engine", spec.req_id)
                continue
            if spec.req_id in self._poisoned or bad.intersection(spec.block_ids):
                log.info("kvdock: not saving %s: its KV was computed over a failed load", spec.req_id)
                continue
            self.transfers.save(spec)
            self.recent.append(spec)

    def mark(self) -> Any:
        return self.copier.mark()

    def copy_out(self, block_ids: list[int], mark: Any) -> torch.Tensor:
        shape = self.codec.geometry.chunk_shape(len(block_ids) * self.block_size)
        return self.copier.copy_out(block_ids, mark, shape)

    # -- get_finished ---------------------------------------------------------------------------

    def finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """vLLM finished these requests: their blocks (and any failed ones) may be reused. Returns
        the requests whose delayed blocks are no longer read, and the background loads that are
        over (their failed blocks go to :meth:`take_load_errors` in the same step)."""
        for rid in finished_req_ids:
            self._poisoned.pop(rid, None)
        if self.transfers is None:
            return None, None
        self.transfers.forget(finished_req_ids)
        if self._idle:
            self.transfers.wait_loaded(IDLE_WAIT_S)
        sent, recved, errors = self.transfers.finished()
        self._load_errors |= errors
        self._failed_recv |= self.transfers.take_failed()
        return sent or None, recved or None

    def take_failed_recving(self) -> set[str]:  # (KV cache groups: vLLM recomputes them from the start)
        failed, self._failed_recv = self._failed_recv, set()
        return failed

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_stats(self) -> dict[str, float]:
        return self.transfers.take_stats() if self.transfers is not None else {}

    def drain(self, timeout: float) -> bool:
        return self.transfers is None or self.transfers.drain(timeout)

    def shutdown(self) -> None:
        if self.transfers is not None:
            self.transfers.shutdown()
        if self.link is not None:
            self.link.close()


def _shards_of(ctx: kvd.KVCacheContext, versions: tuple[int, ...] | None) -> list[int] | None:
    """The entries of a lookup's per-shard ``versions`` for the shards ``ctx`` reads or writes
    (all of them, or its own one); None when they do not fit it (none given, or another layout)."""
    if not versions:
        return None
    mine = list(versions) if ctx.shards > 1 else list(versions[ctx.shard : ctx.shard + 1])
    return mine if len(mine) == ctx.shards else None

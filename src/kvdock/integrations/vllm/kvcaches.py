"""What vLLM chose for its KV caches, read once at ``register_kv_caches``: the attention backend,
the resolved ``kv_cache_layout``, the CPU kernel's ISA and this rank's geometry; from them the
codec for exactly that combination (UnsupportedLayoutError at engine start for anything no codec
knows) and the :class:`~kvdock.protocol.messages.ModelLayout` the worker registers with kvdock."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvdock.codecs import CodecKey, PagedCodec, codec_for
from kvdock.codecs.vllm import LAYOUT_ALIASES
from kvdock.errors import UnsupportedLayoutError
from kvdock.integrations.vllm.geometry import _geometry
from kvdock.protocol.messages import EngineInfo, ModelLayout

__all__ = ["KVCaches", "read_kv_caches"]


@dataclass(frozen=True)
class KVCaches:
    """One worker's KV caches as kvdock sees them."""

    names: list[str]  # the layers' names, in layer order
    key: CodecKey  # the codec's: engine, backend, layout, ISA
    codec: PagedCodec
    layout: ModelLayout  # what the worker registers
    bytes_per_token: int  # of this rank's KV, every layer


def read_kv_caches(
    vllm_config: Any, kv_caches: dict[str, torch.Tensor], block_size: int, model_name: str, fingerprint: str
) -> KVCaches:
    """The codec and layout of this worker's ``kv_caches`` (vLLM's, by layer name)."""
    from vllm import __version__ as vllm_version
    from vllm.distributed.parallel_state import get_pp_group, get_tp_group
    from vllm.model_executor.models.utils import extract_layer_index

    names = sorted(kv_caches, key=extract_layer_index)
    tensors = [kv_caches[n] for n in names]
    layers = vllm_config.compilation_config.static_forward_context
    backends = {layers[n].attn_backend.get_name() for n in names}
    isas = {str(getattr(layers[n], "isa", "") or "") for n in names}
    if len(backends) != 1 or len(isas) != 1:
        raise UnsupportedLayoutError(f"kvdock: layers use several attention backends/kernels {backends} {isas}")
    backend, isa = backends.pop(), isas.pop()
    layout = str(vllm_config.cache_config.kv_cache_layout or "")
    layout = LAYOUT_ALIASES.get(layout, layout)
    first = tensors[0]
    tp, pp = get_tp_group(), get_pp_group()
    geometry = _geometry(vllm_config, backend, first, len(tensors), tp, pp)
    key = CodecKey("vllm", backend, layout, isa if backend == "CPU_ATTN" else "")
    codec = codec_for(key, tensors, geometry, block_size)
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
    g = geometry
    return KVCaches(
        names=names,
        key=key,
        codec=codec,
        layout=ModelLayout(model_name, geometry, block_size, engine, fingerprint),
        bytes_per_token=g.planes * g.num_layers * g.hidden_dim * first.element_size(),
    )

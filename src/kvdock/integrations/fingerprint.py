"""Model fingerprints: what tells two models of the same KV shapes apart.

The registry binds a model name to a geometry; a *fingerprint* (``ModelLayout.fingerprint``) binds
it to the model whose KV it is, so that an engine serving other weights (another seed, a fine-tune)
or another configuration of the same weights (RoPE settings, an ``hf_overrides``) under the name
is refused instead of loading the first one's KV. A fingerprint is ``"<engine>-v1:<32 hex>"``: a
blake3 hash of a canonical JSON of

* the config fields that change KV (:data:`KV_CONFIG_FIELDS`: architecture, attention and head
  dims, RoPE settings, sliding windows, norms, quantization), the dtype, and what the engine adds
  (vLLM: ``hf_overrides``, the KV cache dtype, the quantization method, the revision);
* the weights' identity: a sample of every parameter tensor (transformers: its name, dtype, shape,
  first and last :data:`SAMPLE_BYTES` bytes) or of every checkpoint file (vLLM: its name and size,
  a safetensors file's header, and :data:`FILE_BLOCKS` evenly spaced blocks of
  :data:`BLOCK_BYTES`), so that weights of another seed differ.

Engines of different kinds give different fingerprints for one checkpoint (their recipes differ):
give each engine kind a name of its own, or pass one ``fingerprint=`` yourself through the SDK. A
sample is not a full hash: two checkpoints that differ only outside every sampled byte (and in no
file size or header) would share a fingerprint.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from blake3 import blake3

VERSION = "v1"
SAMPLE_BYTES = 4096  # of each parameter tensor's start and end
FILE_BLOCKS = 16  # evenly spaced blocks sampled from each checkpoint file
BLOCK_BYTES = 64 << 10
MAX_HEADER_BYTES = 16 << 20  # of a safetensors header hashed (the rest is counted by its length)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz", ".msgpack", ".h5")

# config fields whose value changes the KV a model computes (absent ones are skipped)
KV_CONFIG_FIELDS = (
    "architectures",
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "kv_lora_rank",
    "q_lora_rank",
    "qk_rope_head_dim",
    "qk_nope_head_dim",
    "v_head_dim",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "partial_rotary_factor",
    "rotary_dim",
    "max_position_embeddings",
    "sliding_window",
    "layer_types",
    "use_sliding_window",
    "max_window_layers",
    "attention_chunk_size",
    "attention_bias",
    "query_pre_attn_scalar",
    "attn_logit_softcapping",
    "hidden_act",
    "rms_norm_eps",
    "layer_norm_eps",
    "quantization_config",
)


def fingerprint(engine: str, parts: Mapping[str, Any]) -> str:
    """``"<engine>-v1:<32 hex>"`` of ``parts`` (JSON-able, canonicalized: sorted keys, objects
    with ``to_dict`` by it, callables by their qualified name, anything else by ``str``)."""
    text = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=_plain)
    return f"{engine}-{VERSION}:{blake3(text.encode()).hexdigest()[:32]}"


def _plain(obj: object) -> object:
    to_dict = getattr(obj, "to_dict", None)
    if callable(to_dict):
        return to_dict()
    if callable(obj):
        return f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', type(obj).__name__)}"
    if isinstance(obj, (set, frozenset)):
        return sorted(map(str, obj))
    return str(obj)


def config_fields(cfg: Any) -> dict[str, Any]:
    """The :data:`KV_CONFIG_FIELDS` a (transformers) config sets, its text config's for a
    multimodal one."""
    text = cfg.get_text_config() if callable(getattr(cfg, "get_text_config", None)) else cfg
    out: dict[str, Any] = {}
    for source in (cfg, text) if text is not cfg else (cfg,):
        for name in KV_CONFIG_FIELDS:
            value = getattr(source, name, None)
            if value is not None:
                out[name] = value
    return out


def tensors_digest(named: Iterable[tuple[str, Any]]) -> str:
    """A hash of a sample of every ``(name, tensor)``: its name, dtype, shape and first and last
    SAMPLE_BYTES bytes (one copy off each device; meta tensors by their shape alone)."""
    import torch

    h = blake3(b"kvdock/tensors/v1")
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for name, tensor in sorted(named, key=lambda item: item[0]):
        t = tensor.detach()
        h.update(f"{name}|{t.dtype}|{list(t.shape)}\n".encode())
        if t.is_meta or t.numel() == 0:
            continue
        flat = t.reshape(-1)
        k = max(1, SAMPLE_BYTES // t.element_size())
        for part in (flat[:k], flat[-k:]) if flat.numel() > k else (flat,):
            by_device.setdefault(t.device, []).append(part.contiguous().view(torch.uint8).reshape(-1))
    for device in sorted(by_device, key=str):
        h.update(torch.cat(by_device[device]).cpu().numpy().tobytes())
    return str(h.hexdigest()[:32])


def files_digest(root: Path) -> str:
    """A hash of a checkpoint's weight files (a directory, or one file): each file's path below
    ``root``, size, safetensors header (when it is one) and FILE_BLOCKS evenly spaced blocks of
    BLOCK_BYTES. OSError if ``root`` cannot be read."""
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.suffix in WEIGHT_SUFFIXES)
    h = blake3(b"kvdock/files/v1")
    for path in files:
        size = path.stat().st_size
        name = path.name if path == root else path.relative_to(root).as_posix()
        h.update(f"{name}|{size}\n".encode())
        with open(path, "rb") as f:
            if path.suffix == ".safetensors" and size >= 8:
                n = int.from_bytes(f.read(8), "little")
                h.update(n.to_bytes(8, "little"))
                h.update(f.read(min(n, MAX_HEADER_BYTES)))
            step = max(size // FILE_BLOCKS, 1)
            for i in range(min(FILE_BLOCKS, size)):
                h.update(os.pread(f.fileno(), BLOCK_BYTES, i * step))
    return str(h.hexdigest()[:32])


__all__ = ["KV_CONFIG_FIELDS", "config_fields", "files_digest", "fingerprint", "tensors_digest"]

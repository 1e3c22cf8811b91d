"""The fingerprint of the model a vLLM engine serves (:mod:`kvdock.integrations.fingerprint`).

It covers what changes the KV of a prompt beyond its shapes: the architecture and the config fields
that enter attention (after ``hf_overrides``: RoPE settings, windows, norms, quantization), the
``hf_overrides`` themselves, the dtype, the KV cache dtype, the quantization method, the revision,
and the checkpoint's identity -- for a local directory (or a model already in the Hugging Face
cache) a hash of each weight file's name and size, its safetensors header and 16 evenly spaced
64 KiB blocks, so that weights of another seed of the same shapes give another fingerprint; for a
model vLLM loads from elsewhere, its name and revision.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from kvdock.integrations import fingerprint as fp

log = logging.getLogger("kvdock.vllm")


def checkpoint_dir(model: str, revision: str | None) -> Path | None:
    """Where ``model``'s files are on this host: the directory (or file) itself, or its snapshot
    in the Hugging Face cache; None when neither is found."""
    path = Path(model)
    if path.exists():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, revision=revision, local_files_only=True))
    except Exception:  # not a hub id, or not downloaded (vLLM may load it otherwise)
        return None


def model_fingerprint(vllm_config: Any) -> str:
    """The fingerprint of the model ``vllm_config`` serves (read from its files: call it once)."""
    mc = vllm_config.model_config
    model, revision = str(mc.model), getattr(mc, "revision", None)
    where = checkpoint_dir(model, revision)
    weights: str
    if where is not None:
        try:
            weights = fp.files_digest(where)
        except OSError as e:  # unreadable: fall back on the name, and say so
            log.warning("kvdock: cannot read %s to fingerprint its weights (%s); using its name", where, e)
            weights = f"name:{model}@{revision or ''}"
    else:
        weights = f"name:{model}@{revision or ''}"
    parts = {
        "config": fp.config_fields(mc.hf_config),
        "hf_overrides": getattr(mc, "hf_overrides", None) or {},
        "dtype": str(mc.dtype).removeprefix("torch."),
        "kv_cache_dtype": str(getattr(vllm_config.cache_config, "cache_dtype", "auto")),
        "quantization": getattr(mc, "quantization", None),
        "revision": revision,
        "weights": weights,
    }
    return fp.fingerprint("vllm", parts)


__all__ = ["checkpoint_dir", "model_fingerprint"]

"""The fingerprint of the model an SGLang engine serves (:mod:`kvdock.integrations.fingerprint`).

SGLang hands a storage backend no model identity beyond ``HiCacheStorageConfig.model_name`` (the
served name, tagged with the host pool's page format). The scheduler process that builds the
backend has SGLang's server arguments, though (``sglang.srt.runtime_context.get_server_args()``,
published before the cache controller starts): :func:`model_fingerprint` hashes what they say
changes the KV of a prompt, like the vLLM connector does: the checkpoint's config fields that enter
attention (``config.json`` with ``--json-model-override-args`` over it), those overrides, the
dtype, the KV cache dtype, the quantization, the revision, and the weight files' identity (each
file's name, size, safetensors header and evenly spaced blocks) -- for a model directory on this
host, or in the Hugging Face cache; otherwise its name and revision. "" (asserts nothing) when
SGLang published no server arguments (a backend built outside an engine).

An SGLang fingerprint never equals a vLLM or transformers one for the same checkpoint (their
recipes differ): kvdock refuses to serve one name to both unless it was registered without one.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from kvdock.integrations import fingerprint as fp

log = logging.getLogger("kvdock.sglang")


def checkpoint_dir(model: str, revision: str | None) -> Path | None:
    """Where ``model``'s files are on this host (the path itself, or its Hugging Face cache
    snapshot); None when neither is found."""
    path = Path(model)
    if path.exists():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, revision=revision, local_files_only=True))
    except Exception:  # not a hub id, or not downloaded
        return None


def model_fingerprint() -> str:
    """The fingerprint of the model this SGLang process serves, or "" (module docs). Never raises."""
    try:
        from sglang.srt.runtime_context import get_server_args

        args = get_server_args()
    except Exception:  # not inside an engine, or an SGLang without it
        return ""
    try:
        return fingerprint_of(args)
    except Exception as e:
        log.warning("kvdock: cannot fingerprint SGLang's model (%s: %s); none registered", type(e).__name__, e)
        return ""


def fingerprint_of(args: Any) -> str:
    """The fingerprint of the model SGLang server arguments ``args`` name ("" for none)."""
    model = str(getattr(args, "model_path", "") or "")
    if not model:
        return ""
    revision = getattr(args, "revision", None)
    overrides = getattr(args, "json_model_override_args", None) or {}
    if isinstance(overrides, str):
        overrides = json.loads(overrides or "{}")
    where = checkpoint_dir(model, revision)
    config: dict[str, Any] = {}
    weights = f"name:{model}@{revision or ''}"
    if where is not None:
        cfg_file = where / "config.json" if where.is_dir() else None
        if cfg_file is not None and cfg_file.is_file():
            config = json.loads(cfg_file.read_text())
        try:
            weights = fp.files_digest(where)
        except OSError as e:  # unreadable: fall back on the name, and say so
            log.warning("kvdock: cannot read %s to fingerprint its weights (%s); using its name", where, e)
    config.update(overrides)
    parts = {
        "config": fp.config_fields(SimpleNamespace(**config)),
        "overrides": overrides,
        "dtype": str(getattr(args, "dtype", "auto")).removeprefix("torch."),
        "kv_cache_dtype": str(getattr(args, "kv_cache_dtype", "auto")),
        "quantization": getattr(args, "quantization", None),
        "revision": revision,
        "weights": weights,
    }
    return fp.fingerprint("sglang", parts)


__all__ = ["checkpoint_dir", "fingerprint_of", "model_fingerprint"]

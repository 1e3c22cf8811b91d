"""Re-rotating RoPE'd keys from the positions they were computed at to other positions.

HF Llama-family models (Llama, Qwen2, Qwen3, Mistral, ...) store keys *after* rotary position
embedding: a key computed at position ``p`` is ``a * R(p * f) k`` where ``k`` is the unrotated key,
``f`` the model's inverse frequencies (``inv_freq``, which already include its RoPE scaling:
linear, llama3, yarn, ...), ``a`` its attention scaling (yarn/longrope) and ``R`` the
``rotate_half`` rotation (pairs ``(x_i, x_{i + d/2})``). Rotations compose, so the key that the
same model would have computed at position ``q`` is ``R(q * f - p * f)`` applied to the stored one.
That makes moving cached KV to new positions (dropping tokens, splicing) exact for the keys:

    keys_q = rerotate_keys(keys_p, p, q, model)          # [..., T, head_dim]
    kv_q = rerotate_kv(kv_p, p, q, model)                 # KV_2LTD [2, L, T, kv_heads * head_dim]

    old, new = positions_after_drop(kv.shape[2], 256, 1024)   # drop tokens [256, 1024)
    compact = rerotate_kv(kv[:, :, old], old, new, model.config)  # store under the kept tokens

``model_or_config`` is a transformers model or its config (an SDK process needs only the config).

Values carry no position and are never changed. (Exact is per layer: a layer's *unrotated* keys
depend on the hidden states of the layers below, which saw the old context. Only layer 0's keys
are a function of token and position alone.)

Where the rotary parameters come from, in order:

* a model: its rotary module's ``inv_freq`` buffer and ``attention_scaling`` -- what its forward
  pass really multiplies with (a model cast with ``.to(bfloat16)`` has a bfloat16 ``inv_freq``,
  and its keys were rotated with those rounded frequencies);
* a config (or a model whose rotary module cannot be found, a per-layer-type config, or a
  dynamic/longrope model):
  ``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS[rope_type]`` -- the function the model's
  rotary module calls at init -- or, for ``rope_type == "default"``, the standard
  ``theta ** (-2i / dim)`` with ``partial_rotary_factor``.

``dynamic`` (NTK) and ``longrope`` frequencies depend on the sequence length the keys were
computed with; they are computed for ``from_seq_len`` (default ``max(from_positions) + 1``, i.e.
one prefill of the sequence) and ``to_seq_len`` (default ``max(to_positions) + 1``). HF's dynamic
rotary module keeps state across calls, so keys computed after a *longer* earlier sequence differ;
pass ``from_seq_len`` then. (A longrope model cast with ``.to(bfloat16)`` uses its rounded buffer
for the short factors; re-rotation uses float32 frequencies, so expect bfloat16-sized differences
there.) Angles are computed in float32 exactly as HF does
(``position.float() * inv_freq``), their difference in float64, and the rotation in float32; the
result is cast back to the keys' dtype.

Refused with ValueError (never silently wrong): models with interleaved ("rotate every two") RoPE
(GPT-J, Cohere, GLM), models with layers that use no RoPE (``no_rope_layers``), unknown RoPE types,
and :func:`rerotate_keys` without a ``layer_type`` on a per-layer-type config (:func:`rerotate_kv`
picks each layer's type from ``config.layer_types``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["RotaryParams", "head_dim_of", "positions_after_drop", "rerotate_keys", "rerotate_kv", "rotary_params"]

# model_type values whose RoPE pairs adjacent dims (x_2i, x_2i+1) instead of rotate_half, or that
# rotate only some dims in another pattern: re-rotating them with rotate_half would be wrong.
_INTERLEAVED_MODEL_TYPES = frozenset({"gptj", "codegen", "cohere", "cohere2", "glm", "glm4", "chatglm"})
# RoPE types whose frequencies depend on the current sequence length.
_LENGTH_DEPENDENT = frozenset({"dynamic", "longrope"})


@dataclass(frozen=True)
class RotaryParams:
    """One layer's rotary parameters: ``inv_freq`` (float32, ``rotary_dim // 2`` entries),
    ``attention_scaling`` (cos/sin multiplier) and the ``rope_type`` they came from."""

    inv_freq: torch.Tensor
    attention_scaling: float
    rope_type: str

    @property
    def rotary_dim(self) -> int:
        """Leading dims of head_dim that are rotated (the rest pass through)."""
        return 2 * int(self.inv_freq.numel())


def _config_of(model_or_config: Any) -> Any:
    config = getattr(model_or_config, "config", model_or_config)
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    for attr in ("num_attention_heads", "hidden_size"):
        if not hasattr(config, attr):
            raise ValueError(f"{type(config).__name__} is not a transformers decoder config (no {attr})")
    return config


def _check_supported(config: Any) -> None:
    model_type = getattr(config, "model_type", "")
    if model_type in _INTERLEAVED_MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} uses interleaved RoPE; only rotate_half RoPE can be re-rotated")
    if getattr(config, "no_rope_layers", None) is not None or getattr(config, "nope_layer_interval", None):
        raise ValueError(
            f"model_type {model_type!r} has layers without RoPE (no_rope_layers); re-rotating their keys would be wrong"
        )


def head_dim_of(model_or_config: Any) -> int:
    """The attention head size: ``config.head_dim`` or ``hidden_size // num_attention_heads``."""
    config = _config_of(model_or_config)
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def _rope_parameters(config: Any, layer_type: str | None) -> dict[str, Any]:
    """The config's RoPE dict (transformers 5 ``rope_parameters``; 4.x ``rope_scaling`` + ``rope_theta``)."""
    params = getattr(config, "rope_parameters", None)
    if params is None:  # transformers 4.x
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    nested = config.nested_rope_parameter_keys(params) if hasattr(config, "nested_rope_parameter_keys") else []
    if nested:
        if layer_type is None:
            raise ValueError(f"{type(config).__name__} has RoPE parameters per layer type {nested}; pass layer_type")
        if layer_type not in nested:
            raise ValueError(f"layer_type {layer_type!r} has no RoPE parameters; known: {nested}")
        params = params[layer_type]
    if not params or "rope_theta" not in params:
        raise ValueError(f"{type(config).__name__} defines no RoPE parameters (rope_theta)")
    params = dict(params)
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def _find_rotary_module(model: torch.nn.Module) -> torch.nn.Module | None:
    found = [m for m in model.modules() if isinstance(getattr(m, "inv_freq", None), torch.Tensor)]
    return found[0] if len(found) == 1 else None


def rotary_params(model_or_config: Any, layer_type: str | None = None, seq_len: int | None = None) -> RotaryParams:
    """The rotary parameters the model uses (see the module docstring for the sources).

    ``layer_type`` picks an entry of per-layer-type RoPE parameters (``config.layer_types``);
    ``seq_len`` matters only for length-dependent types (dynamic, longrope). Raises ValueError
    for unsupported models or RoPE types."""
    config = _config_of(model_or_config)
    _check_supported(config)
    params = _rope_parameters(config, layer_type)
    rope_type = str(params["rope_type"])
    nested = _rope_is_nested(config)
    if isinstance(model_or_config, torch.nn.Module) and not nested and rope_type not in _LENGTH_DEPENDENT:
        module = _find_rotary_module(model_or_config)
        if module is not None and getattr(module, "rope_type", rope_type) == rope_type:
            inv = getattr(module, "inv_freq")  # noqa: B009 -- typed as Tensor by _find_rotary_module
            scaling = float(getattr(module, "attention_scaling", 1.0))
            return RotaryParams(inv.detach().to("cpu", torch.float32), scaling, rope_type)
    if rope_type == "default":
        dim = int(head_dim_of(config) * float(params.get("partial_rotary_factor", 1.0)))
        inv = 1.0 / (float(params["rope_theta"]) ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        return RotaryParams(inv, 1.0, rope_type)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    fn = ROPE_INIT_FUNCTIONS.get(rope_type)
    if fn is None:
        raise ValueError(f"unsupported RoPE type {rope_type!r}; supported: default, {', '.join(ROPE_INIT_FUNCTIONS)}")
    kwargs: dict[str, Any] = {"seq_len": seq_len}
    if layer_type is not None and nested:
        kwargs["layer_type"] = layer_type
    inv, scaling = fn(config, torch.device("cpu"), **kwargs)
    return RotaryParams(inv.detach().to(torch.float32), float(scaling), rope_type)


def _rope_is_nested(config: Any) -> bool:
    params = getattr(config, "rope_parameters", None) or {}
    return bool(hasattr(config, "nested_rope_parameter_keys") and config.nested_rope_parameter_keys(params))


def _positions(pos: torch.Tensor | Sequence[int], name: str) -> torch.Tensor:
    t = torch.as_tensor(pos)
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise ValueError(f"{name} must hold integer positions, got dtype {t.dtype}")
    if t.numel() and int(t.min()) < 0:
        raise ValueError(f"{name} must be >= 0")
    return t.to("cpu", torch.int64)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rerotate_keys(
    keys: torch.Tensor,
    from_positions: torch.Tensor | Sequence[int],
    to_positions: torch.Tensor | Sequence[int],
    model_or_config: Any,
    *,
    layer_type: str | None = None,
    from_seq_len: int | None = None,
    to_seq_len: int | None = None,
) -> torch.Tensor:
    """Keys ``[..., T, head_dim]`` computed at ``from_positions`` → the same keys at ``to_positions``.

    Positions are integer tensors/sequences broadcastable to ``keys.shape[:-1]`` (usually ``[T]``).
    Returns a new tensor of the keys' dtype and device; ``keys`` is not modified. Only the first
    ``rotary_dim`` dims are rotated (partial RoPE). ``from_seq_len``/``to_seq_len`` matter only for
    dynamic/longrope (see the module docstring). Raises ValueError on mismatched shapes or
    unsupported models."""
    head_dim = head_dim_of(model_or_config)
    if keys.dim() < 2 or keys.shape[-1] != head_dim:
        raise ValueError(f"keys must be [..., seq, head_dim={head_dim}], got {list(keys.shape)}")
    p = _positions(from_positions, "from_positions")
    q = _positions(to_positions, "to_positions")
    lead = keys.shape[:-1]
    try:
        p, q = torch.broadcast_to(p, lead), torch.broadcast_to(q, lead)
    except RuntimeError:
        raise ValueError(
            f"positions {list(p.shape)} / {list(q.shape)} do not broadcast to the keys' {list(lead)}"
        ) from None
    src = rotary_params(model_or_config, layer_type, from_seq_len or (int(p.max()) + 1 if p.numel() else None))
    dst = rotary_params(model_or_config, layer_type, to_seq_len or (int(q.max()) + 1 if q.numel() else None))
    if src.rotary_dim != dst.rotary_dim or src.rotary_dim > head_dim or src.rotary_dim % 2:
        raise ValueError(f"rotary dims {src.rotary_dim}/{dst.rotary_dim} do not fit head_dim {head_dim}")
    # float32 angles exactly as HF computes them, their difference in float64 (no cancellation loss)
    theta_p = p[..., None].float() * src.inv_freq
    theta_q = q[..., None].float() * dst.inv_freq
    delta = theta_q.double() - theta_p.double()
    scale = dst.attention_scaling / src.attention_scaling
    cos = (torch.cat((delta, delta), dim=-1).cos() * scale).float()
    sin = (torch.cat((delta, delta), dim=-1).sin() * scale).float()
    device = keys.device
    k = keys.detach().to(device=device, dtype=torch.float32)
    rd = src.rotary_dim
    rot, rest = k[..., :rd], k[..., rd:]
    out = rot * cos.to(device) + _rotate_half(rot) * sin.to(device)
    if rest.shape[-1]:
        out = torch.cat((out, rest), dim=-1)
    return out.to(keys.dtype)


def rerotate_kv(
    kv: torch.Tensor,
    from_positions: torch.Tensor | Sequence[int],
    to_positions: torch.Tensor | Sequence[int],
    model_or_config: Any,
    *,
    from_seq_len: int | None = None,
    to_seq_len: int | None = None,
) -> torch.Tensor:
    """The SDK's ``KV_2LTD`` tensor ``[2, L, T, kv_heads * head_dim]`` with its keys (index 0)
    moved from ``from_positions`` to ``to_positions`` (each ``[T]``); values are copied unchanged.

    Returns a new contiguous tensor of ``kv``'s dtype. Per-layer-type RoPE
    (``config.layer_types`` with nested ``rope_parameters``) is applied layer by layer.
    Raises ValueError when ``D`` is not a multiple of the model's head_dim, when ``L`` differs
    from ``config.num_hidden_layers``, or for unsupported models."""
    config = _config_of(model_or_config)
    head_dim = head_dim_of(config)
    if kv.dim() != 4 or kv.shape[0] != 2 or kv.shape[3] % head_dim:
        raise ValueError(f"kv must be KV_2LTD [2, L, T, kv_heads * {head_dim}], got {list(kv.shape)}")
    num_layers, num_tokens = kv.shape[1], kv.shape[2]
    expected_layers = getattr(config, "num_hidden_layers", num_layers)
    if num_layers != expected_layers:
        raise ValueError(f"kv has {num_layers} layers, the model {expected_layers}")
    for name, pos in (("from_positions", from_positions), ("to_positions", to_positions)):
        if _positions(pos, name).shape != (num_tokens,):
            raise ValueError(f"{name} must have shape [{num_tokens}], got {list(torch.as_tensor(pos).shape)}")
    heads = kv.shape[3] // head_dim
    out = kv.clone(memory_format=torch.contiguous_format)
    # [L, T, H, hd] -> [L, H, T, hd]: seq is the second-to-last axis, as rerotate_keys wants
    keys = kv[0].reshape(num_layers, num_tokens, heads, head_dim).transpose(1, 2)
    kw: dict[str, Any] = {"from_seq_len": from_seq_len, "to_seq_len": to_seq_len}
    if _rope_is_nested(config):
        layer_types = list(getattr(config, "layer_types", None) or [])
        if len(layer_types) != num_layers:
            raise ValueError(f"config.layer_types has {len(layer_types)} entries for {num_layers} layers")
        rotated = torch.stack(
            [
                rerotate_keys(keys[i], from_positions, to_positions, model_or_config, layer_type=lt, **kw)
                for i, lt in enumerate(layer_types)
            ]
        )
    else:
        rotated = rerotate_keys(keys, from_positions, to_positions, model_or_config, **kw)
    out[0].copy_(rotated.transpose(1, 2).reshape(num_layers, num_tokens, heads * head_dim))
    return out


def positions_after_drop(num_tokens: int, drop_start: int, drop_end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For dropping tokens ``[drop_start, drop_end)`` of ``num_tokens``: (old positions of the kept
    tokens, their new contiguous positions ``0 .. kept - 1``)."""
    if not 0 <= drop_start <= drop_end <= num_tokens:
        raise ValueError(f"drop span [{drop_start}, {drop_end}) is not inside [0, {num_tokens})")
    old = torch.cat((torch.arange(0, drop_start), torch.arange(drop_end, num_tokens)))
    return old, torch.arange(old.numel())

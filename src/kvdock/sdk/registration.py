"""Registering a model's KV layout with a server, without an engine."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvdock import layout
from kvdock.config import MAX_HEAD_DIM, MAX_NAME_LEN, MAX_NUM_KV_HEADS, MAX_NUM_LAYERS, MAX_WORLD_SIZE
from kvdock.errors import InvalidInputError
from kvdock.protocol import messages as m
from kvdock.sdk.context import Connection, dtype_name
from kvdock.sdk.http import get_json


@dataclass(frozen=True)
class ModelRegistration:
    """``created`` is False when the same geometry was already registered."""

    model_name: str
    created: bool
    chunk_nbytes: int


def register_layout(
    url: str, http_url: str, lay: m.ModelLayout, timeout: float = 60.0, admin_token: str = ""
) -> ModelRegistration:
    """Register ``lay`` (what engines call). ``admin_token`` is required when the server has one
    (its ``--admin-token``). Raises ServerUnavailableError; PermissionDeniedError without the right
    token; InvalidInputError when the server already holds ``max_models`` models; ServerError with
    code ``registration`` when the server refuses the layout (e.g. same name, different geometry,
    or a chunk larger than its pool)."""
    if not isinstance(admin_token, str):
        raise InvalidInputError(f"admin_token must be a str, got {type(admin_token).__name__}")
    get_json(http_url, "/config", timeout)  # fail fast, naming the URL, if the server is down
    conn = Connection(url, timeout)
    try:
        reply = conn.call(m.RegisterModel(m.PROTOCOL_VERSION, lay, admin_token)).reply
    finally:
        conn.close()
    return ModelRegistration(lay.model_name, reply.created, reply.slot_nbytes)


def make_layout(
    model_name: str,
    *,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype | str,
    tokens_per_block: int = 16,
    kv_format: str = "NHD",
    world_size: int = 1,
    engine: m.EngineInfo | None = None,
) -> m.ModelLayout:
    """Build a ModelLayout from explicit geometry; InvalidInputError for impossible values (the
    bounds are those of the server: at most 4096 layers and KV heads, head_dim 16384, world_size
    1024, names of 200 characters)."""
    if not isinstance(model_name, str) or not model_name:
        raise InvalidInputError(f"model_name must be a non-empty str, got {model_name!r}")
    if len(model_name) > MAX_NAME_LEN:
        raise InvalidInputError(f"model_name has {len(model_name)} characters, more than {MAX_NAME_LEN}")
    for name, v, most in (
        ("num_layers", num_layers, MAX_NUM_LAYERS),
        ("num_kv_heads", num_kv_heads, MAX_NUM_KV_HEADS),
        ("head_dim", head_dim, MAX_HEAD_DIM),
        ("tokens_per_block", tokens_per_block, None),
        ("world_size", world_size, MAX_WORLD_SIZE),
    ):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise InvalidInputError(f"{name} must be a positive integer, got {v!r}")
        if most is not None and v > most:
            raise InvalidInputError(f"{name} must be between 1 and {most}, got {v}")
    for field in ("name", "version", "attention_backend"):
        value = getattr(engine, field, "")
        if len(value) > MAX_NAME_LEN:
            raise InvalidInputError(f"engine.{field} has {len(value)} characters, more than {MAX_NAME_LEN}")
    try:
        shape = layout.concrete_shape(kv_format, 1, tokens_per_block, num_kv_heads, head_dim)
    except ValueError as e:
        raise InvalidInputError(str(e)) from None
    return m.ModelLayout(
        model_name=model_name,
        world_size=world_size,
        num_layers=num_layers,
        dtype=dtype_name(dtype),
        tokens_per_block=tokens_per_block,
        engine_kv_format=kv_format,
        engine_kv_concrete_shape=shape,
        engine=engine or m.EngineInfo(),
    )


def register_model(
    url: str,
    http_url: str,
    model_name: str,
    *,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype | str,
    tokens_per_block: int = 16,
    kv_format: str = "NHD",
    world_size: int = 1,
    timeout: float = 60.0,
    admin_token: str = "",
) -> ModelRegistration:
    """Register ``model_name`` with explicit geometry so the SDK works with no engine running.

    Registering the same geometry again is harmless (``created=False``); a different geometry
    raises ServerError (code ``registration``). ``admin_token``: see register_layout."""
    lay = make_layout(
        model_name,
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        tokens_per_block=tokens_per_block,
        kv_format=kv_format,
        world_size=world_size,
    )
    return register_layout(url, http_url, lay, timeout, admin_token)


__all__ = ["ModelRegistration", "make_layout", "register_layout", "register_model"]

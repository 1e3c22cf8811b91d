"""Registering a model's KV layout with a server, without an engine."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvdock import layout
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


def register_layout(url: str, http_url: str, lay: m.ModelLayout, timeout: float = 60.0) -> ModelRegistration:
    """Register ``lay`` (what engines call). Raises ServerUnavailableError, or ServerError with code
    ``registration`` when the server refuses it (e.g. same name, different geometry)."""
    get_json(http_url, "/config", timeout)  # fail fast, naming the URL, if the server is down
    conn = Connection(url, timeout)
    try:
        reply = conn.call(m.RegisterModel(m.PROTOCOL_VERSION, lay)).reply
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
    """Build a ModelLayout from explicit geometry; InvalidInputError for impossible values."""
    for name, v in (
        ("num_layers", num_layers),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
        ("tokens_per_block", tokens_per_block),
        ("world_size", world_size),
    ):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise InvalidInputError(f"{name} must be a positive integer, got {v!r}")
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
) -> ModelRegistration:
    """Register ``model_name`` with explicit geometry so the SDK works with no engine running.

    Registering the same geometry again is harmless (``created=False``); a different geometry
    raises ServerError (code ``registration``)."""
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
    return register_layout(url, http_url, lay, timeout)


__all__ = ["ModelRegistration", "make_layout", "register_layout", "register_model"]

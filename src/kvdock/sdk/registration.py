"""Registering a model's KV layout with a server, without an engine."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import torch

from kvdock import layout
from kvdock.config import MAX_NAME_LEN
from kvdock.errors import InvalidInputError
from kvdock.protocol import messages as m
from kvdock.sdk import _http
from kvdock.sdk import _validate as validate
from kvdock.sdk._connection import KeyPath, open_connection
from kvdock.sdk._handshake import dtype_name


@dataclass(frozen=True)
class ModelRegistration:
    """``created`` is False when the same geometry was already registered."""

    model_name: str
    created: bool
    chunk_nbytes: int


def register_layout(
    url: str,
    http_url: str | None,
    lay: m.ModelLayout,
    timeout: float = 60.0,
    admin_token: str = "",
    *,
    server_key: KeyPath = None,
    client_key: KeyPath = None,
    token: str | None = None,
) -> ModelRegistration:
    """Register ``lay`` (what engines call). ``admin_token`` is required when the server has one
    (its ``--admin-token``). Raises ServerUnavailableError; PermissionDeniedError without the right
    token; InvalidInputError when the server already holds ``max_models`` models; ServerError with
    code ``registration`` when the server refuses the layout (e.g. same name, different geometry,
    or a chunk larger than its pool). ``server_key`` / ``client_key`` (CURVE) and ``token`` (a
    tenant's, which may register the models it may use): as in :func:`kvdock.sdk.connect`, and
    ``http_url`` too (None, or checked to be a kvdock server's HTTP API); nothing listening at
    ``url`` fails at once."""
    if not isinstance(admin_token, str):
        raise InvalidInputError(f"admin_token must be a str, got {type(admin_token).__name__}")
    tok = validate.token(token)
    http = validate.http_url(http_url)
    conn = open_connection(url, timeout, server_key, client_key)
    try:
        if http is not None:
            _http.check(http, None, conn.timeout, tok)
        reply = conn.ask(m.RegisterModel(m.PROTOCOL_VERSION, lay, admin_token, tok))
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
    rank: int = 0,
    total_kv_heads: int = 0,
    kv_kind: str = layout.KV_PAIR,
    pp_size: int = 1,
    pp_rank: int = 0,
    fingerprint: str = "",
) -> m.ModelLayout:
    """Build a ModelLayout (geometry of rank ``rank`` of ``world_size``, each holding
    ``num_kv_heads`` of the model's ``total_kv_heads``: see :class:`~kvdock.layout.KVGeometry`)
    from explicit geometry; InvalidInputError for impossible values (the bounds are those of the
    server: at most 4096 layers and KV heads, head_dim 16384, world_size 1024, names of 200
    characters). ``kv_kind="latent"``: an MLA model (``num_kv_heads`` 1, ``head_dim`` the latent's
    ``kv_lora_rank + qk_rope_head_dim``). ``pp_size`` pipeline stages of ``num_layers`` layers each
    (this is stage ``pp_rank``'s). ``fingerprint``: what identifies the model beyond its shapes
    (:attr:`~kvdock.protocol.messages.ModelLayout.fingerprint`; "" asserts nothing).
    ``kv_format`` becomes ``engine.kv_cache_layout`` and ``engine.view_shape`` the format's
    one-block shape (``engine``'s other fields are kept)."""
    if not isinstance(model_name, str) or not model_name:
        raise InvalidInputError(f"model_name must be a non-empty str, got {model_name!r}")
    if not isinstance(fingerprint, str) or len(fingerprint) > MAX_NAME_LEN or not fingerprint.isprintable():
        raise InvalidInputError(f"fingerprint must be a printable str of at most {MAX_NAME_LEN} characters")
    if len(model_name) > MAX_NAME_LEN:
        raise InvalidInputError(f"model_name has {len(model_name)} characters, more than {MAX_NAME_LEN}")
    if isinstance(tokens_per_block, bool) or not isinstance(tokens_per_block, int) or tokens_per_block <= 0:
        raise InvalidInputError(f"tokens_per_block must be a positive integer, got {tokens_per_block!r}")
    for field in ("name", "version", "attention_backend"):
        value = getattr(engine, field, "")
        if len(value) > MAX_NAME_LEN:
            raise InvalidInputError(f"engine.{field} has {len(value)} characters, more than {MAX_NAME_LEN}")
    try:
        geo = layout.KVGeometry(
            num_layers, num_kv_heads, head_dim, dtype_name(dtype), kv_kind, world_size, rank, total_kv_heads,
            pp_size, pp_rank,
        ).check()  # fmt: skip
        shape = layout.concrete_shape(kv_format, 1, tokens_per_block, num_kv_heads, head_dim)
    except ValueError as e:
        raise InvalidInputError(str(e)) from None
    engine = msgspec.structs.replace(
        engine or m.EngineInfo(), kv_cache_layout=kv_format, view_shape=shape, pp_rank=pp_rank, pp_size=pp_size
    )
    return m.ModelLayout(model_name, geo, tokens_per_block, engine, fingerprint)


def register_model(
    url: str,
    http_url: str | None,
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
    rank: int = 0,
    total_kv_heads: int = 0,
    kv_kind: str = layout.KV_PAIR,
    pp_size: int = 1,
    pp_rank: int = 0,
    server_key: KeyPath = None,
    client_key: KeyPath = None,
    token: str | None = None,
    fingerprint: str = "",
) -> ModelRegistration:
    """Register ``model_name`` with explicit geometry so the SDK works with no engine running.

    Registering the same geometry again is harmless (``created=False``); a different geometry, or
    another non-empty ``fingerprint`` than the name's (see :func:`make_layout`), raises ServerError
    (code ``registration``). ``admin_token``, ``server_key``, ``client_key``: ``token``: see
    register_layout."""
    lay = make_layout(
        model_name,
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        tokens_per_block=tokens_per_block,
        kv_format=kv_format,
        world_size=world_size,
        rank=rank,
        total_kv_heads=total_kv_heads,
        kv_kind=kv_kind,
        pp_size=pp_size,
        pp_rank=pp_rank,
        fingerprint=fingerprint,
    )
    return register_layout(
        url, http_url, lay, timeout, admin_token, server_key=server_key, client_key=client_key, token=token
    )


def describe_server(
    url: str,
    model_name: str = "",
    timeout: float = 60.0,
    *,
    server_key: KeyPath = None,
    client_key: KeyPath = None,
    token: str | None = None,
) -> m.Described:
    """The server's chunk size and limits, the models this client may use, and ``model_name``'s
    layout (None when it is not registered or not this client's tenant's), over the control plane
    (keys and token as in :func:`kvdock.sdk.connect`)."""
    tok = validate.token(token)
    conn = open_connection(url, timeout, server_key, client_key)
    try:
        desc = conn.ask(m.Describe(m.PROTOCOL_VERSION, model_name, tok))
    finally:
        conn.close()
    return desc


__all__ = ["ModelRegistration", "describe_server", "make_layout", "register_layout", "register_model"]

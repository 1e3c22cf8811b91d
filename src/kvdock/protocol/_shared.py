"""The structs that requests and replies share, and their two base classes. Field names are part
of the wire contract."""

from __future__ import annotations

from typing import Generic, Literal, TypeVar

import msgspec

from kvdock.layout import KVGeometry

# 12: model fingerprints (ModelLayout.fingerprint); 11: tenants' own pools (Described.pool_*);
# 10: tenants (Describe, tokens); 9: pipeline stages; 8: tensor-parallel shards
PROTOCOL_VERSION = 12

Transport = Literal["shm", "inline"]


class _Msg(msgspec.Struct, tag=True, frozen=True, forbid_unknown_fields=True):
    """A message on the control plane: a tagged struct (the tag is its class name)."""


class ReplyBase(_Msg, frozen=True):
    """Every reply: the op's own reply type, or :class:`~kvdock.protocol.replies.Error`."""


R = TypeVar("R", bound=ReplyBase, covariant=True)


class RequestBase(_Msg, Generic[R], frozen=True):
    """Every request: ``RequestBase[R]`` is a request whose reply is an ``R`` (or an Error), so a
    typed call of it returns an ``R`` (:func:`kvdock.protocol.messages.reply_type` reads ``R`` at
    run time)."""


# --- shared structs -----------------------------------------------------------------------------


class EngineInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Who registered a layout and how it holds its KV (descriptive: no stored byte depends on it)."""

    name: str = "sdk"
    version: str = ""
    attention_backend: str = ""
    kv_cache_layout: str = "NHD"  # the engine's own axis order name, e.g. "NHD", "HND"
    view_shape: list[int] = []  # one layer's KV tensor as the engine holds it
    view_strides: list[int] = []
    pp_rank: int = 0
    pp_size: int = 1


class ModelLayout(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What an engine (or the SDK) registers for a model, and what /status shows of it under
    ``cache_context_meta[i]["layout"]``. Only ``geometry`` decides what a stored chunk holds.

    ``fingerprint`` names the model whose KV it is beyond its shapes (its config and weights:
    engines compute it, :mod:`kvdock.integrations.fingerprint`); "" asserts nothing and matches any.
    The first non-empty fingerprint registered under a name sticks, and a registration with another
    is refused (the server's registry, and fleet-wide through L3). It is not part of where objects
    are stored: a model registered first without one keeps its KV when one is added."""

    model_name: str
    geometry: KVGeometry
    tokens_per_block: int
    engine: EngineInfo = EngineInfo()
    fingerprint: str = ""


class SlotRef(msgspec.Struct, frozen=True, array_like=True):
    """Chunk ``index`` of a request lives at byte ``offset`` of the L1 pool; ``gen`` is the slot's
    generation when it was handed out (a reader checks it is unchanged after copying)."""

    index: int
    offset: int
    gen: int = 0


class ReadPart(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """The part of each chunk a retrieve wants: layers ``range(layer_start, layer_stop,
    layer_step)`` of the chunks from ``first_chunk`` on. An inline reply carries only those bytes
    (per chunk, the chosen layers of each plane in order); shared-memory clients copy their part
    out of the slots themselves."""

    layer_start: int
    layer_stop: int
    layer_step: int = 1
    first_chunk: int = 0


class Stored(msgspec.Struct, frozen=True, array_like=True):
    """One tier's object under a chunk's key: its version and its predecessor's (0: the first chunk)."""

    tier: str
    version: int
    parent: int

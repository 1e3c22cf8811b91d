"""What a model registration is checked against: the engine's description within the wire limits,
and a later registration of a name against the first (the same model's KV, or a refusal naming
both: for one server's registry and for the fleet's record, :mod:`kvdock.server.fleet`)."""

from __future__ import annotations

from kvdock.errors import RegistrationError
from kvdock.layout import KVGeometry
from kvdock.protocol.limits import MAX_NAME_LEN, MAX_VIEW_DIMS
from kvdock.protocol.messages import ModelLayout


def check_engine(lay: ModelLayout) -> None:
    """RegistrationError for an engine description past the wire limits or with an impossible
    pipeline rank."""
    engine = lay.engine
    for name in ("name", "version", "attention_backend", "kv_cache_layout"):
        value = getattr(engine, name)
        if len(value) > MAX_NAME_LEN:
            raise RegistrationError(f"engine.{name} has {len(value)} characters, more than {MAX_NAME_LEN}")
    for name, dims in (("view_shape", engine.view_shape), ("view_strides", engine.view_strides)):
        if len(dims) > MAX_VIEW_DIMS:
            raise RegistrationError(f"engine.{name} has {len(dims)} entries, more than {MAX_VIEW_DIMS}")
    if not 0 <= engine.pp_rank < engine.pp_size:
        raise RegistrationError(f"engine.pp_rank {engine.pp_rank} out of range for pp_size {engine.pp_size}")


def check_same(old: ModelLayout, new: ModelLayout) -> None:
    """RegistrationError naming both unless ``new`` describes the model ``old`` registered: the
    same logical geometry, and fingerprints that do not differ ("" matches any)."""
    refuse_another_model(
        old.model_name,
        old.geometry.logical() == new.geometry.logical(),
        describe_geometry(old.geometry),
        describe_geometry(new.geometry),
        old.fingerprint,
        new.fingerprint,
    )


def refuse_another_model(
    name: str, same_geometry: bool, old: str, new: str, old_fingerprint: str, new_fingerprint: str, by: str = ""
) -> None:
    """RegistrationError naming both registrations of ``name`` (geometries described as ``old`` and
    ``new``) when they are other models: another geometry, or two fingerprints that differ ("" matches
    any). ``by``: who holds the first one (" by a server sharing the L3 ..."), for the message."""
    if not same_geometry:
        raise RegistrationError(
            f"model {name!r} is already registered with a different geometry{by}: {old} (new: {new})"
        )
    if old_fingerprint and new_fingerprint and old_fingerprint != new_fingerprint:
        raise RegistrationError(
            f"model {name!r} is already registered as another model of the same geometry{by}: fingerprint "
            f"{old_fingerprint} (new: {new_fingerprint}); its KV would be wrong for this one (register it under "
            "another name)"
        )


def describe_geometry(geo: KVGeometry) -> str:
    """A geometry as error messages name it."""
    return (
        f"layers={geo.num_layers} kv_heads={geo.num_kv_heads} head_dim={geo.head_dim} dtype={geo.dtype} "
        f"kv_kind={geo.kv_kind} world_size={geo.world_size} rank={geo.rank} kv_heads_total={geo.kv_heads_total}"
        + (f" pp_size={geo.pp_size} pp_rank={geo.pp_rank}" if geo.pp_size > 1 else "")
    )

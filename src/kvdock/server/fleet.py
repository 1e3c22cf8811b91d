"""One model name, one model, across the servers that share an L3.

Each server's registry binds a name to a geometry and a fingerprint (:mod:`kvdock.server.registry`);
servers sharing a Redis agree on both through a record in it, ``kvdock:v2:model:<name>`` (a hash:
the logical geometry, the geometry its objects are stored in, its digest, a readable description
and the fingerprint). :func:`register_model` claims the record with one script (:data:`CLAIM_SCRIPT`,
atomic, a single key: a Redis Cluster takes it too):

* no record yet: this registration's is written (first registration wins);
* a record of the same logical geometry without a fingerprint: this registration's non-empty
  fingerprint is set (compare-and-set: the first non-empty one sticks fleet-wide);
* otherwise the record stays as it is;

and the record as it stands decides: another logical geometry, or another non-empty fingerprint,
is refused with a RegistrationError naming both (the registry's own error for a clash on one
server). A registration that agrees adopts the record's stored geometry when this server does not
know the name yet, so that servers with engines sharded otherwise still share one model's objects,
and its fingerprint when it brings none.

The Redis I/O runs on the L3 lane's reader thread (the event loop never waits on Redis). When L3 is
down or unreachable, the model is registered on this server alone and the fact is logged: its
objects are still named by their geometry's digest (object headers and L3 keys), so two servers
that registered a name differently meanwhile never read each other's KV as their own.

Known limit: a Redis that evicts keys (``maxmemory-policy allkeys-*``) may evict a record; the next
registration then writes a new one. Geometries stay apart regardless (the digest names the
objects); fingerprints are only as durable as the record.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from kvdock.layout import KVGeometry
from kvdock.protocol.messages import ModelLayout
from kvdock.server.layouts import describe_geometry, refuse_another_model
from kvdock.server.registry import ModelEntry

if TYPE_CHECKING:
    from kvdock.server.state import ServerState
    from kvdock.storage.lane import TierLane

log = logging.getLogger(__name__)

RECORD_VERSION = "1"
FIELDS = ("v", "logical", "geometry", "digest", "description", "fingerprint")

# KEYS[1]: the record; ARGV: the record's fields in FIELDS order. Returns the record as it stands.
CLAIM_SCRIPT = """
local key = KEYS[1]
if redis.call('EXISTS', key) == 0 then
  redis.call('HSET', key, 'v', ARGV[1], 'logical', ARGV[2], 'geometry', ARGV[3], 'digest', ARGV[4],
             'description', ARGV[5], 'fingerprint', ARGV[6])
elseif ARGV[6] ~= '' and redis.call('HGET', key, 'logical') == ARGV[2] then
  local fp = redis.call('HGET', key, 'fingerprint')
  if not fp or fp == '' then
    redis.call('HSET', key, 'fingerprint', ARGV[6])
  end
end
return redis.call('HMGET', key, 'v', 'logical', 'geometry', 'digest', 'description', 'fingerprint')
"""


def record_key(model_name: str) -> bytes:
    return b"kvdock:v2:model:" + model_name.encode()


def logical_text(geo: KVGeometry) -> str:
    """The model's KV as every server must agree on it (fixed text: versions of kvdock compare it)."""
    g = geo.logical()
    return f"layers={g.num_layers} kv_heads={g.num_kv_heads} head_dim={g.head_dim} dtype={g.dtype} kind={g.kv_kind}"


@dataclass(frozen=True)
class ModelRecord:
    """A name's record in L3 (see the module docstring); ``geometry`` None when it cannot be
    decoded here (written by another version of kvdock)."""

    version: str
    logical: str
    geometry: KVGeometry | None
    digest: str
    description: str
    fingerprint: str

    @classmethod
    def of(cls, lay: ModelLayout, chunk_size: int) -> ModelRecord:
        geo = lay.geometry
        return cls(
            RECORD_VERSION,
            logical_text(geo),
            geo,
            geo.digest(chunk_size),
            f"{describe_geometry(geo)} chunk_size={chunk_size}",
            lay.fingerprint,
        )

    def args(self) -> list[bytes | str]:
        geo = msgspec.json.encode(self.geometry) if self.geometry is not None else b""
        return [self.version, self.logical, geo, self.digest, self.description, self.fingerprint]

    @classmethod
    def decode(cls, values: list[Any]) -> ModelRecord:
        text = [v.decode() if isinstance(v, bytes) else str(v or "") for v in values]
        version, logical, geo_json, digest, description, fingerprint = text
        try:
            geo: KVGeometry | None = msgspec.json.decode(geo_json, type=KVGeometry).check()
        except (msgspec.DecodeError, ValueError):
            geo = None
        return cls(version, logical, geo, digest, description, fingerprint)


def claim(tier: Any, proposal: ModelRecord, model_name: str) -> ModelRecord:
    """[L3 reader thread] Run :data:`CLAIM_SCRIPT` for ``proposal``; the record as it stands."""
    values = tier.run_script(CLAIM_SCRIPT, [record_key(model_name)], proposal.args())
    return ModelRecord.decode(list(values))


def l3_lane(state: ServerState) -> TierLane | None:
    """The lane of the server's Redis tier (None without one)."""
    return next((lane for lane in state.manager.lanes if hasattr(lane.tier, "run_script")), None)


async def register_model(state: ServerState, lay: ModelLayout) -> tuple[ModelEntry, bool]:
    """Register ``lay`` (the caller checked the right to) on this server once the fleet's record
    in L3 agrees (see the module docstring); returns the registry's (entry, created).
    RegistrationError for a clash with this server's registration or the fleet's."""
    registry = state.registry
    proposal = registry.check_layout(lay)  # this server's own refusal first, before any I/O
    lane = l3_lane(state)
    record = None
    if lane is not None and lane.tier.up():
        mine = ModelRecord.of(proposal, registry.chunk_size)
        record = await lane.on_reader(claim, lane.tier, mine, lay.model_name, default=None)
    name = lay.model_name
    if record is None:
        if lane is not None:
            log.warning(
                "L3 is down: model %r registered on this server only, unchecked against the other servers that share "
                "it (its objects are named by their geometry's digest %s, so no server reads them as another "
                "geometry's)",
                name,
                proposal.geometry.digest(registry.chunk_size),
            )
        return registry.register_model(lay, authorized=True)
    where = str(getattr(lane.tier, "display_url", "")) if lane is not None else ""
    return registry.register_model(_agreed(lay, proposal, record, where), authorized=True)


def _agreed(lay: ModelLayout, proposal: ModelLayout, record: ModelRecord, where: str) -> ModelLayout:
    """``lay`` as this server registers it once the fleet's ``record`` is known; RegistrationError
    naming both when they describe other models."""
    refuse_another_model(
        lay.model_name,
        record.logical == logical_text(proposal.geometry),
        record.description,
        describe_geometry(proposal.geometry),
        record.fingerprint,
        proposal.fingerprint,
        f" by a server sharing the L3 {where}",
    )
    out = lay
    if not lay.fingerprint and record.fingerprint:
        out = msgspec.structs.replace(out, fingerprint=record.fingerprint)
    if record.geometry is not None and record.geometry != proposal.geometry:
        # the fleet stores the model in other shards: this server's objects must be the fleet's
        out = msgspec.structs.replace(out, geometry=record.geometry)
    return out


__all__ = ["CLAIM_SCRIPT", "ModelRecord", "claim", "l3_lane", "record_key", "register_model"]

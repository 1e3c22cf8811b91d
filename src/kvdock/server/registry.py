"""Registered models and clients."""

from __future__ import annotations

import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

import msgspec

from kvdock.errors import RegistrationError
from kvdock.layout import Geometry, check_dtype, decode_shape
from kvdock.protocol.codes import ErrorCode
from kvdock.protocol.messages import ModelLayout, Transport
from kvdock.storage.tiers import ObjectLayout

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelEntry:
    layout: ModelLayout
    geometry: Geometry
    slot_nbytes: int


@dataclass(frozen=True)
class ClientEntry:
    client_id: str
    instance_id: str
    model: ModelEntry
    kv_rank: int
    transport: Transport


class Registry:
    """Models and clients. With ``persist_path`` (in the L2 directory), model registrations are
    saved there and reloaded at start, so a restarted server serves its disk cache to SDK
    clients before any engine registers again."""

    def __init__(self, chunk_size: int, persist_path: Path | None = None) -> None:
        self.chunk_size = chunk_size
        self.models: dict[str, ModelEntry] = {}
        self.clients: dict[str, ClientEntry] = {}
        self._persist_path = persist_path
        if persist_path is not None and persist_path.exists():
            self._load(persist_path)

    def _load(self, path: Path) -> None:
        try:
            layouts = msgspec.msgpack.decode(path.read_bytes(), type=list[ModelLayout])
        except (OSError, msgspec.DecodeError) as e:
            log.warning("ignoring unreadable model registrations in %s: %s", path, e)
            return
        for lay in layouts:
            try:
                self.models[lay.model_name] = self._entry(lay)
            except RegistrationError as e:  # e.g. the chunk size changed since
                log.warning("not restoring model %r: %s", lay.model_name, e)
        log.info("restored %d model registration(s) from %s", len(self.models), path)

    def _save(self) -> None:
        if self._persist_path is None:
            return
        tmp = self._persist_path.with_suffix(".tmp")
        tmp.write_bytes(msgspec.msgpack.encode([e.layout for e in self.models.values()]))
        os.replace(tmp, self._persist_path)

    def register_model(self, lay: ModelLayout) -> tuple[ModelEntry, bool]:
        """Validate and add ``lay``; returns (entry, created). Same geometry again is a no-op;
        a different geometry for a known name raises RegistrationError."""
        entry = self._entry(lay)
        old = self.models.get(lay.model_name)
        if old is not None:
            if (
                old.geometry != entry.geometry
                or old.layout.tokens_per_block != lay.tokens_per_block
                or (old.layout.world_size != lay.world_size)
            ):
                raise RegistrationError(
                    f"model {lay.model_name!r} is already registered with a different geometry: "
                    f"{_describe(old.layout)} (new: {_describe(lay)})"
                )
            return old, False
        self.models[lay.model_name] = entry
        self._save()
        return entry, True

    def _entry(self, lay: ModelLayout) -> ModelEntry:
        if not lay.model_name:
            raise RegistrationError("model_name must not be empty")
        try:
            check_dtype(lay.dtype)
            dec = decode_shape(lay.engine_kv_format, lay.engine_kv_concrete_shape)
        except ValueError as e:
            raise RegistrationError(str(e)) from None
        if lay.num_layers <= 0 or lay.world_size <= 0 or lay.tokens_per_block <= 0:
            raise RegistrationError("num_layers, world_size and tokens_per_block must be positive")
        if dec.block_size != lay.tokens_per_block:
            raise RegistrationError(
                f"block size {dec.block_size} in the {lay.engine_kv_format} shape "
                f"{lay.engine_kv_concrete_shape} != tokens_per_block {lay.tokens_per_block}"
            )
        if self.chunk_size % lay.tokens_per_block:
            raise RegistrationError(
                f"chunk_size {self.chunk_size} is not a multiple of tokens_per_block {lay.tokens_per_block}"
            )
        geo = Geometry(lay.num_layers, dec.num_kv_heads, dec.head_dim, lay.dtype)
        return ModelEntry(lay, geo, geo.chunk_nbytes(self.chunk_size))

    def layout_of(self, model_name: str) -> ObjectLayout | None:
        """How one chunk of ``model_name`` is laid out (for the lower tiers' object headers)."""
        entry = self.models.get(model_name)
        if entry is None:
            return None
        return ObjectLayout(entry.geometry.dtype, list(entry.geometry.chunk_shape(self.chunk_size)), entry.slot_nbytes)

    def register_client(self, instance_id: str, model_name: str, kv_rank: int, transport: Transport) -> ClientEntry:
        model = self.models.get(model_name)
        if model is None:
            known = ", ".join(sorted(self.models)) or "none"
            msg = f"unknown model {model_name!r}; registered models: {known}"
            raise RegistrationError(msg, ErrorCode.UNKNOWN_MODEL)
        if not 0 <= kv_rank < model.layout.world_size:
            raise RegistrationError(f"kv_rank {kv_rank} out of range for world_size {model.layout.world_size}")
        client = ClientEntry(secrets.token_hex(8), instance_id, model, kv_rank, transport)
        self.clients[client.client_id] = client
        return client


def _describe(lay: ModelLayout) -> str:
    return (
        f"layers={lay.num_layers} dtype={lay.dtype} {lay.engine_kv_format}{list(lay.engine_kv_concrete_shape)} "
        f"tokens_per_block={lay.tokens_per_block} world_size={lay.world_size}"
    )

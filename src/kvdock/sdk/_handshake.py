"""The handshake of an SDK context with a server (docs/architecture.md, section 1a: connect): ask
the server to describe itself and the model, map the shared-memory pool when this process can
(by name, or a tenant's own as a descriptor from the pool door), register as a client, and pick
the transfer (shared memory with a watch of the server, or inline frames). Used by
:func:`kvdock.sdk.connect` and again after a server restart."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import msgspec
import torch

from kvdock import layout
from kvdock.errors import InvalidInputError, KVCacheSDKError, ProtocolError, UnknownModelError
from kvdock.layout import KVGeometry
from kvdock.protocol import encode
from kvdock.protocol import messages as m
from kvdock.protocol.door import OpenPool, PoolOpened, decode_door_reply
from kvdock.reach import described_layout
from kvdock.sdk._connection import Connection
from kvdock.sdk._transfer import InlineTransfer, ShmTransfer, Transfer
from kvdock.shm import PoolSegment
from kvdock.shm.segment import proc_start_time
from kvdock.transport import door
from kvdock.transport.local import PeerWatch

log = logging.getLogger("kvdock.sdk")

KNOCKS = 4  # at the pool door, before settling for the inline transport
KNOCK_PAUSES_S = (0.25, 0.75, 1.5)  # between them: past the door's DEADLINE_S for a silent caller
TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in layout.DTYPE_SIZES}
ALL_RANKS = -1  # RegisterClient.kv_rank of the SDK's whole-model view (server.registry.ALL_RANKS)


def dtype_name(dtype: torch.dtype | str) -> str:
    """``torch.bfloat16`` or ``"bfloat16"`` → ``"bfloat16"``; InvalidInputError if unsupported."""
    name = str(dtype).removeprefix("torch.")
    try:
        return layout.check_dtype(name)
    except ValueError as e:
        raise InvalidInputError(str(e)) from None


def find_model(status: dict[str, Any], model_name: str) -> m.ModelLayout:
    """``model_name``'s layout from /status (the ModelLayout under its entry's ``layout``);
    UnknownModelError lists the known ones, KVCacheSDKError if it cannot be decoded."""
    entries = {e.get("model_name"): e for e in status.get("cache_context_meta", [])}
    entry = entries.get(model_name)
    if entry is None:
        known = ", ".join(sorted(str(name) for name in entries)) or "none"
        raise UnknownModelError(f"model {model_name!r} is not registered with the server; registered models: {known}")
    try:
        lay = msgspec.convert(entry["layout"], m.ModelLayout)
        lay.geometry.check()
    except KeyError:
        raise KVCacheSDKError(
            f"the server's /status has no layout for {model_name!r} (a server older than protocol "
            f"{m.PROTOCOL_VERSION}?)"
        ) from None
    except (msgspec.ValidationError, ValueError) as e:
        raise KVCacheSDKError(f"cannot decode the layout of {model_name!r}: {e}") from None
    if lay.model_name != model_name:
        raise KVCacheSDKError(f"the server's /status entry for {model_name!r} holds the layout of {lay.model_name!r}")
    return lay


@dataclass(frozen=True)
class Registration:
    """What a handshake got, frozen: the model's layout, the server's chunk size and limits, this
    client's id, and the transfer to copy through (of one shard's chunks). A context holds one
    and swaps it for another, whole, when it registers again after a server restart: whoever
    read it reads one registration's fields, never a mix of two.

    ``geometry`` is the KV the context reads and writes: the whole model's (``kv_rank`` None)
    or rank ``kv_rank``'s. Each of its chunks is ``shards`` stored chunks (more than one only
    for the whole of a model stored in several shards: tensor parallelism); ``shard`` is the
    one a single-shard context's objects are named by."""

    layout: m.ModelLayout
    chunk_size: int
    client_id: str
    transfer: Transfer
    geometry: KVGeometry
    max_request_tokens: int = 0  # the server's limit (0: not advertised)
    session_ttl: float = 30.0
    kv_rank: int | None = None
    shard: int = 0
    shards: int = 1
    shm_name: str = ""  # the named pool the server offered this client ("" none): whose HTTP API is whose

    @property
    def model_name(self) -> str:
        return self.layout.model_name

    @property
    def dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.geometry.dtype]

    def accepted(self, msg: object) -> None:
        """The server answered ``msg`` (an error raised before this): the ``cache_salt``
        namespaces it names passed its access checks, if it was answered for this registration,
        whose pool directory may now answer reads of them (``Transfer.accepted``, sdk._fastpath)."""
        salt = getattr(msg, "cache_salt", None)
        salts = [salt] if salt is not None else getattr(msg, "cache_salts", None)
        if salts and self.client_id == getattr(msg, "client_id", None):
            self.transfer.accept(salts)


def refusal(old: Registration, new: Registration, url: str) -> str:
    """Why ``new`` (after a restart of the server at ``url``) cannot replace ``old``, or ""."""
    if (new.geometry, new.shards, new.shard, new.chunk_size) != (
        old.geometry,
        old.shards,
        old.shard,
        old.chunk_size,
    ) or (new.layout.geometry != old.layout.geometry):
        return f"the server at {url} restarted with another layout for {old.model_name!r}"
    mine, theirs = old.layout.fingerprint, new.layout.fingerprint
    if mine and theirs and mine != theirs:  # the same shapes, another model's KV ("" asserts nothing)
        return (
            f"the server at {url} restarted with another model under {old.model_name!r}: fingerprint "
            f"{theirs} (this context's: {mine})"
        )
    return ""


def describe(conn: Connection, model_name: str, token: str = "") -> m.Described:
    """The server's settings and ``model_name``'s layout as this client may see them (over the
    control plane: with tenants, HTTP shows a client without a token nothing). UnknownModelError
    lists the models it may use; KVCacheSDKError for a layout it cannot use."""
    me = os.getpid()
    desc = conn.ask(
        m.Describe(m.PROTOCOL_VERSION, model_name, token, pid=me, pid_start=proc_start_time(me) or 0)
    )
    described_layout(desc, model_name)
    return desc


def register(conn: Connection, model_name: str, kv_rank: int | None = None, token: str = "") -> Registration:
    """The handshake (docs/architecture.md, section 1a: connect) over ``conn`` (used again after a
    server restart), as a client of rank ``kv_rank`` of the model (None: of all of it), of the
    tenant ``token`` names (or the CURVE key says). InvalidInputError for a rank the model does
    not have."""
    desc = describe(conn, model_name, token)
    lay = desc.layout
    assert lay is not None
    geo = lay.geometry  # the model's shards (rank 0's geometry)
    chunk_size = desc.chunk_size
    if kv_rank is not None and not 0 <= kv_rank < geo.ranks:
        raise InvalidInputError(
            f"kv_rank {kv_rank} is not a rank of {model_name!r}, stored for {geo.ranks} ranks "
            f"(0..{geo.ranks - 1}; None for the whole model)"
        )
    view = geo.logical() if kv_rank is None else geo.at_rank(kv_rank)
    shards = geo.shards if kv_rank is None else 1
    segment = try_attach(desc.shm_name) if desc.shm_name else open_pool(desc, conn.timeout)
    try:
        reply = conn.ask(
            m.RegisterClient(
                m.PROTOCOL_VERSION,
                str(os.getpid()),
                model_name,
                ALL_RANKS if kv_rank is None else kv_rank,
                segment.nonce if segment else "",
                pid=os.getpid(),
                pid_start=proc_start_time(os.getpid()) or 0,
                token=token,
            ),
        )
        if (
            reply.chunk_size != chunk_size
            or reply.slot_nbytes != geo.chunk_nbytes(chunk_size)
            or reply.geometry != geo  # (registered again otherwise between Describe and now)
        ):
            raise KVCacheSDKError(f"{conn.url} changed its chunk size or the layout of {model_name!r} meanwhile")
    except BaseException:
        if segment:
            segment.close()
        raise
    dtype = TORCH_DTYPES[geo.dtype]
    transfer: Transfer
    if reply.transport == "shm" and segment is not None:
        conn.use_local(reply.local_url)
        transfer = ShmTransfer(geo, chunk_size, dtype, segment, watch_creator(conn, segment))
    else:
        if segment is not None:
            segment.close()
        transfer = InlineTransfer(geo, chunk_size, dtype)
        conn.use_local("")
    return Registration(
        lay,
        chunk_size,
        reply.client_id,
        transfer,
        view,
        max_request_tokens=desc.max_request_tokens,
        session_ttl=desc.session_ttl,
        kv_rank=kv_rank,
        shard=0 if kv_rank is None else geo.shard_of(kv_rank),
        shards=shards,
        shm_name=desc.shm_name,
    )


def register_again(conn: Connection, old: Registration, url: str, token: str = "") -> Registration:
    """A context's registration after the server at ``url`` restarted: ``old``'s model and rank
    registered again, keeping ``old``'s layout (what the context's KV was checked against).
    KVCacheSDKError when the server now serves another layout or model (:func:`refusal`): the
    new registration is then released (its pool unmapped, the server told)."""
    reg = register(conn, old.model_name, old.kv_rank, token)
    refused = refusal(old, reg, url)
    if refused:
        release(conn, reg)
        raise KVCacheSDKError(refused)
    return dataclasses.replace(reg, layout=old.layout)


def release(conn: Connection, reg: Registration) -> None:
    """Give up ``reg``, which the server registered: unmap its pool, tell the server it is gone."""
    reg.transfer.close()
    conn.send_nowait(m.CloseClient(reg.client_id))


def watch_creator(conn: Connection, segment: PoolSegment) -> PeerWatch | None:
    """A watch of the local connection's server end if the process there created ``segment``
    (its pid, and that pid's start time, are the segment's creator's), else None: only then does
    the watch tell whether the segment's directory still means something."""
    watch = conn.peer_watch()
    if watch is None:
        return None
    pid, start = segment.creator_pid, segment.creator_start
    if not watch.alive():  # a channel not yet known to be broken
        watch.close()
        return None
    if watch.pid != pid or not start or proc_start_time(pid) != start:
        log.info("the local socket's peer (pid %d) did not create the pool; reads ask the server", watch.pid)
        watch.close()
        return None
    return watch


def rewatch(conn: Connection, transfer: Transfer) -> None:
    """``conn`` has a new local channel (the server dropped the last one, or it was tried again):
    ``transfer`` watches the server through it from now on, when it leads to the process that
    made the pool it maps (after a server restart it does not: the next request registers
    again), so that reads use the pool directory again. Reads never do this: they only look."""
    if isinstance(transfer, ShmTransfer):
        watch = watch_creator(conn, transfer.segment)
        if watch is not None:
            log.info("watching the server at %s again: reads use its pool directory", conn.url)
            transfer.rewatch(watch)


def open_pool(desc: m.Described, timeout: float) -> PoolSegment | None:
    """Map the pool ``desc`` offers a ticket to (a tenant's own: handed over as a descriptor at
    the pool door), or None (none offered, or it cannot be had: the inline transport then)."""
    if not desc.pool_ticket:
        return None
    try:
        reply, fds = _knock(desc, timeout)
        try:
            answer = decode_door_reply(reply)
            if not isinstance(answer, PoolOpened) or len(fds) != 2:
                raise ValueError(answer.message if isinstance(answer, m.Error) else "its descriptors did not come")
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return PoolSegment.from_fds(*fds)
    except (OSError, ValueError, ProtocolError) as e:
        log.info("cannot map this tenant's pool (%s); using the inline transport", e)
        return None


def _knock(desc: m.Described, timeout: float) -> tuple[bytes, list[int]]:
    """The door's reply and descriptor, knocking again (KNOCKS times in all) when it turns us
    away unanswered: it does so while too many callers wait at once (another user may hold it)."""
    request = encode(OpenPool(m.PROTOCOL_VERSION, desc.pool_ticket))
    deadline = time.monotonic() + timeout
    for attempt in range(KNOCKS):
        try:
            return door.knock(desc.pool_url, request, max(0.01, deadline - time.monotonic()))
        except (FileNotFoundError, PermissionError, TimeoutError, ValueError):
            raise  # no door there for us, or no time left: knocking again will not help
        except OSError:
            if attempt == KNOCKS - 1 or time.monotonic() + KNOCK_PAUSES_S[attempt] >= deadline:
                raise
            time.sleep(KNOCK_PAUSES_S[attempt])
    raise AssertionError("unreachable")


def try_attach(shm_name: str) -> PoolSegment | None:
    if not shm_name:
        return None
    try:
        return PoolSegment.attach(shm_name)
    except (OSError, ValueError) as e:
        log.info("cannot map the server's shared memory (%s); using the inline transport", e)
        return None

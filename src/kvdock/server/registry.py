"""Registered models and clients, and the bounds on both.

Clients hold leases: every request naming a client renews its lease (:meth:`Registry.touch`), and
the reaper forgets a client silent for ``client_ttl`` seconds (:meth:`Registry.expire`). At most
``max_clients`` are live at once. Models are bounded in number (``max_models``), in the size of
their strings and in their geometry (one chunk must fit in the L1 pool), and need the admin
token when the server has one.

A model name is bound to one geometry (its digest, :meth:`KVGeometry.digest`, names its objects in
L2 and L3) and to the first non-empty *fingerprint* registered under it (the model beyond its
shapes: config and weights); servers sharing an L3 agree on both through it (:mod:`kvdock.server.fleet`).
Registrations are saved in ``models.msgpack``; one that could not be saved (a full disk) is saved
again at the next registration and at the reaper's next tick past ``SAVE_RETRY_S``.
"""

from __future__ import annotations

import hmac
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import msgspec

from kvdock.config import MAX_CLIENTS, ServerConfig
from kvdock.errors import RegistrationError
from kvdock.layout import KVGeometry
from kvdock.protocol.codes import ErrorCode
from kvdock.protocol.limits import MAX_NAME_LEN
from kvdock.protocol.messages import ModelLayout, Transport
from kvdock.server.layouts import check_engine, check_same
from kvdock.server.modelfile import ModelFile
from kvdock.server.tenants import Tenant
from kvdock.sizes import format_size

log = logging.getLogger(__name__)




ALL_RANKS = -1  # RegisterClient.kv_rank of a client of every shard of a model (the SDK's logical view)


@dataclass(frozen=True)
class ModelEntry:
    """A registered model: the first layout registered under its name (its geometry that of rank
    0: the shards it is stored in; its fingerprint the first non-empty one), the size of one
    shard's chunk, and ``identity``: the digest of its geometry with the server's chunk size (what
    its stored objects carry)."""

    layout: ModelLayout
    slot_nbytes: int
    identity: str = ""

    @property
    def geometry(self) -> KVGeometry:
        return self.layout.geometry


TOUCH_RATE = 1 << 18  # LRU touches per second one client's reads may make (~0.1 s of the event loop)
TOUCH_BURST = 1 << 14


@dataclass(eq=False)
class ClientEntry:
    client_id: str  # a capability: whoever knows it acts as the client, so it is never shown
    instance_id: str
    model: ModelEntry
    kv_rank: int  # ALL_RANKS: a client of every shard (each request is one per shard: server.shards)
    transport: Transport
    last_seen: float = 0.0  # the Registry's clock at the last request naming this client
    pid: int = 0  # the client process (shared-memory clients: checked at registration)
    pid_start: int = 0
    touch_budget: float = TOUCH_BURST  # LRU touches its FastReads reports may make now
    touch_at: float = 0.0  # the clock when the budget was last counted
    key: bytes = b""  # the CURVE key it registered with: its zmq requests must come with it
    tenant: Tenant | None = None  # with tenants: whose models and salts it may use

    @property
    def shard(self) -> int:
        """The shard whose objects this client's requests name (0 for an all-rank client of a
        model stored in one shard, which is then an ordinary client)."""
        geo = self.model.geometry
        return 0 if self.kv_rank == ALL_RANKS else geo.shard_of(self.kv_rank)

    @property
    def sharded(self) -> bool:
        """Whether each request of this client is one per shard (an all-rank client of a model
        stored in several shards)."""
        return self.kv_rank == ALL_RANKS and self.model.geometry.shards > 1

    def allow_touches(self, want: int) -> int:
        """How many of ``want`` LRU touches of a FastReads report to make, as of ``last_seen``
        (the request's time): TOUCH_RATE per second, TOUCH_BURST at once. A report is never
        answered, so nothing else slows a client that floods them; the rest are skipped (the
        counters still count every read)."""
        budget = min(TOUCH_BURST, self.touch_budget + max(self.last_seen - self.touch_at, 0.0) * TOUCH_RATE)
        self.touch_at = self.last_seen
        allowed = min(want, int(budget))
        self.touch_budget = budget - allowed
        return allowed


class Registry:
    """Models and clients. With ``persist_path`` (in the L2 directory), model registrations are
    saved there (mode 0600) and reloaded at start, so a restarted server serves its disk cache to
    SDK clients before any engine registers again.

    ``config`` gives client_ttl, max_models, max_request_tokens and admin_token (default: the
    defaults of ServerConfig); ``pool_capacity`` is the L1 pool's size in bytes (a model whose chunk
    does not fit is refused; None: not checked); ``clock`` is injectable for tests."""

    def __init__(
        self,
        chunk_size: int,
        persist_path: Path | None = None,
        *,
        config: ServerConfig | None = None,
        pool_capacity: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_clients: int = MAX_CLIENTS,
    ) -> None:
        cfg = config or ServerConfig()
        self.chunk_size = chunk_size
        self.client_ttl = cfg.client_ttl
        self.max_models = cfg.max_models
        self.max_request_tokens = cfg.max_request_tokens
        self.max_clients = max_clients
        self.pool_capacity = pool_capacity
        self._admin_token = cfg.admin_token
        self._clock = clock
        self.models: dict[str, ModelEntry] = {}
        # least recently seen first: touch() moves a client to the end, expire() pops from the front
        self.clients: OrderedDict[str, ClientEntry] = OrderedDict()
        self.expired_clients = 0
        self._file = ModelFile(persist_path, clock)
        for lay in self._file.load():
            if len(self.models) >= self.max_models:
                log.warning("not restoring model %r: max_models (%d) reached", lay.model_name, self.max_models)
                continue
            try:
                self.models[lay.model_name] = self._entry(lay)
            except RegistrationError as e:  # e.g. the chunk size changed since
                log.warning("not restoring model %r: %s", lay.model_name, e)
        if persist_path is not None and persist_path.exists():
            log.info("restored %d model registration(s) from %s", len(self.models), persist_path)

    @property
    def unsaved(self) -> bool:
        """Whether the last save of the registrations failed (it is retried)."""
        return self._file.unsaved

    def save(self) -> bool:
        """Save every registration (:mod:`kvdock.server.modelfile`); False, logged, if it failed."""
        return self._file.save(self._layouts())

    def retry_save(self, force: bool = False) -> bool:
        """Save again if an earlier save failed and SAVE_RETRY_S passed since (or ``force``);
        whether the registrations are saved now."""
        return self._file.retry(self._layouts, force)

    def _layouts(self) -> list[ModelLayout]:
        return [e.layout for e in self.models.values()]

    def is_admin(self, admin_token: str) -> bool:
        """Whether ``admin_token`` is the server's (False when it has none)."""
        return bool(self._admin_token) and hmac.compare_digest(admin_token.encode(), self._admin_token.encode())

    def authorize(self, admin_token: str) -> None:
        """RegistrationError (code UNAUTHORIZED) unless the server has no admin token or
        ``admin_token`` is it."""
        if self._admin_token and not self.is_admin(admin_token):
            raise RegistrationError(
                "registering a model needs the server's admin token (admin_token= in the SDK, --admin-token or "
                "KVDOCK_ADMIN_TOKEN for kvdock register)",
                ErrorCode.UNAUTHORIZED,
            )

    def register_model(
        self, lay: ModelLayout, admin_token: str = "", *, authorized: bool = False
    ) -> tuple[ModelEntry, bool]:
        """Check the admin token, validate and add ``lay``; returns (entry, created).

        A known name is a no-op that keeps the first layout when the model's KV is the same: the
        same layers, heads over all ranks, head_dim, dtype and kind (engine info, tokens_per_block,
        the rank, even the tensor-parallel world size may differ: the model stays stored in the
        shards of its first registration, and an engine sharded otherwise re-shards), and the
        fingerprints do not differ ("" matches any; the first non-empty one registered is kept,
        also when it comes after ""). Any other difference raises RegistrationError naming both
        (two ranks of one engine with different layers or dtypes, another model under the name),
        and so does a new name past ``max_models`` (code LIMIT). The layout kept is rank 0's.
        ``authorized``: the caller checked the right to register (a tenant's), so the admin token
        is not asked for."""
        if not authorized:
            self.authorize(admin_token)
        self.retry_save(force=True)
        entry = self._entry(lay)
        old = self.models.get(lay.model_name)
        if old is not None:
            check_same(old.layout, lay)
            if old.layout.fingerprint or not lay.fingerprint:
                return old, False
            # the first fingerprint of a name registered without one: kept from now on (its KV stays)
            fingerprinted = msgspec.structs.replace(old.layout, fingerprint=lay.fingerprint)
            old = ModelEntry(fingerprinted, old.slot_nbytes, old.identity)
            self.models[lay.model_name] = old
            for client in self.clients.values():
                if client.model.layout.model_name == lay.model_name:
                    client.model = old
            self.save()
            return old, False
        if len(self.models) >= self.max_models:
            raise RegistrationError(
                f"the server already holds {len(self.models)} model registrations, its limit "
                f"(max_models; raise it with --max-models)",
                ErrorCode.LIMIT,
            )
        self.models[lay.model_name] = entry
        self.save()
        return entry, True

    def check_layout(self, lay: ModelLayout) -> ModelLayout:
        """What :meth:`register_model` would keep for ``lay`` now, without keeping it: the known
        entry's layout (its fingerprint ``lay``'s when it had none), or ``lay`` as it would be
        stored (rank 0's geometry). RegistrationError where register_model would refuse it (bar
        the admin token and ``max_models``)."""
        entry = self._entry(lay)
        old = self.models.get(lay.model_name)
        if old is None:
            return entry.layout
        check_same(old.layout, lay)
        if old.layout.fingerprint or not lay.fingerprint:
            return old.layout
        return msgspec.structs.replace(old.layout, fingerprint=lay.fingerprint)

    def _entry(self, lay: ModelLayout) -> ModelEntry:
        try:
            return self._checked_entry(lay)
        except (OverflowError, MemoryError) as e:
            raise RegistrationError(f"impossible geometry for model {lay.model_name[:MAX_NAME_LEN]!r}: {e}") from None

    def _checked_entry(self, lay: ModelLayout) -> ModelEntry:
        if not lay.model_name:
            raise RegistrationError("model_name must not be empty")
        if len(lay.model_name) > MAX_NAME_LEN:
            raise RegistrationError(f"model_name has {len(lay.model_name)} characters, more than {MAX_NAME_LEN}")
        if not lay.model_name.isprintable():  # (a NUL would blur the names of its stored objects)
            raise RegistrationError(f"model_name {lay.model_name!r} holds control characters")
        check_engine(lay)
        if len(lay.fingerprint) > MAX_NAME_LEN or not lay.fingerprint.isprintable():
            raise RegistrationError(f"fingerprint must be printable and at most {MAX_NAME_LEN} characters")
        try:
            geo = lay.geometry.check()
        except ValueError as e:
            raise RegistrationError(str(e)) from None
        if geo != geo.canonical():  # what is kept describes the shards, not the rank that came first
            lay = msgspec.structs.replace(lay, geometry=geo.canonical())
        if lay.tokens_per_block <= 0:
            raise RegistrationError(f"tokens_per_block must be positive, got {lay.tokens_per_block}")
        if self.chunk_size % lay.tokens_per_block:
            raise RegistrationError(
                f"chunk_size {self.chunk_size} is not a multiple of tokens_per_block {lay.tokens_per_block}"
            )
        nbytes = geo.chunk_nbytes(self.chunk_size)
        if self.pool_capacity is not None and nbytes > self.pool_capacity:
            raise RegistrationError(
                f"one chunk of {lay.model_name!r} ({self.chunk_size} tokens) is {format_size(nbytes)}, more than the "
                f"whole L1 pool ({format_size(self.pool_capacity)}; see --l1-size)"
            )
        return ModelEntry(lay, nbytes, lay.geometry.digest(self.chunk_size))

    def geometry_of(self, model_name: str) -> KVGeometry | None:
        """The geometry of ``model_name``'s chunks (for the lower tiers' object headers)."""
        entry = self.models.get(model_name)
        return None if entry is None else entry.geometry

    def identity_of(self, model_name: str) -> str | None:
        """[any thread] The digest of ``model_name``'s geometry with this server's chunk size (what
        its objects in L2 and L3 carry and are named by); None for a model not registered."""
        entry = self.models.get(model_name)
        return None if entry is None else entry.identity

    def register_client(
        self,
        instance_id: str,
        model_name: str,
        kv_rank: int,
        transport: Transport,
        *,
        key: bytes = b"",
        tenant: Tenant | None = None,
    ) -> ClientEntry:
        """A new client of ``model_name`` (RegistrationError: unknown model, rank out of range, or
        max_clients reached); with ``tenant``, a model it may not use is as unknown as one never
        registered, and the error lists only its own."""
        model = self.models.get(model_name)
        if tenant is not None and not tenant.allows_model(model_name):
            model = None
        if model is None:
            known = ", ".join(sorted(self.visible(tenant))) or "none"
            msg = f"unknown model {model_name!r}; registered models: {known}"
            raise RegistrationError(msg, ErrorCode.UNKNOWN_MODEL)
        ranks = model.geometry.ranks
        if kv_rank != ALL_RANKS and not 0 <= kv_rank < ranks:
            raise RegistrationError(
                f"kv_rank {kv_rank} out of range for {model_name!r}, stored for {ranks} ranks "
                f"(0..{ranks - 1}, or {ALL_RANKS}: every rank)"
            )
        if len(self.clients) >= self.max_clients:
            raise RegistrationError(
                f"the server already holds {len(self.clients)} client registrations, its limit; a client silent for "
                f"client_ttl ({self.client_ttl:g} s) is forgotten",
                ErrorCode.LIMIT,
            )
        client = ClientEntry(secrets.token_hex(16), instance_id, model, kv_rank, transport, self._clock())
        client.key, client.tenant = key, tenant
        self.clients[client.client_id] = client
        return client

    def visible(self, tenant: Tenant | None) -> list[str]:
        """The registered models ``tenant`` may use (None: every one)."""
        return [name for name in self.models if tenant is None or tenant.allows_model(name)]

    def touch(self, client_id: str) -> ClientEntry | None:
        """The client registered as ``client_id``, its lease renewed; None if there is none."""
        client = self.clients.get(client_id)
        if client is not None:
            client.last_seen = self._clock()
            self.clients.move_to_end(client_id)
        return client

    def expire(self, end_client: Callable[[str], object]) -> int:
        """Forget every client silent for ``client_ttl`` seconds: ``end_client(client_id)`` (which
        releases its sessions), then remove it. Returns how many. (The reaper calls this every
        second or so: it also retries saving registrations that could not be saved, :meth:`retry_save`.)"""
        self.retry_save()
        oldest_alive = self._clock() - self.client_ttl
        n = 0
        while self.clients:
            client = next(iter(self.clients.values()))
            if client.last_seen > oldest_alive:
                break
            try:
                end_client(client.client_id)
            finally:
                del self.clients[client.client_id]
            n += 1
        self.expired_clients += n
        return n

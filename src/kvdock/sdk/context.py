"""KVCacheContext: one SDK connection to one server for one model (the handshake that makes it is
:mod:`kvdock.sdk.handshake`)."""

from __future__ import annotations

import logging
import threading
import time
import uuid
import weakref
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import msgspec

from kvdock.errors import KVCacheSDKError
from kvdock.protocol import ErrorCode
from kvdock.protocol import messages as m
from kvdock.sdk import validate
from kvdock.sdk.connection import Connection, KeyPath, client_curve
from kvdock.sdk.fastpath import Reporter
from kvdock.sdk.handshake import TORCH_DTYPES as TORCH_DTYPES  # re-exported (moved to handshake)
from kvdock.sdk.handshake import dtype_name as dtype_name
from kvdock.sdk.handshake import find_model as find_model
from kvdock.sdk.handshake import register, watch_creator
from kvdock.sdk.transfer import ShmTransfer, Transfer
from kvdock.transport.client import Response

log = logging.getLogger("kvdock.sdk")

_RESTARTABLE = (m.Lookup, m.PrepareStore, m.PrepareRetrieve, m.LookupMany, m.PrepareRetrieveMany, m.Locate)
CLOSE_WAIT_S = 10.0  # how long close() waits for copies in progress before it stops waiting
REWATCH_S = 1.0  # how often a transfer whose server watch hung up tries another


class _TransferRef:
    """The transfer of one registration and how many threads are copying through it. Once
    retired (by close() or a re-registration) it is closed by whoever sees it unused last."""

    __slots__ = ("client_id", "retired", "transfer", "users")

    def __init__(self, transfer: Transfer, client_id: str) -> None:
        self.transfer = transfer
        self.client_id = client_id
        self.users = 0
        self.retired = False


class _Holding:
    """``with ctx.transfer() as t``: a class, not a generator (this is on every copy's path)."""

    __slots__ = ("_answered", "_ctx", "_ref")

    def __init__(self, ctx: KVCacheContext, answered: bool) -> None:
        self._ctx, self._answered = ctx, answered

    def __enter__(self) -> Transfer:
        self._ref = self._ctx.hold_transfer(self._answered)
        return self._ref.transfer

    def __exit__(self, *exc: object) -> None:
        self._ctx.drop_transfer(self._ref)


class KVCacheContext:
    """A connected SDK context (from :func:`connect`). Close it with :func:`close` or ``with``.

    Threads may share a context. Control messages of different threads overlap (a request the
    server holds delays no other thread). Copies through the shared-memory pool go through
    :meth:`transfer`, a reference-counted guard: :meth:`close` and a re-registration after a
    server restart swap the transfer out, and the old one is unmapped only when the last thread
    copying through it has left, so a copy never runs on unmapped memory. A thread that starts a
    copy after close() gets KVCacheSDKError."""

    def __init__(
        self,
        url: str,
        http_url: str,
        lay: m.ModelLayout,
        chunk_size: int,
        conn: Connection,
        client_id: str,
        transfer: Transfer,
    ) -> None:
        self.url = url
        self.http_url = http_url
        self.layout = lay  # as the server registered it (the first registration of the name)
        self.model_name = lay.model_name
        self.chunk_size = chunk_size
        self.geometry = lay.geometry  # the KV this context reads and writes (connect() sets it)
        self.dtype = TORCH_DTYPES[lay.geometry.dtype]
        self.client_id = client_id
        self.timeout = conn.timeout
        # checked here so that an oversized request is refused at once, never sent (the server
        # refuses it too, and drops frames larger than any request)
        self.max_request_tokens = 0
        self.kv_rank: int | None = None  # the rank it reads and writes (None: the whole model)
        self.shard = 0  # the shard whose objects a single-shard context names
        self.shards = 1  # stored chunks per chunk of ``geometry`` (>1: the whole of a sharded model)
        self._conn = conn
        self._ref = _TransferRef(transfer, client_id)
        self._refs = threading.Condition(threading.Lock())  # guards _ref, its counts, _closed
        self._answered = threading.local()  # .client_id: what this thread's last call was answered as
        self._closed = False
        self._reconnect_lock = threading.Lock()
        self.session_ttl = 30.0  # the server's lease of a session (from Describe)
        self.token = ""  # the tenant token it registered with (again after a server restart)
        self._views: set[Any] = set()  # the leases of open zero-copy views (sdk.views)
        # lookups and retrieves may be answered from the pool directory (sdk.fastpath), and
        # what they read is reported to the server, before any request of this context
        self.fast_reads = validate.fast_reads_default()
        # (a weak reference: the reporter's thread must not keep an unclosed context alive)
        me = weakref.ref(self)
        self.reporter = Reporter(conn.send_report, lambda: getattr(me(), "client_id", ""))

    @property
    def transport(self) -> str:
        """``"shm"`` or ``"inline"``: what the server granted this client."""
        return self._ref.transfer.name  # type: ignore[attr-defined, no-any-return]

    @property
    def _transfer(self) -> Transfer:
        """The current transfer, unguarded (for tests that poke at slots); copies use transfer()."""
        return self._ref.transfer

    @property
    def closed(self) -> bool:
        return self._closed

    def transfer(self, answered: bool = True) -> _Holding:
        """``with ctx.transfer() as t:`` — the transfer to copy through, kept mapped until the
        block ends even if another thread closes the context or registers again meanwhile.

        KVCacheSDKError if the context is closed, or (``answered``: the slots come from the
        server's last answer to this thread) if this thread's last request was answered for an
        older registration than the current one (the server restarted in between, so the slots
        it handed out are not in the pool now mapped)."""
        return _Holding(self, answered)

    def hold_transfer(self, answered: bool = True) -> _TransferRef:
        """What :meth:`transfer` does on entry, for a holder that outlives a ``with`` block (a
        zero-copy view): pair it with :meth:`drop_transfer`. Never from a finalizer (it locks)."""
        with self._refs:
            if self._closed:
                raise KVCacheSDKError("this KVCacheContext is closed")
            ref = self._ref
            last = getattr(self._answered, "client_id", None) if answered else None
            if last is not None and last != ref.client_id:
                raise KVCacheSDKError(
                    f"the server at {self.url} restarted during this transfer (nothing was copied); retry"
                )
            ref.users += 1
            return ref

    def drop_transfer(self, ref: _TransferRef) -> None:
        with self._refs:
            ref.users -= 1
            last = ref.retired and ref.users == 0
            self._refs.notify_all()
        if last:
            ref.transfer.close()

    def _retire(self, new: _TransferRef | None) -> None:
        """Swap the current transfer for ``new`` (under _refs); close the old one if unused."""
        old = self._ref
        if new is not None:
            self._ref = new
        old.retired = True
        if old.users == 0:
            old.transfer.close()

    def call(self, msg: msgspec.Struct, payload: Sequence[memoryview] = (), timeout: float | None = None) -> Response:
        """Send one control message (KVCacheSDKError if closed, unreachable or refused), waiting
        up to ``timeout`` (default: the context's) for the reply.

        If the server restarted meanwhile (it no longer knows this client), a request that starts
        a flow (lookup, prepare) registers again and is retried once; a layout that changed with
        the restart raises KVCacheSDKError."""
        if self._closed:
            raise KVCacheSDKError("this KVCacheContext is closed")
        if self.reporter.pending:
            self.reporter.flush()
        stale_id = getattr(msg, "client_id", self.client_id)
        try:
            resp = self._conn.call(msg, payload, timeout)
        except KVCacheSDKError as e:
            if e.code != ErrorCode.UNKNOWN_CLIENT or not isinstance(msg, _RESTARTABLE):
                raise
            resp = None
        if resp is None:
            with self._reconnect_lock:  # threads sharing this context register again only once
                if self.client_id == stale_id:
                    self._reconnect()
            msg = msgspec.structs.replace(msg, client_id=self.client_id)
            resp = self._conn.call(msg, payload, timeout)
        self._answered.client_id = getattr(msg, "client_id", None)
        self._accepted(msg)
        return resp

    def _accepted(self, msg: msgspec.Struct) -> None:
        """The server answered ``msg`` (an error raised before this): the ``cache_salt``
        namespaces it names passed its access checks for the registration it was answered for,
        whose pool directory may now answer reads of them (``Transfer.accepted``, sdk.fastpath)."""
        salt = getattr(msg, "cache_salt", None)
        salts = [salt] if salt is not None else getattr(msg, "cache_salts", None)
        ref = self._ref
        if salts and ref.client_id == getattr(msg, "client_id", None):
            ref.transfer.accept(salts)

    def _reconnect(self) -> None:
        reg = register(self._conn, self.http_url, self.model_name, self.kv_rank, self.token)
        if (reg.geometry, reg.shards, reg.shard, reg.chunk_size) != (
            self.geometry,
            self.shards,
            self.shard,
            self.chunk_size,
        ) or reg.layout.geometry != self.layout.geometry:
            reg.transfer.close()
            self._conn.send_nowait(m.CloseClient(reg.client_id))  # the server registered it already
            raise KVCacheSDKError(f"the server at {self.url} restarted with another layout for {self.model_name!r}")
        mine, theirs = self.layout.fingerprint, reg.layout.fingerprint
        if mine and theirs and mine != theirs:  # the same shapes, another model's KV ("" asserts nothing)
            reg.transfer.close()
            self._conn.send_nowait(m.CloseClient(reg.client_id))
            raise KVCacheSDKError(
                f"the server at {self.url} restarted with another model under {self.model_name!r}: fingerprint "
                f"{theirs} (this context's: {mine})"
            )
        with self._refs:
            closed = self._closed
            if not closed:
                self._retire(_TransferRef(reg.transfer, reg.client_id))
                self.client_id = reg.client_id
        if closed:  # close() ran meanwhile: this registration is not wanted
            reg.transfer.close()
            self._conn.send_nowait(m.CloseClient(reg.client_id))
            raise KVCacheSDKError("this KVCacheContext is closed")
        log.info("server %s restarted; registered again", self.url)
        self.max_request_tokens = reg.max_request_tokens
        self.session_ttl = reg.session_ttl

    def rewatch(self, transfer: Transfer) -> None:
        """If ``transfer`` lost its watch of the server (the local connection it watched hung up)
        while this registration stands, watch the server again through the connection's current
        local channel, when that leads to the process that made the pool (after a server
        restart it does not: the next request registers again). At most every REWATCH_S."""
        if not isinstance(transfer, ShmTransfer) or not transfer.watch_lost:
            return
        now = time.monotonic()
        if now < transfer.rewatch_at:
            return
        transfer.rewatch_at = now + REWATCH_S
        watch = watch_creator(self._conn, transfer.segment)
        if watch is not None:
            log.info("watching the server at %s again: reads use its pool directory", self.url)
            transfer.rewatch(watch)

    def notify(self, msg: msgspec.Struct) -> None:
        """Send a message whose reply nobody waits for (dropped on arrival); no-op once closed."""
        if not self._closed:
            self._conn.send_nowait(msg)

    def answered_client_id(self) -> str:
        """The client id this thread's last request was answered for (a request that registered
        again after a server restart was answered for the new one): end a flow with it."""
        return getattr(self._answered, "client_id", None) or self.client_id

    def end_session(self, session_id: str, client_id: str | None = None) -> None:
        """Best-effort release of a session's pins and reservations (used on error paths);
        ``client_id``: the one the session was opened for (default: the current one)."""
        self.notify(m.EndSession(client_id or self.client_id, session_id))

    @staticmethod
    def new_session_id() -> str:
        return uuid.uuid4().hex

    def track_view(self, lease: Any) -> None:
        """Remember the lease of an open zero-copy view (anything with ``revoke()``), which
        :meth:`close` revokes first; KVCacheSDKError once the context is closing."""
        with self._refs:
            if self._closed:
                raise KVCacheSDKError("this KVCacheContext is closed")
            self._views.add(lease)

    def untrack_view(self, lease: Any) -> None:
        with self._refs:
            self._views.discard(lease)

    def close(self, wait_s: float = CLOSE_WAIT_S) -> None:
        """Stop new requests and copies, revoke open zero-copy views (their tensors read zeros
        from now on), wait up to ``wait_s`` for copies in progress in other threads, then tell the
        server this client is gone, unmap the pool (or leave that to the last copy still running)
        and close the sockets. Requests of other threads still waiting for a reply get
        KVCacheSDKError. Harmless twice."""
        with self._refs:
            if self._closed:
                return
            self._closed = True  # from here on no new transfer, view or request starts
            views = list(self._views)
        for v in views:  # they hold transfers: released before the wait below
            v.revoke()
        with self._refs:
            deadline = time.monotonic() + wait_s
            while self._ref.users and (left := deadline - time.monotonic()) > 0:
                self._refs.wait(left)
            copying = self._ref.users
            if copying:
                log.warning("closing a KVCacheContext while %d copies still run; unmapped after them", copying)
            self._retire(None)
        self.reporter.close()
        # only now: the server must not release a copy's pins while it runs; with no copy left,
        # it may free (not quarantine) the reservations of stores that will now never copy
        self._conn.send_nowait(m.CloseClient(self.client_id, idle=not copying))
        self._conn.close(linger_s=0.5)  # long enough for CloseClient to leave

    def __enter__(self) -> KVCacheContext:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else self.transport
        return f"KVCacheContext({self.model_name!r} at {self.url}, chunk_size={self.chunk_size}, {state})"


def connect(
    url: str,
    http_url: str,
    model_name: str,
    timeout: float = 60.0,
    *,
    kv_rank: int | None = None,
    server_key: KeyPath = None,
    client_key: KeyPath = None,
    token: str | None = None,
) -> KVCacheContext:
    """Connect to a server for ``model_name`` (which must be registered there).

    Reads /config and /status, decodes the model's geometry, maps the shared-memory pool when it
    can and registers as a client. ``kv_rank`` None (the default) reads and writes the whole
    model's KV, ``[2, L, T, num_kv_heads_total * head_dim]`` (``[1, L, T, latent]`` for an MLA
    model, ``KV_1LTD``), whatever the tensor parallelism of the engines that wrote it: for a model
    stored in several shards, each chunk is assembled from (and split into) every shard, and
    counts as cached only when every shard holds it. ``kv_rank=r`` reads and writes what rank
    ``r`` of an engine of the model's world size holds (``ctx.geometry`` is that rank's).

    ``server_key`` (the server's public certificate, ``NAME.key``) and ``client_key`` (this
    client's secret one, ``NAME.key_secret``; both from ``kvdock keygen``) speak CURVE to a server
    that requires it (default: ``KVDOCK_CURVE_SERVER_KEY`` and ``KVDOCK_CURVE_CLIENT_KEY``).
    ``token``: a tenant's token, for a server with tenants when the key does not name the tenant
    (default: ``KVDOCK_TOKEN``).

    Raises ServerUnavailableError, UnknownModelError or KVCacheSDKError (unsupported layout),
    PermissionDeniedError when the server refuses this client's key, InvalidInputError for
    unusable arguments."""
    validate.url(url)
    validate.http_url(http_url)
    validate.model_name(model_name)
    validate.environment()
    rank = validate.kv_rank(kv_rank)
    tok = validate.token(token)
    conn = Connection(url, timeout, client_curve(server_key, client_key))
    try:
        reg = register(conn, http_url, model_name, rank, tok)
    except BaseException:
        conn.close()
        raise
    ctx = KVCacheContext(url, http_url, reg.layout, reg.chunk_size, conn, reg.client_id, reg.transfer)
    ctx.max_request_tokens = reg.max_request_tokens
    ctx.session_ttl = reg.session_ttl
    ctx.token = tok
    ctx.kv_rank, ctx.shard, ctx.shards = reg.kv_rank, reg.shard, reg.shards
    if reg.geometry is not None:
        ctx.geometry = reg.geometry
    return ctx


def close(ctx: KVCacheContext) -> None:
    """Close ``ctx`` (unmap the pool, close sockets). Harmless to call twice."""
    validate.context(ctx).close()

"""KVCacheContext: one SDK connection to one server for one model (the handshake that makes it is
:mod:`kvdock.sdk._handshake`).

A context is its connection and one frozen :class:`~kvdock.sdk._handshake.Registration` (the
layout, chunk size, limits, client id and transfer the server gave it), swapped whole for another
when the context registers again after a server restart. Its plumbing (the reference-counted
guard of the transfer, the typed request call, registering again) is for the SDK's own modules;
what an application reads of it are its properties."""

from __future__ import annotations

import logging
import threading
import time
import uuid
import weakref
from collections.abc import Sequence
from types import TracebackType
from typing import Any, TypeVar

import msgspec
import torch

from kvdock.errors import InvalidInputError, KVCacheSDKError
from kvdock.layout import KVGeometry
from kvdock.protocol import messages as m
from kvdock.sdk import _http, _retry
from kvdock.sdk import _validate as validate
from kvdock.sdk._connection import Connection, KeyPath, open_connection
from kvdock.sdk._fastpath import Reporter
from kvdock.sdk._guard import Held, Holding
from kvdock.sdk._handshake import Registration, register, register_again, release, rewatch
from kvdock.sdk._transfer import Transfer
from kvdock.transport.client import Response

log = logging.getLogger("kvdock.sdk")

CLOSE_WAIT_S = 10.0  # how long close() waits for copies in progress before it stops waiting
R = TypeVar("R", bound=m.ReplyBase)


class KVCacheContext:
    """A connected SDK context (from :func:`connect`). Close it with :func:`close` or ``with``.

    Threads may share a context. Control messages of different threads overlap (a request the
    server holds delays no other thread). Copies through the shared-memory pool go through
    :meth:`transfer`, a reference-counted guard: :meth:`close` and a re-registration after a
    server restart swap the transfer out, and the old one is unmapped only when the last thread
    copying through it has left, so a copy never runs on unmapped memory. A thread that starts a
    copy after close() gets KVCacheSDKError.

    Applications use its properties (:attr:`registration` and its fields), ``fast_reads`` and
    :meth:`close`; the request methods (call, ask, transfer, ...) are the SDK modules' own."""

    def __init__(self, url: str, http_url: str | None, conn: Connection, reg: Registration, token: str = "") -> None:
        self.url = url
        self.http_url = http_url  # None: not given (connect checked it otherwise)
        self.token = token  # the tenant token it registered with (again after a server restart)
        self.timeout = conn.timeout
        self._conn = conn
        self._ref = Held(reg)  # the one current registration: swapped whole, under _refs
        self._refs = threading.Condition(threading.Lock())  # guards _ref, its counts, _closed
        self._answered = threading.local()  # .client_id: what this thread's last call was answered as
        self._closed = False
        self._reconnect_lock = threading.Lock()
        self._views: set[Any] = set()  # the leases of open zero-copy views (sdk.views)
        # lookups and retrieves may be answered from the pool directory (sdk._fastpath), and
        # what they read is reported to the server, before any request of this context
        self.fast_reads = validate.fast_reads_default()
        # (weak references: the reporter's thread and the connection must not keep an unclosed
        # context alive)
        me = weakref.ref(self)
        self.reporter = Reporter(conn.send_report, lambda: getattr(me(), "client_id", ""))
        conn.on_local = lambda: _rewatch(me())

    @property
    def registration(self) -> Registration:
        """The current registration (frozen; replaced whole after a server restart)."""
        return self._ref.reg

    @property
    def client_id(self) -> str:  # (the one place it is held: the registration)
        return self._ref.reg.client_id

    @property
    def layout(self) -> m.ModelLayout:
        """The model's layout as the server registered it (the first registration of the name)."""
        return self._ref.reg.layout

    @property
    def model_name(self) -> str:
        return self._ref.reg.layout.model_name

    @property
    def chunk_size(self) -> int:
        return self._ref.reg.chunk_size

    @property
    def geometry(self) -> KVGeometry:
        """The KV this context reads and writes (the whole model's, or rank ``kv_rank``'s)."""
        return self._ref.reg.geometry

    @property
    def dtype(self) -> torch.dtype:
        return self._ref.reg.dtype

    @property
    def kv_rank(self) -> int | None:
        """The rank it reads and writes (None: the whole model)."""
        return self._ref.reg.kv_rank

    @property
    def shard(self) -> int:
        """The shard whose objects a single-shard context names."""
        return self._ref.reg.shard

    @property
    def shards(self) -> int:
        """Stored chunks per chunk of ``geometry`` (>1: the whole of a sharded model)."""
        return self._ref.reg.shards

    @property
    def max_request_tokens(self) -> int:
        """The server's limit of tokens per request (0: not advertised): checked here so that an
        oversized request is refused at once, never sent."""
        return self._ref.reg.max_request_tokens

    @property
    def session_ttl(self) -> float:
        """The server's lease of a session."""
        return self._ref.reg.session_ttl

    @property
    def transport(self) -> str:
        """``"shm"`` or ``"inline"``: what the server granted this client."""
        return self._ref.reg.transfer.name  # type: ignore[attr-defined, no-any-return]

    @property
    def _transfer(self) -> Transfer:
        """The current transfer, unguarded (for tests that poke at slots); copies use transfer()."""
        return self._ref.reg.transfer

    @property
    def closed(self) -> bool:
        return self._closed

    def transfer(self, answered: bool = True) -> Holding:
        """``with ctx.transfer() as t:`` — the transfer to copy through, kept mapped until the
        block ends even if another thread closes the context or registers again meanwhile.

        KVCacheSDKError if the context is closed, or (``answered``: the slots come from the
        server's last answer to this thread) if this thread's last request was answered for an
        older registration than the current one (the server restarted in between, so the slots
        it handed out are not in the pool now mapped)."""
        return Holding(self, answered)

    def _hold_transfer(self, answered: bool = True) -> Held:
        """What :meth:`transfer` does on entry, for a holder that outlives a ``with`` block (a
        zero-copy view): pair it with :meth:`_drop_transfer`. Never from a finalizer (it locks)."""
        with self._refs:
            if self._closed:
                raise KVCacheSDKError("this KVCacheContext is closed")
            ref = self._ref
            last = getattr(self._answered, "client_id", None) if answered else None
            if last is not None and last != ref.reg.client_id:
                raise KVCacheSDKError(
                    f"the server at {self.url} restarted during this transfer (nothing was copied); retry"
                )
            ref.users += 1
            return ref

    def _drop_transfer(self, ref: Held) -> None:
        with self._refs:
            ref.users -= 1
            last = ref.retired and ref.users == 0
            self._refs.notify_all()
        if last:
            ref.transfer.close()

    def _retire(self, new: Held | None) -> None:
        """Swap the current registration for ``new`` (under _refs); close the old one's transfer if unused."""
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
            if not _retry.registers_again(msg, e):
                raise
            resp = None
        if resp is None:
            with self._reconnect_lock:  # threads sharing this context register again only once
                if self.client_id == stale_id:
                    self._reconnect()
            msg = msgspec.structs.replace(msg, client_id=self.client_id)
            resp = self._conn.call(msg, payload, timeout)
        self._answered.client_id = getattr(msg, "client_id", None)
        self._ref.reg.accepted(msg)
        return resp

    def ask(self, msg: m.RequestBase[R], payload: Sequence[memoryview] = (), timeout: float | None = None) -> R:
        """:meth:`call`, typed: the reply of the type ``msg``'s op declares (``RequestBase[R]``)."""
        return self.call(msg, payload, timeout).reply  # type: ignore[no-any-return]

    def ask_frames(self, msg: m.RequestBase[R], timeout: float | None = None) -> tuple[R, list[memoryview]]:
        """:meth:`ask`, with the payload frames that came with the reply (an inline read's bytes)."""
        resp = self.call(msg, (), timeout)
        return resp.reply, resp.frames

    def _reconnect(self) -> None:
        """Register again (the server restarted): the new registration replaces the current one
        whole, if it is of the same layout and model (KVCacheSDKError otherwise)."""
        reg = register_again(self._conn, self._ref.reg, self.url, self.token)
        with self._refs:
            closed = self._closed
            if not closed:
                self._retire(Held(reg))
        if closed:  # not wanted: close() ran meanwhile (the server registered it already)
            release(self._conn, reg)
            raise KVCacheSDKError("this KVCacheContext is closed")
        log.info("server %s restarted; registered again", self.url)

    def notify(self, msg: msgspec.Struct) -> None:
        """Send a message whose reply nobody waits for (dropped on arrival); no-op once closed."""
        if not self._closed:
            self._conn.send_nowait(msg)

    def _answered_client_id(self) -> str:
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

    def _track_view(self, lease: Any) -> None:
        """Remember the lease of an open zero-copy view (anything with ``revoke()``), which
        :meth:`close` revokes first; KVCacheSDKError once the context is closing."""
        with self._refs:
            if self._closed:
                raise KVCacheSDKError("this KVCacheContext is closed")
            self._views.add(lease)

    def _untrack_view(self, lease: Any) -> None:
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
        self._conn.send_nowait(m.CloseClient(self._ref.reg.client_id, idle=not copying))
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
    http_url: str | None,
    model_name: str,
    timeout: float = 60.0,
    *,
    kv_rank: int | None = None,
    server_key: KeyPath = None,
    client_key: KeyPath = None,
    token: str | None = None,
) -> KVCacheContext:
    """Connect to a server for ``model_name`` (which must be registered there).

    The handshake runs over the control plane at ``url`` (``tcp://HOST:PORT`` or ``ipc://PATH``):
    it asks the server to describe itself and the model, maps the shared-memory pool when it can
    and registers as a client. When nothing listens at ``url`` it fails at once
    (ServerUnavailableError; so does a socket that takes no connection within 3 s); ``timeout``
    is how long a server that answers may take (for every later request too).

    ``http_url`` (``http://HOST:PORT``, the server's HTTP API: ``/config``, ``/status``,
    ``/metrics``) is not needed to connect: pass None to leave it out. When given, connect checks
    that a kvdock server's HTTP API answers there with the chunk size of the server ``url``
    reached and, when that server offered this client its named pool, the same pool (so another
    server's HTTP API is refused even with the same settings); ServerUnavailableError naming it
    otherwise (a server with tenants shows its ``/config`` only with a token, and is then only
    checked to answer). It is kept as ``ctx.http_url``.

    ``kv_rank`` None (the default) reads and writes the whole
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
    http = validate.http_url(http_url)
    validate.model_name(model_name)
    validate.environment()
    rank = validate.kv_rank(kv_rank)
    tok = validate.token(token)
    conn = open_connection(url, timeout, server_key, client_key)
    try:
        reg = register(conn, model_name, rank, tok)
    except BaseException:
        conn.close()
        raise
    ctx = KVCacheContext(url, http, conn, reg, tok)
    if http is not None:
        try:
            _http.check(http, reg.chunk_size, conn.timeout, tok, reg.shm_name)
        except BaseException:
            ctx.close()
            raise
    return ctx


def checked(ctx: object) -> KVCacheContext:
    """``ctx`` must be what :func:`connect` returned (InvalidInputError otherwise)."""
    if not isinstance(ctx, KVCacheContext):
        raise InvalidInputError(f"ctx must be a KVCacheContext from kvdock.sdk.connect(), got {type(ctx).__name__}")
    return ctx


def close(ctx: KVCacheContext) -> None:
    """Close ``ctx`` (unmap the pool, close sockets). Harmless to call twice."""
    checked(ctx).close()


def _rewatch(ctx: KVCacheContext | None) -> None:
    """The connection has a new local channel: watch the server through it (``rewatch``)."""
    if ctx is None:
        return
    try:
        with ctx.transfer(answered=False) as t:
            rewatch(ctx._conn, t)
    except KVCacheSDKError:
        pass  # closed meanwhile

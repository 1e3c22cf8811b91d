"""Zero-copy reads: the cached prefix as read-only tensors on the server's pool, copied nowhere.

    with kvd.view(ctx, tokens) as kv:        # one round trip, whatever the size
        k0 = kv.chunk(0)[0]                  # [L, chunk_size, D], a view of the slot itself
        full = kv.tensor()                   # a gathered copy, when one is wanted after all

How it stays correct:

* **Pinned while open.** The prefix's objects are pinned by a retrieve session, and a thread of
  the context renews the leases of all its open views every ``session_ttl / 3`` s (one
  message), so no eviction or overwrite frees them.
* **Read-only.** The tensors map the pool through a mapping of their own made with
  ``PROT_READ``: a write into one is a SIGSEGV of this process, never a corrupted cache. Clone a
  tensor to change it.
* **Never other bytes after the end.** When the view closes (the ``with`` block ends,
  :meth:`PrefixView.close`, the context closes, or the view is garbage collected), its mapping
  is replaced by zero pages *before* the pins are released: tensors kept past the block read
  zeros, never whatever the slots hold next. So does a view whose lease the server reports
  gone (found at the next renewal).
* **Checked.** If the process was paused past the lease (SIGSTOP, swapped out), the server may
  have reused a slot while the tensors still showed it. :meth:`PrefixView.verify` (called by
  ``close()`` and at the end of the block) compares the slots' generations with those handed
  out and raises LeaseExpiredError when any moved: whatever the block computed from the view
  must then be discarded.

Needs the shared-memory transport (a client on the server's machine); KVCacheSDKError otherwise.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import queue
import threading
import time
import warnings
import weakref
from collections.abc import Iterator
from types import TracebackType
from typing import Any

import torch

from kvdock.errors import KVCacheSDKError, LeaseExpiredError
from kvdock.memcpy import Copier, blank
from kvdock.protocol import messages as m
from kvdock.protocol.codes import ErrorCode
from kvdock.sdk import _validate as validate
from kvdock.sdk._requests import keyed, prepare, whole_chunks
from kvdock.sdk._transfer import ShmTransfer
from kvdock.sdk.buffers import buffer_pool
from kvdock.sdk.context import KVCacheContext, checked

log = logging.getLogger("kvdock.sdk")

RENEWALS_PER_TTL = 3


class _Lease:
    """What a view, its context and its keeper share: the session, the transfer it holds, the
    read-only mapping and whether it was released. ``lock`` orders the blanking of the mapping
    against letting it go: once ``released``, nobody touches the mapping's addresses again.
    Never used from a finalizer (it locks): a dropped view's lease is queued for its keeper."""

    def __init__(
        self, ctx: KVCacheContext, client_id: str, session_id: str, hold: Any, mm: mmap.mmap, addr: int
    ) -> None:
        self.ctx, self.client_id, self.session_id, self.hold = ctx, client_id, session_id, hold
        self.mm: mmap.mmap | None = mm
        self.addr, self.size = addr, -(-len(mm) // mmap.PAGESIZE) * mmap.PAGESIZE  # what mmap mapped
        self.lock = threading.Lock()
        self.released = False
        self.revoked = False  # released by the context's close(), not by the view's owner
        self.lost = False  # the server no longer holds the session: the mapping was blanked

    def lose(self) -> None:
        """The server no longer holds the pins (or soon will not): blank the mapping now."""
        with self.lock:
            if not self.released and not self.lost:
                blank(self.addr, self.size)
                self.lost = True

    def release(self, revoked: bool = False) -> None:
        """Blank the mapping, then let the pins and the transfer go. Harmless twice. If the
        blank fails (OSError), nothing is let go: the keeper keeps the pins and the error rises."""
        with self.lock:
            if self.released:
                return
            if not self.lost:
                blank(self.addr, self.size)
            self.released, self.revoked = True, revoked
        _keeper(self.ctx).forget(self)
        self.ctx._untrack_view(self)
        self.ctx.notify(m.CommitRetrieve(self.client_id, self.session_id))  # a no-op once closed
        self.ctx._drop_transfer(self.hold)
        # never closed here: tensors on the mapping hold a reference to it (not a buffer export),
        # so closing would unmap memory they point into; it goes when the last of them does
        self.mm = None

    def revoke(self) -> None:
        """The context closes (see KVCacheContext.close)."""
        self.release(revoked=True)


class _Keeper:
    """Renews the leases of a context's open views, in one message (per MAX_RENEW sessions)
    every ``session_ttl / 3`` seconds, and releases the leases of views that were garbage
    collected (their finalizers only queue them: ``dropped.put`` is safe there), on one thread
    that runs while any lease is kept."""

    def __init__(self, ctx: KVCacheContext) -> None:
        self._ctx = weakref.ref(ctx)
        self._lock = threading.Lock()
        self._leases: set[_Lease] = set()
        self.dropped: queue.SimpleQueue[_Lease] = queue.SimpleQueue()
        self._running = False

    def keep(self, lease: _Lease) -> None:
        with self._lock:
            self._leases.add(lease)
            if self._running:
                return
            self._running = True
        threading.Thread(target=self._run, name="kvdock-view-leases", daemon=True).start()

    def forget(self, lease: _Lease) -> None:
        with self._lock:
            self._leases.discard(lease)

    def _run(self) -> None:
        due = time.monotonic() + _interval(self._ctx())
        while True:
            try:
                ctx = self._ctx()
                interval = _interval(ctx)
                del ctx
                with contextlib.suppress(queue.Empty):
                    self.dropped.get(timeout=max(0.0, due - time.monotonic())).release()
                    continue
                with self._lock:
                    leases = list(self._leases)
                    if not leases:
                        self._running = False
                        return
                ctx = self._ctx()
                if ctx is None or ctx.closed:  # its close() revoked the live ones; these are gone too
                    for lease in leases:
                        lease.lose()
                        lease.release(revoked=True)
                    continue
                self.renew(ctx, leases, timeout=interval)
                del ctx
                due = time.monotonic() + interval
            except Exception:  # never die: the leases would lapse and the slots be reused silently
                log.exception("the view-lease thread hit an error; going on")
                due = time.monotonic() + 0.1

    @staticmethod
    def renew(ctx: KVCacheContext, leases: list[_Lease], timeout: float) -> None:
        by_client: dict[str, dict[str, _Lease]] = {}
        for lease in leases:
            by_client.setdefault(lease.client_id, {})[lease.session_id] = lease
        for client_id, mine in by_client.items():
            sids = list(mine)
            for at in range(0, len(sids), m.MAX_RENEW):
                part = sids[at : at + m.MAX_RENEW]
                try:
                    gone = ctx.ask(m.RenewSessions(client_id, part), timeout=timeout).gone
                except KVCacheSDKError as e:
                    if e.code != ErrorCode.UNKNOWN_CLIENT:  # unreachable for now: the leases may still hold
                        log.warning("could not renew the leases of %d view(s): %s", len(part), e)
                        continue
                    gone = part  # the server restarted or forgot the client: the pins are gone
                for sid in gone:
                    mine[sid].lose()


def _interval(ctx: KVCacheContext | None) -> float:
    return max((ctx.session_ttl if ctx is not None else 30.0) / RENEWALS_PER_TTL, 0.05)


_keepers: weakref.WeakKeyDictionary[KVCacheContext, _Keeper] = weakref.WeakKeyDictionary()
_keepers_lock = threading.Lock()


def _keeper(ctx: KVCacheContext) -> _Keeper:
    with _keepers_lock:
        keeper = _keepers.get(ctx)
        if keeper is None:
            keeper = _keepers[ctx] = _Keeper(ctx)
        return keeper


class PrefixView:
    """The cached whole-chunk prefix of some tokens, mapped read-only (from :func:`view`).

    ``num_tokens`` tokens in ``len(view)`` chunks; :meth:`chunk` gives chunk ``i`` as a
    ``[2, L, chunk_size, D]`` tensor on the slot itself. Valid until :meth:`close`; thread-safe
    for reading. A snapshot: an overwrite of the tokens acknowledged while the view is open does
    not change it (as it does not change a tensor retrieved before)."""

    def __init__(self, ctx: KVCacheContext, client_id: str, session_id: str, slots: list[m.SlotRef]) -> None:
        self._ctx = ctx
        self.chunk_size = ctx.chunk_size
        self.num_tokens = len(slots) * ctx.chunk_size
        self.dtype = ctx.dtype
        self._slots = slots
        self._shape = ctx.geometry.chunk_shape(ctx.chunk_size)
        self._nbytes = ctx.geometry.chunk_nbytes(ctx.chunk_size)
        self._lease: _Lease | None = None
        self._reported = False
        if not slots:
            return
        hold = lease = None
        try:
            hold = ctx._hold_transfer()
            transfer = hold.transfer
            if not isinstance(transfer, ShmTransfer):
                raise KVCacheSDKError("view() maps the server's shared memory; this context uses the inline transport")
            self._transfer = transfer
            # only the span of its slots: a view costs address space for what it shows, not the pool
            lo = min(s.offset for s in slots) // mmap.PAGESIZE * mmap.PAGESIZE
            hi = max(s.offset for s in slots) + self._nbytes
            self._lo = lo
            try:
                mm = transfer.map_readonly(lo, hi - lo)
            except OSError as e:
                raise KVCacheSDKError(f"cannot map the server's pool read-only: {e}") from None
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="The given buffer is not writable")
                self._base = torch.frombuffer(mm, dtype=torch.uint8)
            lease = _Lease(ctx, client_id, session_id, hold, mm, self._base.data_ptr())
            ctx._track_view(lease)  # KVCacheSDKError if the context is closing
            keeper = _keeper(ctx)
            keeper.keep(lease)
        except BaseException:
            if lease is not None:
                lease.release()
            else:
                if hold is not None:
                    ctx._drop_transfer(hold)
                ctx.notify(m.CommitRetrieve(client_id, session_id))
            raise
        self._lease = lease
        weakref.finalize(self, keeper.dropped.put, lease).atexit = False

    def __len__(self) -> int:
        return len(self._slots)

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (self.chunk(i) for i in range(len(self)))

    @property
    def closed(self) -> bool:
        return self._lease is None or self._lease.released

    def chunk(self, index: int) -> torch.Tensor:
        """Chunk ``index`` (tokens ``[index * chunk_size, (index + 1) * chunk_size)``) as a
        read-only ``[2, L, chunk_size, D]`` tensor on its slot. IndexError out of range,
        KVCacheSDKError once closed."""
        if not 0 <= index < len(self._slots):
            raise IndexError(f"chunk {index} of a view of {len(self._slots)} chunks")
        if self.closed:
            raise KVCacheSDKError("this view is closed")
        off = self._slots[index].offset - self._lo
        return self._base[off : off + self._nbytes].view(self.dtype).view(self._shape)

    def tensor(self, layers: range | None = None) -> torch.Tensor:
        """A gathered copy ``[2, len(layers), num_tokens, D]`` (all layers by default), checked
        with :meth:`verify` after the copy."""
        picked = validate.layers(self._ctx, layers)
        p, _, c, d = self._shape
        out = buffer_pool().empty((p, len(picked), self.num_tokens, d), self.dtype)
        copier = Copier()
        for i in range(len(self)):
            copier.add(out[:, :, i * c : (i + 1) * c], self.chunk(i)[:, picked.start : picked.stop : picked.step])
        copier.run()
        self.verify()
        return out

    def verify(self) -> None:
        """LeaseExpiredError if the view is no longer sound: a slot was handed to another object
        since it opened, the server no longer holds its pins, or it was released (its context
        closed) while in use. What was read from it may then be wrong (or zeros)."""
        lease = self._lease
        if lease is None:
            return
        with lease.lock:  # a release waits: the transfer stays mapped while its generations are read
            if lease.released:
                raise LeaseExpiredError(
                    "this view was released (its context closed?) while in use: discard what was read"
                )
            if lease.lost:
                raise LeaseExpiredError(
                    "the server released this view's pins (its lease ran out): discard what was read"
                )
            moved = self._transfer.moved(self._slots)
        if moved:
            raise LeaseExpiredError(
                f"{len(moved)} slot(s) of this view were reused while it was open (was the process paused "
                "past the lease?): what was read from it may be another object's bytes; discard it"
            )

    def close(self) -> None:
        """Check the view (:meth:`verify`), then release it: its tensors read zeros from now on
        and the server may evict the prefix. Raises LeaseExpiredError from the check, after
        releasing, and once if the context revoked the view while it was open. Harmless twice."""
        lease = self._lease
        if lease is None:
            return
        if lease.released:
            if lease.revoked and not self._reported:
                self._reported = True
                raise LeaseExpiredError(
                    "this view was revoked by its context's close() while open: discard what was read"
                )
            return
        try:
            self.verify()
        finally:
            lease.release()

    def revoke(self) -> None:
        """Release the view for its context's close(); its owner's close() then raises."""
        if self._lease is not None:
            self._lease.revoke()

    def __enter__(self) -> PrefixView:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.close()
            return
        with contextlib.suppress(LeaseExpiredError):  # the block's own error comes first
            self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed and self._slots else "open"
        return f"PrefixView({self.num_tokens} tokens in {len(self)} chunks, {state})"


def view(ctx: KVCacheContext, tokens: object, cache_salt: str = "") -> PrefixView:
    """The longest cached whole-chunk prefix of ``tokens``, pinned and mapped read-only without a
    copy (see the module docstring); an empty view (``num_tokens == 0``) when nothing is cached.
    Use it as a context manager. Raises KVCacheSDKError on the inline transport, and what
    :func:`~kvdock.sdk.retrieve` raises for bad input."""
    ctx = checked(ctx)
    validate.whole_model_only(ctx, "a zero-copy view")
    arr, cache_salt = keyed(ctx, validate.tokens(tokens), validate.cache_salt(cache_salt))
    whole = whole_chunks(ctx, arr)
    if ctx.transport != "shm":
        raise KVCacheSDKError(
            "view() maps the server's shared memory; this context uses the inline transport "
            "(another host, or a server started with --no-shm): use retrieve()"
        )
    if not whole:
        return PrefixView(ctx, ctx.client_id, "", [])
    sid = ctx.new_session_id()
    msg = m.PrepareRetrieve(ctx.client_id, sid, whole, cache_salt, wait_s=ctx.timeout / 2)
    slots = list(prepare(ctx, sid, msg)[0].slots)
    return PrefixView(ctx, ctx._answered_client_id(), sid, slots)

"""Lookups and retrieves answered from the pool directory, without a round trip to the server.

A shared-memory client whose server publishes a directory of its readable L1 objects
(:mod:`kvdock.shm.directory`) looks a prompt's chunk keys up there itself, and a retrieve copies
the slots it found straight away. That saves the round trip (0.08-0.10 ms between two processes
on a 2-vCPU VM before any work) and the server's work per request. The answer is the server's:

* only while the process that created the segment still holds our local connection, and
  before the segment's ``valid_until_ns`` (``ShmTransfer.directory``): a directory of a server
  that is gone may show KV that a server started since has overwritten. Checked before the
  directory is read and again after the copy, before anything is returned (:func:`vouched`,
  one function for both): a read that spans a server restart is never answered from the old
  pool;
* only for a ``cache_salt`` the server accepted from this registration (``ShmTransfer.accepted``:
  on a tenant's pool, once a request naming it was answered; a server without tenants has a
  named pool, where every salt is accepted), so that a tenant's client is refused another
  tenant's salt by the server, exactly as with fast reads off, never told it is a miss;
* only for a full hit (every whole chunk is published and the version chain holds), or when the
  directory says for sure that nothing past the chunks found is cached (no lower tier, nothing
  unindexed): the next chunk is not published, or its version does not chain (an older or
  newer version of its prefix; looked at twice, as an overwrite's commit rewrites a prefix chunk
  by chunk). Otherwise (a partial hit that L2 or L3 may extend, an entry being rewritten) these
  functions return None and the caller asks the server;
* a retrieve checks every slot's generation after its copy (``ShmTransfer.read``): a slot
  freed meanwhile (evicted, replaced by an overwrite) means None, and the caller asks the
  server, whose answer then goes to the sink again (a sink can be handed garbage for some chunks
  before it gets the real ones: the same contract as a copy that outlives its lease).

The server is told what it would have seen (its counters, the client's lease, and the LRU order of
what a retrieve copied) by a :class:`Reporter`: :class:`~kvdock.protocol.messages.FastReads`
messages (never answered), each covering the reads of up to ``FLUSH_S`` and sent before any other
request of the context, so one client's eviction order is the same as through the server. (A
message per read would cost the reader more than the read: a send wakes the server.) No session
is opened and nothing is pinned: the generation check is what makes the copy safe.

``ctx.fast_reads = False`` (or ``KVDOCK_FAST_READS=0`` before connecting) sends every read to
the server; so does a server started with ``--no-fast-reads``.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from kvdock.errors import LeaseExpiredError
from kvdock.keys import TOKEN_DTYPE, chunk_hashes, namespace_digest
from kvdock.protocol import messages as m
from kvdock.sdk._retry import DIRECTORY_LOOKS
from kvdock.sdk._transfer import ShmTransfer, Transfer, layer_slice
from kvdock.sdk.chunks import ChunkSink
from kvdock.shm.directory import DirectoryReader, Found

if TYPE_CHECKING:
    from kvdock.sdk.context import KVCacheContext

log = logging.getLogger("kvdock.sdk")


FLUSH_S = 0.001  # a reading thread sends what is held once the oldest read is this old
IDLE_FLUSH_S = 0.02  # ... and the reporter's own thread once it is this old (no read came since)
MAX_HELD = 4096  # chunks a Reporter holds before it sends them
PER_MESSAGE = 512  # chunks one FastReads lists: ~14 KiB, written to a socket whole or not at all
MAX_KEPT = 1 << 16  # chunks kept for a server that does not read (older ones' LRU touches are dropped)


class Reporter:
    """The reads of one context the server has not been told of yet, sent as FastReads: by the
    next reading thread once the oldest is FLUSH_S old (or MAX_HELD chunks are held), by
    :meth:`flush` (the context calls it before each of its requests, so a thread's next request
    reaches the server after the reads it did before, as a rule: a report goes over the local
    socket when that takes it at once, else over zmq), at :meth:`close`, and else by a thread of
    the reporter once the oldest is IDLE_FLUSH_S old. That thread wakes rarely (about twice per
    IDLE_FLUSH_S while reads go on, once a second otherwise): on 2 CPUs every wake-up of a second
    Python thread costs the reading thread a GIL hand-over. It holds the reporter only weakly,
    and ends once the reporter is gone (a context dropped without close()).

    ``send`` never waits (``Connection.send_report``): what it cannot send now stays held for
    the next try (the counts all of it, the LRU touches at most MAX_KEPT chunks). A message
    lists at most PER_MESSAGE chunks, so a socket takes it whole or not at all. Thread-safe; not
    across fork()."""

    def __init__(self, send: Callable[[m.FastReads], bool], client_id: Callable[[], str]) -> None:
        self._send, self._client_id = send, client_id
        self._cond = threading.Condition(threading.Lock())
        self._since = 0.0  # when the oldest held read was added; 0: nothing held
        self._counts = [0, 0, 0, 0, 0]  # lookups, retrieves, asked, hit, nbytes
        self._entries: list[int] = []
        self._offsets: list[int] = []
        self._gens: list[int] = []
        self._thread: threading.Thread | None = None
        self._asleep = False  # the thread waits for something to be held (it needs a notify)
        self.closed = False

    @property
    def pending(self) -> bool:
        return self._since != 0.0

    def add(self, asked: int, hit: int, found: Found | None = None, nbytes: int = 0) -> None:
        """A lookup (``found`` None) or a retrieve of ``found`` (``nbytes`` copied) was answered."""
        now = time.monotonic()
        with self._cond:
            c = self._counts
            if found is None:
                c[0] += 1
            elif hit:
                c[1] += 1
                self._entries += found.entries.tolist()
                self._offsets += found.offsets.tolist()
                self._gens += found.gens.tolist()
            c[2] += asked
            c[3] += hit
            c[4] += nbytes
            if not self._since:
                self._since = now
                self._wake()
            due = now - self._since >= FLUSH_S or len(self._entries) >= MAX_HELD
        if due:
            self.flush()

    def _wake(self) -> None:  # under _cond: something is held now
        if self.closed:
            return
        if self._thread is None:
            args = (weakref.ref(self), self._cond)
            self._thread = threading.Thread(target=_report_idle, args=args, name="kvdock-fast-reads", daemon=True)
            self._thread.start()
        elif self._asleep:
            self._cond.notify()

    def due(self) -> float | None:
        """Under ``_cond``: seconds until what is held is IDLE_FLUSH_S old (<= 0: now), None if
        nothing is held."""
        return self._since + IDLE_FLUSH_S - time.monotonic() if self._since else None

    def flush(self) -> bool:
        """Send what is held (nothing if nothing is), in messages of at most PER_MESSAGE chunks;
        what cannot be sent now is held again (then False)."""
        with self._cond:
            if not self._since:
                return True
            since, counts = self._since, self._counts
            entries, offsets, gens = self._entries, self._offsets, self._gens
            self._since, self._counts = 0.0, [0, 0, 0, 0, 0]
            self._entries, self._offsets, self._gens = [], [], []
        client_id = self._client_id()
        for at in range(0, max(len(entries), 1), PER_MESSAGE):
            cut = slice(at, at + PER_MESSAGE)
            lookups, retrieves, asked, hit, nbytes = counts
            report = m.FastReads(
                client_id, lookups, retrieves, asked, hit, entries[cut], offsets[cut], gens[cut], nbytes
            )
            try:
                sent = self._send(report)
            except Exception as e:  # never raised into a read: a lost report costs counts and LRU order
                log.debug("a FastReads report was not sent: %s", e)
                sent = True  # (dropped)
            if not sent:  # the server does not read, or another thread is sending: later
                self._hold_again(since, counts, entries[at:], offsets[at:], gens[at:])
                return False
            counts = [0, 0, 0, 0, 0]  # counted once, with the first message
        return True

    def _hold_again(
        self, since: float, counts: list[int], entries: list[int], offsets: list[int], gens: list[int]
    ) -> None:
        with self._cond:
            self._since = min(self._since or since, since)
            self._counts = [a + b for a, b in zip(self._counts, counts, strict=True)]
            self._entries[:0], self._offsets[:0], self._gens[:0] = entries, offsets, gens
            if len(self._entries) > MAX_KEPT:  # the oldest reads' touches go, their counts stay
                drop = len(self._entries) - MAX_KEPT
                del self._entries[:drop], self._offsets[:drop], self._gens[:drop]

    def close(self) -> None:
        """Send what is held and stop the thread. Harmless twice."""
        with self._cond:
            self.closed = True
            self._cond.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        self.flush()


def _report_idle(ref: weakref.ref[Reporter], cond: threading.Condition) -> None:
    """The reporter's thread: sends what is held once it is IDLE_FLUSH_S old (if it cannot,
    tries again IDLE_FLUSH_S later); ends when the reporter is closed or gone (it holds it only
    while it looks at it)."""
    retry_at = 0.0
    while True:
        with cond:
            reporter = ref()
            if reporter is None or reporter.closed:
                return
            left = reporter.due()
            if left is not None:
                left = max(left, retry_at - time.monotonic())
            if left is None or left > 0:
                reporter._asleep = left is None
                del reporter  # not kept while waiting
                cond.wait(1.0 if left is None else left)
                continue
        if not reporter.flush():
            retry_at = time.monotonic() + IDLE_FLUSH_S
        del reporter


def vouched(ctx: KVCacheContext, t: Transfer, cache_salt: str) -> DirectoryReader | None:
    """The pool directory if a read of ``cache_salt`` may be answered from it now, else None (ask
    the server): fast reads are on, a chunk is one stored object, the server accepted
    ``cache_salt`` from this registration (tenants' salts: ``Transfer.accepted``), and it
    publishes the directory, is alive and vouches for it (``Transfer.directory``: the watch of its
    local connection, ``valid_until_ns``). The one check of a fast read, made before the
    directory is read and again once the answer is copied, before it is returned: an answer
    stands only if all of this held from before the read to after it."""
    if not ctx.fast_reads or ctx.shards > 1 or not t.accepted(cache_salt):
        return None
    return t.directory()


def _find(ctx: KVCacheContext, t: Transfer, whole: bytes, cache_salt: str) -> Found | None:
    """The directory's answer for the whole chunks ``whole`` (token bytes), if it is final."""
    directory = vouched(ctx, t, cache_salt)
    if directory is None:  # (a watch that hung up is replaced by the context, not here: _handshake.rewatch)
        return None
    hashes = b"".join(chunk_hashes(np.frombuffer(whole, TOKEN_DTYPE), ctx.chunk_size))
    ns = namespace_digest(ctx.model_name, ctx.shard, cache_salt)
    found = directory.find(ns, hashes, t.chunk_nbytes)
    for _ in range(DIRECTORY_LOOKS - 1):  # an overwrite's commit rewrites a prefix chunk by chunk (_retry)
        if found.ended != "broken":
            break
        found = directory.find(ns, hashes, t.chunk_nbytes)
    if found.ended == "all" or (found.ended in ("absent", "broken") and directory.complete):
        return found
    return None


def lookup(ctx: KVCacheContext, whole: bytes, cache_salt: str) -> int | None:
    """How many leading tokens of ``whole`` are cached (as ``Lookup`` would answer), or None:
    ask the server."""
    return _read(ctx, whole, cache_salt)


def retrieve(
    ctx: KVCacheContext,
    whole: bytes,
    cache_salt: str,
    make_sink: Callable[[int], ChunkSink],
    part: m.ReadPart | None,
) -> int | None:
    """Copy the cached prefix of ``whole`` to ``make_sink(hit tokens)`` as ``PrepareRetrieve``
    would hand it out (``part`` of each chunk) and return the hit in tokens, or None: ask the
    server (nothing was copied, or what was may be garbage)."""
    return _read(ctx, whole, cache_salt, make_sink, part)


def _read(
    ctx: KVCacheContext,
    whole: bytes,
    cache_salt: str,
    make_sink: Callable[[int], ChunkSink] | None = None,
    part: m.ReadPart | None = None,
) -> int | None:
    """A lookup (no ``make_sink``) or a retrieve answered from the directory, reported."""
    if not ctx.fast_reads or ctx.shards > 1:  # (a chunk of several shards: see server.shards)
        return None
    nbytes = 0
    with ctx.transfer(answered=False) as t:
        found = _find(ctx, t, whole, cache_salt)
        if found is None:
            return None
        if make_sink is not None and found.count:
            sink = make_sink(found.count * ctx.chunk_size)
            try:
                assert isinstance(t, ShmTransfer)  # the only one with a directory
                t.read_at(found.offsets, found.gens, sink, part)
            except LeaseExpiredError:  # a slot was freed during the copy
                return None
        # the same checks again, after the copy: a server restarted since the first (its pool,
        # still mapped here, unchanged, may hold what the new one has overwritten) is not believed
        if vouched(ctx, t, cache_salt) is None:
            return None
        if make_sink is not None:
            layers = len(range(ctx.geometry.num_layers)[layer_slice(part)])
            copied = max(found.count - (part.first_chunk if part else 0), 0)
            nbytes = copied * t.chunk_nbytes // ctx.geometry.num_layers * layers
    asked = len(whole) // TOKEN_DTYPE.itemsize // ctx.chunk_size
    ctx.reporter.add(asked, found.count, found if make_sink is not None else None, nbytes)
    return found.count * ctx.chunk_size

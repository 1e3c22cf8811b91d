"""Coherence of a fleet of servers sharing one L3: what an overwrite on one server does to the
others, and within which bound.

**The guarantee.** Once ``store(..., overwrite=True)`` has returned on any server, no server that
shares its L3 returns the replaced version from a read that starts more than ``bound`` later
(``--l3-coherence-ms``, 100 ms by default): not from L1, not from its pool directory (fast reads),
not from L2, not from L3. A server that cannot tell (L3 unreachable, its poller late) answers from
no tier until it can: misses, never stale KV.

**How.** One Redis stream (``STREAM_KEY``, on the cluster node of its hash slot) lists the
*invalidations*: an overwrite appends its keys twice, before and after it deletes them from L3
(:meth:`Coherence.invalidate`). Every server polls the stream every ``bound / 5`` from its own
thread (:meth:`Coherence.poll`) and applies each entry on the event loop before it reads the next
(the manager drops the entry's keys from L1 and L2 unless its copy is newer, and supersedes loads
of them in flight). A poll that was *sent* at ``t`` and found nothing left to read proves that the
server knows every overwrite acknowledged before ``t``: the server serves L1 and L2 only while
``now < t + bound`` (:meth:`vouched`), and writes that instant into its pool segments' header for
the fast readers (``valid_until_ns``).

**Epochs.** Stream entries are ordered by their ids (``ms-seq``, kept here as one int:
``ms << 64 | seq``). An object gets an *epoch* when it becomes readable in L1: the last position
its server had applied (for an object loaded from a lower tier: at the start of the load; for an
overwrite's new version: its own second entry). Applying entry ``E`` drops the copies whose epoch
is below ``E``: those committed or read before their server knew of the overwrite.

**Fenced writes.** A write-down queued before its server learned of an overwrite could still reach
L3 after the overwrite deleted the key. So the overwrite's deletion sets a per-key *floor* (the id
of its first entry) in the same script, and every write-down carries its server's position when
it was issued (read before the lane checks that the object is still live): L3 refuses a write
whose position is below the floor. A server that had applied the first entry has dropped the
object already, so its write-down never starts. The floor lives ``floor_ttl_ms``
(``--l3-floor-ttl-ms``, 60 s); a write is also refused once it is older than ``ISSUE_LIMIT_MS``
(by L3's clock, estimated from the last poll), so a floor that expired cannot let a stalled write
through.

**Holding an overwrite's version** (storage.keeping). A server serves a copy of an overwrite's
version only while it keeps that overwrite's floor alive in L3; when the floor is gone it drops
its copy (a miss). Such versions carry their E2 (``L1Object.overwrite``, the header's
``overwrite``); every ``refresh_s`` (TTL / 6) their holders refresh the floors in one pipelined
round (KEEP_SCRIPT), write a value L3 lost again, and drop a copy whose floor is gone or raised
or whose value is another version. While it holds any, a server vouches only until ``lease_s``
(TTL / 2) after its last round was sent (:meth:`vouched`, :meth:`until`): a floor it kept outlives
that. So a plain store elsewhere, refused while a floor is live with no value (storage.redis
``floored``), can no longer land while a server serves the overwrite, except after Redis evicted
a floor refreshed less than a round ago with its value: at most ``refresh_s`` of two versions.

**Gaps.** The stream keeps ``MAXLEN`` entries. A server whose position was trimmed away (down for
long), or whose L3 lost the stream (restarted empty), cannot know what it missed: it drops every
L1 object and clears its L2 (logged, counted in ``full_drops``). L2 survives restarts: the
position whose deletions L2 has completed is kept in ``<disk dir>/coherence.pos``; a restart
replays the stream from there (an L2 without that file is cleared).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvdock.keys import ObjectKey
from kvdock.storage._coherence_lua import (
    DELETE_SCRIPT,
    FLOOR_TTL_MS,
    INCARNATION_KEY,
    ISSUE_LIMIT_MS,
    KEEP_SCRIPT,
    POLL_COUNT,
    POLL_SCRIPT,
    PUBLISH_SCRIPT,
    STREAM_KEY,
    WRITE_SCRIPT,
)
from kvdock.storage.stream import (
    Fence,
    Invalidation,
    PollResult,
    decode_keys,
    encode_keys,
    fresh_incarnation,
    pos_int,
    pos_text,
)

__all__ = [
    "COMMIT_MARGIN_MS",
    "DELETE_SCRIPT",
    "FLOOR_TTL_MS",
    "ISSUE_LIMIT_MS",
    "KEEP_SCRIPT",
    "RECENT_MS",
    "STREAM_KEY",
    "WRITE_SCRIPT",
    "Coherence",
    "CoherenceCounters",
]


@dataclass
class CoherenceCounters:
    polls: int = 0
    poll_errors: int = 0
    entries: int = 0  # invalidations applied (other servers' and our own)
    dropped: int = 0  # L1 objects dropped by them
    full_drops: int = 0  # gaps: everything dropped
    lapses: int = 0  # times the server stopped vouching (poller late or L3 unreachable)
    published: int = 0  # entries this server appended
    keep_rounds: int = 0  # rounds of KEEP for the overwrites' versions held here (storage.keeping)
    keep_dropped: int = 0  # versions dropped by them (their floor gone or raised, or L3 holds another)
    keep_repaired: int = 0  # versions written to L3 again (their floor kept, their value gone)


# how long after another server's overwrite of a key a plain store of it here is refused (in
# flight): that overwrite's commit and write-down to L3 normally land well within it
RECENT_MS = 10_000
# an overwrite is committed only within RECENT_MS - this of its second entry (Coherence.too_late)
COMMIT_MARGIN_MS = 2_000
LOOKBACK_COUNT = 100_000  # entries of the last RECENT_MS a starting server reads at most


@dataclass
class Coherence:
    """The invalidation stream for one server (see the module docstring). ``client`` returns the
    redis-py client (raises while L3 cannot be reached). Thread-safety: ``position`` and
    ``vouched_until`` are plain attributes written by the event loop and read by any thread;
    :meth:`poll` and :meth:`invalidate` run on worker threads (I/O)."""

    client: Callable[[], Any]
    bound_s: float = 0.1
    clock: Callable[[], float] = time.monotonic
    floor_ttl_ms: int = FLOOR_TTL_MS  # how long a floor lives in L3 unless refreshed (--l3-floor-ttl-ms)
    held: int = 0  # overwrites' versions this server holds in L1 (storage.keeping; event loop)
    kept_until: float = 0.0  # monotonic; while ``held``, L1/L2 are served only before it (the lease)
    kept_sent: float | None = None  # when the last complete KEEP round was sent (None: none yet)
    position: int = 0  # the last entry applied
    consumed: int = 0  # entries-added of the stream up to ``position``
    vouched_until: float = 0.0  # monotonic; L1/L2 are served only before it
    started: bool = False  # the first poll was applied (position valid)
    failing: bool = False  # the last poll failed (L3 unreachable)
    resume: bool = False  # ``position`` was kept by an earlier run: read on from it, not from the tip
    counters: CoherenceCounters = field(default_factory=CoherenceCounters)
    own: set[int] = field(default_factory=set)  # entries this server appended, not yet applied
    incarnation: bytes = b""  # the stream's (INCARNATION_KEY), as this server first saw it
    _vouched_ms: int | None = None  # L3's clock when the last poll that vouched ran (None: none yet)
    _vouched_sent: float = 0.0  # and ``clock()`` when that poll was sent
    # keys other servers overwrote lately: L3's clock (ms) of the last entry (event loop only)
    recent: OrderedDict[ObjectKey, int] = field(default_factory=OrderedDict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def interval_s(self) -> float:
        return self.bound_s / 5

    @property
    def refresh_s(self) -> float:
        """How often the floors of the overwrites' versions held here are kept (storage.keeping)."""
        return self.floor_ttl_ms / 6000

    @property
    def lease_s(self) -> float:
        """How long after a KEEP round was sent this server may serve what it held (half the TTL:
        every floor it kept lives at least that long)."""
        return self.floor_ttl_ms / 2000

    def vouched(self) -> bool:
        """[any] Whether every overwrite acknowledged more than ``bound`` ago is applied here and,
        while this server holds overwrites' versions, their floors were kept less than the lease
        ago (storage.keeping)."""
        now = self.clock()
        return now < self.vouched_until and (not self.held or now < self.kept_until)

    def until(self) -> float:
        """[any] The monotonic instant until which this server vouches now (its pool segments'
        ``valid_until_ns``)."""
        return min(self.vouched_until, self.kept_until) if self.held else self.vouched_until

    def hold(self, sent: float, held: int) -> None:
        """[loop] A version is held (``held`` now), its floor known live at ``sent`` (its overwrite's second
        step, or the KEEP of its load): the first one starts the lease (later ones are covered by
        the next round; a lapsed lease is not renewed by them)."""
        if not self.held:
            self.kept_until = sent + self.lease_s
        self.held = held

    def kept(self, sent: float, held: int) -> None:
        """[loop] A KEEP round sent at ``sent`` is applied; ``held`` versions are held now."""
        self.held = held
        self.kept_until = max(self.kept_until, sent + self.lease_s)
        self.kept_sent = sent
        self.counters.keep_rounds += 1

    def fence(self, epoch: int) -> Fence:
        """[any] The fence for a write-down of an object of ``epoch``, issued now: the position
        applied, and L3's clock when the server last knew it complete (so that L3 refuses the
        write once that is ISSUE_LIMIT_MS old: a stalled poller, or a write stuck on its way)."""
        with self._lock:
            issued = self._vouched_ms if self._vouched_ms is not None else 0
        return Fence(max(self.position, epoch), issued, self.incarnation)

    # --- worker threads ----------------------------------------------------------------------

    def poll(self) -> PollResult:
        """[worker] Read the entries after our position (raises redis-py errors)."""
        sent = self.clock()
        now, inc, added, last, _first, _length, raw = self.client().eval(
            POLL_SCRIPT, 2, STREAM_KEY, INCARNATION_KEY, pos_text(self.position), POLL_COUNT, fresh_incarnation()
        )
        added, last_pos = int(added), pos_int(last)
        self.counters.polls += 1
        if not self.incarnation:
            self.incarnation = inc
        recent = self._lookback(int(now)) if not self.started else ()
        if not self.started and not self.resume:  # no position of our own: start at the tip
            return PollResult(sent, int(now), [], False, last_pos, added, True, recent)
        caught_up = len(raw) < POLL_COUNT
        lost = (
            inc != self.incarnation
            or last_pos < self.position
            or added < self.consumed
            # every entry added after our position must be there to read: a trim, an XDEL or a
            # stream deleted and started again shows as fewer
            or (caught_up and added - self.consumed != len(raw))
        )
        if lost:
            self.incarnation = inc
            return PollResult(sent, int(now), [], True, last_pos, added, True, recent or self._lookback(int(now)))
        entries = []
        for entry_id, fields in raw:
            data = dict(zip(fields[::2], fields[1::2], strict=True)).get(b"k", b"")
            entries.append(Invalidation(pos_int(entry_id), decode_keys(data)))
        pos = entries[-1].position if entries else self.position
        return PollResult(sent, int(now), entries, False, pos, self.consumed + len(entries), caught_up, recent)

    def _lookback(self, now_ms: int) -> tuple[Invalidation, ...]:
        """[worker] The stream's entries of the last RECENT_MS (the newest LOOKBACK_COUNT), oldest first."""
        raw = self.client().xrevrange(STREAM_KEY, "+", f"{max(now_ms - RECENT_MS, 0)}-0", count=LOOKBACK_COUNT)
        seen = [Invalidation(pos_int(entry_id), decode_keys(fields.get(b"k", b""))) for entry_id, fields in raw]
        return tuple(reversed(seen))  # oldest first

    def publish(self, keys: list[ObjectKey], run: Callable[..., Any] | None = None) -> int:
        """[worker] Append an invalidation of ``keys``; its position. ``run(key, *eval args)``
        runs the script (on a cluster: and WAITs on the same connection for a replica to have
        it, raising if none does); by default the client's ``eval``."""
        args = (PUBLISH_SCRIPT, 2, STREAM_KEY, INCARNATION_KEY, encode_keys(keys), fresh_incarnation())
        entry_id = run(STREAM_KEY, *args) if run is not None else self.client().eval(*args)
        pos = pos_int(entry_id)
        with self._lock:
            self.own.add(pos)
        self.counters.published += 1
        return pos

    # --- the event loop ----------------------------------------------------------------------

    def applied(self, result: PollResult) -> None:
        """[loop] ``result``'s entries were applied (by the manager): advance."""
        self.position, self.consumed = result.position, result.consumed
        self.started = True
        self.counters.entries += len(result.entries)
        with self._lock:
            self.own = {p for p in self.own if p > self.position}  # (ours applied, or never to come)

    def vouch(self, result: PollResult) -> None:
        """[loop] After :meth:`applied`: a poll that read everything there was vouches for every
        overwrite acknowledged before it was sent, for ``bound``."""
        if result.caught_up:
            self.vouched_until = max(self.vouched_until, result.sent + self.bound_s)
            with self._lock:
                self._vouched_ms = result.redis_ms
                self._vouched_sent = result.sent

    def l3_now_ms(self) -> float | None:
        """[loop] L3's clock now as this server estimates it (its last vouching poll's reading plus
        the time since that poll was sent: never behind, a pause included); None before any."""
        if self._vouched_ms is None:
            return None
        return self._vouched_ms + (self.clock() - self._vouched_sent) * 1000

    def note_foreign(self, keys: list[ObjectKey], position: int) -> None:
        """[loop] Another server's invalidation of ``keys`` was applied (see :meth:`recently_overwritten`)."""
        ms = position >> 64
        for key in keys:
            self.recent[key] = ms
            self.recent.move_to_end(key)
        now = self.l3_now_ms()
        while self.recent and now is not None and next(iter(self.recent.values())) < now - RECENT_MS:
            self.recent.popitem(last=False)

    def recently_overwritten(self, key: ObjectKey) -> bool:
        """[loop] Whether another server overwrote ``key`` less than :data:`RECENT_MS` ago: its
        overwrite may not be committed or written down to L3 yet, so a plain store of the key here
        (which no longer holds it) would keep other bytes than that server (a store refuses it:
        in flight)."""
        ms = self.recent.get(key)
        if ms is None:
            return False
        now = self.l3_now_ms()
        return now is None or now - ms < RECENT_MS

    def too_late(self, position: int) -> bool:
        """[loop] Whether an overwrite whose second entry is at ``position`` comes too late to be
        committed: other servers stop refusing plain stores of its keys :data:`RECENT_MS` after
        that entry (:meth:`recently_overwritten`, their clock estimates over by up to a poll's
        delay: :data:`COMMIT_MARGIN_MS`), and one stored then would keep other bytes than this
        overwrite for good (R-FLEET). Unknown before this server's first vouching poll: False."""
        now = self.l3_now_ms()
        return now is not None and now - (position >> 64) > RECENT_MS - COMMIT_MARGIN_MS

    def is_own(self, position: int) -> bool:
        with self._lock:
            return position in self.own

    def status(self) -> dict[str, Any]:
        c = self.counters
        return {
            "bound_ms": round(self.bound_s * 1000, 3),
            "vouched": self.vouched(),
            "failing": self.failing,
            "position": pos_text(self.position),
            "polls": c.polls,
            "poll_errors": c.poll_errors,
            "entries_applied": c.entries,
            "l1_dropped": c.dropped,
            "full_drops": c.full_drops,
            "lapses": c.lapses,
            "published": c.published,
            "floor_ttl_ms": self.floor_ttl_ms,
            "held": self.held,
            "keep_round_age_s": None if self.kept_sent is None else round(self.clock() - self.kept_sent, 3),
            "keep_rounds": c.keep_rounds,
            "keep_dropped": c.keep_dropped,
            "keep_repaired": c.keep_repaired,
        }

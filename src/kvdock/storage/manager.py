"""StorageManager: the one owner of an object's life, in L1 and in every lower tier.

It owns the L1 store, the sessions (every pin and reservation a client holds), the lanes of the
lower tiers (write-down, deletion, loads) and the per-key records that all of them consult:

* ``loads`` (storage.loads): reservations being filled from a lower tier. An overwrite
  supersedes them (the load's bytes are thrown away), and a store never reserves a key that a
  load holds;
* ``deletions`` (storage.deletions): keys whose older version is being deleted from the lower
  tiers for an overwrite. No lookup counts them and no load reads them there until every
  deletion is done.

The read-only chain queries are storage.chains; applying the fleet's invalidations is
storage.invalidations.

Why an acknowledged overwrite is final, before and after a crash:

1. at PrepareStore the old L1 version of every chunk the overwrite cannot write (pool full)
   stops being visible (at the commit, that of every chunk it reserved but does not commit), and
   each lane queues a durable deletion of every overwritten key;
2. a lane applies its jobs one at a time, and that deletion lands after every write-down of an
   older version: it cancels those queued and waits for one in flight (see :mod:`kvdock.storage.lane`);
3. CommitStore makes the new versions visible and is acknowledged only after every deletion is
   done; if a tier cannot delete (Redis down) the overwrite is refused and nothing is stored.

So after the acknowledgement no tier holds an older version, and a crash can only lose the new
one (a miss), never bring back the old one. Every chunk also stays one version: L1 commits a
store's chunks in one step of the event loop, and lookups stop at the first missing chunk.

Not thread-safe: the event loop only (the lanes' threads never call back in here).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from operator import itemgetter

from kvdock.errors import SessionError
from kvdock.keys import ObjectKey
from kvdock.layout import KVGeometry
from kvdock.storage.chains import Chains
from kvdock.storage.coherence import Coherence
from kvdock.storage.commits import to_commit
from kvdock.storage.deletions import Deletion, Deletions
from kvdock.storage.drain import drain_lanes
from kvdock.storage.invalidations import apply_invalidations
from kvdock.storage.keeping import Holdings
from kvdock.storage.lane import SharedHeader, TierLane, check_dirty
from kvdock.storage.loads import Loads
from kvdock.storage.memory import L1Object, L1Store
from kvdock.storage.plans import OVERWRITING, SUPERSEDED, Chain, Placement, StorePlan
from kvdock.storage.reservations import reserve
from kvdock.storage.sessions import PrefetchJob, Session, SessionTable, Writer
from kvdock.storage.stream import PollResult, pos_text
from kvdock.storage.tier import Head

log = logging.getLogger(__name__)

__all__ = ["OVERWRITING", "SUPERSEDED", "Chain", "Placement", "PrefetchJob", "StorageManager", "StorePlan"]


class StorageManager:
    def __init__(
        self,
        l1: L1Store,
        session_ttl: float,
        lanes: list[TierLane] | None = None,
        geometry_of: Callable[[str], KVGeometry | None] = lambda model: None,
        chunk_size: int = 0,
        clock: Callable[[], float] = time.monotonic,
        coherence: Coherence | None = None,
    ) -> None:
        self.l1 = l1
        # the fleet's invalidations (a shared L3): L1 and L2 are read only while it vouches
        self.coherence = coherence
        self.sessions = SessionTable(l1, session_ttl, clock)
        self.lanes = lanes or []
        # the registry's answer: a model's geometry; with chunk_size, what a stored chunk holds
        self.geometry_of = geometry_of
        self.chunk_size = chunk_size
        # keys whose older version is being deleted from the lower tiers (and tiers being cleared)
        self.deletions = Deletions()
        self.loads = Loads(
            l1, self.sessions, self.deletions, geometry_of, chunk_size, self._readable, self._epoch, self.vouched
        )
        self.chains = Chains(l1, self.lanes, self.deletions, self._readable, self.vouched)
        # the overwrites' versions held here, kept in L3 (storage.keeping): with the fleet's coherence
        held = Holdings.make(l1, self.lanes, self.deletions, coherence, geometry_of, chunk_size, self._write_down)
        self.holdings = self.loads.holdings = held

    @property
    def session_count(self) -> int:
        return len(self.sessions)

    # --- lookup ------------------------------------------------------------------------------

    def lookup_l1(self, keys: list[ObjectKey]) -> int:
        """Number of leading chunks of ``keys`` that are READY in L1 and form one version chain."""
        return len(self.chains.l1_run(keys))

    def l1_hit(self, keys: list[ObjectKey]) -> Chain:
        """:meth:`lookup_l1`, with the version the rest must chain to (see :meth:`count`)."""
        run = self.chains.l1_run(keys)
        return Chain(len(run), run[-1].version if run else 0)

    def vouched(self) -> bool:
        """Whether L1 and L2 may be read: always, unless servers share an L3 and this one has not
        applied every overwrite acknowledged more than the bound ago (storage.coherence)."""
        return self.coherence is None or self.coherence.vouched()

    def _epoch(self) -> int:  # (storage.coherence)
        return self.coherence.position if self.coherence is not None else 0

    def _readable(self) -> list[TierLane]:
        """The lower tiers reads may use now: those up, less this host's own (L2) while a gap in
        the fleet's invalidations has it cleared or while the server does not vouch for it
        (storage.coherence); the shared tier (L3) is always current."""
        local_ok = not self.deletions.clearing and self.vouched()
        return [lane for lane in self.lanes if lane.tier.up() and (local_ok or not lane.tier.indexed)]

    async def count(self, keys: list[ObjectKey], start: Chain) -> int:
        """How many leading ``keys`` are cached in any tier as one version chain, given that the
        first ``start.count`` were in L1 when ``start`` was taken (storage.chains)."""
        return (await self.chains.chain(keys, start)).count

    async def chain(self, keys: list[ObjectKey], start: Chain) -> Chain:
        """:meth:`count`, with the version of the run's last chunk (storage.chains)."""
        return await self.chains.chain(keys, start)

    async def locate(self, keys: list[ObjectKey]) -> tuple[list[list[Placement]], list[str]]:
        """Every object stored under each key, per tier, and the tiers down (storage.chains)."""
        return await self.chains.locate(keys)

    # --- store -------------------------------------------------------------------------------

    def prepare_store(
        self,
        client_id: str,
        session_id: str,
        keys: list[ObjectKey],
        nbytes: int,
        overwrite: bool = False,
        writer: Writer | None = None,
        below: dict[ObjectKey, Head] | None = None,
        open_empty: bool = False,
        limit: int | None = None,
        edited: bool = False,
        pending: set[ObjectKey] | None = None,
    ) -> StorePlan:
        """Reserve slots for the chunks of ``keys`` that need writing, in order, until the pool is
        full. Chunks already stored are pinned until the commit, so that making room for the new
        ones never evicts the prefix they extend. With ``overwrite``, every chunk is written anew;
        the older versions of chunks that find no room stop being visible now, those of chunks
        reserved but not committed at the commit (never a prefix of mixed versions); an overwrite
        of a prefix that another client is writing reserves nothing, all chunks ``in_flight``.
        ``writer`` is the client process that fills the slots itself (shared memory); its slots
        are quarantined if its lease runs out. ``below``: heads read from the tiers without an
        index (:meth:`unindexed_heads`), so that a chunk only they hold is deduped too. ``limit``
        (a plain store: storage.plans.write_limit): no chunk from that index on is written, they
        are counted ``diverged``. ``edited`` (PrepareStore.edited): a plain store's versions carry
        the EDITED bit too. ``pending`` (storage.chains ``pending_overwrites``): keys a plain store
        does not write (in flight), as an overwrite elsewhere is writing them.

        Opens a session when at least one slot is reserved (always with ``open_empty``: one shard
        of a request whose commit must also wait for its deletions); SessionError if the id is in
        use. One shard of :meth:`prepare_stores`."""
        shard = (session_id, keys, below)
        return self.prepare_stores(client_id, [shard], nbytes, overwrite, writer, open_empty, limit, edited, pending)[0]

    def prepare_stores(
        self,
        client_id: str,
        shards: list[tuple[str, list[ObjectKey], dict[ObjectKey, Head] | None]],
        nbytes: int,
        overwrite: bool = False,
        writer: Writer | None = None,
        open_empty: bool = False,
        limit: int | None = None,
        edited: bool = False,
        pending: set[ObjectKey] | None = None,
    ) -> list[StorePlan]:
        """:meth:`prepare_store` of every shard of one request, (session id, keys, below) each, in
        this one step, with ONE deletion of all their older versions: one invalidation (E1, E2)
        names every shard's keys, so the fleet orders two overwrites of a chunk the same way for
        all its shards and the commit decides them together (R-KEEP 2 and 5: per-shard entries let
        one writer's shard 0 end beside another's shard 1)."""
        for sid, _, _ in shards:  # before anything is reserved for them
            if self.sessions.in_use(client_id, sid):
                raise SessionError(f"session {sid!r} is already open")
        if overwrite and any(self.contended(keys) for _, keys, _ in shards):
            # Writing the chunks around another client's in-flight write would commit a prefix of
            # two versions: the overwrite writes nothing, and says the whole prefix is contended.
            return [StorePlan([], 0, len(keys), 0) for _, keys, _ in shards]
        l1, epoch = self.l1, self._epoch()
        coh, busy = self.coherence, pending or set()
        recent = (lambda k: k in busy or coh.recently_overwritten(k)) if coh is not None else None
        plans: list[StorePlan] = []
        opened: list[Session] = []
        replaced: list[ObjectKey] = []
        try:
            for sid, keys, below in shards:
                args = (epoch, keys, nbytes, overwrite, below, limit, edited, recent)
                got = reserve(l1, self.loads, self.deletions, self.chains, *args)
                replaced += got.replaced
                plans.append(got.plan)
                if got.plan.slots or open_empty:
                    slots = dict(got.plan.slots)
                    session = self.sessions.open(client_id, sid, reserved=slots, pinned=got.kept, writer=writer)
                    session.overwrite = overwrite
                    opened.append(session)
                else:
                    for obj in got.kept:
                        self.l1.unpin(obj)
        except BaseException:
            for session in opened:
                self.end_session(client_id, session.session_id)
            raise
        finally:  # (the old versions reserve replaced go, whatever happens)
            deletes = self._delete_everywhere(replaced) if replaced else []
            for session in opened:
                session.deletes = deletes
        return plans

    @property
    def has_unindexed_tier(self) -> bool:
        return any(not lane.tier.indexed and lane.tier.up() for lane in self.lanes)

    async def unindexed_heads(self, keys: list[ObjectKey]) -> dict[ObjectKey, Head]:
        """The heads of the leading ``keys`` the first reachable tier without an index holds (one
        round trip), for :meth:`prepare_store`'s ``below``."""
        lanes = [lane for lane in self.lanes if lane.tier.up()]
        return dict(zip(keys, await self.chains.remote_heads(lanes, keys), strict=False))

    def contended(self, keys: list[ObjectKey]) -> bool:
        """Whether another client is writing any of ``keys`` now (an overwrite reserves nothing)."""
        return any(self._written_by_other(key) for key in keys)

    def _written_by_other(self, key: ObjectKey) -> bool:
        pending = self.l1.reservation(key)
        return pending is not None and pending not in self.loads

    def _delete_everywhere(self, keys: list[ObjectKey], lanes: list[TierLane] | None = None) -> list[Deletion]:
        """Queue the deletion of ``keys`` in every lane (or those given); none of them is counted
        by lookups nor loaded from a lower tier until it is done."""
        return self.deletions.queue(keys, self.lanes if lanes is None else lanes)

    def reservations(self, client_id: str, session_id: str, indexes: list[int]) -> list[L1Object]:
        """The reserved objects for chunk ``indexes`` of a store session (renews its lease).

        Raises SessionError for an unknown session or an index it did not reserve; a session
        whose lease ran out has its quarantined slots released here (its copy is over)."""
        if self.sessions.release_quarantine(client_id, session_id):
            raise SessionError(f"session {session_id!r}: its lease ran out before the commit; nothing was stored")
        session = self.sessions.get(client_id, session_id)
        if len(set(indexes)) != len(indexes):
            raise SessionError(f"chunk indexes repeat in {indexes}")
        try:
            return [session.reserved[i] for i in indexes]
        except KeyError as e:
            raise SessionError(f"chunk {e.args[0]} was not reserved by session {session_id!r}") from None

    async def wait_deletes(self, client_id: str, session_id: str) -> bool:
        """Wait for the deletions an overwrite queued (the lease waits too); whether all were done."""
        session = self.sessions.get(client_id, session_id)
        if not session.deletes:
            return True
        self.sessions.hold(session)
        try:
            results = await asyncio.gather(*session.deletes)
        finally:
            self.sessions.unhold(session)
        return all(r is not None for r in results)

    def commit_store(self, client_id: str, session_id: str, indexes: list[int], deletes_ok: bool = True) -> int:
        """Make the listed chunks READY (and queue their write-down), drop the session's other
        reservations, end the session. The caller awaits :meth:`wait_deletes` first and passes
        its answer: an overwrite whose older versions could not all be deleted is refused
        (RequestError ``tier_unavailable``) and stores nothing."""
        return self.commit_stores(client_id, [(session_id, indexes)], deletes_ok)

    def commit_stores(self, client_id: str, work: list[tuple[str, list[int]]], deletes_ok: bool = True) -> int:
        """:meth:`commit_store` of several sessions (one request's shards) in one step, their
        chunks committed and written down chunk-major (chunk 0 of every shard, then chunk 1...):
        write-downs and dirty evictions (newest first) then never keep one shard's tail while
        another shard's head goes (issue 28 R3). An overwrite commits all its shards or none, a plain
        store each chunk in all shards or none (storage.commits)."""
        # every shard or none (storage.commits: R-KEEP 2 and 5)
        ordered = sorted(to_commit(self, client_id, work, deletes_ok), key=itemgetter(0, 1))  # (chunk, shard)
        objs = [obj for _, _, obj in ordered]
        self.l1.commit(*objs)  # (in this order, each as if alone)
        units: dict[int, int] = {}  # a chunk's shards: dirty evictions take them together (L1Object.unit)
        for i, _, obj in ordered:
            obj.unit = units.setdefault(i, obj.seq) if len(work) > 1 else 0
        if self.holdings is not None:  # (an overwrite's: its floor was raised before the commit)
            self.holdings.add(objs)
        self._write_down(objs)
        for sid, indexes in work:
            session = self.sessions.get(client_id, sid)
            committed = set(indexes)
            session.reserved = {i: o for i, o in session.reserved.items() if i not in committed}
            self.end_session(client_id, sid)
        return len(objs)

    def _write_down(self, objs: list[L1Object], lanes: list[TierLane] | None = None) -> None:
        for obj in objs if self.lanes else []:
            geo = self.geometry_of(obj.key.model)
            assert geo is not None and geo.chunk_nbytes(self.chunk_size) == obj.nbytes
            view = self.l1.view(obj)
            over = pos_text(obj.overwrite) if obj.overwrite else ""  # (an overwrite's E2: storage.keeping)
            header = SharedHeader(obj.key, geo, self.chunk_size, view, Head(obj.version, obj.parent, over))
            for lane in self.lanes if lanes is None else lanes:
                lane.write(obj, header, view)

    # --- retrieve ----------------------------------------------------------------------------

    def open_retrieve(self, client_id: str, session_id: str, keys: list[ObjectKey]) -> Session:
        """Open a retrieve session pinning the leading READY run of ``keys`` (possibly none)."""
        session = self.sessions.open(client_id, session_id, keys=list(keys))
        for obj in self.chains.l1_run(keys):
            self.l1.pin(obj)
            session.pinned.append(obj)
        return session

    def start_prefetch(self, session: Session) -> PrefetchJob | None:
        """Load the session's keys past its pinned run from the lower tiers into L1, in order,
        pinning each for the session, until the first miss; None when there is nothing to do."""
        if not self.lanes or len(session.pinned) >= len(session.keys):
            return None
        job = PrefetchJob(session)
        session.job = job
        self.loads.prefetch(job)
        return job

    def commit_retrieve(self, client_id: str, session_id: str) -> int:
        """Release a retrieve session's pins; returns how many objects it pinned."""
        n = len(self.sessions.get(client_id, session_id).pinned)
        self.end_session(client_id, session_id)
        return n

    # --- the fleet's invalidations (storage.coherence) ----------------------------------------

    def apply(self, result: PollResult) -> list[Awaitable[object]]:
        """Apply one poll of the invalidation stream (storage.invalidations); L2's deletions."""
        assert self.coherence is not None
        return apply_invalidations(result, self.coherence, self.l1, self.loads, self.deletions, self.lanes)

    # --- session ends (the session table releases what they hold) ----------------------------

    def end_session(self, client_id: str, session_id: str) -> bool:
        """The client ended a session (or a handler aborts it); see SessionTable.end."""
        return self.sessions.end(client_id, session_id)

    # --- operations --------------------------------------------------------------------------

    async def clear(self, tier: str) -> dict[str, int]:
        """Drop every object from L1 (``"l1"``), one lower tier by name, or ``"all"`` of them."""
        removed = {}
        if tier in ("all", "l1"):
            removed["l1"] = self.l1.clear()
        for lane in self.lanes:
            if tier in ("all", lane.name):
                removed[lane.name] = await lane.clear()
        return removed

    async def drain(self, abort: asyncio.Event | None = None) -> bool:
        """Finish every queued write-down (at shutdown), with no time limit unless ``abort`` is set;
        logs progress and what was dropped (storage.drain). False if aborted."""
        return await drain_lanes(self.lanes, abort)

    def close(self) -> None:
        for lane in self.lanes:
            lane.close()

    def check_integrity(self) -> None:
        """Assert L1's invariants, each tier's, and that every pin and reservation is held by
        exactly one session, lane, load or quarantine."""
        self.l1.check_integrity()
        pins, held = self.sessions.holdings()
        held += len(self.loads)
        for lane in self.lanes:
            lane.check_integrity()
        self.loads.check_integrity()
        for obj in self.l1.pinned_objects():
            assert pins.pop(id(obj), 0) == obj.pins, "pin count does not match the sessions holding it"
        assert not pins, "a session pins an object the store does not know"
        assert self.l1.reserved_count() == held, "a reservation belongs to no session, load or quarantine"
        self.deletions.check_integrity()
        check_dirty(self.l1, self.lanes)  # (storage.lane: dirty counts match the write-downs)

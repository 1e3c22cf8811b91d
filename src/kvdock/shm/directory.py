"""The pool's directory: which READY L1 object each key maps to, readable without asking the server.

A lookup or a one-chunk retrieve that asks the server pays a round trip between two processes
(0.08-0.10 ms on a 2-vCPU VM, before any work), more than the copy of a 512 KiB chunk. So the
segment holds a directory of the readable L1 objects, and shared-memory clients answer lookups
and copy slots straight from it (``kvdock.sdk._fastpath``), telling the server afterwards.

Contract (the correctness of those reads rests on it):

* one writer: the server's L1 store, on its event loop (:class:`Directory`). An object is
  published when it becomes READY and unpublished before its key stops being readable (evicted,
  deleted, replaced, cleared) and before its slot is freed. A READY object's slot is never
  written, so the bytes a published entry points to are that object's for as long as the slot's
  generation is the one the entry names;
* an entry is (namespace digest, chunk hash) -> (slot offset, slot generation, nbytes, version,
  parent), read and written under a per-entry seqlock (``kvdock._directory``);
* a reader that copies a slot it found must then check the slot's generation in the
  generation table (:meth:`kvdock.sdk._transfer.ShmTransfer.read` does): unchanged means nobody
  was handed the slot since the entry was published, so it copied that object;
* the directory may be incomplete: a key whose bucket is full is not published, and the state
  word UNINDEXED counts such objects. Not finding a key means "not in L1" only while the state
  says COMPLETE (the server has no lower tier) and UNINDEXED is 0; else the reader asks the
  server;
* a directory only means something while its server runs: a reader must know that the process
  that created the segment is alive (``transport.local.PeerWatch``), else a server started after
  it may have overwritten what this one still shows.

The state words live in the segment header (:data:`kvdock.shm.segment.STATE_OFFSET`): FLAGS
(``LIVE``: the server publishes; ``COMPLETE``: no lower tier) and UNINDEXED.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvdock import _directory  # type: ignore[attr-defined]
from kvdock.shm.segment import BUCKET, ENTRY_SIZE, PoolSegment

assert _directory.ENTRY_SIZE == ENTRY_SIZE and _directory.BUCKET == BUCKET

LIVE = 1  # the server publishes its READY objects here
COMPLETE = 2  # the server has no lower tier: what L1 does not hold is not cached at all
W_FLAGS, W_UNINDEXED = 0, 1  # the state words
BYTES_PER_ENTRY = 16 << 10  # one entry per 16 KiB of slot area
MIN_ENTRIES = 1024
# one object to publish (Directory.publish): ns, chunk, offset, gen, nbytes, version, parent
Listed = tuple[bytes, bytes, int, int, int, int, int]


def entries_for(data_size: int) -> int:
    """How many entries a pool of ``data_size`` bytes gets: one per BYTES_PER_ENTRY of slot area,
    rounded up to a power of two, at least MIN_ENTRIES (128 B each: 0.8% of the pool). Smaller
    chunks than that fill some buckets; their objects are then read through the server."""
    want = max(MIN_ENTRIES, -(-data_size // BYTES_PER_ENTRY))
    return 1 << (want - 1).bit_length()


@dataclass(frozen=True)
class Entry:
    """One published entry, as a reader sees it."""

    ns: bytes
    chunk: bytes
    offset: int
    gen: int
    nbytes: int
    version: int
    parent: int


@dataclass(frozen=True)
class Found:
    """What :meth:`DirectoryReader.find` found of one prompt: the first ``count`` chunks, with
    their entries, slot offsets and slot generations; ``ended``: "all" (every chunk), "absent"
    (the next chunk is not published), "broken" (it is, but does not chain to the one before: another version of
    its prefix) or "unsure" (it cannot be vouched for: its entry kept changing while it was read,
    or it names no slot of this model)."""

    count: int
    entries: np.ndarray  # int64
    offsets: np.ndarray  # int64
    gens: np.ndarray  # uint64
    ended: str


_ENDED = ("all", "absent", "unsure", "broken")
_SEQ, _CHUNK0, _NS0, _OFFSET = 0, 1, 5, 9  # u64 words of an entry (_directory.c's entry_t)


class _Mapped:
    """The directory's bytes and the state words of one segment, kept referenced (the segment
    cannot be unmapped under them until :meth:`close`)."""

    def __init__(self, segment: PoolSegment) -> None:
        self.entries = segment.directory_entries
        if not self.entries:
            raise ValueError("the segment has no directory (its server publishes none)")
        self.nbuckets = self.entries // BUCKET
        self._bytes: np.ndarray | None = np.frombuffer(
            segment.meta, np.uint8, count=self.entries * ENTRY_SIZE, offset=segment.directory_offset
        )
        self.addr = self._bytes.ctypes.data
        self.state: np.ndarray = segment.state_words()

    @property
    def unindexed(self) -> int:
        """READY objects the server has not published (their buckets were full)."""
        return int(self.state[W_UNINDEXED]) if len(self.state) else 0

    def _entry(self, entry: int) -> int:
        """``entry`` if this open directory has it; IndexError (not an assert: the native side
        writes at ``addr + entry`` as told), ValueError once closed."""
        if self._bytes is None:
            raise ValueError("the directory is closed")
        if not 0 <= entry < self.entries:
            raise IndexError(f"entry {entry} of a directory of {self.entries}")
        return entry

    def read(self, entry: int) -> Entry | None:
        """Entry ``entry`` as a reader sees it (None: free, or it kept changing)."""
        got = _directory.read(self.addr, self.entries, self._entry(entry))
        return None if got is None else Entry(*got)

    def close(self) -> None:
        self._bytes = None
        self.state = np.zeros(0, np.uint64)


class Directory(_Mapped):
    """The writing side: one per server, owned by its L1 store, which alone writes the entries and
    the state words (from the event loop; not thread-safe). ``complete``: the server has no lower
    tier. The state says LIVE from construction on."""

    def __init__(self, segment: PoolSegment, complete: bool) -> None:
        super().__init__(segment)
        self.state[W_FLAGS] = LIVE | (COMPLETE if complete else 0)

    def publish(self, items: Sequence[Listed]) -> list[int]:
        """Publish each of ``items``, in order: (ns, chunk, offset, gen, nbytes, version, parent),
        key (``ns``, ``chunk``) not published now; each one's entry number, or -1 where its bucket
        is full (the caller then counts it as unindexed). ValueError for a bad item before any
        is written."""
        self._entry(0)  # (closed: ValueError)
        return list(_directory.publish(self.addr, self.nbuckets, items))

    def rewrite(
        self, entry: int, ns: bytes, chunk: bytes, offset: int, gen: int, nbytes: int, version: int, parent: int
    ) -> None:
        """Make published ``entry`` name another object of its key (``ns``, ``chunk``), in one
        write: readers see the old object or the new one, never none (an overwrite's commit)."""
        _directory.rewrite(self.addr, self.entries, self._entry(entry), ns, chunk, offset, gen, nbytes, version, parent)

    def unpublish(self, entry: int) -> None:
        """Free entry ``entry`` (a published one)."""
        _directory.unpublish(self.addr, self.entries, self._entry(entry))

    def set_unindexed(self, count: int) -> None:
        self.state[W_UNINDEXED] = count

    def check_integrity(self, published: int) -> None:
        """Assert that no entry is mid-write, exactly ``published`` (the owner's count) are in use,
        and each one in use is in its key's bucket (the writer's own view: no seqlock needed)."""
        assert self._bytes is not None
        words = self._bytes.view("<u8").reshape(-1, ENTRY_SIZE // 8)
        assert not (words[:, _SEQ] & 1).any(), "a directory entry is left mid-write"
        used = np.flatnonzero(words[:, _OFFSET])
        assert len(used) == published, f"{len(used)} directory entries in use, {published} published"
        buckets = (words[used, _CHUNK0] ^ words[used, _NS0]) & np.uint64(self.nbuckets - 1)
        misplaced = used[buckets != used // BUCKET]
        assert not len(misplaced), f"entries {misplaced[:5].tolist()} are not in their key's bucket"


class DirectoryReader(_Mapped):
    """The reading side (a shared-memory client). Thread-safe: it only reads."""

    def __init__(self, segment: PoolSegment) -> None:
        super().__init__(segment)
        self._lo = segment.first  # the pool offsets of the segment's slots (entries name those)
        self._hi = segment.first + segment.data_size

    @property
    def live(self) -> bool:
        """Whether the server publishes here (else every lookup must ask it)."""
        return bool(int(self.state[W_FLAGS]) & LIVE) if len(self.state) else False

    @property
    def complete(self) -> bool:
        """Whether a key not found is not cached anywhere (no lower tier, nothing unindexed)."""
        if not len(self.state):
            return False
        return bool(int(self.state[W_FLAGS]) & COMPLETE) and self.unindexed == 0

    def find(self, ns: bytes, hashes: bytes, nbytes: int) -> Found:
        """The leading chunks of a prompt (``hashes``: their chained 32-byte hashes back to back)
        published in namespace ``ns`` as one version chain, in slots of ``nbytes`` bytes."""
        n = len(hashes) // 32
        out = np.empty((n, 3), np.uint64)
        count, status = _directory.find(self.addr, self.nbuckets, ns, hashes, out, self._lo, self._hi, nbytes)
        got = out[:count]
        entries, offsets = got[:, 0].astype(np.int64), got[:, 1].astype(np.int64)
        return Found(count, entries, offsets, got[:, 2].copy(), _ENDED[status])

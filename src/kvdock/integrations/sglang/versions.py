"""The versions a rank of SGLang saw and loaded: tensor-parallel ranks load one version of a page
(or miss), and SGLang's continuations of a prefix it loaded from kvdock (an SDK edit) are stored.

**How SGLang orders its ranks** (0.5.23, ``sglang/srt/managers/cache_controller.py``): a prefetch
operation's storage hit query runs on every rank's prefetch thread
(``HiCacheController.prefetch_thread_func`` → ``_storage_hit_query``: ``batch_exists`` batch by
batch of ``STORAGE_BATCH_SIZE`` pages, each after ``prefix_keys`` grown by the batches before),
then ``_sync_prefetch_hit_query`` all-reduces the hit count with ``ReduceOp.MIN`` over the TP
(and PP) group, and only then may the scheduler hand the operation to the I/O thread
(``prefetch_io_aux_func`` → ``_page_transfer``: ``batch_get_v1`` batch by batch over
``operation.hash_value[:hit]``, after ``unified_radix_cache``'s ``_try_alloc_storage_hit`` may
have cut it further to the host memory it got); ``_reduce_prefetch_ack`` all-reduces the
completed tokens with MIN after the gets. So **every rank's ``batch_exists`` of an operation
happens before any rank's ``batch_get_v1`` of it**, and a page any rank failed to load is used
by none.

:class:`Seen` records what each ``batch_exists`` saw: kvdock's lookup tips (the version of the
hit's last chunk in this rank's shard, :func:`kvdock.sdk.engine.lookup_tips`) and the call's
page hashes. The following ``batch_get_v1`` of those pages passes them as ``tips``, so kvdock
hands the pages out only while they are still the versions that exists saw: an SDK overwrite
landing between two ranks' loads gives the later rank a miss, never the new version next to the
other rank's old one (an overwrite after every exists and before a get makes that get miss;
versions never come back, so two ranks that both load, load the same one).

A get is matched to *its own operation's* exists by the identity of the key objects: SGLang
computes an operation's page hashes once (``get_storage_hash_str``) and slices that list for
both calls, while another operation over the same tokens hashes them anew (equal strings, other
objects). Matching by equality could pair a get with a *later* operation's exists (which may come
after another rank's get): that could mix versions. A get whose pages no recorded exists of this
rank saw (evicted from the record, or a caller that hashes anew) is a miss on a rank of a
tensor- or pipeline-parallel engine (counted ``get_unvouched``); a single-rank engine loads
whatever is there (nothing to mix with), with the tips only when they name an edit (a version with
the EDITED or DERIVED bit: :class:`Loaded` needs the version it loaded), else by the plain read
that may skip the server (the pool directory). A get asking fewer pages than its exists saw (the MIN,
or the host memory cut) asks kvdock for the whole chain exists saw, with its tip, and copies only
the pages asked for.

:class:`Loaded` records, by page hash, the version this rank loaded of the last page of each get
that loaded exactly what its exists saw. A ``batch_set_v1`` whose prefix holds such a page passes
that version as ``over`` (``PrepareStore.over``): KV that SGLang computed over a prefix it loaded
from kvdock (an SDK edit) extends it; without, kvdock drops such a continuation as diverged. A set
of a page itself (SGLang computed that page) forgets it: a continuation computed over SGLang's own
bytes for those tokens must not chain onto the edit.

Both records are bounded (oldest dropped first): a dropped record is a miss or a dropped
continuation, never wrong bytes.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass

SEEN_LIMIT = 8192  # pages indexed by Seen (each holds its exists call's record)
LOADED_LIMIT = 65536  # page hashes remembered by Loaded


@dataclass(frozen=True)
class _Exists:
    """One ``batch_exists`` call's hit: its prefix (length and last key), the hit keys, the tips."""

    prefix_len: int
    prefix_last: str | None
    keys: tuple[str, ...]
    tips: tuple[int, ...]


@dataclass(frozen=True)
class Vouched:
    """What a get asks kvdock for: ``extra`` keys past the call's (the rest of the chain its exists
    saw, loaded by kvdock but not copied) and the ``tips`` of that chain's last page."""

    extra: list[str]
    tips: tuple[int, ...]


class Seen:
    """The tips each ``batch_exists`` saw, for the gets of the same operation (module docs)."""

    def __init__(self, limit: int = SEEN_LIMIT) -> None:
        self.limit = limit
        self._index: collections.OrderedDict[int, tuple[_Exists, int]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._index)

    def note(self, prefix: list[str], keys: list[str], hit: int, tips: tuple[int, ...]) -> None:
        """Record that an exists of ``keys`` after ``prefix`` saw ``keys[:hit]`` at ``tips``."""
        if hit <= 0 or not tips:
            return
        rec = _Exists(len(prefix), prefix[-1] if prefix else None, tuple(keys[:hit]), tips)
        with self._lock:  # (the record holds each key: its id stays its own)
            before = len(self._index)
            self._index.update((id(key), (rec, pos)) for pos, key in enumerate(rec.keys))
            if len(self._index) - before != len(rec.keys):  # some were there: last, in this call's order
                for key in rec.keys:
                    self._index.move_to_end(id(key))
            while len(self._index) > self.limit:
                self._index.popitem(last=False)

    def vouch(self, prefix: list[str], keys: list[str]) -> Vouched | None:
        """The tips a get of ``keys`` after ``prefix`` passes, when an exists of this operation saw
        them (``keys[-1]`` is one of the very key objects it was given, at the same place of the
        same chain); None otherwise."""
        if not keys:
            return None
        with self._lock:
            found = self._index.get(id(keys[-1]))
        if found is None:
            return None
        rec, pos = found
        if rec.keys[pos] is not keys[-1]:
            return None
        off = len(prefix) - rec.prefix_len  # the get's keys start this far into the exists' keys
        if off < 0 or off + len(keys) - 1 != pos:
            return None
        if rec.prefix_len and prefix[rec.prefix_len - 1] != rec.prefix_last:
            return None
        if list(rec.keys[: off + len(keys)]) != list(prefix[rec.prefix_len :]) + list(keys):
            return None
        return Vouched(list(rec.keys[off + len(keys) :]), rec.tips)


class Loaded:
    """The version of the last page of each get that loaded exactly what its exists saw, by page
    hash, for the ``over`` of the sets after it (module docs)."""

    def __init__(self, limit: int = LOADED_LIMIT) -> None:
        self.limit = limit
        self._versions: collections.OrderedDict[str, tuple[int, ...]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._versions)

    def note(self, key: str, tips: tuple[int, ...]) -> None:
        with self._lock:
            self._versions[key] = tips
            self._versions.move_to_end(key)
            while len(self._versions) > self.limit:
                self._versions.popitem(last=False)

    def over(self, prefix: list[str], keys: list[str]) -> list[int] | None:
        """``over`` for a set of ``keys`` after ``prefix``: the versions loaded of the deepest page
        of ``prefix`` this rank loaded, or None. Forgets ``keys`` (SGLang computed them)."""
        with self._lock:
            if not self._versions:
                return None
            for key in keys:
                self._versions.pop(key, None)
            for key in reversed(prefix):
                tips = self._versions.get(key)
                if tips is not None:
                    return list(tips)
        return None


__all__ = ["LOADED_LIMIT", "SEEN_LIMIT", "Loaded", "Seen", "Vouched"]

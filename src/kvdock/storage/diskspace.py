"""L2's budget while its disk is full, and its recovery once the disk has room again (:class:`DiskSpace`).

A write that meets ENOSPC cuts the budget to the bytes stored then (:meth:`DiskSpace.cut`), so that
later writes evict older files to make room instead of failing one by one. The cut is not forever:
while it lasts, a write attempt re-probes the free space of the file system (``statvfs``, cheap)
once its backoff has passed (:data:`PROBE_FIRST_S`, doubling up to :data:`PROBE_MAX_S` while the
disk stays full), and once the disk has room again the budget goes back to the configured one,
bounded by what the disk holds (stored + free, less a small reserve). Each transition is logged
once (full, room again) and shows in ``/status`` (``disk_full``, ``capacity_bytes``).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

log = logging.getLogger("kvdock.storage.disk")

PROBE_FIRST_S = 0.5  # the first re-probe of a full disk comes this long after it filled up
PROBE_MAX_S = 15.0  # ... and later ones at most this far apart while it stays full
RESERVE_FRACTION = 100  # room left free on a disk that filled up once: 1/100 of it ...
RESERVE_MAX = 1 << 30  # ... at most 1 GiB


def free_space(path: Path) -> tuple[int, int]:
    """(bytes free to this process, total bytes) of the file system holding ``path``."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


class DiskSpace:
    """The budget of one L2 directory: ``budget`` as configured, ``capacity`` what writes may use
    now (the budget, or less while the disk is full). Not thread-safe: the DiskTier calls it under
    its index lock."""

    clock = staticmethod(time.monotonic)  # (tests set their own)

    def __init__(self, root: Path, budget: int) -> None:
        self.root = root
        self.budget = budget
        self.capacity = budget
        self.full = False  # ENOSPC was met and the disk has not shown room since
        self._wait = PROBE_FIRST_S
        self._probe_at = 0.0

    def cut(self, stored: int) -> None:
        """A write met ENOSPC: cut the capacity to the ``stored`` bytes (logged on the way into
        the full state only); the next probe comes after the current backoff."""
        self.capacity = stored
        if not self.full:
            log.warning(
                "L2: disk full at %s; budget cut to the %d bytes stored until the disk has room again",
                self.root,
                stored,
            )
            self.full = True
        self._probe_at = self.clock() + self._wait

    def recover(self, stored: int, size: int) -> bool:
        """While full and the backoff has passed: whether the disk now has room for ``size`` more
        bytes than the ``stored`` ones (its reserve kept free). If so the capacity goes back to the
        budget, bounded by what the disk holds, and the recovery is logged; if not the backoff
        doubles. Cheap when not due (no system call)."""
        if not self.full:
            return True
        now = self.clock()
        if now < self._probe_at:
            return False
        try:
            free, total = free_space(self.root)
        except OSError as e:  # the directory vanished, EIO...: still full as far as we know
            log.debug("L2: cannot probe the free space at %s: %s", self.root, e)
            free = total = 0
        room = free - min(total // RESERVE_FRACTION, RESERVE_MAX)
        if room < size:
            self._wait = min(self._wait * 2, PROBE_MAX_S)
            self._probe_at = now + self._wait
            return False
        self.capacity = min(self.budget, stored + room)
        self.full = False
        self._wait = PROBE_FIRST_S
        log.info(
            "L2: disk at %s has room again (%d bytes free); budget back to %d bytes", self.root, free, self.capacity
        )
        return True

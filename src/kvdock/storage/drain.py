"""The shutdown drain: finish every acknowledged write-down before the server exits (:func:`drain_lanes`).

A chunk is acknowledged to its client once it is in L1; its copies to L2 and L3 are queued on the
tiers' lanes. At a clean shutdown (SIGTERM, SIGINT) the server waits for every lane's queue to be
worked off, with no time limit, so no acknowledged chunk is lost to a restart. How long that takes
is bounded by the backlog (``writeback_backlog_bytes`` in ``/status``, the
``kvdock_writeback_backlog_bytes`` gauge of ``/metrics``) divided by the slowest tier's write speed.

Nothing is dropped silently. A tier that is down (Redis gone) is never waited for: its queued
write-downs are dropped at once, and counted. A second signal aborts the drain: what is still
queued is dropped and counted (the write in progress finishes; the rest of its batch is
dropped). The log says, per tier, how many write-downs were done, dropped and why.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

from kvdock.storage.lane import TierLane

log = logging.getLogger("kvdock.storage.drain")

PROGRESS_EVERY_S = 5.0  # how often a long drain logs what is left
POLL_S = 0.02


def _left(lanes: Sequence[TierLane]) -> str:
    parts = []
    for lane in lanes:
        chunks, nbytes = lane.backlog()
        parts.append(f"{lane.name}: {chunks} chunk(s), {nbytes} bytes")
    return "; ".join(parts)


def _tally(lane: TierLane) -> tuple[int, int, int, int, int, int]:
    c = lane.counters
    return c.writes, c.bytes_written, c.writes_skipped, c.write_errors, lane.dropped_down, lane.dropped_down_bytes


async def drain_lanes(
    lanes: Sequence[TierLane], abort: asyncio.Event | None = None, every_s: float = PROGRESS_EVERY_S
) -> bool:
    """Wait until every job queued in ``lanes`` is done, all tiers at once and with no time limit,
    unless ``abort`` is set (then the rest is dropped: :meth:`TierLane.abandon`). Logs the backlog at
    the start and every ``every_s`` seconds, and at the end per tier: write-downs done, dropped
    because the tier was down, skipped (no room, or replaced meanwhile), failed, and dropped by the
    abort. Returns False if aborted. Runs on the event loop."""
    busy = [lane for lane in lanes if not lane.idle]
    if not busy:
        return True
    before = {lane.name: _tally(lane) for lane in busy}
    log.info("draining write-downs before exit (%s); a second SIGTERM/SIGINT drops them", _left(busy))
    t0 = time.monotonic()
    next_log = t0 + every_s
    aborted = False
    while not all(lane.idle for lane in busy):
        if abort is not None and abort.is_set():
            aborted = True
            break
        if time.monotonic() >= next_log:
            log.info("draining write-downs: %s left", _left(busy))
            next_log += every_s
        await asyncio.sleep(POLL_S)
    for lane in busy:
        dropped = lane.abandon() if aborted else (0, 0)
        writes, nbytes, skipped, errors, down, down_bytes = (
            now - then for now, then in zip(_tally(lane), before[lane.name], strict=True)
        )
        skipped -= down + dropped[0]  # (both count in writes_skipped too)
        log.info(
            "%s: %d write-down(s) done (%d bytes written) in %.1f s of shutdown drain",
            lane.name,
            writes,
            nbytes,
            time.monotonic() - t0,
        )
        if dropped[0]:
            log.warning(
                "%s: drain aborted by a second signal: %d write-down(s) (%d bytes) dropped",
                lane.name,
                dropped[0],
                dropped[1],
            )
        if down:
            log.warning("%s: %d write-down(s) (%d bytes) dropped: the tier is down", lane.name, down, down_bytes)
        if skipped:
            log.warning("%s: %d write-down(s) skipped (no room, or replaced meanwhile)", lane.name, skipped)
        if errors:
            log.warning("%s: %d write-down(s) failed (see the errors above)", lane.name, errors)
    return not aborted

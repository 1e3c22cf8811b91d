"""Following the fleet's invalidation stream (storage.coherence) for as long as a server runs:
each poll on a thread of its own, applied on the event loop before the next is sent, the server
vouching after each poll that read everything; the position whose L2 deletions are done is kept
beside L2 (``coherence.pos``) so that a restart replays the stream from there. Beside the polls,
every ``refresh_s`` a round keeps the floors of the overwrites' versions held here
(storage.keeping), on a thread of its own too."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

from kvdock.storage.coherence import Coherence
from kvdock.storage.stream import PollResult, pos_text

__all__ = ["POSITION_FILE", "SavedPosition", "follow", "load_position", "save_position", "until_vouched"]

log = logging.getLogger(__name__)

POSITION_FILE = "coherence.pos"


async def follow(
    coherence: Coherence,
    apply: Callable[[PollResult], list[Awaitable[object]]],
    failed: Callable[[BaseException], None],
    vouch: Callable[[float], None],
    keep: Path | None = None,
    recovered: Callable[[], None] | None = None,
    keeper: Callable[[Callable[..., Awaitable[Any]]], Awaitable[None]] | None = None,
) -> None:
    """Poll the stream for ever (until cancelled): each poll on a thread of its own, applied
    (``apply``, the manager's) on the loop before the next is sent; ``vouch(until)`` with the
    monotonic time until which this server now vouches (its pool segments' headers); ``failed``
    on an L3 error (once per outage); ``recovered()`` on the first poll that succeeds after one
    failed (L3 answers again: the tier's probe need not wait out its backoff); with ``keep`` (the
    L2 directory), the position whose L2 deletions are done is kept there. ``keeper(run)``: one
    round of storage.keeping (``run(fn, *args)`` runs ``fn`` on the keeper's thread), every
    ``refresh_s``."""
    loop = asyncio.get_running_loop()
    executor = ThreadPoolExecutor(1, "kvdock-coherence")
    keeping = loop.create_task(_keep(coherence, keeper, vouch)) if keeper is not None else None
    saved = [SavedPosition(coherence.position, coherence.consumed, coherence.incarnation)]
    saving: set[asyncio.Task[None]] = set()
    stuck: list[SavedPosition] = []

    async def save(after: list[Awaitable[object]], position: SavedPosition) -> None:
        results = await asyncio.gather(*after, return_exceptions=True)
        if any(r is None or isinstance(r, BaseException) for r in results) and not stuck:
            # an L2 deletion that did not happen: a restart must replay from the last position
            # whose deletions all did (never advanced again in this run)
            stuck.append(position)
            log.error("coherence: an L2 deletion failed; the kept position stays at %s", pos_text(saved[0].position))
        if keep is not None and not stuck and position.position >= saved[0].position:
            saved[0] = position
            save_position(keep, position)

    try:
        while True:
            try:
                result = await loop.run_in_executor(executor, coherence.poll)
            except Exception as e:  # L3 unreachable: stop vouching (the lease runs out), retry
                coherence.counters.poll_errors += 1
                if not coherence.failing:  # once per outage: each call pushes the tier's next probe back
                    failed(e)
                coherence.failing = True
                await asyncio.sleep(coherence.interval_s * 2)
                continue
            if coherence.failing and recovered is not None:
                recovered()
            coherence.failing = False
            first = not coherence.started  # its position is kept at once (a restart replays from it)
            lapsed = coherence.started and not coherence.vouched()
            try:
                pending = apply(result)
            except Exception:  # a bug: never vouch on a half-applied poll; the next reads it again
                log.exception("coherence: applying invalidations failed; not vouching, retrying")
                await asyncio.sleep(coherence.interval_s * 2)
                continue
            coherence.vouch(result)
            if lapsed and coherence.vouched():
                coherence.counters.lapses += 1
            vouch(coherence.until())
            if keep is not None and (pending or result.entries or result.lost or first):
                position = SavedPosition(result.position, result.consumed, coherence.incarnation)
                task = loop.create_task(save(pending, position))
                saving.add(task)
                task.add_done_callback(saving.discard)
            if result.caught_up:
                await asyncio.sleep(coherence.interval_s)
    finally:
        if keeping is not None:
            keeping.cancel()
        executor.shutdown(wait=False)


async def _keep(
    coherence: Coherence,
    keeper: Callable[[Callable[..., Awaitable[Any]]], Awaitable[None]],
    vouch: Callable[[float], None],
) -> None:
    """Run a keeping round every ``refresh_s`` (storage.keeping); one that fails (L3 unreachable)
    renews no lease, and the next comes after the same pause."""
    loop = asyncio.get_running_loop()
    executor = ThreadPoolExecutor(1, "kvdock-keep")
    run = functools.partial(loop.run_in_executor, executor)
    try:
        while True:
            try:
                await keeper(run)
            except Exception as e:  # (the polls report outages; a round only renews the lease)
                log.debug("coherence: a keeping round failed: %s", e)
            vouch(coherence.until())
            await asyncio.sleep(coherence.refresh_s)
    finally:
        executor.shutdown(wait=False)


async def until_vouched(coherence: Coherence, timeout_s: float) -> bool:
    """Wait (at most ``timeout_s``) until the server vouches again; whether it does. No wait while
    its polls fail (L3 unreachable): no poll is coming soon."""
    deadline = coherence.clock() + timeout_s
    while not coherence.vouched() and not coherence.failing:
        if coherence.clock() >= deadline:
            return False
        await asyncio.sleep(coherence.interval_s / 4)
    return True


class SavedPosition(NamedTuple):
    position: int
    consumed: int
    incarnation: bytes = b""


def load_position(directory: Path) -> SavedPosition | None:
    """The position kept beside L2, None if absent or unreadable."""
    try:
        text = (directory / POSITION_FILE).read_text().split()
        return SavedPosition(int(text[0]), int(text[1]), text[2].encode())
    except (OSError, ValueError, IndexError):
        return None


def save_position(directory: Path, saved: SavedPosition) -> None:
    """Keep the position whose deletions L2 has done (written to a temporary name, renamed: a
    crash leaves the older position, which replays more, never less)."""
    tmp = directory / (POSITION_FILE + ".tmp")
    try:
        tmp.write_text(f"{saved.position} {saved.consumed} {saved.incarnation.decode()}\n")
        os.replace(tmp, directory / POSITION_FILE)
    except OSError as e:
        log.warning("coherence: could not keep the position in %s: %s", directory, e)

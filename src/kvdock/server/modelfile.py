"""``models.msgpack``: the registry's models, saved in the L2 directory (mode 0600) and read at
start, so a restarted server serves its disk cache before any engine registers again.

A save that fails (a full disk) is logged and retried (:meth:`ModelFile.retry`: at each later
registration, and by the reaper's tick every ``SAVE_RETRY_S``: ``ModelFile.retry_s``), so the file
catches up once the disk has room; until then a restart would forget what was registered since."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

import msgspec

from kvdock.protocol.messages import ModelLayout

log = logging.getLogger("kvdock.server.registry")

SAVE_RETRY_S = 5.0  # how often the reaper's tick retries a save that failed


class ModelFile:
    """The file at ``path`` (None: nothing is saved); ``clock`` paces the retries, one every
    ``retry_s`` seconds of it (a test may shorten it)."""

    def __init__(self, path: Path | None, clock: Callable[[], float], retry_s: float = SAVE_RETRY_S) -> None:
        self.path = path
        self._clock = clock
        self.retry_s = retry_s
        self.unsaved = False  # the last save failed: the file is older than the registry
        self._retry_at = 0.0

    def load(self) -> list[ModelLayout]:
        """The layouts saved there ([] when there is no file, or an unreadable one: logged); a
        file an older server wrote 0644 is made private."""
        path = self.path
        if path is None or not path.exists():
            return []
        try:
            layouts = msgspec.msgpack.decode(path.read_bytes(), type=list[ModelLayout])
        except (OSError, msgspec.DecodeError) as e:
            log.warning("ignoring unreadable model registrations in %s: %s", path, e)
            return []
        try:  # a file written by an older server may be 0644
            if path.stat().st_mode & 0o077:
                path.chmod(0o600)
        except OSError as e:
            log.warning("cannot make %s private (mode 0600): %s", path, e)
        return layouts

    def save(self, layouts: list[ModelLayout]) -> bool:
        """Write ``layouts`` (atomically: a new 0600 file, fsynced, renamed); False, logged, if
        it failed (then :meth:`retry` tries again)."""
        try:
            self._write(msgspec.msgpack.encode(layouts))
        except OSError as e:
            self.unsaved = True
            self._retry_at = self._clock() + self.retry_s
            log.error(
                "could not save model registrations to %s: %s; retrying every %g s and at each registration "
                "(a restart now would forget them)",
                self.path,
                e,
                self.retry_s,
            )
            return False
        if self.unsaved:
            log.warning("model registrations saved to %s after an earlier failure", self.path)
        self.unsaved = False
        return True

    def retry(self, layouts: Callable[[], list[ModelLayout]], force: bool = False) -> bool:
        """Save ``layouts()`` again if the last save failed and ``retry_s`` passed since (or
        ``force``); whether the file is up to date now."""
        if not self.unsaved:
            return True
        if not force and self._clock() < self._retry_at:
            return False
        return self.save(layouts())

    def _write(self, data: bytes) -> None:
        path = self.path
        if path is None:
            return
        tmp = path.with_name(path.name + ".tmp")
        tmp.unlink(missing_ok=True)  # O_EXCL below: a new file, created 0600 whatever was there
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

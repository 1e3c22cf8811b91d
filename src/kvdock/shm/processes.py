"""Who a process is, as /proc tells it: its start time (pid and start time together name one
process for good, where a pid alone is reused), whether it still runs, and whether this process
can see it at all (the same PID namespace). The server grants shared memory only to processes it
can watch this way (a writer's death frees its reservations: :mod:`kvdock.storage.sessions`)."""

from __future__ import annotations

from pathlib import Path


def proc_start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot, or None if it does not exist."""
    return _proc_start_time(pid)


def process_alive(pid: int, start_time: int) -> bool:
    """Whether process ``pid`` that started at ``start_time`` still runs (a zombie does not).
    Only a missing /proc entry means gone: any other error (EMFILE, ENOMEM) answers "alive",
    since freeing a live writer's slots would let it write into another object."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    except OSError:
        return True
    fields = stat.rsplit(")", 1)[1].split()
    return fields[0] not in ("Z", "X") and int(fields[19]) == start_time


def process_visible(pid: int, start_time: int) -> bool:
    """Whether ``pid`` names a process this one can see (the same PID namespace, and /proc not
    hiding it) that started at ``start_time``: a client process a server can tell is gone."""
    return pid > 0 and _proc_start_time(pid) == start_time


def _proc_start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot, or None if it does not exist."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name may contain spaces; fields resume after the last ')'
    return int(stat.rsplit(")", 1)[1].split()[19])

"""Shared pieces of the benchmark scripts: timing helpers (servers come from kvdock.testing)."""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Callable
from typing import Any


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    r = fn()
    return time.perf_counter() - t0, r


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def cpu_busy_s() -> float:
    """CPU-seconds all CPUs spent in user and system mode since boot (/proc/stat; irq, softirq
    and steal are left out: loopback TCP of our own inline transport lands in softirq)."""
    with open("/proc/stat") as f:
        user, nice, system = (int(x) for x in f.readline().split()[1:4])
    return (user + nice + system) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    """CPU-seconds of this process and its reaped children (the servers, once stopped)."""
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime

"""Shared pieces of the benchmark scripts: timing helpers (servers come from kvdock.server.process)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    r = fn()
    return time.perf_counter() - t0, r


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9

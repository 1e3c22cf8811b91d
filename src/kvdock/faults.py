"""Test-only fault injection, in one place: the slow copies, slow disks and vanishing chunks that
tests need and that real hardware cannot produce on demand. Production modules ask
:func:`current` when they are built (a server's state, its L2 tier, a vLLM worker) and keep what
it says; nothing else in ``src/`` reads a ``KVDOCK_FAULT_*`` variable.

Two ways in, the same faults:

- black-box tests start a process with ``KVDOCK_FAULT_*`` in its environment (the names below,
  kept stable: ``kvdock.testing.launch_server(env=...)``, a vLLM engine's environment);
- in-process tests (``kvdock.inprocess``) build a server inside :func:`injected`, which overrides
  the environment for what is built in that context (a ``ContextVar``: another thread, another
  server in the same process, sees its own).

With neither, every fault is off (:data:`NONE`)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

COPY_DELAY_ENV = "KVDOCK_FAULT_COPY_DELAY_S"  # seconds each inline copy of the server sleeps first
RETRIEVE_MISS_ENV = "KVDOCK_FAULT_RETRIEVE_MISS"  # "1": every retrieve finds nothing (no fast reads either)
L2_WRITE_DELAY_ENV = "KVDOCK_FAULT_L2_WRITE_DELAY_S"  # seconds each L2 write or delete sleeps first
FAIL_LOADS_ENV = "KVDOCK_FAULT_FAIL_LOADS"  # "salt@rank,...": a vLLM worker's loads under salt fail on rank
COPY_GATE_ENV = "KVDOCK_FAULT_COPY_GATE"  # a path: while a file is there, each inline copy waits first
ENV_NAMES = (COPY_DELAY_ENV, RETRIEVE_MISS_ENV, L2_WRITE_DELAY_ENV, FAIL_LOADS_ENV, COPY_GATE_ENV)


@dataclass(frozen=True)
class Faults:
    """The faults in force (all off by default).

    ``copy_delay_s``: each inline copy between frames and slots sleeps that long first (on the
    server's copier threads). ``retrieve_miss``: every retrieve finds nothing, as if its chunks
    were evicted right after a lookup found them (an engine's lookup and load cannot be split
    apart on demand); a server built with it offers no fast reads, so every read reaches it.
    ``l2_write_delay_s``: each L2 write or delete sleeps that long first (a slow disk).
    ``fail_loads``: (cache_salt, global rank as a string) pairs whose vLLM loads fail on that
    rank (an engine's ranks failing apart). ``copy_gate``: a path; while a file is there, each
    inline copy waits (after its ``copy_delay_s``): a test holds copies for exactly as long as
    it needs (another server's window) instead of a fixed delay, then removes the file."""

    copy_delay_s: float = 0.0
    retrieve_miss: bool = False
    l2_write_delay_s: float = 0.0
    fail_loads: frozenset[tuple[str, str]] = frozenset()
    copy_gate: str = ""

    @classmethod
    def from_env(cls, env: Mapping[str, str], strict: bool = False) -> Faults:
        """The faults an environment names (absent or empty: off). ``strict``: ValueError for a
        ``KVDOCK_FAULT_*`` name this module does not know (a typo would silently test nothing);
        a malformed number is a ValueError either way."""
        if strict:
            unknown = sorted(k for k in env if k.startswith("KVDOCK_FAULT_") and k not in ENV_NAMES)
            if unknown:
                raise ValueError(f"unknown fault variable(s) {', '.join(unknown)}: known are {', '.join(ENV_NAMES)}")
        loads = (f.rsplit("@", 1) for f in env.get(FAIL_LOADS_ENV, "").split(",") if "@" in f)
        return cls(
            copy_delay_s=float(env.get(COPY_DELAY_ENV, "") or 0),
            retrieve_miss=env.get(RETRIEVE_MISS_ENV) == "1",
            l2_write_delay_s=float(env.get(L2_WRITE_DELAY_ENV, "") or 0),
            fail_loads=frozenset((salt, rank) for salt, rank in loads),
            copy_gate=env.get(COPY_GATE_ENV, ""),
        )


NONE = Faults()
_injected: ContextVar[Faults | None] = ContextVar("kvdock_faults", default=None)


def current() -> Faults:
    """The faults in force here: those of the innermost :func:`injected` of this context, else
    those of this process's environment (read now, not cached: a test may set a variable before
    it builds what reads it)."""
    faults = _injected.get()
    return faults if faults is not None else Faults.from_env(os.environ)


GATE_POLL_S = 0.01


def wait_at_gate(gate: str) -> None:
    """[a copier thread] Wait while the file ``gate`` is there (``copy_gate``; "" for none)."""
    while gate and os.path.exists(gate):
        time.sleep(GATE_POLL_S)


@contextmanager
def injected(faults: Faults) -> Iterator[Faults]:
    """Make ``faults`` the ones in force in this context (the environment's are ignored) while
    the block runs; what is built meanwhile keeps them after it."""
    token = _injected.set(faults)
    try:
        yield faults
    finally:
        _injected.reset(token)

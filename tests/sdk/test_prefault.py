"""connect() maps the pool without populating it; a background thread faults the pages in, and a
copy that comes first populates its own range. Checked on the mapping's resident set
(/proc/self/smaps), not on time."""

from __future__ import annotations

import mmap
import time
from pathlib import Path

import numpy as np
import torch

import kvdock.sdk as kvd
from helpers import CHUNK, MODEL, make_kv, make_tokens
from kvdock.sdk._transfer import Prefault


def _rss_kib(addr: int) -> int:
    """The Rss of this process's mapping that starts at ``addr``."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        if line.split("-", 1)[0] == f"{addr:x}":
            for field in lines[i + 1 :]:
                if field.startswith("Rss:"):
                    return int(field.split()[1])
    raise AssertionError(f"no mapping at {addr:x}")


def test_the_background_thread_populates_the_whole_mapping() -> None:
    n = 8 * Prefault.STEP // 64  # 8 MiB
    mm = mmap.mmap(-1, n)
    addr = np.frombuffer(mm, dtype=np.uint8).ctypes.data
    assert _rss_kib(addr) == 0
    p = Prefault(addr, n)
    deadline = time.monotonic() + 30
    while not p.done:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    p.stop()
    assert _rss_kib(addr) == n // 1024


def test_ensure_populates_a_range_before_the_thread_gets_there() -> None:
    n = 3 * Prefault.STEP
    mm = mmap.mmap(-1, n)
    addr = np.frombuffer(mm, dtype=np.uint8).ctypes.data
    p = Prefault(addr, n)
    p.stop()  # stopped before its second step: the last step's pages are not populated
    assert not p.done and _rss_kib(addr) <= Prefault.STEP // 1024
    before = _rss_kib(addr)
    p.ensure(addr + n - (1 << 20), 1 << 20)
    assert _rss_kib(addr) == before + 1024


def test_connect_leaves_the_pool_unpopulated_and_copies_work_before_the_prefault(server) -> None:
    with kvd.connect(server.url, server.http_url, MODEL) as c:
        t = c._transfer
        t._prefault.stop()  # as if the copies came before the thread got anywhere
        t._prefault.done = False
        toks = make_tokens(3 * CHUNK)
        kv = make_kv(3 * CHUNK, seed=1)
        assert kvd.store(c, kv, toks)
        assert torch.equal(kvd.retrieve(c, toks), kv)

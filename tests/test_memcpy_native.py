"""kvdock._native's copy engine (_copy.c): every branch byte-exact. Streamed copies of every
length around the 256-byte body and the 32-byte head (AVX2 and SSE2), unaligned both sides, many
runs split across threads at odd points; the kept workers and the thread-per-call fallback; copies
from several Python threads at once (the pool busy); a forked child copying on threads of its own
(its parent's workers do not exist there), also when the parent forked mid-copy; reading ahead
of a run that ends right before an inaccessible page."""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvdock import _native  # type: ignore[attr-defined]


@pytest.fixture(params=[(True, True), (True, False), (False, True)], ids=["pool-avx2", "pool-sse2", "threads-avx2"])
def mode(request: pytest.FixtureRequest) -> Iterator[tuple[bool, bool]]:
    was = _native._copy_mode(*request.param)
    yield request.param
    _native._copy_mode(*was)


def _addrs(base: np.ndarray, offsets: list[int] | np.ndarray) -> np.ndarray:
    return (np.asarray(offsets, np.uint64) + np.uint64(base.ctypes.data)).astype(np.uint64)


def _copy(dst: np.ndarray, src: np.ndarray, d_off: list[int], s_off: list[int], run: int, threads: int,
          min_part: int = 1, stream_min: int = 0) -> None:  # fmt: skip
    _native.copy_runs(_addrs(dst, d_off), _addrs(src, s_off), run, threads, min_part, stream_min)


def _rand(n: int, seed: int) -> np.ndarray:
    return np.frombuffer(np.random.default_rng(seed).bytes(n), np.uint8).copy()


def test_streamed_copies_of_every_length_and_alignment_are_exact(mode: tuple[bool, bool]) -> None:
    """stream_min 0: every copy streams, so the head (to 32-byte alignment), the 256-byte body
    (the part prefetched a page ahead, then the last page's) and the tail meet at every length
    and offset."""
    src = _rand(16384, 1)
    page = [4096 + 256 + k for k in (-257, -256, -255, -1, 0, 1, 31, 32, 33, 255, 256, 257)]
    lengths = [*range(1, 70), *range(220, 300), *range(500, 530), 1000, 1024, 2047, *page, 8192 + 37, 12000]
    for n in lengths:
        for so, do in [(0, 0), (1, 0), (0, 1), (3, 31), (31, 33), (64, 7), (17, 96)]:
            dst = np.zeros(16384, np.uint8)
            _copy(dst, src, [do], [so], n, 1)
            assert np.array_equal(dst[do : do + n], src[so : so + n]), (n, so, do)
            assert not dst[:do].any() and not dst[do + n :].any(), (n, so, do)


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
def test_many_runs_split_across_threads_at_odd_points_are_exact(mode: tuple[bool, bool], threads: int) -> None:
    """Parts cut at 4 KiB multiples of the concatenated runs, which fall mid-run; runs of odd
    lengths at odd offsets, in a scrambled order."""
    run, count = 4096 * 3 + 129, 97
    src = _rand(run * count + 64, 2)
    dst = np.zeros(run * count + 64, np.uint8)
    order = np.random.default_rng(3).permutation(count)
    s_off = [5 + int(i) * run for i in order]
    d_off = [11 + k * run for k in range(count)]
    for stream_min in (0, 1 << 40):  # streamed, and glibc's memcpy
        dst[:] = 0
        _copy(dst, src, d_off, s_off, run, threads, min_part=1, stream_min=stream_min)
        for k, i in enumerate(order):
            at = 5 + int(i) * run
            assert np.array_equal(dst[11 + k * run : 11 + (k + 1) * run], src[at : at + run])
        assert not dst[:11].any() and not dst[11 + count * run :].any()


@pytest.mark.parametrize("threads", [2, 5])
def test_sizes_around_the_thresholds_are_exact(mode: tuple[bool, bool], threads: int) -> None:
    """A total just under, at and over ``stream_min`` and over ``threads * min_part`` (how many
    threads take part), on one run and on many."""
    min_part, stream_min = 64 << 10, 256 << 10
    src = _rand(threads * min_part + stream_min + 8192, 4)
    for total in (stream_min - 1, stream_min, stream_min + 1, threads * min_part - 1, threads * min_part + 257):
        dst = np.zeros(len(src), np.uint8)
        _copy(dst, src, [3], [1], total, threads, min_part, stream_min)
        assert np.array_equal(dst[3 : 3 + total], src[1 : 1 + total]), total
        assert not dst[3 + total :].any() and not dst[:3].any()
    run, count = 1000, (stream_min + 999) // 1000  # many short runs past stream_min
    dst = np.zeros(len(src), np.uint8)
    d_off, s_off = [7 + k * run for k in range(count)], [k * run for k in range(count)]
    _copy(dst, src, d_off, s_off, run, threads, min_part, stream_min)
    assert np.array_equal(dst[7 : 7 + count * run], src[: count * run])


def test_copies_from_several_python_threads_at_once_are_exact() -> None:
    """The GIL is released: while one caller holds the workers, the others start and join
    threads of their own. Each checks its own bytes, many times over."""
    errors: list[str] = []

    def worker(seed: int) -> None:
        src = _rand((3 << 20) + 123, seed)
        dst = np.zeros_like(src)
        for rep in range(40):
            dst[:] = 0
            _native.copy_runs(_addrs(dst, [0]), _addrs(src, [0]), len(src), 3, 1 << 18, 1 << 20 if rep % 2 else 1 << 40)
            if not np.array_equal(dst, src):
                errors.append(f"thread {seed} rep {rep}")

    ts = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert errors == []


def _child_copies(threads: int = 3) -> int:
    """In a forked child: a threaded copy, checked; the exit status (0 good, 1 wrong bytes)."""
    src = _rand(4 << 20, 9)
    dst = np.zeros_like(src)
    for stream_min in (0, 1 << 40):
        _native.copy_runs(_addrs(dst, [0]), _addrs(src, [0]), len(src), threads, 1 << 18, stream_min)
        if not np.array_equal(dst, src):
            return 1
    return 0


def _wait(pid: int, timeout: float = 30.0) -> int:
    """The exit code of child ``pid``; it is killed and the test fails if it hangs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail("the forked child's copy hung (waiting for its parent's workers?)")


def _fork(fn: object) -> int:
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 2
        try:
            code = fn()  # type: ignore[operator]
        finally:
            os._exit(code)
    return pid


def test_a_forked_child_copies_on_threads_of_its_own() -> None:
    assert _child_copies() == 0  # the parent's workers exist now
    assert _wait(_fork(_child_copies)) == 0
    assert _wait(_fork(lambda: _child_copies() or _wait(_fork(_child_copies)))) == 0  # a grandchild too
    assert _child_copies(threads=5) == 0  # the parent's pool is intact (and grows)


def test_a_child_forked_while_the_parent_copies_copies_too() -> None:
    """The fork happens while another thread of the parent holds the workers mid-copy: the child
    starts from a free pool, not a lock held by a thread it does not have."""
    stop = threading.Event()
    src = _rand(32 << 20, 10)
    dst = np.zeros_like(src)

    def busy() -> None:
        while not stop.is_set():
            _native.copy_runs(_addrs(dst, [0]), _addrs(src, [0]), len(src), 2, 1 << 20, 1 << 20)

    t = threading.Thread(target=busy)
    t.start()
    try:
        codes = [_wait(_fork(_child_copies)) for _ in range(8)]
    finally:
        stop.set()
        t.join()
    assert codes == [0] * 8
    assert np.array_equal(dst, src)


def test_reading_ahead_of_a_run_that_ends_before_an_inaccessible_page_is_harmless(mode: tuple[bool, bool]) -> None:
    """The source is prefetched a page ahead: past the end of a run that ends right before a
    PROT_NONE page (prefetches never fault)."""
    page = mmap.PAGESIZE
    mm = mmap.mmap(-1, 4 * page)
    buf = np.frombuffer(mm, np.uint8)
    buf[: 3 * page] = _rand(3 * page, 11)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    assert libc.mprotect(buf.ctypes.data + 3 * page, page, 0) == 0
    dst = np.zeros(3 * page, np.uint8)
    for start in (0, 1, 100):
        dst[:] = 0
        _native.copy_runs(_addrs(dst, [0]), _addrs(buf, [start]), 3 * page - start, 2, 1, 0)
        assert np.array_equal(dst[: 3 * page - start], buf[start : 3 * page])
    assert libc.mprotect(buf.ctypes.data + 3 * page, page, mmap.PROT_READ | mmap.PROT_WRITE) == 0
    del buf
    mm.close()


def test_the_mode_switch_reports_and_restores() -> None:
    was = _native._copy_mode()
    try:
        assert _native._copy_mode(False, False) == was
        assert _native._copy_mode() == (False, False)
    finally:
        _native._copy_mode(*was)
    assert _native._copy_mode() == was and was[0] is True


_FAULT = r"""
import ctypes, faulthandler, mmap, sys
import numpy as np
from kvdock import _native
faulthandler.enable()
_native._copy_mode(int(sys.argv[1]), -1)
P = mmap.PAGESIZE
mm = mmap.mmap(-1, 1024 * P)
a = np.frombuffer(mm, np.uint8)
libc = ctypes.CDLL(None)
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
assert libc.mprotect(a.ctypes.data + 1000 * P, 24 * P, 1) == 0  # read-only: the second thread's part
src = np.zeros(1024 * P, np.uint8)
_native.copy_runs(np.array([a.ctypes.data], np.uint64), np.array([src.ctypes.data], np.uint64), 1024 * P, 2, 1, 0)
"""


@pytest.mark.parametrize("pool", [0, 1], ids=["threads-per-call", "kept-workers"])
def test_a_fault_in_a_workers_part_is_reported_by_faulthandler(pool: int) -> None:
    """Review R-NAT: a copy into a read-only mapping (a PrefixView's tensor is one) faults where
    a worker copies. The process dies either way, but the kept workers blocked every signal, so
    SIGSEGV killed it with no report; faults now reach faulthandler as on any thread."""
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-c", _FAULT, str(pool)], capture_output=True, text=True, timeout=60)
    assert p.returncode == -11, p.stderr
    assert "Fatal Python error: Segmentation fault" in p.stderr


_AFFINITY = r"""
import os, threading
import numpy as np
from kvdock import _native
a = lambda x: np.array([x.ctypes.data], np.uint64)
src = np.ones(8 << 20, np.uint8); dst = np.empty_like(src)
def first():
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    _native.copy_runs(a(dst), a(src), len(src), 4, 1 << 20, 0)
t = threading.Thread(target=first); t.start(); t.join()
allowed = os.sched_getaffinity(0)
_native.copy_runs(a(dst), a(src), len(src), 4, 1 << 20, 0)
assert (dst == 1).all()
# (the first thread is not counted: join() returns before its OS thread is gone, and until then
# /proc/self/task still lists it, pinned as it was)
skip = {threading.get_native_id(), t.native_id}
workers = [w for w in map(int, os.listdir("/proc/self/task")) if w not in skip]
print(len(workers), sum(os.sched_getaffinity(w) != allowed for w in workers))
"""


def test_workers_run_on_the_callers_cpus_not_those_of_the_thread_that_started_them() -> None:
    """Review R-NAT: the kept workers inherited the affinity of the caller that started them: a
    first copy from a thread pinned to one CPU left every later copy's workers on that CPU."""
    import subprocess
    import sys

    assert len(os.sched_getaffinity(0)) >= 2, "needs 2 CPUs"
    env = os.environ | {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}  # (numpy starts no threads of its own)
    p = subprocess.run([sys.executable, "-c", _AFFINITY], capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode == 0, p.stderr
    workers, pinned = map(int, p.stdout.split())
    assert workers == 3, p.stdout  # (the kept workers of a 4-thread copy: the ones checked)
    assert pinned == 0, f"{pinned} copy workers still pinned to the first caller's CPU"


# ---------------------------------------------------------------- page_starts


def _page_starts_reference(idx: np.ndarray, page: int, capacity: int, distinct: bool) -> tuple[int, int, list[int]]:
    """What HostPages.starts checked with numpy before the native call (the same order)."""
    grid = idx.reshape(-1, page)
    first = grid[:, 0].copy()
    bad_run = np.flatnonzero((grid - first[:, None] != np.arange(page)).any(axis=1))
    if len(bad_run):
        return 1, int(bad_run[0]), []
    bad = (first % page != 0) | (first < 0) | (first > capacity - page)
    if bad.any():
        return 2, int(first[np.flatnonzero(bad)[0]]), []
    if distinct:
        seen: set[int] = set()
        for s in first.tolist():
            if s in seen:
                return 3, s, []
            seen.add(s)
    return 0, 0, first.tolist()


def test_page_starts_equals_the_numpy_checks_it_replaced() -> None:
    """Random host indices (whole pages, torn runs, off-page, outside the pool, negative, repeated
    pages): the same verdict, the same index named, the same starts as the numpy checks."""
    rng = np.random.default_rng(7)
    seen_codes = set()
    for case in range(3000):
        page = int(rng.choice([1, 2, 4, 16, 64]))
        capacity = page * int(rng.integers(1, 40)) + int(rng.integers(0, page))  # (not always whole pages)
        pages = int(rng.integers(0, 12))
        starts = rng.integers(-1, capacity // page + 1, pages) * page
        kind = case % 5
        if kind == 1 and pages:
            starts[rng.integers(pages)] += int(rng.integers(1, page + 1))  # off a page boundary
        idx = (starts[:, None] + np.arange(page)).reshape(-1).astype(np.int64)
        if kind == 2 and idx.size > 1:
            idx[rng.integers(1, idx.size)] += 1  # a torn run (or a first index moved)
        if kind == 3 and pages > 1:
            idx[page : 2 * page] = idx[:page]  # a page named twice
        distinct = bool(case % 2)
        want = _page_starts_reference(idx, page, capacity, distinct)
        out = np.full(pages, -7, np.int64)
        code, at = _native.page_starts(idx, out, page, capacity, distinct)
        assert (code, at) == want[:2], (case, page, capacity, idx.tolist())
        if code == 0:
            assert out.tolist() == want[2]
        seen_codes.add(code)
    assert seen_codes == {0, 1, 2, 3}  # every verdict was reached


def test_page_starts_refuses_mismatched_buffers() -> None:
    idx = np.arange(8, dtype=np.int64)
    with pytest.raises(ValueError, match="one item per page"):
        _native.page_starts(idx, np.empty(3, np.int64), 4, 64, False)
    readonly = np.empty(2, np.int64)
    readonly.flags.writeable = False
    with pytest.raises(ValueError, match="writable"):
        _native.page_starts(idx, readonly, 4, 64, False)
    with pytest.raises(TypeError, match="64-bit integers"):
        _native.page_starts(idx.astype(np.int32), np.empty(2, np.int64), 4, 64, False)
    with pytest.raises(ValueError, match="page_size must be positive"):
        _native.page_starts(idx, np.empty(2, np.int64), 0, 64, False)
    assert _native.page_starts(np.empty(0, np.int64), np.empty(0, np.int64), 4, 64, True) == (0, 0)

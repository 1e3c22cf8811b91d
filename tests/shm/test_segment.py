"""kvdock.shm.segment: creating, attaching, unlinking and reaping /dev/shm pool segments."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvdock.shm import segment as seg_mod
from kvdock.shm.segment import (
    HEADER_SIZE,
    MAGIC,
    NO_DEADLINE,
    PAGE,
    PREFIX,
    SHM_DIR,
    STATE_OFFSET,
    STATE_WORDS,
    VALID_UNTIL_OFFSET,
    VERSION,
    PoolSegment,
    cleanup_stale,
    directory_bytes,
    table_bytes,
)

NAME_RE = re.compile(r"kvdock-[0-9a-f]{32}")


@pytest.fixture
def created() -> Iterator[list[PoolSegment]]:
    """Segments appended here are closed and unlinked at teardown, whatever happens."""
    segs: list[PoolSegment] = []
    yield segs
    for s in segs:
        s.close()
        s.unlink()


@pytest.fixture
def own_shm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Segments made under a directory of this test's own instead of /dev/shm. For tests that
    expect cleanup_stale to name a dead segment: a server starting in another xdist worker runs
    its own cleanup_stale and may take the segment first (CI saw it with the door's directories).
    Request it before ``created``, so segments are unlinked while the directory is still in use."""
    monkeypatch.setattr(seg_mod, "SHM_DIR", tmp_path)
    return tmp_path


def _create(created: list[PoolSegment], data_size: int = 2 * 4096) -> PoolSegment:
    s = PoolSegment.create(data_size)
    created.append(s)
    return s


def _header(path: Path) -> tuple:
    with open(path, "rb") as f:
        return seg_mod._HEADER.unpack(f.read(seg_mod._HEADER.size))


def _rewrite_header(path: Path, **changes: int) -> None:
    magic, ver, pid, start, nonce, size, table, data, directory, entries, first = _header(path)
    pid = changes.get("pid", pid)
    start = changes.get("start", start)
    table = changes.get("table", table)
    data = changes.get("data", data)
    directory = changes.get("directory", directory)
    entries = changes.get("entries", entries)
    with open(path, "r+b") as f:
        f.write(seg_mod._HEADER.pack(magic, ver, pid, start, nonce, size, table, data, directory, entries, first))


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    assert not Path(f"/proc/{p.pid}").exists()
    return p.pid


@contextlib.contextmanager
def _stray_file(name: str, content: bytes) -> Iterator[Path]:
    path = SHM_DIR / name
    path.write_bytes(content)
    try:
        yield path
    finally:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


# ---------------------------------------------------------------- create / attach / unlink


def test_create_makes_private_file_with_unguessable_name(created: list[PoolSegment]) -> None:
    s = _create(created, 3 * 4096)
    assert NAME_RE.fullmatch(s.name), s.name
    assert s.name.startswith(PREFIX) and PREFIX == "kvdock-"
    path = SHM_DIR / s.name
    assert Path("/dev/shm") == SHM_DIR
    st = path.stat()
    assert stat.S_ISREG(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert st.st_uid == os.getuid()
    # layout: header, generation table, slot area
    assert st.st_size == HEADER_SIZE + table_bytes(3 * 4096) + 3 * 4096 == 5 * 4096
    assert s.size == HEADER_SIZE + table_bytes(3 * 4096) + 3 * 4096
    assert s.data_size == 3 * 4096
    assert s.owner is True
    assert len(s.buf) == s.size and not s.buf.readonly


def test_names_and_nonces_differ_between_segments(created: list[PoolSegment]) -> None:
    a, b = _create(created), _create(created)
    assert a.name != b.name
    assert a.nonce != b.nonce
    assert re.fullmatch(r"[0-9a-f]{64}", a.nonce)


def test_header_records_magic_pid_start_time_and_size(created: list[PoolSegment]) -> None:
    s = _create(created, 4096)
    magic, ver, pid, start, nonce, size, table, data, directory, entries, first = _header(SHM_DIR / s.name)
    assert magic == MAGIC == b"KVDOCKL1"
    assert ver == VERSION == 5
    assert first == data == s.first  # a named segment's pool offsets are its own positions
    assert (directory, entries) == (data, 0) == (s.directory_offset, s.directory_entries)  # no directory asked for
    assert (s.creator_pid, s.creator_start) == (pid, start)
    assert pid == os.getpid()
    assert start == seg_mod.proc_start_time(os.getpid()) and start > 0
    assert nonce.hex() == s.nonce
    assert size == HEADER_SIZE + table_bytes(4096) + 4096
    assert (table, data) == (HEADER_SIZE, HEADER_SIZE + table_bytes(4096)) == (s.table_offset, s.data_offset)


def test_table_and_data_area_start_zeroed(created: list[PoolSegment]) -> None:
    s = _create(created, 2 * 4096)
    assert bytes(s.buf[s.data_offset :]) == b"\x00" * (2 * 4096)
    assert bytes(s.buf[s.table_offset : s.data_offset]) == b"\x00" * table_bytes(2 * 4096)


def test_attach_sees_the_same_bytes_both_ways(created: list[PoolSegment]) -> None:
    s = _create(created, 2 * 4096)
    s.buf[s.data_offset : s.data_offset + 5] = b"hello"
    other = PoolSegment.attach(s.name)
    created.append(other)  # unlink twice is harmless
    assert other.owner is False
    assert other.name == s.name and other.size == s.size and other.data_size == s.data_size
    assert other.nonce == s.nonce
    assert bytes(other.buf[s.data_offset : s.data_offset + 5]) == b"hello"
    other.buf[s.size - 3 : s.size] = b"xyz"
    assert bytes(s.buf[s.size - 3 : s.size]) == b"xyz"
    # numpy views of both mappings agree too
    arr_a = np.frombuffer(s.buf, dtype=np.uint8)
    arr_b = np.frombuffer(other.buf, dtype=np.uint8)
    arr_a[s.data_offset + 100] = 42
    assert arr_b[s.data_offset + 100] == 42
    del arr_a, arr_b


def test_attach_from_another_process_sees_the_bytes(created: list[PoolSegment]) -> None:
    s = _create(created, 4096)
    s.buf[s.data_offset : s.data_offset + 4] = b"ping"
    code = (
        "import sys; from kvdock.shm.segment import PoolSegment\n"
        f"s = PoolSegment.attach({s.name!r})\n"
        "d = s.data_offset\n"
        "print(bytes(s.buf[d:d + 4]).decode(), s.nonce)\n"
        "s.buf[d + 4:d + 8] = b'pong'\n"
        "s.close()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["ping", s.nonce]
    assert bytes(s.buf[s.data_offset + 4 : s.data_offset + 8]) == b"pong"
    # the attaching process exiting must not unlink the segment
    assert (SHM_DIR / s.name).exists()


def test_unlink_removes_the_file_and_is_idempotent(created: list[PoolSegment]) -> None:
    s = _create(created)
    path = SHM_DIR / s.name
    assert path.exists()
    s.unlink()
    assert not path.exists()
    s.unlink()  # no error
    with pytest.raises(FileNotFoundError):
        PoolSegment.attach(s.name)


def test_mapping_survives_unlink_until_close(created: list[PoolSegment]) -> None:
    s = _create(created)
    s.unlink()
    s.buf[s.data_offset] = 7
    assert s.buf[s.data_offset] == 7


def test_close_is_harmless_twice_and_with_live_exports(created: list[PoolSegment]) -> None:
    s = _create(created)
    s.buf[s.data_offset : s.data_offset + 3] = b"abc"
    view = np.frombuffer(s.buf, dtype=np.uint8)
    s.close()
    s.close()
    assert bytes(view[s.data_offset : s.data_offset + 3]) == b"abc"  # the mapping lives while exported
    del view
    s2 = _create(created)
    s2.close()
    s2.close()
    with pytest.raises(ValueError):
        s2.buf[0]  # released view


@pytest.mark.parametrize("name", ["", "foo", "kvdock", "x-kvdock-abc", "kvdock-../etc/passwd", "kvdock-a/b"])
def test_attach_rejects_foreign_names(name: str) -> None:
    with pytest.raises(ValueError, match="not a kvdock segment name"):
        PoolSegment.attach(name)


def test_attach_missing_segment_is_os_error() -> None:
    with pytest.raises(OSError):
        PoolSegment.attach(PREFIX + "0" * 32)


def test_attach_rejects_too_small_file() -> None:
    name = PREFIX + "test-small-" + os.urandom(4).hex()
    with _stray_file(name, b"KVDOCKL1"), pytest.raises(ValueError, match="too small"):
        PoolSegment.attach(name)


def test_attach_rejects_file_without_magic() -> None:
    name = PREFIX + "test-nomagic-" + os.urandom(4).hex()
    with (
        _stray_file(name, b"\x00" * (2 * HEADER_SIZE)),
        pytest.raises(ValueError, match=f"has no kvdock v{VERSION} header"),
    ):
        PoolSegment.attach(name)


def test_anonymous_segment() -> None:
    s = PoolSegment.anonymous(2 * 4096)
    try:
        assert s.name == ""
        assert s.size == HEADER_SIZE + table_bytes(2 * 4096) + 2 * 4096 and s.data_size == 2 * 4096
        s.buf[s.data_offset] = 9
        assert s.buf[s.data_offset] == 9
        s.unlink()  # a no-op, must not touch /dev/shm
    finally:
        s.close()


# ---------------------------------------------------------------- the generation table


@pytest.mark.parametrize(
    ("data_size", "expected"),
    [(4096, PAGE), (512 * 4096, PAGE), (512 * 4096 + 1, 2 * PAGE), (513 * 4096, 2 * PAGE), (3 * 4096 + 5, PAGE)],
)
def test_table_bytes_is_one_u64_per_page_rounded_to_pages(data_size: int, expected: int) -> None:
    assert table_bytes(data_size) == expected
    assert table_bytes(data_size) // 8 >= -(-data_size // PAGE)


@pytest.mark.parametrize("data_size", [4096, 3 * 4096, 600 * 4096])
def test_table_and_slot_area_are_page_aligned(created: list[PoolSegment], data_size: int) -> None:
    for s in (_create(created, data_size), PoolSegment.anonymous(data_size)):
        try:
            assert s.table_offset == HEADER_SIZE and s.table_offset % PAGE == 0
            assert s.data_offset == s.table_offset + table_bytes(data_size) and s.data_offset % PAGE == 0
            assert s.data_size == data_size and s.size == s.data_offset + data_size
            gens = s.generations()
            assert gens.dtype == np.dtype("<u8") and len(gens) == table_bytes(data_size) // 8
            assert len(gens) >= data_size // PAGE and not gens.any()
            del gens
        finally:
            if not s.name:
                s.close()


def test_generations_view_the_mapping_across_attaches(created: list[PoolSegment]) -> None:
    s = _create(created, 4 * 4096)
    other = PoolSegment.attach(s.name)
    created.append(other)
    mine, theirs = s.generations(), other.generations()
    assert (other.table_offset, other.data_offset) == (s.table_offset, s.data_offset)
    mine[1] = 7  # the server bumps a slot's generation ...
    assert theirs[1] == 7  # ... and a client that attached sees it
    theirs[3] += 2
    assert mine[3] == 2
    # the table lives in the mapping: little-endian u64 at table_offset + 8 * page index
    assert bytes(s.buf[s.table_offset + 8 : s.table_offset + 16]) == (7).to_bytes(8, "little")
    assert bytes(s.buf[s.data_offset : s.data_offset + 8]) == b"\0" * 8  # not in the slot area
    del mine, theirs


def test_attach_refuses_an_impossible_layout(created: list[PoolSegment]) -> None:
    s = _create(created, 4096)
    _rewrite_header(SHM_DIR / s.name, data=s.size + PAGE)
    with pytest.raises(ValueError, match="impossible layout"):
        PoolSegment.attach(s.name)
    _rewrite_header(SHM_DIR / s.name, table=0, data=s.data_offset)
    with pytest.raises(ValueError, match="impossible layout"):
        PoolSegment.attach(s.name)
    _rewrite_header(SHM_DIR / s.name, table=s.table_offset, entries=8)  # a directory past the slot area's start
    with pytest.raises(ValueError, match="impossible layout"):
        PoolSegment.attach(s.name)


def test_a_directory_lies_between_the_table_and_the_slot_area(created: list[PoolSegment]) -> None:
    s = PoolSegment.create(4096, 64)
    created.append(s)
    other = PoolSegment.attach(s.name)
    created.append(other)
    for seg in (s, other):
        assert (seg.directory_offset, seg.directory_entries) == (HEADER_SIZE + table_bytes(4096), 64)
        assert seg.data_offset == seg.directory_offset + directory_bytes(64) == seg.directory_offset + 2 * PAGE
        assert seg.size == seg.data_offset + 4096
    assert bytes(s.buf[s.directory_offset : s.data_offset]) == b"\0" * (2 * PAGE)  # every entry free
    words = s.state_words()
    words[1] = 5  # the server's state words ...
    assert int(other.state_words()[1]) == 5  # ... in the header every client maps
    del words


@pytest.mark.parametrize("entries", [24, 12])  # 3 buckets: not a power of two; 12: not whole buckets
def test_attach_refuses_a_directory_of_impossible_size(created: list[PoolSegment], entries: int) -> None:
    s = PoolSegment.create(4096, 32)
    created.append(s)
    _rewrite_header(SHM_DIR / s.name, entries=entries)
    with pytest.raises(ValueError, match="impossible layout"):
        PoolSegment.attach(s.name)


def test_create_too_large_is_os_error_and_leaves_nothing() -> None:
    st = os.statvfs(SHM_DIR)
    assert st.f_blocks > 0, "/dev/shm has no size limit; this test would exhaust memory"
    too_big = st.f_blocks * st.f_frsize + 2**30
    before = set(SHM_DIR.glob(PREFIX + "*"))
    with pytest.raises(OSError):
        PoolSegment.create(too_big)
    leaked = set(SHM_DIR.glob(PREFIX + "*")) - before
    # other processes may create segments meanwhile: only ours (this pid) count as leaks
    assert not [p for p in leaked if _header(p)[2] == os.getpid()]


# ---------------------------------------------------------------- cleanup_stale


def test_proc_start_time() -> None:
    assert isinstance(seg_mod.proc_start_time(os.getpid()), int)
    assert seg_mod.proc_start_time(_dead_pid()) is None


def test_cleanup_keeps_a_live_segment(created: list[PoolSegment]) -> None:
    s = _create(created)
    removed = cleanup_stale()
    assert s.name not in removed
    assert (SHM_DIR / s.name).exists()


def test_cleanup_removes_segment_of_sigkilled_creator(own_shm: Path) -> None:
    code = (
        "import sys, time; from pathlib import Path; from kvdock.shm import segment\n"
        f"segment.SHM_DIR = Path({str(own_shm)!r})\n"
        "s = segment.PoolSegment.create(4096)\n"
        "print(s.name, flush=True)\n"
        "time.sleep(120)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    name = ""
    try:
        assert proc.stdout is not None
        name = proc.stdout.readline().strip()
        assert NAME_RE.fullmatch(name), name
        path = own_shm / name
        assert _header(path)[2] == proc.pid
        assert name not in cleanup_stale()  # creator still alive: kept
        assert path.exists()
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
        assert path.exists()  # SIGKILL leaves the segment behind
        assert name in cleanup_stale()
        assert not path.exists()
        assert name not in cleanup_stale()  # nothing left to remove
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if name:
            with contextlib.suppress(FileNotFoundError, OSError):
                (own_shm / name).unlink()


def test_cleanup_removes_segment_whose_header_pid_is_dead(own_shm: Path, created: list[PoolSegment]) -> None:
    stale = _create(created)
    live = _create(created)
    _rewrite_header(own_shm / stale.name, pid=_dead_pid())
    removed = cleanup_stale()
    assert stale.name in removed
    assert live.name not in removed
    assert not (own_shm / stale.name).exists()
    assert (own_shm / live.name).exists()


def test_cleanup_removes_segment_when_pid_was_reused(own_shm: Path, created: list[PoolSegment]) -> None:
    # same pid as a live process, but another start time: the creator is gone, the pid recycled
    s = _create(created)
    start = seg_mod.proc_start_time(os.getpid())
    assert start is not None
    _rewrite_header(own_shm / s.name, start=start + 1)
    assert s.name in cleanup_stale()
    assert not (own_shm / s.name).exists()


def test_cleanup_with_unknown_start_time_trusts_live_pid(created: list[PoolSegment]) -> None:
    s = _create(created)
    _rewrite_header(SHM_DIR / s.name, start=0)
    assert s.name not in cleanup_stale()
    assert (SHM_DIR / s.name).exists()


def test_cleanup_ignores_files_that_are_not_kvdock_pools() -> None:
    with (
        _stray_file(PREFIX + "test-short-" + os.urandom(4).hex(), b"KVD") as short,
        _stray_file(PREFIX + "test-foreign-" + os.urandom(4).hex(), b"\x01" * HEADER_SIZE) as foreign,
    ):
        removed = cleanup_stale()
        assert short.name not in removed and foreign.name not in removed
        assert short.exists() and foreign.exists()


def test_a_start_interrupted_while_the_pool_is_allocated_leaves_no_segment(monkeypatch) -> None:
    """SIGTERM or Ctrl-C during the seconds a large pool takes to allocate and pre-fault (seen
    with the default L1 size: a 6 GB segment was left in /dev/shm). The interruption is
    simulated: it cannot be timed to land inside fallocate."""
    seg = seg_mod
    monkeypatch.setattr(seg.secrets, "token_hex", lambda n: "ab" * n)
    name = seg.PREFIX + "ab" * 16

    def interrupted(*args: object) -> None:
        assert (seg.SHM_DIR / name).exists()  # created, and then:
        raise KeyboardInterrupt

    monkeypatch.setattr(seg.os, "posix_fallocate", interrupted)
    with pytest.raises(KeyboardInterrupt):
        PoolSegment.create(1 << 20)
    assert not (seg.SHM_DIR / name).exists()


# ---------------------------------------------------------------- valid_until_ns


def test_valid_until_ns_is_no_limit_in_a_new_segment_and_what_the_server_sets_after() -> None:
    """Issue 29 (6): the header word valid_until_ns (CLOCK_MONOTONIC ns until which the server
    vouches for the pool directory) lies after the directory's state words, apart from them, and
    every segment the pool is made of (named, a tenant's sealed memfd, anonymous) starts with no
    limit and takes the server's writes, which its clients' mappings read."""
    from kvdock.shm.pool import Pool

    assert STATE_OFFSET + 8 * STATE_WORDS <= VALID_UNTIL_OFFSET < HEADER_SIZE and NO_DEADLINE == 2**64 - 1
    pools = [Pool.create(64 * PAGE, {"acme": 8 * PAGE}, tenants=True, directories=True), Pool.create(16 * PAGE)]
    pools.append(Pool.create(16 * PAGE, directories=True))
    try:
        segments = [pools[0].main, pools[0].own["acme"], pools[1].main, pools[2].main]
        assert [s.private for s in segments] == [False, True, False, False]
        assert [bool(s.name) for s in segments] == [False, False, True, True]  # anonymous, memfd, named, named
        for seg in segments:
            assert seg.valid_until_ns() == NO_DEADLINE
            words = seg.state_words()
            words[:] = 2**64 - 2  # the state words, written as the directory writes them ...
            assert seg.valid_until_ns() == NO_DEADLINE  # ... leave it alone
            words[:] = 0
            del words
            for ns in (0, 1, 123_456_789_012_345, NO_DEADLINE - 1, NO_DEADLINE):
                seg.set_valid_until_ns(ns)
                assert seg.valid_until_ns() == ns
                assert int.from_bytes(seg.meta[VALID_UNTIL_OFFSET : VALID_UNTIL_OFFSET + 8], "little") == ns
            for bad in (-1, 2**64):
                with pytest.raises(ValueError, match="must be a u64"):
                    seg.set_valid_until_ns(bad)
            assert seg.valid_until_ns() == NO_DEADLINE
        # what clients map: a tenant's pool by its descriptors (metadata read-only), a named one by name
        server_side = pools[0].own["acme"]
        client = PoolSegment.from_fds(*(os.dup(fd) for fd in server_side.filenos()))
        named = PoolSegment.attach(pools[2].main.name)
        try:
            for ns in (42, NO_DEADLINE):
                server_side.set_valid_until_ns(ns)
                pools[2].main.set_valid_until_ns(ns + 1 if ns < NO_DEADLINE else ns)
                assert client.valid_until_ns() == ns
                assert named.valid_until_ns() == (ns + 1 if ns < NO_DEADLINE else ns)
            with pytest.raises(ValueError):  # a client of a sealed pool cannot vouch for it
                client.set_valid_until_ns(1)
            assert server_side.valid_until_ns() == NO_DEADLINE
        finally:
            client.close()
            named.close()
        assert client.valid_until_ns() == 0  # closed: vouched for by nobody
        with pytest.raises(ValueError, match="closed"):
            client.set_valid_until_ns(1)
    finally:
        for pool in pools:
            pool.close()

"""The pool's segments: the shared rest in the main segment, each quota'd tenant's region in a
memfd of its own (sealed, nameless), and pool offsets that find their bytes in the right one."""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvdock.shm.directory import entries_for
from kvdock.shm.pool import Pool
from kvdock.shm.segment import HEADER_SIZE, SEALS, SHM_DIR, VERSION, PoolSegment, directory_bytes, table_bytes
from kvdock.shm.slots import ALIGN

P = ALIGN


def _shm_names() -> set[str]:
    return {p.name for p in SHM_DIR.iterdir()}


@pytest.fixture
def pools() -> Iterator[list[Pool]]:
    made: list[Pool] = []
    yield made
    for pool in made:
        pool.close()


def test_a_tenants_pool_has_a_region_per_quota_each_in_a_memfd_of_its_own(pools: list[Pool]) -> None:
    before = _shm_names()
    pool = Pool.create(10 * P + 100, {"b": 3 * P + 5, "a": 2 * P}, tenants=True, directories=True)
    pools.append(pool)
    assert _shm_names() == before  # nothing anyone could open by name
    assert pool.shared_segments() == pool.own and pool.main.directory_entries == 0  # nobody reads the rest's
    assert pool.own["a"].directory_entries == entries_for(2 * P)
    assert pool.main.name == "" and not pool.main.private and not pool.shared
    assert sorted(pool.own) == ["a", "b"] and all(s.private and s.name == "" for s in pool.own.values())
    regions = pool.allocator.regions
    rest = 10 * P + 100 - 5 * P
    # the shared rest first, then the tenants in name order, page-rounded down, each from a page
    assert {n: (r.base, r.capacity) for n, r in regions.items()} == {
        None: (pool.main.first, rest),
        "a": (pool.main.first + 6 * P, 2 * P),
        "b": (pool.main.first + 8 * P, 3 * P),
    }
    assert pool.capacity == 10 * P + 100 and pool.own["b"].data_size == 3 * P
    pool.check_integrity()
    # a slot of a's region is in a's segment, at its offset less the segment's shift
    off = pool.allocator.alloc(100, "a")
    assert off == regions["a"].base + 0
    pool.view(off, P)[:] = b"\xab" * P
    seg = pool.own["a"]
    assert bytes(seg.data[off - seg.first : off - seg.first + P]) == b"\xab" * P
    assert not any(bytes(pool.main.data)) and not any(bytes(pool.own["b"].data))
    # generations live in the region's own segment, where its clients read them
    pool.allocator.free(off)
    assert seg.generations()[0] == 1 and pool.allocator.generation(off) == 1
    with pytest.raises(AssertionError, match="in no segment"):
        pool.view(regions["a"].base + 2 * P - 1, 2)  # across a's end into b's segment
    # who may map what: a tenant its own; the shared rest nobody; a tenant without a quota nothing
    assert pool.segment_of("a") is seg and pool.segment_of("c") is None and pool.segment_of(None) is None


def test_without_tenants_the_main_segment_is_named_and_mapped_by_everyone(pools: list[Pool]) -> None:
    pool = Pool.create(4 * P, directories=True)
    pools.append(pool)
    assert pool.shared and pool.main.name and (SHM_DIR / pool.main.name).exists()
    assert pool.main.directory_entries == entries_for(4 * P) and pool.own == {}
    assert pool.shared_segments() == {None: pool.main}
    assert pool.segment_of(None) is pool.main and pool.main.first == pool.main.data_offset
    name = pool.main.name
    pool.close()
    pools.remove(pool)
    assert not (SHM_DIR / name).exists()


def test_no_shm_makes_every_segment_anonymous(pools: list[Pool]) -> None:
    pool = Pool.create(4 * P, {"a": 2 * P}, shm=False, tenants=True)
    pools.append(pool)
    assert not pool.main.private and not pool.own["a"].private and pool.segment_of("a") is None
    pool.check_integrity()


def test_a_private_segment_is_sealed_and_maps_by_descriptor_only() -> None:
    seg = PoolSegment.create_private(2 * P, first=64 * P, label="t-sealed", directory_entries=8)
    try:
        meta_fd, data_fd = seg.filenos()
        assert seg.size == HEADER_SIZE + table_bytes(2 * P) + directory_bytes(8) + 2 * P and seg.first == 64 * P
        assert os.fstat(meta_fd).st_size == seg.data_offset and os.fstat(data_fd).st_size == 2 * P
        for fd in (meta_fd, data_fd):
            assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SEALS == SEALS
            for size in (0, P // 2, 8 * P):  # no client can shrink or grow it under the server
                with pytest.raises(PermissionError):
                    os.ftruncate(fd, size)
        maps = Path("/proc/self/maps").read_text()
        assert "/memfd:kvdock-t-sealed-meta" in maps and "/memfd:kvdock-t-sealed-slots" in maps
        # a client maps it from its descriptors (here dups: what SCM_RIGHTS hands over)
        other = PoolSegment.from_fds(os.dup(meta_fd), os.dup(data_fd))
        try:
            assert (other.nonce, other.first, other.owner, other.directory_entries) == (seg.nonce, seg.first, False, 8)
            seg.data[P] = 7
            assert other.data[65 * P - other.first] == 7  # pool offset 65 * P
            other.data[0] = 9  # the slots are the client's to write
            assert seg.data[0] == 9
            ro = other.map_readonly(65 * P, P)
            assert isinstance(ro, mmap.mmap) and len(ro) == P and ro[0] == 7
            with pytest.raises(TypeError):
                ro[0] = 1  # read-only
            ro.close()
        finally:
            other.close()
    finally:
        seg.close()


def test_no_client_can_write_a_private_segments_metadata() -> None:
    """(review) Each tenant's pool directory, generation table and nonce are the server's: a
    client that could write them broke the server's own bookkeeping (a directory entry it reads
    to publish) and its integrity checks, not only its own tenant's reads."""
    import ctypes

    seg = PoolSegment.create_private(2 * P, first=8 * P, label="t-meta", directory_entries=8)
    meta_fd = seg.filenos()[0]
    other = PoolSegment.from_fds(os.dup(meta_fd), os.dup(seg.filenos()[1]))
    try:
        assert other.meta.readonly and not other.data.readonly
        with pytest.raises(TypeError):
            other.meta[0] = 0
        with pytest.raises(PermissionError):  # no writable mapping of it can be made any more
            mmap.mmap(meta_fd, HEADER_SIZE, flags=mmap.MAP_SHARED)
        with pytest.raises(PermissionError):
            os.pwrite(meta_fd, b"x", 0)
        libc = ctypes.CDLL(None, use_errno=True)
        libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
        assert libc.fallocate(meta_fd, 0x02 | 0x01, 0, P) == -1 and ctypes.get_errno() == errno.EPERM  # punch hole
        addr = np.frombuffer(other.meta, np.uint8).ctypes.data
        libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        assert libc.mprotect(ctypes.c_void_p(addr), P, 3) == -1 and ctypes.get_errno() == errno.EACCES
        with pytest.raises(OSError), open("/proc/self/mem", "r+b", buffering=0) as mem:
            mem.seek(addr + 100)
            mem.write(b"Z")
        gens = seg.generations()
        gens[0] += 1  # while the server's own mapping writes on
        assert other.generations()[0] == 1
        del gens
    finally:
        other.close()
        seg.close()


def test_from_fds_refuses_what_is_not_a_sealed_kvdock_segment() -> None:
    def memfd(seal: bool) -> int:
        fd = os.memfd_create("junk", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, 4 * P)
        if seal:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
        return fd

    a, b = memfd(False), memfd(True)
    with pytest.raises(ValueError, match="not a sealed memfd"):
        PoolSegment.from_fds(a, b)
    for fd in (a, b):
        with pytest.raises(OSError) as e:
            os.fstat(fd)  # closed by from_fds: the caller handed them over
        assert e.value.errno == errno.EBADF
    with pytest.raises(ValueError, match=f"no kvdock v{VERSION} header"):
        PoolSegment.from_fds(memfd(True), memfd(True))


def test_generation_tables_of_two_regions_are_apart(pools: list[Pool]) -> None:
    pool = Pool.create(6 * P, {"a": 2 * P, "b": 2 * P}, tenants=True)
    pools.append(pool)
    offs = {t: pool.allocator.alloc(1, t) for t in ("a", "b", None)}
    for off in offs.values():
        assert off is not None
        pool.allocator.free(off)
    for name, seg in pool.own.items():
        assert list(seg.generations()[:2]) == [1, 0], name
    assert list(pool.main.generations()[:2]) == [1, 0]
    assert np.array_equal(pool.own["a"].generations(), pool.own["b"].generations())

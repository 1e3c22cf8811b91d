"""kvdock.memcpy: copies through the native helper are byte-exact for every layout the data plane
uses (strided chunks, layer subsets, numpy frames), on any thread count, with and without
streaming stores; what does not reduce to runs falls back to copy_."""

from __future__ import annotations

import mmap

import numpy as np
import pytest
import torch

from kvdock import memcpy


def _kv(shape: tuple[int, ...], seed: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_chunks_of_a_kv_tensor_go_to_slots_and_back_byte_exact(threads: int, dtype: torch.dtype) -> None:
    kv = _kv((2, 5, 96, 64), seed=1, dtype=dtype)
    slots = [torch.empty((2, 5, 32, 64), dtype=dtype) for _ in range(3)]
    c = memcpy.Copier(threads)
    for j, slot in enumerate(slots):
        c.add(slot, kv[:, :, j * 32 : (j + 1) * 32])
    c.run()
    out = torch.full_like(kv, 7)
    for j, slot in enumerate(slots):
        assert torch.equal(slot, kv[:, :, j * 32 : (j + 1) * 32])
        c.add(out[:, :, j * 32 : (j + 1) * 32], slot)
    c.run()
    assert torch.equal(out, kv)
    c.run()  # nothing pending: harmless


def test_large_copies_use_streaming_stores_and_split_at_odd_offsets() -> None:
    n = memcpy.STREAM_MIN + 12345  # over the streaming threshold, not a multiple of anything
    src = torch.randint(0, 256, (n + 3,), dtype=torch.uint8)
    dst = torch.zeros(n + 5, dtype=torch.uint8)
    for threads in (1, 2, 7):
        dst.zero_()
        memcpy.copy(dst[5:], src[3:], threads)  # unaligned on both sides
        assert torch.equal(dst[5:], src[3:]) and not dst[:5].any()


def test_a_layer_subset_and_numpy_frames_copy_exactly() -> None:
    frame = np.frombuffer(np.random.default_rng(2).bytes(2 * 6 * 4096), dtype=np.uint8)  # read-only, like a zmq frame
    rows = frame.reshape(2, 6, 4096)[:, 1:6:2]
    out = np.zeros((2, 3, 4096), dtype=np.uint8)
    memcpy.copy(out, rows)
    assert np.array_equal(out, rows)
    kv = _kv((2, 6, 16, 32), seed=3)
    part = torch.empty((2, 2, 16, 32), dtype=torch.bfloat16)
    memcpy.copy(part, kv[:, 2:6:2])
    assert torch.equal(part, kv[:, 2:6:2])


def test_layouts_without_long_runs_fall_back_to_copy_and_stay_exact() -> None:
    x = torch.randn(64, 48)
    t = torch.empty(48, 64).t()  # transposed: no dense innermost dim
    memcpy.copy(t, x)
    assert torch.equal(t, x)
    small = torch.randn(4, 3)  # runs under MIN_RUN
    dst = torch.empty(4, 3)
    memcpy.copy(dst, small)
    assert torch.equal(dst, small)
    empty = torch.empty(0, 5)
    memcpy.copy(empty, torch.empty(0, 5))


def test_bad_copies_are_refused() -> None:
    with pytest.raises(ValueError, match="shape"):
        memcpy.copy(torch.empty(3, 4), torch.empty(4, 3))
    with pytest.raises(TypeError, match="two tensors or two numpy arrays"):
        memcpy.copy(torch.empty(3, 4), np.zeros((3, 4), np.float32))
    with pytest.raises(ValueError, match="copy threads"):
        memcpy.Copier(-1)
    with pytest.raises(ValueError, match="copy threads"):
        memcpy.Copier(1000)


def test_default_threads_come_from_the_environment_or_the_cpus(monkeypatch) -> None:
    monkeypatch.setenv(memcpy.ENV_THREADS, "3")
    assert memcpy.default_threads() == 3 and memcpy.Copier().threads == 3
    monkeypatch.setenv(memcpy.ENV_THREADS, "zero")
    with pytest.raises(ValueError, match="KVDOCK_COPY_THREADS='zero'"):
        memcpy.default_threads()
    monkeypatch.setenv(memcpy.ENV_THREADS, "\u00b2")  # (a digit to str.isdigit, not to int(): review R-NAT)
    with pytest.raises(ValueError, match="expected a whole number of threads"):
        memcpy.default_threads()
    monkeypatch.delenv(memcpy.ENV_THREADS)
    import os

    assert memcpy.default_threads() == min(len(os.sched_getaffinity(0)), memcpy.MAX_DEFAULT_THREADS)


def test_populate_faults_pages_in_and_blank_replaces_them_with_zeros() -> None:
    mm = mmap.mmap(-1, 1 << 20)
    arr = np.frombuffer(mm, dtype=np.uint8)
    memcpy.populate(arr.ctypes.data, len(arr))
    arr[:] = 9
    memcpy.populate(arr.ctypes.data, len(arr), write=False)
    assert int(arr.sum()) == 9 * len(arr)  # populating never changes the bytes
    memcpy.blank(arr.ctypes.data, 1 << 16)
    assert not arr[: 1 << 16].any() and (arr[1 << 16 :] == 9).all()
    with pytest.raises(ValueError, match="page-aligned"):
        memcpy.blank(arr.ctypes.data + 1, 4096)
    del arr
    mm.close()
    with pytest.raises(OSError):
        memcpy.populate(1 << 46, 4096)  # nothing mapped there


def test_what_copy_refuses_or_interprets_is_left_to_it() -> None:
    x = torch.randn(8, 512)
    with pytest.raises(RuntimeError, match="more than one element of the written-to tensor"):
        memcpy.copy(torch.empty(1, 512).expand(8, 512), x)  # overlapping destination
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        memcpy.copy(torch.zeros(8, 512, requires_grad=True), x)
    c = torch.randn(8, 512, dtype=torch.complex64)
    out = torch.empty_like(c)
    memcpy.copy(out, c.conj())  # a lazy conjugate: copy_ materializes it
    assert torch.equal(out, c.conj())
    frozen = np.frombuffer(bytes(8192), np.uint8)
    with pytest.raises(ValueError, match="read-only"):
        memcpy.copy(frozen, np.ones(8192, np.uint8))
    assert not frozen.any()
    a = np.arange(64 * 1024, dtype=np.uint8).reshape(64, 1024)
    b = np.zeros((64, 1024), np.uint8)
    memcpy.copy(b, a[::-1])  # negative strides
    assert np.array_equal(b, a[::-1])


def test_addresses_must_be_64_bit_integers() -> None:
    """Second review: any buffer of 8-byte items passed as addresses, floats included."""
    from kvdock import _native  # type: ignore[attr-defined]

    floats, ints = np.zeros(2, np.float64), np.zeros(2, np.int64)
    with pytest.raises(TypeError, match="64-bit integers"):
        _native.copy_runs(floats, ints, 8, 1, 1 << 20, 8 << 20)
    with pytest.raises(TypeError, match="64-bit integers"):
        _native.copy_grid(0, 0, floats, ints, ints, ints, 8, True, 1, 1 << 20, 8 << 20)
    with pytest.raises(TypeError, match="64-bit integers"):
        _native.moved(0, 0, 0, ints, floats, None)
    assert _native.moved(0, 0, 4096, np.zeros(0, np.int64), np.zeros(0, np.uint64), None) == 0


def test_a_grid_copy_copies_each_chunks_runs_in_either_direction() -> None:
    from kvdock import _native  # type: ignore[attr-defined]

    tensor = np.arange(64, dtype=np.uint8)  # two chunks of 32 bytes: runs of 8 at 0 and 16
    slots = [np.full(16, 100 + i, np.uint8) for i in range(2)]  # each slot: two runs of 8
    addrs = np.array([s.ctypes.data for s in slots], np.int64)
    grid = (np.array([0, 1], np.int64), addrs, np.array([0, 16], np.int64), np.array([0, 8], np.int64))
    _native.copy_grid(tensor.ctypes.data, 32, *grid, 8, True, 1, 1 << 20, 8 << 20)
    want = np.arange(64, dtype=np.uint8)
    for i in range(2):
        want[32 * i : 32 * i + 8] = want[32 * i + 16 : 32 * i + 24] = 100 + i
    assert np.array_equal(tensor, want)
    tensor[:] = 7
    _native.copy_grid(tensor.ctypes.data, 32, *grid, 8, False, 1, 1 << 20, 8 << 20)
    assert all((s == 7).all() for s in slots)


@pytest.mark.parametrize("shift", [1024, -1024, 4])
def test_overlapping_source_and_destination_are_never_copied_wrong(shift: int) -> None:
    """Before: copy(buf[k:], buf[:-k]) ran as long runs (threads, streaming stores, forward) and
    read bytes it had already overwritten. numpy's copyto copies overlapping arrays as memmove
    does; torch's copy_ refuses them: either is right, a silent mix is not."""
    n = 4 << 20
    buf = np.arange(n + abs(shift), dtype=np.uint32).view(np.uint8)[: n + abs(shift)].copy()
    want = buf.copy()
    k = abs(shift)
    dst, src = (buf[k:], buf[:-k]) if shift > 0 else (buf[:-k], buf[k:])
    want_dst = (want[:-k] if shift > 0 else want[k:]).copy()
    memcpy.copy(dst, src)
    assert np.array_equal(dst, want_dst)
    t = torch.arange(n, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="refer to a single memory location"):
        memcpy.copy(t[k:], t[:-k])
    assert torch.equal(t, torch.arange(n, dtype=torch.int32))  # refused: nothing half-copied


@pytest.mark.parametrize("up", [True, False])
@pytest.mark.parametrize("view", ["reversed rows", "reversed both", "every other row"])
def test_overlapping_views_with_negative_or_gapped_strides_are_copied_as_memmove(view: str, up: bool) -> None:
    """The overlap check covers views whose outer strides are negative or leave gaps: the span
    of their runs, not the first and last address, is what meets."""
    buf = np.arange(1 << 20, dtype=np.uint32).view(np.uint8).reshape(4096, 1024)
    pick = {
        "reversed rows": lambda b: (b[4:][::-1], b[:-4][::-1]),
        "reversed both": lambda b: (b[4:][::-1, ::-1], b[:-4][::-1, ::-1]),
        "every other row": lambda b: (b[3::2], b[:-3:2]),
    }[view]
    want = buf.copy()
    dst, src = pick(want)
    np.copyto(*((dst, src) if up else (src, dst)))  # (numpy copies overlapping arrays as memmove does)
    dst, src = pick(buf)
    memcpy.copy(*((dst, src) if up else (src, dst)))
    assert np.array_equal(buf, want)


def test_the_span_of_a_layouts_runs_is_that_of_its_addresses() -> None:
    """_Layout.bounds (from the shape alone) == the first address and the last one plus a run."""
    base = np.zeros(1 << 16, np.uint8)
    rng = np.random.default_rng(3)
    for _ in range(200):
        dims = int(rng.integers(1, 4))
        shape = tuple(int(n) for n in rng.integers(1, 5, dims))
        strides = tuple(int(s) for s in rng.integers(-600, 600, dims))
        layout = memcpy._Layout(base.ctypes.data + (1 << 15), shape, strides, 1)
        run = int(rng.integers(1, 300))
        addr = layout.addresses(dims).view(np.int64)
        assert layout.bounds(dims, run) == (int(addr.min()), int(addr.max()) + run)

"""kvdock.keys: the chunk-hash contract and token-id validation."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
from blake3 import blake3

from kvdock.keys import (
    MAX_TOKEN_ID,
    SEED,
    TOKEN_DTYPE,
    ObjectKey,
    chunk_hashes,
    normalize_tokens,
    tokens_from_bytes,
)


def _u32le(tokens: list[int]) -> bytes:
    """The documented wire form: unsigned 32-bit little-endian, built without numpy."""
    return b"".join(struct.pack("<I", t) for t in tokens)


def _expected_chain(tokens: list[int], chunk_size: int) -> list[bytes]:
    """h_0 = blake3(b"kvdock/chunk-key/v1"); h_i = blake3(h_{i-1} || u32le(chunk i)), from the docstring."""
    prev = blake3(b"kvdock/chunk-key/v1").digest()
    out = []
    for i in range(len(tokens) // chunk_size):
        prev = blake3(prev + _u32le(tokens[i * chunk_size : (i + 1) * chunk_size])).digest()
        out.append(prev)
    return out


def _arr(tokens: list[int]) -> np.ndarray:
    return np.array(tokens, dtype=TOKEN_DTYPE)


# ---------------------------------------------------------------- chunk_hashes


def test_seed_is_blake3_of_documented_tag() -> None:
    assert blake3(b"kvdock/chunk-key/v1").digest() == SEED
    assert len(SEED) == 32


def test_token_dtype_is_uint32_little_endian() -> None:
    assert TOKEN_DTYPE.itemsize == 4
    assert TOKEN_DTYPE.kind == "u"
    assert TOKEN_DTYPE.byteorder in ("<", "=") and np.dtype("<u4") == TOKEN_DTYPE
    assert MAX_TOKEN_ID == 4294967295


def test_pinned_digest_of_one_chunk() -> None:
    # computed here from the contract alone: seed, then one chunk of [1, 2, 3, 4] as u32 LE
    seed = blake3(b"kvdock/chunk-key/v1").digest()
    payload = b"\x01\x00\x00\x00\x02\x00\x00\x00\x03\x00\x00\x00\x04\x00\x00\x00"
    expected = blake3(seed + payload).digest()
    assert chunk_hashes(_arr([1, 2, 3, 4]), 4) == [expected]


def test_pinned_digest_uses_little_endian_for_large_ids() -> None:
    tokens = [0x01020304, MAX_TOKEN_ID]
    payload = bytes([0x04, 0x03, 0x02, 0x01, 0xFF, 0xFF, 0xFF, 0xFF])
    expected = blake3(blake3(b"kvdock/chunk-key/v1").digest() + payload).digest()
    assert chunk_hashes(_arr(tokens), 2) == [expected]
    # a big-endian encoding would give a different key
    be = blake3(SEED + struct.pack(">II", *tokens)).digest()
    assert be != expected


def test_chain_matches_independent_implementation() -> None:
    tokens = list(range(100, 100 + 24))
    got = chunk_hashes(_arr(tokens), 8)
    assert len(got) == 3
    assert all(len(h) == 32 for h in got)
    assert got == _expected_chain(tokens, 8)
    assert len(set(got)) == 3


def test_hash_i_depends_on_every_previous_chunk() -> None:
    base = list(range(32))
    ref = chunk_hashes(_arr(base), 8)
    for pos in range(32):
        changed = list(base)
        changed[pos] += 1000
        got = chunk_hashes(_arr(changed), 8)
        chunk = pos // 8
        assert got[:chunk] == ref[:chunk], f"chunks before {chunk} must not change (pos {pos})"
        for i in range(chunk, 4):
            assert got[i] != ref[i], f"chunk {i} must change when token {pos} changes"


def test_same_chunk_content_at_different_positions_hashes_differently() -> None:
    tokens = [7, 7, 7, 7] * 3
    got = chunk_hashes(_arr(tokens), 4)
    assert len(set(got)) == 3


def test_prefix_hashes_are_a_prefix() -> None:
    tokens = list(range(40))
    assert chunk_hashes(_arr(tokens[:16]), 8) == chunk_hashes(_arr(tokens), 8)[:2]


def test_partial_trailing_chunk_is_ignored() -> None:
    tokens = list(range(20))
    full = chunk_hashes(_arr(tokens[:16]), 8)
    assert chunk_hashes(_arr(tokens), 8) == full
    assert chunk_hashes(_arr(tokens[:16] + [999999] * 7), 8) == full
    assert len(full) == 2


def test_fewer_tokens_than_a_chunk_gives_no_hashes() -> None:
    assert chunk_hashes(_arr([1, 2, 3]), 4) == []
    assert chunk_hashes(np.zeros(0, dtype=TOKEN_DTYPE), 4) == []


def test_chunk_size_changes_keys() -> None:
    tokens = list(range(16))
    by8 = chunk_hashes(_arr(tokens), 8)
    by16 = chunk_hashes(_arr(tokens), 16)
    assert by16 == _expected_chain(tokens, 16)
    assert by16[0] != by8[1]


def test_object_key_identity_includes_salt_model_and_rank() -> None:
    h = chunk_hashes(_arr([1, 2]), 2)[0]
    k = ObjectKey("m", 0, "", h)
    assert k == ObjectKey("m", 0, "", h)
    assert len({k, ObjectKey("m", 0, "salt", h), ObjectKey("m", 1, "", h), ObjectKey("n", 0, "", h)}) == 4
    assert k.chunk == h and k.model == "m" and k.rank == 0 and k.salt == ""


# ---------------------------------------------------------------- tokens_from_bytes


def test_tokens_from_bytes_round_trip() -> None:
    arr = tokens_from_bytes(_u32le([5, 6, MAX_TOKEN_ID]))
    assert arr.dtype == TOKEN_DTYPE
    assert arr.tolist() == [5, 6, MAX_TOKEN_ID]


def test_tokens_from_bytes_rejects_ragged_buffer() -> None:
    with pytest.raises(ValueError, match="7 bytes"):
        tokens_from_bytes(b"\x00" * 7)


# ---------------------------------------------------------------- normalize_tokens


def _check_out(arr: np.ndarray, expected: list[int]) -> None:
    assert isinstance(arr, np.ndarray)
    assert arr.dtype == TOKEN_DTYPE
    assert arr.ndim == 1
    assert arr.flags["C_CONTIGUOUS"]
    assert arr.tolist() == expected


@pytest.mark.parametrize(
    "value",
    [
        [1, 2, 3],
        (1, 2, 3),
        range(1, 4),
        [np.int64(1), np.uint16(2), np.int8(3)],
        np.array([1, 2, 3], dtype=np.int64),
        np.array([1, 2, 3], dtype=np.uint8),
        np.array([1, 2, 3], dtype=np.uint64),
        torch.tensor([1, 2, 3]),
        torch.tensor([1, 2, 3], dtype=torch.int32),
    ],
    ids=["list", "tuple", "range", "np-scalars", "np-int64", "np-uint8", "np-uint64", "torch-int64", "torch-int32"],
)
def test_normalize_accepts_integer_inputs(value: object) -> None:
    _check_out(normalize_tokens(value), [1, 2, 3])


def test_normalize_boundaries() -> None:
    _check_out(normalize_tokens([0, MAX_TOKEN_ID]), [0, MAX_TOKEN_ID])
    _check_out(normalize_tokens(np.array([0, MAX_TOKEN_ID], dtype=np.int64)), [0, MAX_TOKEN_ID])
    _check_out(normalize_tokens(torch.tensor([0, MAX_TOKEN_ID])), [0, MAX_TOKEN_ID])


def test_normalize_empty() -> None:
    _check_out(normalize_tokens([]), [])
    _check_out(normalize_tokens(np.zeros(0, dtype=np.int64)), [])
    _check_out(normalize_tokens(torch.zeros(0, dtype=torch.long)), [])


def test_normalize_non_contiguous_input_becomes_contiguous() -> None:
    arr = np.arange(10, dtype=np.int64)[::2]
    assert not arr.flags["C_CONTIGUOUS"]
    _check_out(normalize_tokens(arr), [0, 2, 4, 6, 8])
    t = torch.arange(10)[::3]
    _check_out(normalize_tokens(t), [0, 3, 6, 9])


def test_normalize_returns_a_contiguous_uint32_array_itself() -> None:
    """Every uint32 is a token id: such an array is returned as it is (no copy, no range check);
    a strided or big-endian one is still made a contiguous little-endian copy."""
    arr = np.array([0, 7, MAX_TOKEN_ID], dtype=TOKEN_DTYPE)
    assert normalize_tokens(arr) is arr
    _check_out(normalize_tokens(np.arange(10, dtype=TOKEN_DTYPE)[::3]), [0, 3, 6, 9])
    _check_out(normalize_tokens(np.array([1, MAX_TOKEN_ID], dtype=">u4")), [1, MAX_TOKEN_ID])
    with pytest.raises(ValueError, match="one-dimensional"):
        normalize_tokens(np.zeros((2, 2), dtype=TOKEN_DTYPE))


def test_normalize_float_tensor_requiring_grad_is_a_type_error() -> None:
    # .numpy() on such a tensor raises RuntimeError; normalize must detach first and report the dtype
    t = torch.tensor([4.0, 5.0], requires_grad=True)
    with pytest.raises(TypeError, match="float32"):
        normalize_tokens(t)


def test_normalized_tokens_hash_like_raw_contract() -> None:
    tokens = [3, 1, 4, 1, 5, 9, 2, 6]
    for value in (tokens, np.array(tokens), torch.tensor(tokens)):
        assert chunk_hashes(normalize_tokens(value), 4) == _expected_chain(tokens, 4)


@pytest.mark.parametrize(
    "value",
    [
        [1.0, 2.0],
        [1, 2.5],
        [True, False],
        [1, True],
        [np.bool_(True)],
        ["1", "2"],
        "12",
        [None],
        [b"1"],
        np.array([1.0, 2.0]),
        np.array([True, False]),
        np.array(["1", "2"]),
        torch.tensor([1.0, 2.0]),
        torch.tensor([1.0, 2.0], dtype=torch.float16),
        torch.tensor([True, False]),
        5,
        None,
    ],
    ids=[
        "floats",
        "mixed-float",
        "bools",
        "mixed-bool",
        "np-bool-scalar",
        "str-list",
        "str",
        "none-item",
        "bytes-item",
        "np-float",
        "np-bool",
        "np-str",
        "torch-float",
        "torch-half",
        "torch-bool",
        "scalar-int",
        "none",
    ],
)
def test_normalize_rejects_non_integers_with_type_error(value: object) -> None:
    with pytest.raises(TypeError):
        normalize_tokens(value)


def test_type_error_message_names_the_offender() -> None:
    with pytest.raises(TypeError, match="float"):
        normalize_tokens([1, 2.5])
    with pytest.raises(TypeError, match="bool"):
        normalize_tokens([1, True])
    with pytest.raises(TypeError, match="float64"):
        normalize_tokens(np.array([1.5]))


@pytest.mark.parametrize(
    "value",
    [
        [-1],
        [0, -5, 3],
        [MAX_TOKEN_ID + 1],
        [2**40],
        np.array([-1, 2], dtype=np.int64),
        np.array([MAX_TOKEN_ID + 1], dtype=np.int64),
        np.array([2**64 - 1], dtype=np.uint64),
        torch.tensor([-3, 1]),
        torch.tensor([MAX_TOKEN_ID + 1]),
    ],
    ids=["neg", "neg-mid", "max+1", "2^40", "np-neg", "np-max+1", "np-u64max", "torch-neg", "torch-max+1"],
)
def test_normalize_rejects_out_of_range_with_value_error(value: object) -> None:
    with pytest.raises(ValueError, match="out of range"):
        normalize_tokens(value)


@pytest.mark.parametrize("big", [2**63, 2**64, -(2**63) - 1, 10**30], ids=["2^63", "2^64", "-2^63-1", "1e30"])
def test_normalize_rejects_huge_python_ints_with_value_error(big: int) -> None:
    # documented: ValueError for ids outside 0..2**32-1, whatever their magnitude
    with pytest.raises(ValueError, match="out of range"):
        normalize_tokens([1, big])


@pytest.mark.parametrize(
    "value",
    [np.zeros((2, 3), dtype=np.int64), np.zeros((1, 4), dtype=np.uint32), torch.zeros(2, 3, dtype=torch.long)],
    ids=["np-2x3", "np-1x4", "torch-2x3"],
)
def test_normalize_rejects_2d_with_value_error(value: object) -> None:
    with pytest.raises(ValueError, match="one-dimensional"):
        normalize_tokens(value)


def test_normalize_rejects_0d_array() -> None:
    with pytest.raises(ValueError, match="one-dimensional"):
        normalize_tokens(np.array(7))
    with pytest.raises(ValueError, match="one-dimensional"):
        normalize_tokens(torch.tensor(7))


def test_a_list_of_ints_takes_the_native_path_with_the_same_checks() -> None:
    from kvdock.keys import MAX_TOKEN_ID

    assert normalize_tokens([0, 5, MAX_TOKEN_ID]).tolist() == [0, 5, MAX_TOKEN_ID]
    assert normalize_tokens((7, 8)).dtype == np.dtype("<u4")
    got = normalize_tokens(list(range(10_000)))
    assert got.flags.writeable and np.array_equal(got, np.arange(10_000, dtype=np.uint32))
    for bad, err, msg in [
        ([1, True], TypeError, "got bool True"),
        ([1, 2.0], TypeError, "got float 2.0"),
        ([3, -1], ValueError, "out of range"),
        ([MAX_TOKEN_ID + 1], ValueError, "out of range"),
        ([2**80], ValueError, "out of range"),
    ]:
        with pytest.raises(err, match=msg):
            normalize_tokens(bad)
    assert normalize_tokens([np.int64(3), 4]).tolist() == [3, 4]  # numpy ints: the general path

"""kvdock.layout: engine formats, geometry decoding, chunk sizes and HF config parsing."""

from __future__ import annotations

import dataclasses

import pytest

from kvdock.layout import (
    DTYPE_SIZES,
    FORMAT_AXES,
    KV_2LTD,
    DecodedShape,
    Geometry,
    HFGeometry,
    check_dtype,
    concrete_shape,
    decode_shape,
    hf_config_geometry,
)


def test_constants() -> None:
    assert KV_2LTD == "KV_2LTD"
    assert set(FORMAT_AXES) == {"NHD", "HND"}
    assert DTYPE_SIZES == {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}


# ---------------------------------------------------------------- shapes


def test_concrete_shape_nhd_axis_order() -> None:
    assert concrete_shape("NHD", 10, 16, 4, 64) == [2, 10, 16, 4, 64]


def test_concrete_shape_hnd_axis_order() -> None:
    assert concrete_shape("HND", 10, 16, 4, 64) == [2, 10, 4, 16, 64]


@pytest.mark.parametrize("fmt", ["NHD", "HND"])
@pytest.mark.parametrize(("blocks", "block", "heads", "dim"), [(1, 16, 2, 8), (7, 32, 8, 128), (3, 1, 1, 1)])
def test_decode_concrete_round_trip(fmt: str, blocks: int, block: int, heads: int, dim: int) -> None:
    shape = concrete_shape(fmt, blocks, block, heads, dim)
    assert decode_shape(fmt, shape) == DecodedShape(num_kv_heads=heads, block_size=block, head_dim=dim)
    assert decode_shape(fmt, tuple(shape)) == DecodedShape(heads, block, dim)


def test_decode_distinguishes_heads_and_block_axes() -> None:
    shape = [2, 5, 16, 4, 64]
    nhd = decode_shape("NHD", shape)
    hnd = decode_shape("HND", shape)
    assert (nhd.block_size, nhd.num_kv_heads) == (16, 4)
    assert (hnd.block_size, hnd.num_kv_heads) == (4, 16)
    assert nhd.head_dim == hnd.head_dim == 64


def test_decoded_shape_is_frozen() -> None:
    d = decode_shape("NHD", [2, 1, 16, 2, 8])
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.head_dim = 4  # type: ignore[misc]


@pytest.mark.parametrize("fmt", ["nhd", "KV_2LTD", "", "NHD "])
def test_unknown_format_is_a_value_error(fmt: str) -> None:
    with pytest.raises(ValueError, match="unknown KV format"):
        decode_shape(fmt, [2, 1, 16, 2, 8])
    with pytest.raises(ValueError, match="unknown KV format"):
        concrete_shape(fmt, 1, 16, 2, 8)


@pytest.mark.parametrize("shape", [[2, 1, 16, 2], [2, 1, 16, 2, 8, 1], [], [2]])
@pytest.mark.parametrize("fmt", ["NHD", "HND"])
def test_wrong_rank_is_a_value_error(fmt: str, shape: list[int]) -> None:
    with pytest.raises(ValueError, match="5-d shape"):
        decode_shape(fmt, shape)


@pytest.mark.parametrize("axis0", [1, 3, 0, 4])
@pytest.mark.parametrize("fmt", ["NHD", "HND"])
def test_axis0_must_be_two(fmt: str, axis0: int) -> None:
    with pytest.raises(ValueError, match="axis 0 must be 2"):
        decode_shape(fmt, [axis0, 1, 16, 2, 8])


@pytest.mark.parametrize("pos", [1, 2, 3, 4])
def test_non_positive_sizes_are_a_value_error(pos: int) -> None:
    for bad in (0, -1):
        shape = [2, 1, 16, 2, 8]
        shape[pos] = bad
        with pytest.raises(ValueError, match="all sizes > 0"):
            decode_shape("NHD", shape)


# ---------------------------------------------------------------- dtype and Geometry


def test_check_dtype() -> None:
    for name in DTYPE_SIZES:
        assert check_dtype(name) == name
    with pytest.raises(ValueError, match="unsupported KV dtype 'int8'"):
        check_dtype("int8")
    with pytest.raises(ValueError, match="unsupported"):
        check_dtype("torch.float16")


def test_geometry_derived_values() -> None:
    g = Geometry(num_layers=3, num_kv_heads=2, head_dim=8, dtype="bfloat16")
    assert g.hidden_dim == 16
    assert g.itemsize == 2
    assert g.chunk_shape(16) == (2, 3, 16, 16)


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [("float32", 6144), ("bfloat16", 3072), ("float16", 3072), ("float8_e4m3fn", 1536)],
)
def test_chunk_nbytes(dtype: str, expected: int) -> None:
    g = Geometry(3, 2, 8, dtype)
    assert g.chunk_nbytes(16) == expected
    shape = g.chunk_shape(16)
    assert shape[0] * shape[1] * shape[2] * shape[3] * g.itemsize == expected


def test_chunk_nbytes_realistic_model() -> None:
    # Llama-3-8B-like: 32 layers, 8 kv heads x 128, bf16, chunk 256 -> 32 MiB per chunk
    g = Geometry(32, 8, 128, "bfloat16")
    assert g.chunk_nbytes(256) == 2 * 32 * 256 * 1024 * 2 == 32 * 2**20


def test_chunk_nbytes_scales_linearly_with_chunk_size() -> None:
    g = Geometry(4, 2, 16, "float32")
    assert g.chunk_nbytes(1) == 2 * 4 * 32 * 4
    assert g.chunk_nbytes(64) == 64 * g.chunk_nbytes(1)


def test_geometry_is_frozen_and_hashable() -> None:
    g = Geometry(3, 2, 8, "float16")
    with pytest.raises(dataclasses.FrozenInstanceError):
        g.num_layers = 4  # type: ignore[misc]
    assert {g, Geometry(3, 2, 8, "float16")} == {g}


# ---------------------------------------------------------------- hf_config_geometry

LLAMA = {
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "hidden_size": 4096,
    "torch_dtype": "bfloat16",
}


def test_hf_with_kv_heads_and_derived_head_dim() -> None:
    assert hf_config_geometry(LLAMA) == HFGeometry(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16")


def test_hf_without_kv_heads_uses_attention_heads() -> None:
    cfg = {k: v for k, v in LLAMA.items() if k != "num_key_value_heads"}
    assert hf_config_geometry(cfg) == HFGeometry(32, 32, 128, "bfloat16")


def test_hf_null_kv_heads_uses_attention_heads() -> None:
    assert hf_config_geometry({**LLAMA, "num_key_value_heads": None}).num_kv_heads == 32


def test_hf_explicit_head_dim_wins_over_hidden_size() -> None:
    # Gemma-like: head_dim is not hidden_size / heads
    cfg = {**LLAMA, "head_dim": 256}
    g = hf_config_geometry(cfg)
    assert g.head_dim == 256
    assert isinstance(g.head_dim, int)


def test_hf_explicit_head_dim_without_hidden_size() -> None:
    cfg = {"num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 16, "torch_dtype": "float16"}
    assert hf_config_geometry(cfg) == HFGeometry(2, 4, 16, "float16")


def test_hf_dtype_fallbacks() -> None:
    base = {k: v for k, v in LLAMA.items() if k != "torch_dtype"}
    assert hf_config_geometry(base).dtype == "float32"
    assert hf_config_geometry({**base, "dtype": "float16"}).dtype == "float16"
    assert hf_config_geometry({**base, "torch_dtype": "bfloat16", "dtype": "float16"}).dtype == "bfloat16"


def test_hf_unsupported_dtype_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="unsupported KV dtype"):
        hf_config_geometry({**LLAMA, "torch_dtype": "int4"})


def test_hf_text_config_nesting() -> None:
    cfg = {"model_type": "llava", "vision_config": {"hidden_size": 1024}, "text_config": dict(LLAMA)}
    assert hf_config_geometry(cfg) == HFGeometry(32, 8, 128, "bfloat16")


def test_hf_top_level_fields_win_over_text_config() -> None:
    cfg = {**LLAMA, "text_config": {"num_hidden_layers": 2, "num_attention_heads": 2, "hidden_size": 8}}
    assert hf_config_geometry(cfg).num_layers == 32


def test_hf_values_as_strings_are_converted() -> None:
    cfg = {"num_hidden_layers": "4", "num_attention_heads": "2", "hidden_size": "64", "head_dim": "32"}
    assert hf_config_geometry(cfg) == HFGeometry(4, 2, 32, "float32")


@pytest.mark.parametrize("missing", ["num_hidden_layers", "num_attention_heads"])
def test_hf_missing_required_field_is_a_value_error(missing: str) -> None:
    cfg = {k: v for k, v in LLAMA.items() if k != missing}
    with pytest.raises(ValueError, match=missing):
        hf_config_geometry(cfg)


def test_hf_missing_field_in_text_config_is_a_value_error() -> None:
    text = {k: v for k, v in LLAMA.items() if k != "num_hidden_layers"}
    with pytest.raises(ValueError, match="num_hidden_layers"):
        hf_config_geometry({"text_config": text})


def test_hf_missing_head_dim_and_hidden_size_is_a_value_error() -> None:
    # documented: "ValueError when a required field is missing"; head_dim can only be derived
    # from hidden_size, so a config with neither must be a ValueError (not a bare KeyError)
    cfg = {"num_hidden_layers": 2, "num_attention_heads": 4, "torch_dtype": "float16"}
    with pytest.raises(ValueError, match="hidden_size"):
        hf_config_geometry(cfg)


def test_hf_empty_config_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="num_hidden_layers"):
        hf_config_geometry({})

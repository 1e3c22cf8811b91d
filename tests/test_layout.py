"""kvdock.layout: KVGeometry (checks, chunk shapes and sizes, HF configs), engine formats, dtypes."""

from __future__ import annotations

import re

import msgspec
import pytest

from kvdock.config import MAX_HEAD_DIM, MAX_NUM_KV_HEADS, MAX_NUM_LAYERS, MAX_WORLD_SIZE
from kvdock.layout import (
    DTYPE_SIZES,
    FORMAT_AXES,
    KV_2LTD,
    KV_LATENT,
    KV_PAIR,
    KVGeometry,
    check_dtype,
    concrete_shape,
)


def test_constants() -> None:
    assert KV_2LTD == "KV_2LTD"
    assert (KV_PAIR, KV_LATENT) == ("pair", "latent")
    assert set(FORMAT_AXES) == {"NHD", "HND"}
    assert DTYPE_SIZES == {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}
    assert (MAX_NUM_LAYERS, MAX_NUM_KV_HEADS, MAX_HEAD_DIM, MAX_WORLD_SIZE) == (4096, 4096, 16384, 1024)


# ---------------------------------------------------------------- engine formats


def test_concrete_shape_nhd_axis_order() -> None:
    assert concrete_shape("NHD", 10, 16, 4, 64) == [2, 10, 16, 4, 64]


def test_concrete_shape_hnd_axis_order() -> None:
    assert concrete_shape("HND", 10, 16, 4, 64) == [2, 10, 4, 16, 64]


@pytest.mark.parametrize("fmt", ["nhd", "KV_2LTD", "", "NHD "])
def test_unknown_format_is_a_value_error(fmt: str) -> None:
    with pytest.raises(ValueError, match="unknown KV format"):
        concrete_shape(fmt, 1, 16, 2, 8)


def test_check_dtype() -> None:
    for name in DTYPE_SIZES:
        assert check_dtype(name) == name
    with pytest.raises(ValueError, match="unsupported KV dtype 'int8'"):
        check_dtype("int8")
    with pytest.raises(ValueError, match="unsupported"):
        check_dtype("torch.float16")


# ---------------------------------------------------------------- KVGeometry


def test_geometry_defaults_and_derived_values() -> None:
    g = KVGeometry(num_layers=3, num_kv_heads=2, head_dim=8, dtype="bfloat16")
    assert (g.kv_kind, g.world_size, g.rank) == (KV_PAIR, 1, 0)
    assert g.hidden_dim == 16
    assert g.itemsize == 2
    assert g.planes == 2
    assert g.chunk_shape(16) == (2, 3, 16, 16)
    assert g.check() is g


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [("float32", 6144), ("bfloat16", 3072), ("float16", 3072), ("float8_e4m3fn", 1536)],
)
def test_chunk_nbytes(dtype: str, expected: int) -> None:
    g = KVGeometry(3, 2, 8, dtype)
    assert g.chunk_nbytes(16) == expected
    shape = g.chunk_shape(16)
    assert shape[0] * shape[1] * shape[2] * shape[3] * g.itemsize == expected


def test_latent_geometry_has_one_plane() -> None:
    # DeepSeek-V3-like MLA: one latent of 512 + 64 per token and layer
    g = KVGeometry(61, 1, 576, "bfloat16", kv_kind=KV_LATENT).check()
    assert g.planes == 1 and g.hidden_dim == 576
    assert g.chunk_shape(256) == (1, 61, 256, 576)
    assert g.chunk_nbytes(256) == 61 * 256 * 576 * 2
    assert g.chunk_nbytes(256) * 2 == KVGeometry(61, 1, 576, "bfloat16").chunk_nbytes(256)


def test_chunk_nbytes_realistic_model() -> None:
    # Llama-3-8B-like: 32 layers, 8 kv heads x 128, bf16, chunk 256 -> 32 MiB per chunk
    g = KVGeometry(32, 8, 128, "bfloat16")
    assert g.chunk_nbytes(256) == 2 * 32 * 256 * 1024 * 2 == 32 * 2**20


def test_chunk_nbytes_scales_linearly_with_chunk_size() -> None:
    g = KVGeometry(4, 2, 16, "float32")
    assert g.chunk_nbytes(1) == 2 * 4 * 32 * 4
    assert g.chunk_nbytes(64) == 64 * g.chunk_nbytes(1)


def test_geometry_is_frozen_hashable_and_compared_by_value() -> None:
    g = KVGeometry(3, 2, 8, "float16")
    with pytest.raises(AttributeError):
        g.num_layers = 4  # type: ignore[misc]
    assert {g, KVGeometry(3, 2, 8, "float16")} == {g}
    assert g != KVGeometry(3, 2, 8, "float16", kv_kind=KV_LATENT)
    assert g != KVGeometry(3, 2, 8, "float16", world_size=2)
    assert g != KVGeometry(3, 2, 8, "float16", world_size=2, rank=1)


def test_geometry_wire_form_is_strict() -> None:
    g = KVGeometry(3, 2, 8, "float16", world_size=4, rank=3)
    assert msgspec.convert(msgspec.to_builtins(g), KVGeometry) == g
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(g), type=KVGeometry) == g
    with pytest.raises(msgspec.ValidationError, match="unknown field `block_size`"):
        msgspec.convert({**msgspec.to_builtins(g), "block_size": 16}, KVGeometry)
    with pytest.raises(msgspec.ValidationError, match="missing required field `dtype`"):
        msgspec.convert({"num_layers": 3, "num_kv_heads": 2, "head_dim": 8}, KVGeometry)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"num_layers": 0}, "num_layers must be between 1 and 4096, got 0"),
        ({"num_layers": 2**40}, "num_layers must be between 1 and 4096, got 1099511627776"),
        ({"num_kv_heads": -1}, "num_kv_heads must be between 1 and 4096, got -1"),
        ({"num_kv_heads": 4097}, "num_kv_heads must be between 1 and 4096, got 4097"),
        ({"head_dim": 0}, "head_dim must be between 1 and 16384, got 0"),
        ({"head_dim": 16385}, "head_dim must be between 1 and 16384, got 16385"),
        ({"world_size": 0}, "world_size must be between 1 and 1024, got 0"),
        ({"world_size": 1025}, "world_size must be between 1 and 1024, got 1025"),
        ({"num_layers": True}, "num_layers must be an int, got True"),
        ({"head_dim": 8.0}, "head_dim must be an int, got 8.0"),
        ({"num_kv_heads": "2"}, "num_kv_heads must be an int, got '2'"),
        ({"rank": 1}, "rank must be between 0 and world_size - 1 = 0, got 1"),
        ({"rank": -1, "world_size": 2}, "rank must be between 0 and world_size - 1 = 1, got -1"),
        ({"rank": 4, "world_size": 4}, "rank must be between 0 and world_size - 1 = 3, got 4"),
        ({"dtype": "int8"}, "unsupported KV dtype 'int8'"),
        ({"dtype": "torch.bfloat16"}, "unsupported KV dtype 'torch.bfloat16'"),
        ({"kv_kind": "mla"}, "unknown kv_kind 'mla'; known: pair, latent"),
        ({"kv_kind": ""}, "unknown kv_kind ''"),
        ({"total_kv_heads": 4097}, "total_kv_heads must be between 0 and 4096, got 4097"),
        ({"total_kv_heads": True}, "total_kv_heads must be between 0 and 4096, got True"),
        ({"total_kv_heads": 3}, "total_kv_heads 3 does not fit world_size 1 ranks of 2 KV head(s)"),
        ({"world_size": 4, "num_kv_heads": 1, "total_kv_heads": 3}, "total_kv_heads 3 does not fit world_size 4"),
        ({"kv_kind": "latent"}, "an MLA latent cache has one latent per token (num_kv_heads 1), got num_kv_heads 2"),
    ],
)
def test_check_names_the_impossible_field(changes: dict, message: str) -> None:
    g = msgspec.structs.replace(KVGeometry(3, 2, 8, "bfloat16"), **changes)
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        g.check()


def test_shards_of_tensor_parallel_ranks() -> None:
    tp4 = KVGeometry(3, 2, 8, "float16", world_size=4, rank=2)
    assert (tp4.kv_heads_total, tp4.shards, [tp4.shard_of(r) for r in range(4)]) == (8, 4, [0, 1, 2, 3])
    assert tp4.logical() == KVGeometry(3, 8, 8, "float16") and tp4.at_rank(0).rank == 0
    # 2 KV heads over 8 ranks: each head on 4 ranks (vLLM: shard = rank // replicas), stored once
    gqa = KVGeometry(3, 1, 8, "float16", world_size=8, total_kv_heads=2)
    assert (gqa.shards, [gqa.shard_of(r) for r in range(8)]) == (2, [0, 0, 0, 0, 1, 1, 1, 1])
    assert gqa.logical() == KVGeometry(3, 2, 8, "float16")
    # an explicit total that is the product changes nothing but the field
    assert KVGeometry(3, 2, 8, "float16", world_size=4, total_kv_heads=8).check().shards == 4
    # an MLA latent is the same on every rank: one shard
    mla = KVGeometry(3, 1, 576, "float16", kv_kind=KV_LATENT, world_size=4, rank=3)
    assert (mla.kv_heads_total, mla.shards, mla.shard_of(3)) == (1, 1, 0)
    assert mla.logical() == KVGeometry(3, 1, 576, "float16", kv_kind=KV_LATENT)
    assert mla.logical().chunk_shape(16) == (1, 3, 16, 576)  # KV_1LTD


def test_check_accepts_the_bounds_and_every_rank() -> None:
    KVGeometry(MAX_NUM_LAYERS, MAX_NUM_KV_HEADS, MAX_HEAD_DIM, "float8_e5m2").check()
    for rank in range(8):
        KVGeometry(3, 2, 8, "float16", world_size=8, rank=rank).check()
    KVGeometry(3, 1, 576, "float16", kv_kind=KV_LATENT, world_size=MAX_WORLD_SIZE, rank=MAX_WORLD_SIZE - 1).check()


# ---------------------------------------------------------------- KVGeometry.from_hf_config

LLAMA = {
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "hidden_size": 4096,
    "torch_dtype": "bfloat16",
}


def test_hf_with_kv_heads_and_derived_head_dim() -> None:
    assert KVGeometry.from_hf_config(LLAMA) == KVGeometry(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16")


def test_hf_without_kv_heads_uses_attention_heads() -> None:
    cfg = {k: v for k, v in LLAMA.items() if k != "num_key_value_heads"}
    assert KVGeometry.from_hf_config(cfg) == KVGeometry(32, 32, 128, "bfloat16")


def test_hf_null_kv_heads_uses_attention_heads() -> None:
    assert KVGeometry.from_hf_config({**LLAMA, "num_key_value_heads": None}).num_kv_heads == 32


def test_hf_explicit_head_dim_wins_over_hidden_size() -> None:
    # Gemma-like: head_dim is not hidden_size / heads
    cfg = {**LLAMA, "head_dim": 256}
    g = KVGeometry.from_hf_config(cfg)
    assert g.head_dim == 256
    assert isinstance(g.head_dim, int)


def test_hf_explicit_head_dim_without_hidden_size() -> None:
    cfg = {"num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 16, "torch_dtype": "float16"}
    assert KVGeometry.from_hf_config(cfg) == KVGeometry(2, 4, 16, "float16")


def test_hf_dtype_fallbacks() -> None:
    base = {k: v for k, v in LLAMA.items() if k != "torch_dtype"}
    assert KVGeometry.from_hf_config(base).dtype == "float32"
    assert KVGeometry.from_hf_config({**base, "dtype": "float16"}).dtype == "float16"
    assert KVGeometry.from_hf_config({**base, "torch_dtype": "bfloat16", "dtype": "float16"}).dtype == "bfloat16"


def test_hf_unsupported_dtype_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="unsupported KV dtype"):
        KVGeometry.from_hf_config({**LLAMA, "torch_dtype": "int4"})


def test_hf_text_config_nesting() -> None:
    cfg = {"model_type": "llava", "vision_config": {"hidden_size": 1024}, "text_config": dict(LLAMA)}
    assert KVGeometry.from_hf_config(cfg) == KVGeometry(32, 8, 128, "bfloat16")


def test_hf_top_level_fields_win_over_text_config() -> None:
    cfg = {**LLAMA, "text_config": {"num_hidden_layers": 2, "num_attention_heads": 2, "hidden_size": 8}}
    assert KVGeometry.from_hf_config(cfg).num_layers == 32


def test_hf_values_as_strings_are_converted() -> None:
    cfg = {"num_hidden_layers": "4", "num_attention_heads": "2", "hidden_size": "64", "head_dim": "32"}
    assert KVGeometry.from_hf_config(cfg) == KVGeometry(4, 2, 32, "float32")


@pytest.mark.parametrize("missing", ["num_hidden_layers", "num_attention_heads"])
def test_hf_missing_required_field_is_a_value_error(missing: str) -> None:
    cfg = {k: v for k, v in LLAMA.items() if k != missing}
    with pytest.raises(ValueError, match=missing):
        KVGeometry.from_hf_config(cfg)


def test_hf_missing_field_in_text_config_is_a_value_error() -> None:
    text = {k: v for k, v in LLAMA.items() if k != "num_hidden_layers"}
    with pytest.raises(ValueError, match="num_hidden_layers"):
        KVGeometry.from_hf_config({"text_config": text})


def test_hf_missing_head_dim_and_hidden_size_is_a_value_error() -> None:
    # documented: "ValueError when a required field is missing"; head_dim can only be derived
    # from hidden_size, so a config with neither must be a ValueError (not a bare KeyError)
    cfg = {"num_hidden_layers": 2, "num_attention_heads": 4, "torch_dtype": "float16"}
    with pytest.raises(ValueError, match="hidden_size"):
        KVGeometry.from_hf_config(cfg)


def test_hf_empty_config_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="num_hidden_layers"):
        KVGeometry.from_hf_config({})


def test_hf_mla_config_is_a_latent_geometry() -> None:
    # DeepSeek-V3: the cache holds one latent of kv_lora_rank + qk_rope_head_dim per token and layer
    cfg = {**LLAMA, "num_hidden_layers": 61, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "num_key_value_heads": 128}
    g = KVGeometry.from_hf_config(cfg)
    assert g == KVGeometry(61, 1, 576, "bfloat16", kv_kind=KV_LATENT)
    assert g.chunk_shape(16) == (1, 61, 16, 576)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"num_hidden_layers": 0}, "num_layers must be between 1 and 4096, got 0"),
        ({"num_key_value_heads": 5000}, "num_kv_heads must be between 1 and 4096, got 5000"),
        ({"hidden_size": 16}, "head_dim must be between 1 and 16384, got 0"),
        ({"num_hidden_layers": None}, "config.json: int() argument must be"),
    ],
)
def test_hf_impossible_values_are_a_value_error_naming_the_field(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        KVGeometry.from_hf_config({**LLAMA, **changes})

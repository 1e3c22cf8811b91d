"""Error messages that named the wrong thing (issue 27): a whole-model read of a model in pipeline
stages said "tensor parallelism"; an MLA model's shape error named the K/V layout KV_2LTD."""

from __future__ import annotations

import pytest
import torch

import kvdock.sdk as kvd
from helpers import CHUNK, make_tokens
from kvdock.errors import InvalidInputError


def test_a_model_in_pipeline_stages_is_refused_for_its_stages_not_tensor_parallelism(make_server) -> None:
    srv = make_server(register=None)
    kvd.register_model(srv.url, srv.http_url, "pp", num_layers=2, num_kv_heads=2, head_dim=8, dtype="bfloat16",
                       pp_size=2, timeout=10)  # fmt: skip
    kvd.register_model(srv.url, srv.http_url, "both", num_layers=2, num_kv_heads=1, head_dim=8, dtype="bfloat16",
                       world_size=2, pp_size=2, timeout=10)  # fmt: skip
    tokens = make_tokens(CHUNK)
    with kvd.connect(srv.url, srv.http_url, "pp", timeout=10) as c:
        with pytest.raises(InvalidInputError) as err:
            kvd.retrieve(c, tokens, layers=range(1, 3))
        assert str(err.value) == (
            "a read of some layers of 'pp', stored in 2 shards (2 pipeline stages), is not supported for the "
            "whole model yet; connect with kv_rank=r to work on one rank's shard"
        )
    both = r"stored in 4 shards \(tensor parallelism and 2 pipeline stages\)"
    with kvd.connect(srv.url, srv.http_url, "both", timeout=10) as c, pytest.raises(InvalidInputError, match=both):
        kvd.inspect_prefix(c, tokens)


def test_an_mla_shape_error_names_the_latent_layout(make_server) -> None:
    srv = make_server(register=None)
    kvd.register_model(srv.url, srv.http_url, "mla", num_layers=2, num_kv_heads=1, head_dim=40, dtype="bfloat16",
                       kv_kind="latent", timeout=10)  # fmt: skip
    with kvd.connect(srv.url, srv.http_url, "mla", timeout=10) as c:
        with pytest.raises(InvalidInputError) as err:
            kvd.store(c, torch.zeros(2, 2, CHUNK, 40, dtype=torch.bfloat16), make_tokens(CHUNK))
        assert str(err.value) == "kv must be KV_1LTD [1, num_layers=2, tokens, D=40] for 'mla', got [2, 2, 16, 40]"

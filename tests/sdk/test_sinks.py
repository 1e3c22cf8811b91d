"""The ChunkSink / ChunkSource seam: finish() ends every transfer, also a failed one (no copy is
left pending for the sink's next transfer), and sinks written without finish() still work."""

from __future__ import annotations

import pytest
import torch

import kvdock.sdk as kvd
from helpers import CHUNK, MODEL, make_kv, make_tokens
from kvdock.sdk.chunks import TensorChunks


def test_a_take_that_raises_leaves_no_copy_pending(transport_server) -> None:
    with kvd.connect(transport_server.url, transport_server.http_url, MODEL) as c:
        toks = make_tokens(3 * CHUNK, start=70_000)
        kv = make_kv(3 * CHUNK, seed=1)
        kvd.store(c, kv, toks)
        out = torch.zeros_like(kv)

        class Failing(TensorChunks):
            def take(self, index: int, src: torch.Tensor) -> None:
                if index == 2:
                    raise RuntimeError("sink broke")
                super().take(index, src)

        sink = Failing(out, CHUNK)
        with pytest.raises(RuntimeError, match="sink broke"):
            kvd.retrieve_into(c, toks, sink)
        assert sink._copier._pending == {}  # run at the failed transfer's end, not carried on
        assert torch.equal(out[:, :, : 2 * CHUNK], kv[:, :, : 2 * CHUNK])  # the slots were still held


def test_a_sink_without_finish_still_gets_every_chunk(transport_server) -> None:
    with kvd.connect(transport_server.url, transport_server.http_url, MODEL) as c:
        toks = make_tokens(2 * CHUNK, start=80_000)
        kv = make_kv(2 * CHUNK, seed=2)
        kvd.store(c, kv, toks)
        got: dict[int, torch.Tensor] = {}

        class Plain:
            def take(self, index: int, src: torch.Tensor) -> None:
                got[index] = src.clone()

        assert kvd.retrieve_into(c, toks, Plain()) == 2 * CHUNK
        assert torch.equal(torch.cat([got[0], got[1]], dim=2), kv)

"""kvdock.sdk.aio against real servers: 64 concurrent retrieves on one context are byte-exact on
both transports, the event loop keeps running while calls wait, and a cancelled call still
releases what it held."""

from __future__ import annotations

import asyncio

import pytest
import torch

import kvdock.sdk as kvd
import kvdock.sdk.aio as kva
from helpers import CHUNK, MODEL, ServerProc, make_kv, make_tokens
from kvdock.server.state import FAULT_COPY_ENV


def prompt(i: int) -> list[int]:
    return make_tokens((1 + i % 4) * CHUNK, start=1_000_000 + 10_000 * i)


def test_64_concurrent_retrieves_on_one_context(transport_server: ServerProc) -> None:
    kvs = [make_kv(len(prompt(i)), seed=100 + i) for i in range(64)]

    async def main() -> list[torch.Tensor | None]:
        async with await kva.connect(transport_server.url, transport_server.http_url, MODEL, timeout=20) as ctx:
            assert ctx.model_name == MODEL and ctx.chunk_size == CHUNK
            stored = await asyncio.gather(*(kva.store(ctx, kvs[i], prompt(i)) for i in range(64)))
            assert stored == [True] * 64
            got = await asyncio.gather(*(kva.retrieve(ctx, prompt(i)) for i in range(64)))
            hits = await kva.lookup_many(ctx, [prompt(i) for i in range(64)])
            assert hits == [len(prompt(i)) for i in range(64)]
            many = await kva.retrieve_many(ctx, [prompt(i) for i in range(64)], layers=range(1, 2))
            for i in range(64):
                assert many[i] is not None and torch.equal(many[i], kvs[i][:, 1:2])
            assert await kva.check_server_integrity(ctx) == []
            return got

    got = asyncio.run(main())
    for i, g in enumerate(got):
        assert g is not None and g.shape == kvs[i].shape and torch.equal(g.view(torch.uint8), kvs[i].view(torch.uint8))
    assert transport_server.get("/status")["sessions"] == 0


def test_the_loop_runs_while_calls_wait_and_a_cancelled_call_cleans_up(make_server) -> None:
    srv = make_server("--no-shm", env={FAULT_COPY_ENV: "0.3"})  # every inline copy waits 0.3 s on the server
    toks = make_tokens(2 * CHUNK, start=2_000_000)
    kv = make_kv(len(toks), seed=7)

    async def main() -> int:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        async with await kva.connect(srv.url, srv.http_url, MODEL, timeout=20, max_concurrency=8) as ctx:
            assert ctx.transport == "inline"
            assert await kva.store(ctx, kv, toks)
            tick = asyncio.create_task(ticker())
            got = await asyncio.gather(*(kva.retrieve(ctx, toks) for _ in range(8)))  # 8 copies at once
            assert ticks >= 5  # the loop kept running while all 8 waited on the server (>= 0.3 s)
            assert all(g is not None and torch.equal(g, kv) for g in got)
            slow = asyncio.create_task(kva.retrieve(ctx, toks))
            await asyncio.sleep(0.05)
            slow.cancel()
            with pytest.raises(asyncio.CancelledError):
                await slow
            again = await kva.retrieve(ctx, toks)  # the context still serves
            assert again is not None and torch.equal(again, kv)
            tick.cancel()
            return ticks

    asyncio.run(main())
    assert srv.get("/status")["sessions"] == 0  # the cancelled retrieve ran to its end and released its session


def test_aio_refuses_a_sync_context_and_bad_concurrency(ctx) -> None:
    async def main() -> None:
        with pytest.raises(kvd.InvalidInputError, match="ctx must be an AsyncKVCacheContext"):
            await kva.lookup(ctx, [1, 2])  # type: ignore[arg-type]
        with pytest.raises(kvd.InvalidInputError, match=r"max_concurrency must be an int in \[1, 1024\]"):
            await kva.connect(ctx.url, ctx.http_url, MODEL, max_concurrency=0)
        with pytest.raises(kvd.UnknownModelError, match="'nope' is not registered"):
            await kva.connect(ctx.url, ctx.http_url, "nope")
        status = await kva.server_status(ctx.http_url)
        assert [e["model_name"] for e in status["cache_context_meta"]] == [MODEL]

    asyncio.run(main())


def test_calls_on_a_closed_context_raise_the_sdk_error(server) -> None:
    async def main() -> None:
        actx = await kva.connect(server.url, server.http_url, MODEL, timeout=10)
        await kva.close(actx)
        await kva.close(actx)  # harmless twice
        assert actx.closed
        for call in (kva.lookup(actx, [1]), kva.retrieve(actx, [1]), kva.retrieve_many(actx, [[1]])):
            with pytest.raises(kvd.KVCacheSDKError, match="closed"):
                await call

    asyncio.run(main())

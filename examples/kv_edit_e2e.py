#!/usr/bin/env python
"""End-to-end KV edit: re-key a source prompt's cached KV under a different target prompt.

Steps (the engine is kvdock.integrations.hf, the SDK role is kvdock.sdk in another process):

1. the engine runs a SOURCE prompt (greedy); kvdock saves its KV (whole chunks);
2. the SDK role -- a separate process that connects by model name only -- retrieves the source KV;
3. a TARGET prompt of the same length differs from the source only in its first few token ids,
   so no chunk key of the target matches the source's (chunk keys chain the whole prefix);
4. the SDK role stores the source KV under the target's tokens (a "remap");
5. the engine runs the target prompt: its cached prefix now comes from kvdock (the source's KV);
6. a JSON report goes to stdout.

Why the outputs must match: the model never reads the target's first tokens -- their KV is loaded,
and it is the source's. Everything the engine computes (the uncached tail, identical in both
prompts, and every new token) attends to exactly the KV the source run produced, at the same
positions. Greedy decoding (do_sample=False, no beams, EOS suppressed until --max-new-tokens) is
deterministic, so the target continues exactly like the source. The only numerical difference is
that the source computed the tail in the same forward pass as the prefix; on a float32 model that
changes logits by ~1e-6, far below any greedy margin.

Without --url a ``kvdock serve`` subprocess is started on free loopback ports (chunk size
--chunk-size, no disk tier) and stopped at the end; with --url/--http-url the example uses that
server (which must allow registration of the model). Without --model a tiny random Llama is built
from a fixed config and --seed, so the example runs anywhere in seconds.

Exit status: 0 when the outputs match and the target hit the remapped KV, 1 otherwise, 2 on
usage or setup errors. Progress goes to stderr, the JSON report (only) to stdout.

    python examples/kv_edit_e2e.py
    python examples/kv_edit_e2e.py --url tcp://127.0.0.1:5555 --http-url http://127.0.0.1:9000 \\
        --model ~/models/Qwen3-0.6B --cache-salt demo
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument(
        "--prompt-tokens",
        type=int,
        help="source/target prompt length (default: 6 chunks + a quarter chunk, so a partial tail is computed)",
    )
    p.add_argument("--prompt", help="source prompt text (needs a --model with a tokenizer; default: random ids)")
    p.add_argument("--changed-tokens", type=int, default=4, help="leading token ids that differ in the target (4)")
    p.add_argument(
        "--sdk-in-process", action="store_true", help="run the SDK role in this process (default: a spawned process)"
    )
    return p.parse_args(argv)


def sdk_remap(
    url: str, http_url: str, model_name: str, source: list[int], target: list[int], salt: str, timeout: float
) -> dict[str, Any]:
    """The SDK role: retrieve the source's cached KV and store it under the target's tokens."""
    with kvd.connect(url, http_url, model_name, timeout) as ctx:
        before = kvd.lookup(ctx, target, salt)
        t0 = time.perf_counter()
        kv = kvd.retrieve(ctx, source, salt)
        t1 = time.perf_counter()
        if kv is None:
            raise RuntimeError("the source prompt's KV is not cached; was step 1 saved?")
        hit = int(kv.shape[2])
        stored = kvd.store(ctx, kv, target[:hit], salt)
        t2 = time.perf_counter()
        after = kvd.lookup(ctx, target, salt)
        return {
            "sdk_pid": os.getpid(),
            "sdk_transport": ctx.transport,
            "retrieved_tokens": hit,
            "retrieved_shape": list(kv.shape),
            "retrieve_s": round(t1 - t0, 6),
            "stored": stored,
            "store_s": round(t2 - t1, 6),
            "target_hit_tokens_before_remap": before,
            "target_hit_tokens_after_remap": after,
        }


def run_sdk_role(in_process: bool, *call: Any) -> dict[str, Any]:
    if in_process:
        return sdk_remap(*call)
    with ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn")) as pool:
        return pool.submit(sdk_remap, *call).result()


def check_lengths(num_tokens: int, changed: int, chunk: int) -> None:
    """The changed tokens must lie inside the prefix the engine can load."""
    cached = (num_tokens - 1) // chunk * chunk  # what the engine can load (at least one token computed)
    if not 0 < changed <= cached:
        raise die(
            f"--changed-tokens must be in [1, {cached}]: the prompt of {num_tokens} tokens has {cached} loadable "
            f"tokens with chunk size {chunk}; use a longer prompt"
        )


def make_prompts(args: argparse.Namespace, model: Any, chunk: int) -> tuple[list[int], list[int]]:
    """(source, target): same length, the target's first --changed-tokens ids replaced."""
    if args.prompt:
        if model.tokenizer is None:
            raise die("--prompt needs a --model directory with a tokenizer")
        source = list(model.tokenizer(args.prompt)["input_ids"])
    else:
        source = synthetic_prompt(default_length(args, chunk), int(model.model.config.vocab_size), args.seed)
    check_lengths(len(source), args.changed_tokens, chunk)
    vocab = int(model.model.config.vocab_size)
    target = [(t + 1) % vocab if i < args.changed_tokens else t for i, t in enumerate(source)]
    return source, target


def default_length(args: argparse.Namespace, chunk: int) -> int:
    return int(args.prompt_tokens or 6 * chunk + max(1, chunk // 4))


def run_vllm(args: argparse.Namespace, url: str, http_url: str, chunk: int) -> int:
    """The same flow with vLLM as the engine: kvdock's connector saves the source prompt's KV and
    loads the remapped KV for the target in a fresh engine (``--reuse-engine``: the same engine
    with its prefix cache cleared). A baseline run of the target in a namespace without the remap
    shows what the target gives when its prefix is computed."""
    salt = args.cache_salt
    m = load_model(args)
    source, target = make_prompts(args, m, chunk)
    n, gen = len(source), args.max_new_tokens
    cap = (n - 1) // chunk * chunk
    with tempfile.TemporaryDirectory(prefix="kvdock-e2e-") as tmp:
        cfg = {"kvdock.url": url, "kvdock.http_url": http_url, "kvdock.model_name": m.name}
        engines = VllmEngines(
            args, model_dir(args, m, Path(tmp)), str(m.model.dtype).removeprefix("torch."), cfg, Path(tmp)
        )
        try:
            log(f"1. source prompt ({n} tokens) through vLLM")
            src = engines.engine().call(op="generate", prompts=[source], max_tokens=gen, salts=[salt])
            with kvd.connect(url, http_url, m.name, args.timeout) as ctx:
                cached = kvd.lookup(ctx, source, salt)
            log(f"2-4. SDK role: retrieve {cached} cached tokens, store them under the target")
            remap = run_sdk_role(args.sdk_in_process, url, http_url, m.name, source, target, salt, args.timeout)
            log("5. target prompt through " + ("the same vLLM engine" if args.reuse_engine else "a fresh vLLM engine"))
            engine = engines.fresh()
            base = engine.call(op="generate", prompts=[target], max_tokens=gen, salts=[salt + "\x00baseline"])
            tgt = engine.call(op="generate", prompts=[target], max_tokens=gen, salts=[salt])
        finally:
            engines.close()
    src_new, tgt_new, base_new = src["outputs"][0], tgt["outputs"][0], base["outputs"][0]
    report: dict[str, Any] = {
        "engine": "vllm",
        **report_header(m, chunk, salt, n),
        "changed_leading_tokens": args.changed_tokens,
        "cached_tokens": cached,
        "source_hit_tokens": src["cached"][0],
        **remap,
        "vllm_engine_starts": engines.starts,
        "target_engine_hit_tokens": tgt["cached"][0],
        "baseline_hit_tokens": base["cached"][0],
        "source_generate_s": round(src["seconds"], 6),
        "target_generate_s": round(tgt["seconds"], 6),
        "baseline_generate_s": round(base["seconds"], 6),
        "new_tokens": len(src_new),
        **preview(m, "source", src_new),
        **preview(m, "target", tgt_new),
        **preview(m, "baseline", base_new),
        "outputs_match": src_new == tgt_new,
        "baseline_differs": base_new != src_new,
    }
    print_json(report)
    ok = report["outputs_match"] and report["baseline_differs"] and tgt["cached"][0] == cap > 0
    if not ok:
        log("FAILED: " + ("outputs differ" if not report["outputs_match"] else "no hit, or the baseline matched"))
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    salt = args.cache_salt
    with server(args) as (url, http_url, chunk):
        if not args.prompt:  # fail fast, before loading the model
            check_lengths(default_length(args, chunk), args.changed_tokens, chunk)
        if args.engine == "vllm":
            return run_vllm(args, url, http_url, chunk)
        import kvdock.integrations.hf as kvhf

        m = load_model(args)
        gen = greedy_kwargs(m.model, args.max_new_tokens)
        warm_up(m.model, gen)
        source, target = make_prompts(args, m, chunk)
        n = len(source)
        with kvhf.connect(m.model, url, http_url, m.name, args.timeout) as ctx:
            if kvd.lookup(ctx, source, salt) or kvd.lookup(ctx, target, salt):
                log("warning: the prompts are already cached (an earlier run?); use another --cache-salt or --seed")
            log(f"1. source prompt ({n} tokens) through the engine")
            src = kvhf.generate(m.model, ctx, source, salt, **gen)
            cached = kvd.lookup(ctx, source, salt)
            log(f"2-4. SDK role: retrieve {cached} cached tokens, store them under the target")
            remap = run_sdk_role(args.sdk_in_process, url, http_url, ctx.model_name, source, target, salt, args.timeout)
            log("5. target prompt through the engine")
            tgt = kvhf.generate(m.model, ctx, target, salt, **gen)
        src_new = src.output_ids[0, n:].tolist()
        tgt_new = tgt.output_ids[0, n:].tolist()
        report: dict[str, Any] = {
            **report_header(m, chunk, salt, n),
            "changed_leading_tokens": args.changed_tokens,
            "cached_tokens": cached,
            "source_hit_tokens": src.hit_tokens,
            **remap,
            "engine_pid": os.getpid(),
            "target_engine_hit_tokens": tgt.hit_tokens,
            "source_ttft_s": round(src.ttft_s, 6),
            "target_ttft_s": round(tgt.ttft_s, 6),
            "new_tokens": len(src_new),
            **preview(m, "source", src_new),
            **preview(m, "target", tgt_new),
            "outputs_match": src_new == tgt_new,
        }
    print_json(report)
    ok = report["outputs_match"] and tgt.hit_tokens == cached > 0
    if not ok:
        log("FAILED: " + ("outputs differ" if not report["outputs_match"] else "the target missed the remapped KV"))
    return 0 if ok else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except kvd.KVCacheSDKError as e:
        log(f"error: {type(e).__name__}: {e}")
        sys.exit(2)

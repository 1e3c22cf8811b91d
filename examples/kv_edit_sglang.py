#!/usr/bin/env python
"""End-to-end KV edit with SGLang as the engine: re-key a source prompt's KV under a target prompt.

1. SGLang (HiCache, kvdock as its L3 storage backend) runs a SOURCE prompt greedily; HiCache
   writes the KV of its whole pages through to kvdock;
2. the SDK retrieves the source's KV by its token ids (kvdock keys an SGLang model the way SGLang
   does) as ``[2, L, T, D]``;
3. the SDK stores it under a TARGET prompt whose whole pages are other token ids (a "remap");
4. SGLang's caches are flushed and the target prompt (the same last, partial page as the source)
   runs: its prefix loads from kvdock -- the source's KV -- and it continues exactly like the
   source (the model never reads the target's own prefix: its KV is the source's);
5. a JSON report goes to stdout; exit 0 when the outputs match and the target hit kvdock.

Without --url a ``kvdock serve`` subprocess is started (chunk size = --page-size, no disk tier).
Without --model a tiny random Llama is built from a fixed config and --seed. ``--device cpu``
(the default) runs SGLang's CPU engine (``SGLANG_USE_CPU_ENGINE=1``, torch_native attention) on a
CPU-only torch, which needs this repository's test-only stand-ins
(``tests/integrations/sglang/standins``: ``sgl_kernel``'s one op in torch, unpinned HiCache host
buffers); on a GPU, pass ``--device cuda`` and nothing of the kind is used.

    .venv-sglang/bin/python examples/kv_edit_sglang.py
    python examples/kv_edit_sglang.py --device cuda --model ~/models/Qwen3-0.6B --page-size 64 \\
        --url tcp://127.0.0.1:5555 --http-url http://127.0.0.1:9000
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

STANDINS = Path(__file__).resolve().parent.parent / "tests" / "integrations" / "sglang" / "standins"


def log(msg: str) -> None:
    print(f"[kv_edit_sglang] {msg}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="a running kvdock server (default: start one)")
    p.add_argument("--http-url", help="its HTTP address (with --url)")
    p.add_argument("--model", help="a model directory (default: a tiny random Llama)")
    p.add_argument("--model-name", default="kv-edit-sglang", help="the name registered with kvdock")
    p.add_argument("--device", default="cpu", help="SGLang's device (cpu: the CPU engine and the stand-ins)")
    p.add_argument("--page-size", type=int, default=16, help="SGLang's page size = kvdock's chunk size (16)")
    p.add_argument("--pages", type=int, default=8, help="whole pages of each prompt (8)")
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.url and not args.http_url:
        p.error("--url needs --http-url")
    return args


def tiny_llama(path: Path, seed: int) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, torch_dtype="float32",
    )  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(path)
    return str(path)


def engine(args: argparse.Namespace, model: str, url: str, http_url: str) -> Any:
    if args.device == "cpu":  # SGLang's CPU engine on a CPU-only torch: the repository's stand-ins
        os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(STANDINS), os.environ.get("PYTHONPATH")) if p)
        sys.path.insert(0, str(STANDINS))
    import sglang as sgl

    extra = {
        "backend_name": "kvdock", "module_path": "kvdock.integrations.sglang", "class_name": "KvdockHiCacheStorage",
        "interface_v1": 1, "hicache_storage_pass_prefix_keys": True, "prefetch_threshold": args.page_size,
        "kvdock.url": url, "kvdock.http_url": http_url, "kvdock.model_name": args.model_name,
    }  # fmt: skip
    # (the KV pool capped: a fraction of the memory free at start, with another engine beside it, may be none)
    cpu = {
        "attention_backend": "torch_native",
        "dtype": "float32",
        "mem_fraction_static": 0.3,
        "max_total_tokens": 16384,
    }
    return sgl.Engine(
        model_path=model, device=args.device, skip_tokenizer_init=True, page_size=args.page_size,
        disable_cuda_graph=args.device == "cpu", log_level="warning", enable_hierarchical_cache=True,
        hicache_ratio=2.0, hicache_write_policy="write_through", hicache_storage_backend="dynamic",
        hicache_storage_backend_extra_config=json.dumps(extra), **(cpu if args.device == "cpu" else {}),
    )  # fmt: skip


def run(args: argparse.Namespace, url: str, http_url: str, model: str) -> dict[str, Any]:
    import numpy as np

    import kvdock.sdk as kvd

    eng = engine(args, model, url, http_url)
    try:
        rng = np.random.default_rng(args.seed)
        n = args.pages * args.page_size
        vocab = 500
        source = rng.integers(1, vocab, n).tolist()
        target = rng.integers(1, vocab, n).tolist()
        tail = rng.integers(1, vocab, args.page_size // 2).tolist()  # a partial page: never cached
        greedy = {"max_new_tokens": args.max_new_tokens, "temperature": 0}
        want = eng.generate(input_ids=source + tail, sampling_params=greedy)["output_ids"]
        log(f"source output {want}")
        with kvd.connect(url, http_url, args.model_name) as ctx:
            deadline = time.monotonic() + 60  # HiCache writes through in the background
            while kvd.lookup(ctx, source) < n and time.monotonic() < deadline:
                time.sleep(0.05)
            kv = kvd.retrieve(ctx, source)
            if kv is None or kv.shape[2] != n:
                raise SystemExit(f"kvdock holds {0 if kv is None else kv.shape[2]} of the source's {n} tokens")
            log(f"retrieved the source's KV {tuple(kv.shape)} {kv.dtype}; storing it under the target's tokens")
            kvd.store(ctx, kv, target, overwrite=True)
        eng.flush_cache()
        out = eng.generate(input_ids=target + tail, sampling_params=greedy)
        got, details = out["output_ids"], out["meta_info"].get("cached_tokens_details") or {}
        log(f"target output {got}, {details.get('storage', 0)} tokens from {details.get('storage_backend')}")
        return {
            "model": args.model_name,
            "kv_shape": list(kv.shape),
            "source_output": want,
            "target_output": got,
            "target_tokens_from_kvdock": int(details.get("storage", 0)),
            "match": got == want and int(details.get("storage", 0)) == n,
        }
    finally:
        eng.shutdown()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kv-edit-sglang-") as tmp:
        model = args.model or tiny_llama(Path(tmp) / "model", args.seed)
        if args.url:
            report = run(args, args.url, args.http_url, model)
        else:
            from kvdock.testing import start_server

            with start_server("--no-disk", chunk_size=args.page_size, l1_size="256MiB") as srv:
                report = run(args, srv.url, srv.http_url, model)
    print(json.dumps(report))
    return 0 if report["match"] else 1


if __name__ == "__main__":
    sys.exit(main())

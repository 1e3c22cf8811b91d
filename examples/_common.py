"""Shared plumbing of the examples: flags, the model (a local directory or a tiny random Llama),
and a ``kvdock serve`` subprocess when no server URL is given. Not part of the kvdock package."""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import kvdock.sdk as kvd
from kvdock.testing import start_server

TINY_NAME = "kvdock-example-tiny-llama"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def add_common_args(p: argparse.ArgumentParser) -> None:
    """Flags every example takes."""
    g = p.add_argument_group("server")
    g.add_argument("--url", help="ZMQ control URL of a running server, e.g. tcp://127.0.0.1:5555 (default: start one)")
    g.add_argument("--http-url", help="HTTP URL of that server, e.g. http://127.0.0.1:9000 (required with --url)")
    g.add_argument(
        "--chunk-size",
        type=int,
        help="chunk size of the server started when no --url is given (16; 64 with --engine vllm, whose blocks are 32)",
    )
    g.add_argument("--l1-size", default="512MiB", help="L1 pool of the server started when no --url is given")
    g.add_argument("--cache-salt", default="", help="cache namespace used for every store/retrieve/lookup ('')")
    g.add_argument("--timeout", type=float, default=60.0, help="SDK timeout in seconds (60)")
    p.add_argument(
        "--engine",
        choices=["hf", "vllm"],
        default="hf",
        help="the engine: kvdock.integrations.hf in this process, or vLLM with kvdock's connector (hf)",
    )
    p.add_argument(
        "--reuse-engine",
        action="store_true",
        help="--engine vllm: run the later prompts on the same engine after clearing its prefix cache, instead "
        "of starting a fresh engine (saves one engine start)",
    )
    m = p.add_argument_group("model")
    m.add_argument("--model", help="local HF model directory (default: a tiny random Llama built from a config)")
    m.add_argument("--model-name", help="name to register the model under (default: the directory, or the tiny name)")
    m.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        help="model dtype (default: float32 for the tiny model, the checkpoint's own otherwise)",
    )
    m.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"], help="attention implementation (sdpa)")
    m.add_argument("--seed", type=int, default=0, help="seed of the tiny model's weights and of the prompt (0)")
    m.add_argument("--max-new-tokens", type=int, default=16, help="greedy tokens to generate (16)")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def die(msg: str) -> SystemExit:
    """Log a usage/setup error; ``raise die(...)`` exits with status 2."""
    log(f"error: {msg}")
    return SystemExit(2)


@dataclass
class Model:
    model: Any  # a transformers PreTrainedModel
    tokenizer: Any | None
    name: str
    description: str


def tiny_config(head_dim: int = 16) -> Any:
    """The tiny model's config: 2 layers, GQA (4 query / 2 KV heads of ``head_dim``: 16, or 32 for
    vLLM, whose CPU kernels start at 32), vocab 512."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=512,
        hidden_size=4 * head_dim,
        intermediate_size=8 * head_dim,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )


def load_model(args: argparse.Namespace) -> Model:
    """The model of ``--model`` (with its tokenizer when the directory has one), or the tiny one."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = DTYPES[args.dtype] if args.dtype else None
    if args.model:
        path = Path(args.model)
        if not (path / "config.json").is_file():
            raise die(f"--model {args.model}: not a local model directory (no config.json)")
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or "auto", attn_implementation=args.attn)
        tok = None
        if any((path / f).is_file() for f in TOKENIZER_FILES):
            tok = AutoTokenizer.from_pretrained(path)
        return Model(model.eval(), tok, args.model_name or str(path), str(path))
    torch.manual_seed(args.seed)
    cfg = tiny_config(32 if args.engine == "vllm" else 16)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype or torch.float32, attn_implementation=args.attn)
    model.eval()
    return Model(model, None, args.model_name or TINY_NAME, f"tiny random Llama (seed {args.seed})")


def greedy_kwargs(model: Any, max_new_tokens: int) -> dict[str, Any]:
    """Deterministic greedy decoding of exactly ``max_new_tokens`` tokens (EOS suppressed until
    then, so runs are comparable token for token)."""
    gc = model.generation_config
    eos = gc.eos_token_id if gc.eos_token_id is not None else model.config.eos_token_id
    pad = gc.pad_token_id if gc.pad_token_id is not None else (eos[0] if isinstance(eos, list) else eos)
    return {
        "do_sample": False,
        "num_beams": 1,
        "max_new_tokens": max_new_tokens,
        "min_new_tokens": max_new_tokens,
        "pad_token_id": pad,
        "temperature": None,
        "top_p": None,
        "top_k": None,
    }


def synthetic_prompt(num_tokens: int, vocab_size: int, seed: int) -> list[int]:
    """Reproducible random token ids (the tiny model has no tokenizer)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (num_tokens,), generator=g).tolist()


def preview(model: Model, name: str, ids: list[int]) -> dict[str, Any]:
    """``{name}_output_preview``: the generated ids, and ``{name}_output_text`` when there is a tokenizer."""
    out: dict[str, Any] = {f"{name}_output_preview": ids}
    if model.tokenizer is not None:
        out[f"{name}_output_text"] = model.tokenizer.decode(ids)
    return out


@contextmanager
def server(args: argparse.Namespace) -> Iterator[tuple[str, str, int]]:
    """(url, http_url, chunk_size) of ``--url``/``--http-url``, or of a ``kvdock serve`` subprocess
    started on free loopback ports (no disk tier) and stopped with SIGTERM on exit."""
    if args.url or args.http_url:
        if not (args.url and args.http_url):
            raise die("--url and --http-url go together")
        try:
            chunk = int(kvd.server_config(args.http_url)["chunk_size"])
        except kvd.KVCacheSDKError as e:
            raise die(f"no kvdock server answers at {args.http_url}: {e}") from None
        yield args.url, args.http_url, chunk
        return
    chunk = args.chunk_size or (64 if args.engine == "vllm" else 16)
    try:
        srv = start_server("--no-disk", l1_size=args.l1_size, chunk_size=chunk, timeout=60)
    except RuntimeError as e:
        raise die(str(e)) from None
    with srv:
        log(f"started kvdock serve on {srv.url} / {srv.http_url} (chunk {chunk})")
        yield srv.url, srv.http_url, chunk


def warm_up(model: Any, gen: dict[str, Any], num_tokens: int = 24) -> None:
    """One short plain ``model.generate`` so one-time costs (lazy init, first kernels) do not land
    in the timed runs."""
    ids = torch.tensor([synthetic_prompt(num_tokens, int(model.config.vocab_size), 12345)], device=model.device)
    model.generate(ids, **{**gen, "max_new_tokens": 4, "min_new_tokens": 4})


def report_header(m: Model, chunk: int, salt: str, prompt_tokens: int) -> dict[str, Any]:
    """The fields every example's report starts with."""
    return {
        "model": m.description,
        "model_name": m.name,
        "dtype": str(m.model.dtype).removeprefix("torch."),
        "chunk_size": chunk,
        "cache_salt": salt,
        "prompt_tokens": prompt_tokens,
    }


def print_json(report: dict[str, Any]) -> None:
    """The report on stdout, the only thing written there (lists of numbers kept on one line)."""
    text = json.dumps(report, indent=2)
    text = re.sub(r"\[\s*([-0-9.e, \n]+?)\s*\]", lambda mt: "[" + re.sub(r"\s+", " ", mt.group(1)) + "]", text)
    print(text, flush=True)


def model_dir(args: argparse.Namespace, m: Model, tmp: Path) -> Path:
    """A directory vLLM can load the model from: ``--model``, or the tiny model saved into ``tmp``."""
    if args.model:
        return Path(args.model)
    m.model.save_pretrained(tmp / "model")
    return tmp / "model"


class VllmEngines:
    """The vLLM engine(s) of an example: ``engine()`` is the current one; ``fresh()`` stops it and
    starts a new one (or, with ``--reuse-engine``, clears its prefix cache instead)."""

    def __init__(self, args: argparse.Namespace, path: Path, dtype: str, kvdock_cfg: dict[str, Any], logs: Path):
        self.args, self.path, self.dtype, self.cfg, self.logs = args, path, dtype, kvdock_cfg, logs
        self.starts = 0
        self._engine: Any = None

    def engine(self) -> Any:
        if self._engine is None:
            from kvdock.integrations.vllm.engine import EngineProcess

            self.starts += 1
            log(f"starting vLLM engine #{self.starts} (log: {self.logs / f'vllm-{self.starts}.log'})")
            self._engine = EngineProcess(self.path, self.dtype, self.cfg, self.logs / f"vllm-{self.starts}.log")
        return self._engine

    def fresh(self) -> Any:
        if self._engine is not None and self.args.reuse_engine:
            self._engine.call(op="reset_prefix_cache")
            return self._engine
        self.close()
        return self.engine()

    def close(self) -> None:
        if self._engine is not None:
            self._engine.stop()
            self._engine = None

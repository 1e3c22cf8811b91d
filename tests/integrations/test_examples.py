"""The two examples run end to end (subprocesses, tiny random model) against a test server, and
their JSON reports -- and the server's contents afterwards -- are checked value by value."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import kvdock.sdk as kvd
import zygote
from helpers import CHUNK, ServerProc

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))
import _common  # noqa: E402 -- the examples' own helpers: same tiny model, same prompts

TINY = _common.TINY_NAME
# the tiny model: 2 layers, 2 KV heads of 16, float32 -> 2 * 2 * 32 * 4 bytes per token
LAYERS, D, BYTES_PER_TOKEN = 2, 32, 512
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "rope_theta": 1e4}


def run_example(script: str, srv: ServerProc, *extra: str) -> tuple[dict[str, Any], subprocess.CompletedProcess[str]]:
    cmd = [sys.executable, str(EXAMPLES / script), "--url", srv.url, "--http-url", srv.http_url, *extra]
    proc = zygote.run(cmd, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, f"{script} exited {proc.returncode}\nstderr:\n{proc.stderr}\nstdout:\n{proc.stdout}"
    return json.loads(proc.stdout), proc


def test_kv_edit_e2e(make_server: Callable[..., ServerProc]) -> None:
    srv = make_server(register=None)
    salt = f"kv-edit-{uuid.uuid4().hex[:8]}"
    report, _ = run_example("kv_edit_e2e.py", srv, "--cache-salt", salt)
    n, cached = 6 * CHUNK + CHUNK // 4, 6 * CHUNK  # default prompt: 6 chunks + a quarter chunk
    assert report["model_name"] == TINY and report["dtype"] == "float32" and report["cache_salt"] == salt
    assert report["chunk_size"] == CHUNK
    assert (report["prompt_tokens"], report["cached_tokens"], report["changed_leading_tokens"]) == (n, cached, 4)
    assert report["source_hit_tokens"] == 0
    assert report["target_hit_tokens_before_remap"] == 0
    assert report["retrieved_tokens"] == cached and report["retrieved_shape"] == [2, LAYERS, cached, D]
    assert report["stored"] is True
    assert report["target_hit_tokens_after_remap"] == cached
    assert report["target_engine_hit_tokens"] == cached
    assert report["sdk_pid"] != report["engine_pid"]  # the SDK role ran in its own process
    assert report["sdk_transport"] in ("shm", "inline")
    assert report["retrieve_s"] > 0 and report["store_s"] > 0 and report["target_ttft_s"] > 0
    assert report["new_tokens"] == 16 and len(report["target_output_preview"]) == 16
    assert report["source_output_preview"] == report["target_output_preview"]
    assert report["outputs_match"] is True

    # the server holds the source KV under the target's tokens, in the salt's namespace only
    source = _common.synthetic_prompt(n, 512, 0)
    target = [(t + 1) % 512 if i < 4 else t for i, t in enumerate(source)]
    assert source[4:] == target[4:] and all(a != b for a, b in zip(source[:4], target[:4], strict=True))
    with kvd.connect(srv.url, srv.http_url, TINY, timeout=10) as ctx:
        assert kvd.lookup(ctx, target, salt) == cached
        assert kvd.lookup(ctx, target) == 0 and kvd.lookup(ctx, source) == 0
        src_kv, tgt_kv = kvd.retrieve(ctx, source, salt), kvd.retrieve(ctx, target, salt)
        assert src_kv is not None and tgt_kv is not None and torch.equal(src_kv, tgt_kv)


def _example(script: str) -> Any:
    """The example ``script`` as a module of this process (its ``main(argv)`` is what runs it)."""
    import importlib.util

    name = "example_" + Path(script).stem
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, EXAMPLES / script)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def test_help_and_bad_arguments(make_server: Callable[..., ServerProc], capsys: pytest.CaptureFixture[str]) -> None:
    """--help documents the flags; usage errors exit 2 with a message on stderr and nothing on stdout
    (checked before the model loads). Each runs the example's main() in this process (the other
    tests run the scripts as processes): five processes importing torch cost seconds."""
    srv = make_server(register=None)
    urls = ["--url", srv.url, "--http-url", srv.http_url]
    cases = [
        ("kv_edit_e2e.py", [*urls, "--changed-tokens", "200"], "--changed-tokens must be in [1, 96]"),
        ("kv_edit_e2e.py", ["--url", srv.url], "--url and --http-url go together"),
        ("token_dropping.py", [*urls, "--prompt-tokens", "40"], "has 2 loadable chunks of 16"),
        ("kv_edit_e2e.py", ["--help"], ""),
        ("token_dropping.py", ["--help"], ""),
    ]
    for script, args, message in cases:
        try:
            code = _example(script).main(args)
        except SystemExit as e:  # argparse, and the examples' own usage errors
            code = e.code
        out, err = capsys.readouterr()
        if args == ["--help"]:
            assert code in (0, None), err
            for flag in ("--cache-salt", "--url", "--http-url", "--model", "--chunk-size", "--seed", "Exit status"):
                assert flag in out, (script, flag)
            continue
        assert code == 2 and message in err, (script, args, code, err)
        assert out == ""


@torch.no_grad()
def layer0_keys(tokens: list[int]) -> torch.Tensor:
    """Layer 0's keys of the examples' tiny model (seed 0) for ``tokens`` at positions 0.., as [T, D]."""
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(_common.tiny_config(), dtype=torch.float32).eval()
    out = model(input_ids=torch.tensor([tokens]), use_cache=True)
    cache = out.cache if hasattr(out, "cache") else out.past_key_values
    return cache.layers[0].keys[0].transpose(0, 1).reshape(len(tokens), -1)


def test_token_dropping(make_server: Callable[..., ServerProc]) -> None:
    srv = make_server(register=None)
    salt = f"drop-{uuid.uuid4().hex[:8]}"
    report, _ = run_example("token_dropping.py", srv, "--cache-salt", salt, "--max-new-tokens", "12")
    n, cached = 12 * CHUNK + CHUNK // 4, 12 * CHUNK  # default prompt: 12 chunks + a quarter chunk
    kept, dropped = 2 * CHUNK, 10 * CHUNK  # keep-first 1, keep-last 1
    assert report["model_name"] == TINY and report["cache_salt"] == salt and report["chunk_size"] == CHUNK
    assert (report["prompt_tokens"], report["cached_tokens"]) == (n, cached)
    assert report["dropped_span"] == [CHUNK, cached - CHUNK] and report["dropped_tokens"] == dropped
    assert report["kept_cached_tokens"] == kept and report["compacted_prompt_tokens"] == kept + n - cached
    assert report["kv_bytes_per_token"] == BYTES_PER_TOKEN
    assert report["kv_bytes_full"] == cached * BYTES_PER_TOKEN
    assert report["kv_bytes_kept"] == kept * BYTES_PER_TOKEN
    assert report["kv_bytes_saved"] == dropped * BYTES_PER_TOKEN == report["kv_bytes_full"] - report["kv_bytes_kept"]
    assert report["memory_saved_fraction"] == round(dropped / cached, 6)
    assert report["stored"] is True
    assert report["full_hit_tokens"] == 0 and report["dropped_hit_tokens"] == kept
    assert report["decode_tokens_per_s_full"] > 0 and report["decode_tokens_per_s_dropped"] > 0
    full, drop = report["full_output_preview"], report["dropped_output_preview"]
    assert report["new_tokens"] == len(full) == len(drop) == 12
    agree = sum(a == b for a, b in zip(full, drop, strict=True))
    assert report["generated_tokens_agreeing"] == agree and report["agreement"] == round(agree / 12, 6)
    first = report["first_disagreement"]
    if first is None:
        assert full == drop
    else:
        assert full[:first] == drop[:first] and full[first] != drop[first]
    err = report["layer0_keys_max_abs_err"]
    assert err["rerotated"] <= err["tolerance"] < 1e-5
    assert err["not_rerotated"] > 1000 * err["tolerance"]
    assert report["rerotation_exact"] is True

    # what the server holds under the kept tokens: re-rotated keys, original values
    prompt = _common.synthetic_prompt(n, 512, 0)
    kept_tokens = prompt[:CHUNK] + prompt[cached - CHUNK : cached]
    old_pos = list(range(CHUNK)) + list(range(cached - CHUNK, cached))
    with kvd.connect(srv.url, srv.http_url, TINY, timeout=10) as ctx:
        assert kvd.lookup(ctx, kept_tokens, salt) == kept and kvd.lookup(ctx, kept_tokens) == 0
        compact, original = kvd.retrieve(ctx, kept_tokens, salt), kvd.retrieve(ctx, prompt, salt)
    assert compact is not None and original is not None
    assert compact.shape == (2, LAYERS, kept, D) and original.shape == (2, LAYERS, cached, D)
    assert torch.equal(compact[1], original[1][:, old_pos])  # values are not touched
    assert torch.equal(compact[0, :, :CHUNK], original[0, :, :CHUNK])  # the first chunk does not move
    assert not torch.allclose(compact[0, :, CHUNK:], original[0, :, cached - CHUNK :], atol=1e-2)
    want = layer0_keys(kept_tokens)
    assert (compact[0, 0] - want).abs().max().item() <= err["tolerance"]


def test_examples_with_a_local_model_directory(make_server: Callable[..., ServerProc], tmp_path: Path) -> None:
    """--model takes a local HF directory: a tiny Qwen3 (bfloat16, yarn-scaled RoPE) saved with
    save_pretrained; both examples run on it concurrently, in their own salts."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        rope_parameters=YARN,
    )
    torch.manual_seed(3)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(tmp_path / "qwen3-tiny")
    srv = make_server(register=None)
    common = ["--url", srv.url, "--http-url", srv.http_url, "--model", str(tmp_path / "qwen3-tiny")]
    common += ["--model-name", "qwen3-tiny"]
    runs = {
        "kv_edit_e2e.py": ["--sdk-in-process", "--cache-salt", "a", "--max-new-tokens", "8"],
        "token_dropping.py": ["--cache-salt", "b", "--max-new-tokens", "8", "--prompt-tokens", "100"],
    }
    procs = {
        script: zygote.Popen(
            [sys.executable, str(EXAMPLES / script), *common, *extra],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for script, extra in runs.items()
    }
    reports = {}
    for script, proc in procs.items():
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, f"{script}: {err}"
        reports[script] = json.loads(out)
    edit, drop = reports["kv_edit_e2e.py"], reports["token_dropping.py"]
    assert edit["model_name"] == drop["model_name"] == "qwen3-tiny" and edit["dtype"] == drop["dtype"] == "bfloat16"
    assert edit["sdk_pid"] == edit["engine_pid"]  # --sdk-in-process
    assert (edit["cached_tokens"], edit["source_hit_tokens"], edit["target_hit_tokens_before_remap"]) == (96, 0, 0)
    assert edit["target_hit_tokens_after_remap"] == edit["target_engine_hit_tokens"] == 96
    assert edit["outputs_match"] is True and len(edit["target_output_preview"]) == 8
    # 100 tokens: 6 loadable chunks, keep the first and the last -> 32 kept, 64 dropped
    assert (drop["cached_tokens"], drop["kept_cached_tokens"], drop["dropped_tokens"]) == (96, 32, 64)
    assert drop["kv_bytes_per_token"] == 2 * 2 * 32 * 2 and drop["dropped_hit_tokens"] == 32
    err = drop["layer0_keys_max_abs_err"]
    assert err["rerotated"] <= err["tolerance"] and err["not_rerotated"] > 10 * err["tolerance"]
    with kvd.connect(srv.url, srv.http_url, "qwen3-tiny", timeout=10) as ctx:
        assert ctx.dtype == torch.bfloat16 and ctx.geometry.num_layers == 2

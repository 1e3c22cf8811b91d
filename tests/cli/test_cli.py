"""The kvdock command line against a real server."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

import kvdock.sdk as kvd
from helpers import CHUNK, ServerProc, free_port, make_tokens, start_server


def kvdock(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvdock.cli.main", *args], capture_output=True, text=True, timeout=60, env=env
    )


def test_register_from_hf_config_then_status_and_lookup(server, tmp_path) -> None:
    cfg = {
        "model_type": "llama",
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "hidden_size": 64,
        "torch_dtype": "float16",
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    r = kvdock(
        "register",
        "--url",
        server.url,
        "--http-url",
        server.http_url,
        "--model",
        "llama-tiny",
        "--hf-config",
        str(path),
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"model_name": "llama-tiny", "created": True, "chunk_nbytes": 2 * 4 * CHUNK * 16 * 2}
    r = kvdock("status", "--http-url", server.http_url)
    assert r.returncode == 0
    meta = {e["model_name"]: e for e in json.loads(r.stdout)["cache_context_meta"]}
    assert meta["llama-tiny"]["kv_cache_layout"]["engine_kv_concrete_shape"] == [2, 1, 16, 2, 8]
    assert meta["llama-tiny"]["kv_cache_layout"]["dtype"] == "float16"
    with kvd.connect(server.url, server.http_url, "llama-tiny", timeout=5) as c:
        assert kvd.store(c, torch.ones(2, 4, 2 * CHUNK, 16, dtype=torch.float16), make_tokens(2 * CHUNK))
    toks = ",".join(map(str, make_tokens(3 * CHUNK)))
    r = kvdock("lookup", "--url", server.url, "--http-url", server.http_url, "--model", "llama-tiny", toks)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"hit_tokens": 2 * CHUNK, "tokens": 3 * CHUNK}


def test_register_errors_are_one_clear_line(server, tmp_path) -> None:
    r = kvdock("register", "--url", server.url, "--http-url", server.http_url, "--model", "m", "--num-layers", "2")
    assert r.returncode == 2
    assert (
        r.stderr.strip() == "kvdock register: error: missing --num-kv-heads, --head-dim, --dtype (or give --hf-config)"
    )
    r = kvdock(
        "register",
        "--url",
        server.url,
        "--http-url",
        server.http_url,
        "--model",
        "m",
        "--hf-config",
        str(tmp_path / "nope.json"),
    )
    assert r.returncode == 2 and "cannot use" in r.stderr and "nope.json" in r.stderr
    dead = f"http://127.0.0.1:{free_port()}"
    r = kvdock("status", "--http-url", dead, "--timeout", "2")
    assert r.returncode == 2 and f"cannot reach the kvdock HTTP API at {dead}/status" in r.stderr
    r = kvdock("lookup", "--url", server.url, "--http-url", server.http_url, "--model", "ghost", "1,2")
    assert r.returncode == 2 and "'ghost' is not registered" in r.stderr


def test_serve_precedence_cli_over_env_over_file(tmp_path) -> None:
    conf = tmp_path / "kvdock.toml"
    conf.write_text('chunk_size = 64\nsession_ttl = 7.5\nl1_size = "8MiB"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVDOCK_")}
    env.update(KVDOCK_CONFIG=str(conf), KVDOCK_CHUNK_SIZE="32")
    port, http_port = free_port(), free_port()
    p = subprocess.Popen(
        [sys.executable, "-m", "kvdock.cli.main", "serve", "--port", str(port), "--http-port", str(http_port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    try:
        srv = _wait(p, port, http_port, tmp_path)
        cfg = srv.get("/config")
        assert (cfg["chunk_size"], cfg["session_ttl"], cfg["l1"]["size_bytes"]) == (32, 7.5, 8 * 2**20)
    finally:
        p.terminate()
        p.wait(30)
    srv = start_server(tmp_path, "--config", str(conf), "--session-ttl", "3", l1_size="4MiB", chunk_size=16)
    try:
        cfg = srv.get("/config")
        assert (cfg["chunk_size"], cfg["session_ttl"], cfg["l1"]["size_bytes"]) == (16, 3.0, 4 * 2**20)
    finally:
        srv.stop()


def test_serve_rejects_bad_config(tmp_path) -> None:
    conf = tmp_path / "bad.toml"
    conf.write_text("chunk_sizes = 64\n")
    r = kvdock("serve", "--config", str(conf))
    assert r.returncode == 2 and "unknown keys in" in r.stderr and "chunk_sizes" in r.stderr
    r = kvdock("serve", "--l1-size", "lots")
    assert r.returncode == 2 and "not a size: 'lots'" in r.stderr


def _wait(p, port: int, http_port: int, tmp_path):
    return ServerProc(p, port, http_port, tmp_path / "none.log").wait_ready(30)


def test_store_and_retrieve_commands_round_trip_files(server, tmp_path) -> None:
    kv = torch.randn(2, 3, 3 * CHUNK, 16).to(torch.bfloat16)
    torch.save(kv, tmp_path / "kv.pt")
    (tmp_path / "tokens.json").write_text(json.dumps(make_tokens(3 * CHUNK, start=5)))
    flags = ["--url", server.url, "--http-url", server.http_url, "--model", "tiny"]
    r = kvdock("store", *flags, "--kv", str(tmp_path / "kv.pt"), "--tokens-file", str(tmp_path / "tokens.json"))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"stored_chunks": 3, "deduped_chunks": 0, "pool_full_chunks": 0}
    r = kvdock("store", *flags, "--kv", str(tmp_path / "kv.pt"), "--tokens-file", str(tmp_path / "tokens.json"))
    assert json.loads(r.stdout) == {"stored_chunks": 0, "deduped_chunks": 3, "pool_full_chunks": 0}
    toks = ",".join(map(str, make_tokens(4 * CHUNK, start=5)))
    r = kvdock("retrieve", *flags, "--out", str(tmp_path / "out.pt"), toks)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["hit_tokens"] == 3 * CHUNK
    assert torch.equal(torch.load(tmp_path / "out.pt", weights_only=True), kv)
    r = kvdock("retrieve", *flags, "--out", str(tmp_path / "miss.pt"), "1,2,3")
    assert r.returncode == 1 and json.loads(r.stdout) == {"hit_tokens": 0, "tokens": 3, "out": None}
    assert not (tmp_path / "miss.pt").exists()
    (tmp_path / "bad.pt").write_bytes(b"not a tensor")
    r = kvdock("store", *flags, "--kv", str(tmp_path / "bad.pt"), "1,2")
    assert r.returncode == 2 and "cannot load a tensor from" in r.stderr
    r = kvdock("store", *flags, "--kv", str(tmp_path / "kv.pt"), "1,2")
    assert r.returncode == 2 and "kv has 48 tokens but 2 token ids were given" in r.stderr
    r = kvdock("lookup", *flags, "1,x")
    assert r.returncode == 2 and "token ids must be integers" in r.stderr

"""The kvdock command line against a real server."""

from __future__ import annotations

import ast
import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

import kvdock.sdk as kvd
from helpers import CHUNK, NOTHING_ELSE, ServerProc, free_port, free_ports, make_tokens, start_inprocess, start_server
from kvdock.cli.main import main


def kvdock_binary(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m kvdock.cli.main ...`` as its own process (the entry point itself)."""
    return subprocess.run(
        [sys.executable, "-m", "kvdock.cli.main", *args], capture_output=True, text=True, timeout=60, env=env
    )


def kvdock(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The same command run in this process (``main(args)`` with its output captured and ``env``
    as the environment): what a command does and prints, without a second torch import each."""
    out, err = io.StringIO(), io.StringIO()
    saved = dict(os.environ)
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as e:  # argparse's exits
                code = int(e.code or 0)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return subprocess.CompletedProcess(["kvdock", *args], code, out.getvalue(), err.getvalue())


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


def test_register_an_mla_hf_config_registers_a_latent_geometry(server, tmp_path) -> None:
    cfg = {"num_hidden_layers": 4, "kv_lora_rank": 32, "qk_rope_head_dim": 8, "torch_dtype": "bfloat16"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    args = ("register", "--url", server.url, "--http-url", server.http_url, "--model", "mla", "--hf-config", str(path))
    r = kvdock(*args)
    assert r.returncode == 0, r.stderr
    entry = {e["model_name"]: e for e in server.get("/status")["cache_context_meta"]}["mla"]
    geo = entry["layout"]["geometry"]
    assert (geo["kv_kind"], geo["num_layers"], geo["num_kv_heads"], geo["head_dim"]) == ("latent", 4, 1, 40)


def test_serve_precedence_cli_over_env_over_file(tmp_path) -> None:
    conf = tmp_path / "kvdock.toml"
    conf.write_text('chunk_size = 64\nsession_ttl = 7.5\nl1_size = "8MiB"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVDOCK_")}
    env.update(KVDOCK_CONFIG=str(conf), KVDOCK_CHUNK_SIZE="32", KVDOCK_CLIENT_TTL="9", KVDOCK_MAX_REQUEST_TOKENS="512")
    port, http_port = free_ports(2)
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
        assert (cfg["client_ttl"], cfg["max_request_tokens"]) == (9.0, 512)
    finally:
        p.terminate()
        p.wait(30)
    conf.write_text('chunk_size = 64\nsession_ttl = 7.5\nl1_size = "8MiB"\nclient_ttl = 11\nmax_request_tokens = 256\n')
    srv = start_server(
        tmp_path, "--config", str(conf), "--session-ttl", "3", "--client-ttl", "4.5", l1_size="4MiB", chunk_size=16
    )
    try:
        cfg = srv.get("/config")
        assert (cfg["chunk_size"], cfg["session_ttl"], cfg["l1"]["size_bytes"]) == (16, 3.0, 4 * 2**20)
        assert (cfg["client_ttl"], cfg["max_request_tokens"]) == (4.5, 256)
    finally:
        srv.stop()


def test_serve_rejects_bad_config(tmp_path) -> None:
    conf = tmp_path / "bad.toml"
    conf.write_text("chunk_sizes = 64\n")
    r = kvdock_binary("serve", "--config", str(conf))
    assert r.returncode == 2 and "unknown keys in" in r.stderr and "chunk_sizes" in r.stderr
    r = kvdock_binary("serve", "--l1-size", "lots")
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
    assert json.loads(r.stdout) == {"stored_chunks": 3, "deduped_chunks": 0, "pool_full_chunks": 0, **NOTHING_ELSE}
    r = kvdock("store", *flags, "--kv", str(tmp_path / "kv.pt"), "--tokens-file", str(tmp_path / "tokens.json"))
    assert json.loads(r.stdout) == {"stored_chunks": 0, "deduped_chunks": 3, "pool_full_chunks": 0, **NOTHING_ELSE}
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


def test_export_and_import_move_a_prefix_between_servers(server, tmp_path) -> None:
    kv = torch.randn(2, 3, 4 * CHUNK, 16).to(torch.bfloat16)
    tokens = make_tokens(4 * CHUNK, start=300)
    with kvd.connect(server.url, server.http_url, "tiny", timeout=10) as c:
        kvd.store(c, kv, tokens, cache_salt="s")
    (tmp_path / "t.json").write_text(json.dumps(tokens))
    src = ["--url", server.url, "--http-url", server.http_url]
    out = str(tmp_path / "p.kvb")
    r = kvdock("export", *src, "--model", "tiny", "--cache-salt", "s", "--tokens-file", str(tmp_path / "t.json"),
               "-o", out, "--note", "from A")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"hit_tokens": 4 * CHUNK, "tokens": 4 * CHUNK, "out": out}
    r = kvdock("export", *src, "--model", "tiny", "1,2,3", "-o", str(tmp_path / "miss.kvb"))
    assert r.returncode == 1 and not (tmp_path / "miss.kvb").exists()
    b = start_inprocess(tmp_path, chunk_size=2 * CHUNK)  # another chunk size (in process: no boundary needed)
    try:
        kvd.register_model(b.url, b.http_url, "tiny", dtype="bfloat16", num_layers=3, num_kv_heads=2, head_dim=8)
        dst = ["--url", b.url, "--http-url", b.http_url]
        r = kvdock("import", *dst, out)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout) == {
            "model_name": "tiny", "tokens": 4 * CHUNK, "dropped_tokens": 0, "stored_chunks": 2,
            "deduped_chunks": 0, "pool_full_chunks": 0, **NOTHING_ELSE, "note": "from A",
        }  # fmt: skip
        with kvd.connect(b.url, b.http_url, "tiny", timeout=10) as c:
            got = kvd.retrieve(c, tokens, cache_salt="s")
            assert got is not None and torch.equal(got, kv)
        raw = bytearray(Path(out).read_bytes())
        size = int.from_bytes(raw[:8], "little")
        end = 8 + size + json.loads(raw[8 : 8 + size])["kv"]["data_offsets"][1]
        raw[end - 5] ^= 1  # a flipped bit in the last chunk's KV
        Path(out).write_bytes(bytes(raw))
        r = kvdock("import", *dst, "--cache-salt", "other", out)
        assert r.returncode == 2 and "chunk 3 does not match its blake3 checksum" in r.stderr
    finally:
        b.stop()


def _no_kvdock_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("KVDOCK_")}


def test_serve_help_lists_the_limit_flags() -> None:
    r = kvdock_binary("serve", "--help")
    assert r.returncode == 0
    for flag in ("--client-ttl", "--max-models", "--max-request-tokens", "--admin-token"):
        assert flag in r.stdout, flag
    r = kvdock_binary("serve", "--max-request-tokens", "0")
    assert r.returncode == 2 and r.stderr.strip() == "kvdock serve: error: max_request_tokens must be positive, got 0"


def test_register_needs_the_admin_token_when_the_server_has_one(make_server) -> None:
    srv = make_server("--admin-token", "s3cret", register=None)
    flags = ["register", "--url", srv.url, "--http-url", srv.http_url, "--model", "m", "--num-layers", "2"]
    flags += ["--num-kv-heads", "2", "--head-dim", "8", "--dtype", "float16"]
    r = kvdock(*flags, env=_no_kvdock_env())
    assert r.returncode == 2
    assert r.stderr.strip() == (
        "kvdock register: error: registering a model needs the server's admin token (admin_token= in the SDK, "
        "--admin-token or KVDOCK_ADMIN_TOKEN for kvdock register)"
    )
    r = kvdock(*flags, "--admin-token", "wrong", env=_no_kvdock_env())
    assert r.returncode == 2 and "needs the server's admin token" in r.stderr
    r = kvdock(*flags, "--admin-token", "s3cret", env=_no_kvdock_env())
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"model_name": "m", "created": True, "chunk_nbytes": 2 * 2 * CHUNK * 16 * 2}
    r = kvdock(*flags, env={**_no_kvdock_env(), "KVDOCK_ADMIN_TOKEN": "s3cret"})
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["created"] is False
    r = kvdock(*flags, "--admin-token", "wrong", env={**_no_kvdock_env(), "KVDOCK_ADMIN_TOKEN": "s3cret"})
    assert r.returncode == 2  # the flag wins over the environment


def test_register_refuses_absurd_geometry_at_once() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    r = kvdock(
        "register", "--url", f"tcp://127.0.0.1:{free_port()}", "--http-url", dead, "--model", "huge",
        "--num-layers", str(2**40), "--num-kv-heads", str(2**20), "--head-dim", str(2**20), "--dtype", "bfloat16",
    )  # fmt: skip
    assert r.returncode == 2
    assert r.stderr.strip() == "kvdock register: error: num_layers must be between 1 and 4096, got 1099511627776"


def test_the_test_launcher_is_kvdock_testing_and_standard_library_only() -> None:
    import kvdock
    import kvdock.testing

    src = Path(kvdock.testing.__file__)
    assert src.parent == Path(kvdock.__file__).parent
    assert not (src.parent / "server" / "process.py").exists()
    tree = ast.parse(src.read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert imported - {"__future__"} <= sys.stdlib_module_names, imported - sys.stdlib_module_names


def test_serve_refuses_a_non_loopback_host_without_insecure_allow_remote() -> None:
    r = kvdock("serve", "--host", "0.0.0.0", "--no-disk")
    assert r.returncode == 2
    assert "host '0.0.0.0' is not a loopback address" in r.stderr and "--insecure-allow-remote" in r.stderr

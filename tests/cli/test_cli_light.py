"""The kvdock command as a new user meets it (issue 27): commands that move no KV import no torch
and reach a loopback server whatever ``http_proxy`` says; every option has help; ``register``
takes MLA, pipeline stages and replicated heads; ``serve``'s flags come from ServerConfig and its
first line says what it takes; ``import`` offers to register the bundle's model."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tests.cli.test_cli import kvdock as _run  # kvdock ARGS in this process, output captured

import kvdock.sdk as kvd
from helpers import CHUNK, GEOMETRY, NOTHING_ELSE, free_port, free_ports, make_kv, make_tokens
from kvdock.cli.main import build_parser
from kvdock.cli.serve import flag
from kvdock.config import DEFAULT_HTTP_URL, ServerConfig
from kvdock.errors import KVDockError
from kvdock.sizes import DISK_DEFAULT, auto_disk_size

# run `kvdock ARGS` in a fresh interpreter, then say which heavy modules it imported
PROBE = """
import json, sys
from kvdock.cli.main import main
code = main(sys.argv[1:])
heavy = sorted(m for m in ("torch", "transformers", "safetensors", "matplotlib") if m in sys.modules)
print(json.dumps({"code": code, "heavy": heavy}))
"""


def probe(*args: str, env: dict[str, str] | None = None) -> tuple[dict[str, object], str]:
    r = subprocess.run(
        [sys.executable, "-c", PROBE, *args], capture_output=True, text=True, timeout=120, env=env or _env()
    )
    assert r.returncode == 0, r.stderr
    *out, last = r.stdout.strip().splitlines()
    return json.loads(last), "\n".join(out)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVDOCK_") and "proxy" not in k.lower()}
    return {**env, **extra}


def test_status_and_register_import_no_torch_and_bypass_a_proxy_for_loopback(server, tmp_path) -> None:
    # a proxy that does not exist: urllib would send every request there (and fail) but for loopback
    dead_proxy = f"http://127.0.0.1:{free_port()}"
    env = _env(http_proxy=dead_proxy, HTTP_PROXY=dead_proxy, no_proxy="")
    got, out = probe("status", "--http-url", server.http_url, env=env)
    assert got == {"code": 0, "heavy": []}
    assert json.loads(out)["health"] == "ok"
    flags = ["--url", server.url, "--http-url", server.http_url, "--model", "light", "--num-layers", "2"]
    got, out = probe("register", *flags, "--num-kv-heads", "2", "--head-dim", "8", "--dtype", "float16", env=env)
    assert got == {"code": 0, "heavy": []}
    assert json.loads(out) == {"model_name": "light", "created": True, "chunk_nbytes": 2 * 2 * CHUNK * 16 * 2}
    got, out = probe("keygen", str(tmp_path / "keys"), env=env)
    assert got == {"code": 0, "heavy": []} and json.loads(out)["public"].endswith("kvdock.key")
    got, out = probe("serve", "--l1-size", "lots", env=env)  # fails in the config, before any import
    assert got == {"code": 2, "heavy": []}


def _options(parser: argparse.ArgumentParser, path: str = "kvdock") -> list[tuple[str, argparse.Action]]:
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += _options(sub, f"{path} {name}")
        elif not isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            found.append((path, action))
    return found


def test_every_option_of_every_command_has_help() -> None:
    missing = [f"{path} {'/'.join(a.option_strings) or a.dest}" for path, a in _options(build_parser()) if not a.help]
    assert missing == []


def test_serve_flags_are_generated_from_server_config() -> None:
    serve = next(sub for path, sub in _subparsers(build_parser()) if path == "serve")
    by_dest = {a.dest: a for a in serve._actions}
    for f in dataclasses.fields(ServerConfig):
        action = by_dest[f.name]
        assert action.option_strings == [flag(f.name)], f.name
        assert action.default is None, f.name  # not given: env, file, then the field's default
        assert f"KVDOCK_{f.name.upper()}" in action.help, f.name
        if f.default not in ("", 0, False) and "default" not in f.metadata["help"]:
            assert f"(default {f.default})" in action.help, f.name
    assert set(by_dest) - {f.name for f in dataclasses.fields(ServerConfig)} == {"help", "config"}
    # the help says each default once, from the field (the old parser restated "default 30")
    assert "(default 30.0)" in by_dest["session_ttl"].help and "5555" in by_dest["port"].help
    ns = build_parser().parse_args(["serve", "--no-disk", "--l1-size", "8MiB", "--session-ttl", "3"])
    assert (ns.no_disk, ns.l1_size, ns.session_ttl, ns.no_shm, ns.port) == (True, "8MiB", 3.0, None, None)


def _subparsers(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser]]:
    return [
        (name, sub)
        for a in parser._actions
        if isinstance(a, argparse._SubParsersAction)
        for name, sub in a.choices.items()
    ]


def test_register_flags_for_mla_pipeline_stages_and_replicated_heads(server) -> None:
    base = ["register", "--url", server.url, "--http-url", server.http_url]
    runs = {
        "mla": ["--num-layers", "4", "--num-kv-heads", "1", "--head-dim", "40", "--kv-kind", "latent"],
        "stages": ["--num-layers", "2", "--num-kv-heads", "2", "--head-dim", "8", "--pp-size", "2"],
        "gqa": ["--num-layers", "2", "--num-kv-heads", "1", "--head-dim", "8", "--world-size", "4",
                "--total-kv-heads", "2"],
    }  # fmt: skip
    for name, flags in runs.items():
        r = _run(*base, "--model", name, "--dtype", "bfloat16", *flags)
        assert r.returncode == 0, (name, r.stderr)
    models = {e["model_name"]: e["layout"]["geometry"] for e in server.get("/status")["cache_context_meta"]}
    assert (models["mla"]["kv_kind"], models["mla"]["head_dim"]) == ("latent", 40)
    assert (models["stages"]["pp_size"], models["stages"]["num_layers"]) == (2, 2)
    assert (models["gqa"]["world_size"], models["gqa"]["total_kv_heads"]) == (4, 2)
    with kvd.connect(server.url, server.http_url, "mla", timeout=10) as c:  # one latent per token
        kv = torch.randn(1, 4, CHUNK, 40).to(torch.bfloat16)
        assert kvd.store(c, kv, make_tokens(CHUNK))
        got = kvd.retrieve(c, make_tokens(CHUNK))
        assert got is not None and torch.equal(got, kv)
    r = _run(*base, "--model", "bad", "--dtype", "bfloat16", "--num-layers", "2", "--num-kv-heads", "2",
             "--head-dim", "8", "--kv-kind", "latent")  # fmt: skip
    assert r.returncode == 2 and "latent" in r.stderr, r.stderr


def test_import_offers_to_register_the_bundles_model(make_server, tmp_path) -> None:
    a = make_server()
    kv = torch.randn(2, 3, 2 * CHUNK, 16).to(torch.bfloat16)
    tokens = make_tokens(2 * CHUNK, start=40)
    with kvd.connect(a.url, a.http_url, "tiny", timeout=10) as c:
        kvd.store(c, kv, tokens)
    out = str(tmp_path / "p.kvb")
    with kvd.connect(a.url, a.http_url, "tiny", timeout=10) as c:
        assert kvd.export_bundle(c, tokens, out) is not None
    b = make_server("--admin-token", "s3cret", register=None)
    dst = ["import", "--url", b.url, "--http-url", b.http_url, out]
    r = _run(*dst, env=_env())
    assert r.returncode == 2
    assert "'tiny' is not registered" in r.stderr and "add --register" in r.stderr, r.stderr
    r = _run(*dst, "--register", env=_env())  # the server has an admin token: registering needs it
    assert r.returncode == 2 and "needs the server's admin token" in r.stderr, r.stderr
    r = _run(*dst, "--register", "--admin-token", "s3cret", env=_env())
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert (doc["registered"], doc["stored_chunks"], doc["model_name"]) == (True, 2, "tiny")
    with kvd.connect(b.url, b.http_url, "tiny", timeout=10) as c:
        got = kvd.retrieve(c, tokens)
        assert got is not None and torch.equal(got, kv)
    r = _run(*dst, "--register", env=_env(KVDOCK_ADMIN_TOKEN="s3cret"))  # registered already: harmless
    assert r.returncode == 0 and json.loads(r.stdout)["registered"] is False, r.stderr


def test_retrieve_then_store_a_prompt_that_does_not_end_on_a_chunk(server, tmp_path) -> None:
    """The README's round trip: the retrieved prefix is whole chunks; storing it back with the
    whole prompt's tokens file stores that prefix (the SDK takes the first kv.shape[2] tokens)."""
    tokens = make_tokens(2 * CHUNK + 5, start=900)
    kv = torch.randn(2, 3, 2 * CHUNK, 16).to(torch.bfloat16)
    with kvd.connect(server.url, server.http_url, "tiny", timeout=10) as c:
        assert kvd.store(c, kv, tokens[: 2 * CHUNK])
    (tmp_path / "t.json").write_text(json.dumps(tokens))
    flags = ["--url", server.url, "--http-url", server.http_url, "--model", "tiny", "--tokens-file"]
    r = _run("retrieve", *flags, str(tmp_path / "t.json"), "--out", str(tmp_path / "kv.pt"))
    assert r.returncode == 0 and json.loads(r.stdout)["hit_tokens"] == 2 * CHUNK, r.stderr
    edited = torch.load(tmp_path / "kv.pt", weights_only=True) * 2
    torch.save(edited, tmp_path / "kv.pt")
    r = _run("store", *flags, str(tmp_path / "t.json"), "--kv", str(tmp_path / "kv.pt"), "--overwrite")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"stored_chunks": 2, "deduped_chunks": 0, "pool_full_chunks": 0, **NOTHING_ELSE}
    with kvd.connect(server.url, server.http_url, "tiny", timeout=10) as c:
        got = kvd.retrieve(c, tokens)
        assert got is not None and torch.equal(got, edited)


def test_serve_says_what_it_takes_in_one_line(tmp_path) -> None:
    port, http_port = free_ports(2)
    env = _env(XDG_CACHE_HOME=str(tmp_path / "cache"))
    p = subprocess.Popen(
        [sys.executable, "-m", "kvdock.cli.main", "serve", "--port", str(port), "--http-port", str(http_port),
         "--l1-size", "8MiB", "--chunk-size", "16"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )  # fmt: skip
    try:
        assert p.stdout is not None
        lines: list[str] = []
        while not lines or "L1 size:" not in lines[-1]:  # a stale-segment note may come first
            lines.append(p.stdout.readline())
            assert lines[-1], f"server exited: {lines}"
        line = lines[-1]
        disk = auto_disk_size(tmp_path / "cache" / "kvdock" / "l2")
        assert disk <= DISK_DEFAULT
        assert f"ZMQ tcp://127.0.0.1:{port}, HTTP 127.0.0.1:{http_port}" in line
        assert "L1 size: 8.00 MiB (given) of shared memory, pre-faulted" in line
        assert f"L2 disk: {disk / 2**30:.2f} GiB (auto: --disk-size to choose) in " in line
        assert str(tmp_path / "cache" / "kvdock" / "l2") in line and line.rstrip().endswith("L3 off")
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(30) in (0, 130)


def test_default_sizes_suit_a_laptop(tmp_path) -> None:
    """L1 at most 2 GiB however much memory there is; L2 a fixed 8 GiB (half the free space when
    less is free), not a fraction of the disk recomputed at every start."""
    from kvdock.sizes import L1_AUTO_MAX, auto_l1_size

    assert 0 < auto_l1_size() <= L1_AUTO_MAX == 2 * 2**30
    st = os.statvfs(tmp_path)
    assert auto_disk_size(tmp_path) == min(8 * 2**30, st.f_bavail * st.f_frsize // 2) // 2**20 * 2**20


def test_readme_states_the_defaults() -> None:
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    assert "| `--l1-size` | 1/4 of available memory, at most 2 GiB |" in readme
    assert "| `--disk-dir` / `--disk-size` | `~/.cache/kvdock/l2` / 8 GiB (half the free space when less) |" in readme


def test_the_sdk_reaches_a_loopback_server_past_an_http_proxy(server) -> None:
    """connect() checks ``http_url``: through a proxy the environment names, a loopback URL would
    reach the proxy (here: nothing) and the server would look dead. (A process of its own: urllib
    reads the proxy variables once per process.)"""
    dead_proxy = f"http://127.0.0.1:{free_port()}"
    code = (
        "import sys, kvdock.sdk as kvd\n"
        "with kvd.connect(sys.argv[1], sys.argv[2], 'tiny', timeout=10) as c:\n"
        "    print(kvd.lookup(c, list(range(16))))\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, server.url, server.http_url], capture_output=True, text=True, timeout=120,
        env=_env(http_proxy=dead_proxy, HTTP_PROXY=dead_proxy),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "0"


def test_lookup_imports_no_torch_and_answers_what_the_sdk_does(make_server) -> None:
    """``kvdock lookup`` (cli/light.py: Describe, RegisterClient, Lookup, CloseClient over the
    control plane, no SDK) prints the SDK's lookup for a stored prompt (its whole chunks, also of a
    prompt past them), a miss, another cache_salt; an unknown model and a dead server are the
    SDK's errors with the SDK's messages; it imports no torch."""
    srv = make_server()
    stored = make_tokens(2 * CHUNK, start=7)
    kv = torch.randn(2, 3, 2 * CHUNK, 16).to(torch.bfloat16)
    with kvd.connect(srv.url, srv.http_url, "tiny", timeout=10) as c:
        assert kvd.store_chunks(c, kv, stored, cache_salt="s").stored_chunks == 2
        prompts = {
            "stored": (stored, "s"),
            "longer": (stored + make_tokens(CHUNK + 5, start=900), "s"),
            "partial": (stored[: CHUNK + 3], "s"),
            "miss": (make_tokens(2 * CHUNK, start=500), "s"),
            "other salt": (stored, ""),
            "short": (stored[:5], "s"),
        }
        want = {name: kvd.lookup(c, toks, cache_salt=salt) for name, (toks, salt) in prompts.items()}
    assert want == {"stored": 2 * CHUNK, "longer": 2 * CHUNK, "partial": CHUNK, "miss": 0, "other salt": 0, "short": 0}
    flags = ["--url", srv.url, "--http-url", srv.http_url, "--model", "tiny"]
    for name, (toks, salt) in prompts.items():
        got, out = probe("lookup", *flags, "--cache-salt", salt, ",".join(map(str, toks)))
        assert got == {"code": 0, "heavy": []}, name
        assert json.loads(out) == {"hit_tokens": want[name], "tokens": len(toks)}, name
    # the errors: each the message the SDK's connect raises
    for args in (
        ["--url", srv.url, "--http-url", srv.http_url, "--model", "nope"],  # an unknown model
        ["--url", f"tcp://127.0.0.1:{free_port()}", "--model", "tiny"],  # no server
        ["--url", srv.url, "--http-url", f"http://127.0.0.1:{free_port()}", "--model", "tiny"],  # no HTTP API
    ):
        url = args[1]
        http = args[3] if args[2] == "--http-url" else DEFAULT_HTTP_URL
        model = args[-1]
        with pytest.raises(KVDockError) as e:
            kvd.connect(url, http, model, timeout=10)
        r = _run("lookup", *args, "1,2,3", env=_env())
        assert (r.returncode, r.stdout) == (2, ""), r.stderr
        assert r.stderr == f"kvdock lookup: error: {e.value}\n"
        assert str(e.value)  # (a message, not an empty one)
    unknown = _run("lookup", "--url", srv.url, "--http-url", srv.http_url, "--model", "nope", "1", env=_env())
    assert "model 'nope' is not registered with the server; registered models: tiny" in unknown.stderr
    got, _ = probe("lookup", "--url", f"tcp://127.0.0.1:{free_port()}", "--model", "tiny", "1")
    assert got == {"code": 2, "heavy": []}


def test_lookup_with_a_tenant_token(make_server, tmp_path) -> None:
    """A tenant's token (``--token`` or ``KVDOCK_TOKEN``) is honoured as the SDK honours it: its
    namespace's hit; a wrong token is the SDK's PermissionDeniedError message."""
    acme = "acme-token-0123456789"
    admin = "admin-0123456789"
    path = tmp_path / "tenants.toml"
    path.write_text(f'[tenants.acme]\ntokens = ["{acme}"]\nmodels = ["tiny"]\nsalts = ["acme"]\n')
    srv = make_server("--tenants", str(path), "--admin-token", admin, register=None)
    kvd.register_model(srv.url, srv.http_url, "tiny", dtype="bfloat16", **GEOMETRY, timeout=10, admin_token=admin)
    toks = make_tokens(2 * CHUNK, start=3)
    with kvd.connect(srv.url, srv.http_url, "tiny", timeout=10, token=acme) as c:
        assert kvd.store_chunks(c, make_kv(2 * CHUNK), toks, cache_salt="acme").stored_chunks == 2
        assert kvd.lookup(c, toks, cache_salt="acme") == 2 * CHUNK
    flags = ["--url", srv.url, "--http-url", srv.http_url, "--model", "tiny", "--cache-salt", "acme"]
    ids = ",".join(map(str, toks))
    got, out = probe("lookup", *flags, "--token", acme, ids)
    assert got == {"code": 0, "heavy": []} and json.loads(out) == {"hit_tokens": 2 * CHUNK, "tokens": 2 * CHUNK}
    got, out = probe("lookup", *flags, ids, env=_env(KVDOCK_TOKEN=acme))
    assert got == {"code": 0, "heavy": []} and json.loads(out) == {"hit_tokens": 2 * CHUNK, "tokens": 2 * CHUNK}
    for bad in ("wrong-token-0123456789", ""):
        with pytest.raises(KVDockError) as e, kvd.connect(srv.url, srv.http_url, "tiny", timeout=10, token=bad) as c:
            kvd.lookup(c, toks, cache_salt="acme")
        r = _run("lookup", *flags, "--token", bad, ids, env=_env())
        assert (r.returncode, r.stdout) == (2, ""), (bad, r.stderr)
        assert r.stderr == f"kvdock lookup: error: {e.value}\n", bad


def test_lookup_of_a_model_sglang_registered_uses_sglangs_keys(make_server) -> None:
    """A model SGLang registered is stored under SGLang's page-hash keys (kvdock.keying):
    ``kvdock lookup`` keys the tokens (and cache_salt) as the SDK does, so it finds what the SDK
    stored, and misses under another salt."""
    from kvdock.protocol import messages as m

    srv = make_server(register=None)
    lay = kvd.make_layout("sg", **GEOMETRY, dtype="bfloat16", engine=m.EngineInfo("sglang", "0.5"))
    kvd.register_layout(srv.url, srv.http_url, lay, timeout=10)
    toks = make_tokens(3 * CHUNK + 4, start=11)
    with kvd.connect(srv.url, srv.http_url, "sg", timeout=10) as c:
        assert kvd.store_chunks(c, make_kv(2 * CHUNK), toks[: 2 * CHUNK], cache_salt="n").stored_chunks == 2
        want = {salt: kvd.lookup(c, toks, cache_salt=salt) for salt in ("n", "")}
    assert want == {"n": 2 * CHUNK, "": 0}
    for salt, hit in want.items():
        flags = ["--url", srv.url, "--http-url", srv.http_url, "--model", "sg", "--cache-salt", salt]
        got, out = probe("lookup", *flags, ",".join(map(str, toks)))
        assert got == {"code": 0, "heavy": []} and json.loads(out) == {"hit_tokens": hit, "tokens": len(toks)}, salt

"""The README's code blocks, extracted and run against real servers (issue 27), so that the README
cannot drift from what kvdock does. Each block is run as written, with only what the README
leaves to the reader supplied: the server's URLs (the README's are the defaults), the variables a
block uses (``kv``, ``tokens``, ``prompts``, a transformers ``model``: :func:`prelude`), and, for
shell lines, ``--url``/``--http-url`` after the command. Blocks that cannot run here say why in
:data:`NOT_RUN`; a new block that is neither run nor listed fails the test."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import re
import shlex
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers import start_inprocess

ROOT = Path(__file__).parents[1]
README = ROOT / "README.md"
DEFAULT_URL, DEFAULT_HTTP_URL = "tcp://127.0.0.1:5555", "http://127.0.0.1:9000"
# the README's model: 32 layers, 8 KV heads of 128, bfloat16 (register block); 530 tokens are
# two whole chunks of 256 and a tail
LAYERS, D, TOKENS = 32, 8 * 128, 530

# blocks not run here, by a line they contain, and why
NOT_RUN = {
    "pip install torch==2.13.0": "the quick start installs and runs the suite (CI runs exactly that: .ci/run)",
    "vllm serve MODEL": "needs vLLM (its venv: tests/integrations/vllm run the connector configured so)",
    "python examples/kv_edit_e2e.py": "tests/integrations/test_examples.py runs both examples",
    "chunk         tokens  tiers": "sample output of kvdock inspect, not code",
    "sglang.launch_server": "needs SGLang (its venv: tests/integrations/sglang run the backend configured so)",
}


def blocks() -> list[tuple[str, str]]:
    """``(language, code)`` of every fenced block, in order."""
    return [(m.group(1), m.group(2)) for m in re.finditer(r"^```(\w*)\n(.*?)^```", README.read_text(), re.S | re.M)]


def _not_run(code: str) -> str | None:
    return next((why for marker, why in NOT_RUN.items() if marker in code), None)


def test_every_block_is_run_or_says_why_not() -> None:
    found = blocks()
    assert len(found) >= 12
    for lang, code in found:
        assert lang in ("bash", "python") or _not_run(code), code[:80]
    # the quick start is still two commands, and its server flags are valid
    quick = next(code for _, code in found if "pip install torch==2.13.0" in code)
    assert len([line for line in quick.splitlines() if line and not line.startswith("#")]) == 2
    from kvdock.inprocess import config_from_args

    assert config_from_args(["--l1-size", "2GiB"]).l1_size == 2 * 2**30


def prelude(srv: Any) -> dict[str, Any]:
    """What the SDK blocks take as given."""
    import kvdock.sdk as kvd

    g = torch.Generator().manual_seed(0)
    kv = torch.randn(2, LAYERS, TOKENS, D, generator=g).to(torch.bfloat16)
    tokens = list(range(1000, 1000 + TOKENS))
    other_tokens = list(range(5000, 5000 + TOKENS))
    hit = TOKENS // 256 * 256
    return {
        "kvd": kvd,
        "torch": torch,
        "url": srv.url,
        "http_url": srv.http_url,
        "kv": kv,
        "edited": kv * 2,
        "tokens": tokens,
        "other_tokens": other_tokens,
        "prompts": [tokens, other_tokens],
        "buf": torch.empty(2, LAYERS, hit, D, dtype=torch.bfloat16),
    }


def run_python(code: str, ns: dict[str, Any], srv: Any) -> None:
    code = code.replace(DEFAULT_URL, srv.url).replace(DEFAULT_HTTP_URL, srv.http_url)
    if "ctx" in ns and "ctx = " not in code:  # a block that continues with the README's ctx
        ns["ctx"] = ns["kvd"].connect(srv.url, srv.http_url, "my-model")
    if re.search(r"^(async |await )|^\s+await ", code, re.M):
        imports = [line for line in code.splitlines() if line.startswith(("import ", "from "))]
        body = "\n".join(line for line in code.splitlines() if line not in imports)
        code = "\n".join(imports) + "\nasync def _block():\n" + textwrap.indent(body, "    ") + "\n"
        exec(compile(code, "README.md", "exec"), ns)
        asyncio.run(ns["_block"]())
        return
    exec(compile(code, "README.md", "exec"), ns)


def run_shell(code: str, srv: Any, cwd: Path) -> list[tuple[str, dict[str, Any] | str]]:
    """Each command line of a shell block as ``kvdock`` runs it (its ``main``, in this process,
    in ``cwd``, told the server's URLs); its exit status must be 0, or 1 where the README says
    "exit 1". tests/cli run the same commands as processes."""
    outputs: list[tuple[str, dict[str, Any] | str]] = []
    for line in code.splitlines():
        command = line.split("#", 1)[0].strip()
        if not command:
            continue
        assert command.startswith("kvdock "), command
        sub, *rest = shlex.split(command)[1:]
        code_, out, err = _kvdock([sub, "--url", srv.url, "--http-url", srv.http_url, *rest], cwd)
        allowed = (0, 1) if "exit 1" in line else (0,)
        assert code_ in allowed, (line, err)
        try:
            outputs.append((command, json.loads(out)))
        except ValueError:
            outputs.append((command, out))
    return outputs


def _kvdock(args: list[str], cwd: Path) -> tuple[int, str, str]:
    from kvdock.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    here = Path.cwd()
    saved = dict(os.environ)
    os.chdir(cwd)
    try:
        for k in [k for k in os.environ if k.startswith("KVDOCK_")]:
            del os.environ[k]
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(args)
            except SystemExit as e:
                code = int(e.code or 0)
    finally:
        os.chdir(here)
        os.environ.clear()
        os.environ.update(saved)
    return code, out.getvalue(), err.getvalue()


def _run_blocks(ns: dict[str, Any], srv: Any, cwd: Path, ran: list[Any]) -> None:
    """Every block in order, in ``cwd`` (the files they name, e.g. prompt.kvb, land there)."""
    here = Path.cwd()
    os.chdir(cwd)
    try:
        _run_each(ns, srv, cwd, ran)
    finally:
        os.chdir(here)


def _run_each(ns: dict[str, Any], srv: Any, cwd: Path, ran: list[Any]) -> None:
    for lang, code in blocks():
        if _not_run(code) or "hf.connect(model" in code:
            continue
        if lang == "bash":
            ran.append((code, run_shell(code, srv, cwd)))
        else:
            if "ctx" in ns and "ctx = " not in code:  # a block that continues with the README's ctx
                ns["ctx"].close()
            run_python(code, ns, srv)
            ran.append((code, None))


@pytest.fixture
def readme_server(tmp_path: Path) -> Any:
    srv = start_inprocess(tmp_path, "--no-disk", l1_size="640MiB", chunk_size=256)
    yield srv
    srv.stop()


def test_the_readme_blocks_run_against_a_real_server(readme_server: Any, tmp_path: Path) -> None:
    srv = readme_server
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    ns = prelude(srv)
    (cwd / "t.json").write_text(json.dumps(ns["tokens"]))
    (cwd / "a.json").write_text(json.dumps(ns["tokens"]))
    (cwd / "b.json").write_text(json.dumps(ns["other_tokens"]))
    ran = []
    try:
        _run_blocks(ns, srv, cwd, ran)
    finally:
        if "ctx" in ns:
            ns["ctx"].close()
    assert len(ran) >= 9
    # what the blocks did, where the README says what to expect
    outputs = dict(o for _, outs in ran if outs for o in outs)
    register = next(v for k, v in outputs.items() if k.startswith("kvdock register --model my-model"))
    assert register == {"model_name": "my-model", "created": True, "chunk_nbytes": 2 * LAYERS * 256 * D * 2}
    mla = next(v for k, v in outputs.items() if k.startswith("kvdock register --model my-mla"))
    assert mla == {"model_name": "my-mla", "created": True, "chunk_nbytes": 4 * 256 * 576 * 2}
    assert outputs["kvdock lookup   --model my-model 1,2,3"] == {"hit_tokens": 0, "tokens": 3}
    retrieved = next(v for k, v in outputs.items() if k.startswith("kvdock retrieve"))
    assert isinstance(retrieved, dict) and retrieved["hit_tokens"] == 512
    assert (cwd / "prompt.kvb").exists() and (cwd / "norms.png").stat().st_size > 0
    # the SDK block: the overwrite stored `edited`'s whole chunks under `tokens`
    kvd = ns["kvd"]
    with kvd.connect(srv.url, srv.http_url, "my-model") as ctx:
        got = kvd.retrieve(ctx, ns["tokens"])
        assert got is not None and got.shape[2] == 512
    assert isinstance(ns["b"], kvd.Bundle) and ns["b"].manifest.model_name == "my-model"


def test_the_readme_transformers_block(tmp_path: Path) -> None:
    from integrations.hf_models import prompt, tiny_model

    code = next(code for _, code in blocks() if "hf.connect(model" in code)
    srv = start_inprocess(tmp_path, "--no-disk", l1_size="64MiB", chunk_size=16)
    try:
        input_ids = prompt(40)
        ns: dict[str, Any] = {"model": tiny_model("llama"), "input_ids": input_ids, "tokens": input_ids[0].tolist()}
        run_python(code, ns, srv)
        assert ns["result"].hit_tokens == 0 and ns["n"] == 32  # the prompt's whole chunks, saved by generate
    finally:
        ns.get("ctx") and ns["ctx"].close()  # type: ignore[func-returns-value]
        srv.stop()


def test_the_readme_lists_every_serve_flag_with_its_default() -> None:
    """The flags table of "The server": a row per ServerConfig field, and where the default column
    is a plain value, it is the field's default (automatic sizes are described in words)."""
    import dataclasses

    from kvdock.cli.serve import flag
    from kvdock.config import ServerConfig

    defaults: dict[str, str] = {}
    for line in README.read_text().splitlines():
        if line.startswith("| `--"):
            names, default = (cell.strip() for cell in line.split("|")[1:3])
            flags = re.findall(r"`(--[a-z0-9-]+)`", names)
            values = default.split(" / ") if len(flags) > 1 else [default]
            defaults.update(zip(flags, values, strict=False))
    for f in dataclasses.fields(ServerConfig):
        assert flag(f.name) in defaults, f"README's flags table has no row for {flag(f.name)}"
        shown = defaults[flag(f.name)].split(" (")[0]
        if isinstance(f.default, bool):
            assert shown == ("on" if f.default else "off"), f.name
        elif isinstance(f.default, (int, float)) and f.default and re.fullmatch(r"[\d.]+", shown):
            assert float(shown) == f.default, f.name
        elif isinstance(f.default, str) and f.default and not shown.startswith("`"):
            assert shown == f.default, f.name

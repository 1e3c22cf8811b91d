"""``kvdock inspect`` and ``kvdock diff`` on a real server (the commands run in-process: their
parsing, output and exit codes are what is tested here; test_cli.py runs the binary)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import kvdock.sdk as kvd
from helpers import CHUNK, make_kv, make_tokens
from kvdock.cli.main import main
from kvdock.sdk.bundle import digest


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_inspect_prints_chunks_and_norms_and_plots(server, ctx, tmp_path: Path, capsys) -> None:
    toks = make_tokens(2 * CHUNK, start=80_000)
    kv = make_kv(len(toks), seed=31)
    kvd.store(ctx, kv, toks)
    (tmp_path / "t.json").write_text(json.dumps([*toks, *make_tokens(CHUNK, start=81_000)]))
    flags = [
        "--url",
        server.url,
        "--http-url",
        server.http_url,
        "--model",
        "tiny",
        "--tokens-file",
        str(tmp_path / "t.json"),
    ]
    code, out, _ = run(capsys, "inspect", *flags, "--plot", str(tmp_path / "n.png"))
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == "model 'tiny': 32 of 48 tokens cached (2 of 3 whole chunks of 16)"
    assert lines[3].split() == ["0", "0-15", "l1", "3072", digest(kv[:, :, :CHUNK])]
    assert lines[5].split()[:3] == ["2", "32-47", "-"] and "(not in the cached prefix)" in lines[5]
    norms = kv.float().square().sum(dim=(2, 3)).sqrt()
    layer1 = lines[9].split()
    assert layer1[0] == "1" and float(layer1[1]) == pytest.approx(norms[0, 1].item(), rel=1e-5)
    assert (tmp_path / "n.png").read_bytes()[:4] == b"\x89PNG"
    code, out, _ = run(capsys, "inspect", *flags, "--json")
    doc = json.loads(out)
    assert (
        code == 0 and doc["hit_tokens"] == 32 and [c["blake3"] is None for c in doc["chunks"]] == [False, False, True]
    )


def test_diff_exit_codes_follow_diff(server, ctx, tmp_path: Path, capsys) -> None:
    a, b = make_tokens(2 * CHUNK, start=82_000), make_tokens(2 * CHUNK, start=83_000)
    kv = make_kv(len(a), seed=32)
    kvd.store(ctx, kv, a)
    changed = kv.clone()
    changed[0, 2, CHUNK + 1, 0] += 2.0
    kvd.store(ctx, changed, b)
    flags = ["--url", server.url, "--http-url", server.http_url, "--model", "tiny", ",".join(map(str, a))]
    code, out, _ = run(capsys, "diff", *flags, "--other-tokens", ",".join(map(str, a)))
    assert code == 0 and out.splitlines() == ["cached: 32 and 32 tokens; compared the first 32", "identical"]
    code, out, _ = run(capsys, "diff", *flags, "--other-tokens", ",".join(map(str, b)))
    lines = out.splitlines()
    assert code == 1 and lines[1] == "first differing chunk: 1"
    assert lines[6].split()[0] == "2" and float(lines[6].split()[1]) == pytest.approx(2.0, rel=0.02)
    code, out, _ = run(capsys, "diff", *flags, "--other-tokens", ",".join(map(str, b)), "--json")
    assert code == 1 and json.loads(out)["first_differing_chunk"] == 1
    code, _, err = run(capsys, "diff", *flags)
    assert code == 2 and "--other-tokens or --other-tokens-file" in err
    code, _, err = run(capsys, "inspect", *flags[:-1], "1,2,x")
    assert code == 2 and "token ids must be integers" in err
    code, out, err = run(capsys, "inspect", *flags, "--plot", str(tmp_path / "norms.unknownext"))
    assert code == 2 and out == "" and "kvdock inspect: error: cannot plot to" in err  # refused before any work
    assert not list(tmp_path.glob("norms*"))

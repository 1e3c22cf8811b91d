"""examples/kv_edit_sglang.py runs as documented (its own kvdock server, a tiny random Llama,
SGLang's CPU engine): the remapped target gives the source's output from kvdock's KV."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "kv_edit_sglang.py"


def test_the_sglang_kv_edit_example_matches() -> None:
    out = subprocess.run(
        [sys.executable, str(EXAMPLE), "--pages", "4", "--max-new-tokens", "6"],
        capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["match"] is True
    assert report["target_tokens_from_kvdock"] == 4 * 16
    assert report["kv_shape"] == [2, 2, 64, 32]
    assert report["target_output"] == report["source_output"] and len(report["source_output"]) == 6

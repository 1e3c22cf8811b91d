"""The package as it installs (issue 27): a light install for the server (no torch, no
transformers), extras for the rest, license metadata, and a build error without a C compiler that
says what to install. (.ci/wheel-check builds the wheel and runs it in a fresh venv.)"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _names(reqs: list[str]) -> set[str]:
    return {re.split(r"[\s<>=!~;\[]", r, maxsplit=1)[0].lower() for r in reqs}


def test_the_server_installs_without_torch_or_transformers() -> None:
    base = _names(PYPROJECT["dependencies"])
    assert not base & {"torch", "transformers", "huggingface-hub", "matplotlib", "safetensors"}, base
    extras = PYPROJECT["optional-dependencies"]
    assert {"torch", "safetensors"} <= _names(extras["sdk"])
    assert "transformers" in _names(extras["hf"]) and "matplotlib" in _names(extras["plot"])
    # the README's quick start installs [dev]: it must still bring everything the tests import
    assert "kvdock[sdk,hf,plot]" in extras["dev"]


def test_the_server_and_the_light_commands_import_neither_torch_nor_transformers() -> None:
    code = (
        "import sys, json, kvdock.server.launch, kvdock.cli.main, kvdock.cli.light;"
        "print(json.dumps(sorted(m for m in ('torch', 'transformers', 'safetensors') if m in sys.modules)))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == []


def test_license_metadata_and_file() -> None:
    assert PYPROJECT["license"] == "MIT"
    assert PYPROJECT["license-files"] == ["LICENSE"]
    assert (ROOT / "LICENSE").read_text().startswith("MIT License")


def test_building_without_a_c_compiler_says_what_to_install(tmp_path) -> None:
    r = subprocess.run(
        [sys.executable, "setup.py", "-q", "build_ext", "--build-temp", str(tmp_path / "t"),
         "--build-lib", str(tmp_path / "l")],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env={"CC": "/nonexistent/cc", "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert r.returncode != 0
    assert "kvdock has two small C extensions and could not compile them" in r.stderr, r.stderr
    assert "apt-get install gcc python3-dev" in r.stderr and "/nonexistent/cc" in r.stderr


def test_ci_needs_nothing_outside_the_repository() -> None:
    run = (ROOT / ".ci" / "run").read_text()
    assert "scripts/check_deps.py" in run and (ROOT / "scripts" / "check_deps.py").exists()
    assert ".ci/wheel-check" in run and (ROOT / ".ci" / "wheel-check").exists()
    outside = [p for p in ("../shared", "/work/") if p in (ROOT / "README.md").read_text()]
    assert outside == []
    for path in (ROOT / "src").rglob("*.py"):
        assert "../shared" not in path.read_text(), path

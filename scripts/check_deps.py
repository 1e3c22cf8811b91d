#!/usr/bin/env python3
"""Lists third-party modules that src/ imports but pyproject.toml does not declare.

A package installed by hand on one machine makes every test pass there and the first command
fail on a fresh one. Run from the project root: python3 scripts/check_deps.py (the repository's
copy of the shared tool of the same name, so that CI needs nothing outside the repository).
Exit 1 when something is undeclared. Optional extras count as declared; say in the message
which extra a user needs when an optional import is missing.
"""
import ast
import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path


# import name -> distribution name, for when the module is not installed where this runs
ALIASES = {"zmq": "pyzmq", "yaml": "pyyaml", "PIL": "pillow", "sklearn": "scikit-learn", "cv2": "opencv-python",
           "google": "protobuf", "dateutil": "python-dateutil", "jwt": "pyjwt", "nacl": "pynacl"}


def declared(pyproject: dict) -> set[str]:
    proj = pyproject.get("project", {})
    reqs = list(proj.get("dependencies", []))
    for extra in proj.get("optional-dependencies", {}).values():
        reqs += extra
    return {re.split(r"[\s<>=!~;\[]", r, maxsplit=1)[0].lower().replace("_", "-") for r in reqs}


def imported(src: Path) -> dict[str, str]:
    found: dict[str, str] = {}
    for f in sorted(src.rglob("*.py")):
        try:
            tree = ast.parse(f.read_text(), str(f))
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for n in names:
                found.setdefault(n.split(".")[0], f"{f.relative_to(src.parent) if f.is_relative_to(src.parent) else f}:{node.lineno}")
    return found


def main() -> int:
    root = Path.cwd()
    py = root / "pyproject.toml"
    if not py.exists():
        return 0
    pyproject = tomllib.loads(py.read_text())
    own = {p.name for p in (root / "src").iterdir() if p.is_dir()} if (root / "src").is_dir() else set()
    decl = declared(pyproject)
    dists = metadata.packages_distributions()
    bad = []
    for mod, where in imported(root / "src" if (root / "src").is_dir() else root).items():
        if mod in own or mod in sys.stdlib_module_names or mod == "__future__":
            continue
        names = {d.lower().replace("_", "-") for d in dists.get(mod, [ALIASES.get(mod, mod)])}
        if not names & decl:
            bad.append(f"  {mod} (first at {where}; installed as {', '.join(sorted(names))})")
    if bad:
        print("Imported by src/ but not declared in pyproject.toml (a fresh install breaks):")
        print("\n".join(bad))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

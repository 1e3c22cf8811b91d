"""Opt-in CPU accounting of the suite (issue 25: the suite's time is CPU on 2 cores, not waits):
``KVDOCK_TEST_CPU=DIR python -m pytest ...`` writes, per pytest process, ``DIR/cpu-<worker>.tsv``:
one row per test with the CPU seconds its setup + call + teardown took in the test process
(``self``: the test, in-process servers, their threads) and in the child processes reaped
meanwhile (``children``: ``kvdock serve`` processes, redis-server / valkey-server, client
processes), and a row per reaped child with its command (``child``), so that the children's CPU
can be put down to a cause. A child is counted when reaped: a spare Redis Cluster made in one
test and stopped in another counts in the second. ``python tests/cpu_table.py DIR`` sums the
files up: by test, by file, by kind of child."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest


def _cpu(who: int) -> float:
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


def _command(argv: list[Any]) -> str:
    """A child's command for the table: its first words, one line (``-c`` without its code)."""
    words = [str(x) for x in argv[:4]]
    if words[1:2] == ["-c"]:
        words = words[:2]
    return " ".join(words).replace("\t", " ").replace("\n", " ")[:200]


class CpuTable:
    """The pytest plugin: rows written to ``out`` as the tests end."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.commands: dict[int, str] = {}  # pid -> what it runs
        self.test = "(start)"
        self.file: Any = None
        self._real_waitpid = os.waitpid
        self._patch()

    def _patch(self) -> None:
        table = self
        popen_init = subprocess.Popen.__init__

        def init(self: subprocess.Popen[Any], args: Any, *a: Any, **kw: Any) -> None:
            popen_init(self, args, *a, **kw)
            argv = [args] if isinstance(args, (str, bytes)) else list(args)
            table.commands[self.pid] = _command(argv)

        subprocess.Popen.__init__ = init  # type: ignore[method-assign]

        def waitpid(pid: int, options: int) -> tuple[int, int]:
            got, status, usage = os.wait4(pid, options)
            if got > 0 and (os.WIFEXITED(status) or os.WIFSIGNALED(status)):
                table.child(got, usage.ru_utime + usage.ru_stime)
            return got, status

        os.waitpid = waitpid
        # (Popen.poll takes os.waitpid as a default argument, bound at import)
        poll = subprocess.Popen._internal_poll
        poll.__defaults__ = tuple(waitpid if d is self._real_waitpid else d for d in poll.__defaults__ or ())

    def child(self, pid: int, cpu: float) -> None:
        cmd = self.commands.pop(pid, "") or "(forked: multiprocessing or os.fork)"
        self.write("child", f"{cpu:.3f}", "", self.test, cmd)

    def write(self, *cells: str) -> None:
        if self.file is None:
            worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
            self.file = open(self.out / f"cpu-{worker}.tsv", "a", buffering=1)  # noqa: SIM115
        self.file.write("\t".join(cells) + "\n")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> Generator[None, None, None]:
        self.test = item.nodeid
        own, kids, wall = _cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN), time.monotonic()
        yield
        own = _cpu(resource.RUSAGE_SELF) - own
        kids = _cpu(resource.RUSAGE_CHILDREN) - kids
        # children of the test zygote (tests/zygote.py): reaped by it, not by this process
        forked = sys.modules.get("zygote")
        while forked is not None and forked.REAPED:
            cmd, cpu = forked.REAPED.pop(0)
            kids += cpu
            self.write("child", f"{cpu:.3f}", "", item.nodeid, "zygote: " + cmd)
        self.write("test", f"{own:.3f}", f"{kids:.3f}", item.nodeid, f"{time.monotonic() - wall:.2f}")
        self.test = "(between)"

    def pytest_sessionfinish(self) -> None:
        forked = sys.modules.get("zygote")
        if forked is not None:
            forked.Zygote.close()  # (its CPU counts once it is reaped)
        self.write("process", f"{_cpu(resource.RUSAGE_SELF):.3f}", f"{_cpu(resource.RUSAGE_CHILDREN):.3f}", "", "")


def register(config: pytest.Config) -> None:
    """Add the plugin when KVDOCK_TEST_CPU names a directory (conftest's pytest_configure)."""
    out = os.environ.get("KVDOCK_TEST_CPU")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        config.pluginmanager.register(CpuTable(Path(out)), "kvdock-cpu-table")


def _kind(cmd: str) -> str:
    """What a child ran, without its ports and paths: the program, and for python what it ran."""
    words = cmd.split(" ")
    if words[0] == "zygote:":
        return "zygote: " + _kind(" ".join(words[1:]))
    prog = words[0].rsplit("/", 1)[-1]
    if not prog.startswith("python"):
        return prog
    if words[1:2] == ["-m"]:
        return " ".join(["python -m", *words[2:4]])
    if words[1:2] == ["-c"]:
        return "python -c"
    return "python " + " ".join(w.rsplit("/", 1)[-1] for w in words[1:2])


def summary(folder: Path, top: int = 60) -> str:
    tests: dict[str, list[float]] = {}
    files: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    kinds: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    procs = [0.0, 0.0]
    for path in sorted(folder.glob("cpu-*.tsv")):
        for line in path.read_text().splitlines():
            row = line.split("\t")
            if row[0] == "test":
                own, kids, wall = float(row[1]), float(row[2]), float(row[4])
                tests[row[3]] = [own, kids, wall]
                f = files[row[3].split("::")[0]]
                f[0], f[1], f[2] = f[0] + own, f[1] + kids, f[2] + wall
            elif row[0] == "child":
                k = kinds[_kind(row[4])]
                k[0], k[1] = k[0] + 1, k[1] + float(row[1])
            elif row[0] == "process":
                procs[0], procs[1] = procs[0] + float(row[1]), procs[1] + float(row[2])
    lines = [f"pytest processes: self {procs[0]:.1f} s, children {procs[1]:.1f} s, total {sum(procs):.1f} s"]
    lines.append(
        f"tests: {len(tests)}, self {sum(t[0] for t in tests.values()):.1f} s, "
        f"children {sum(t[1] for t in tests.values()):.1f} s"
    )
    lines.append("\nchildren by kind: count, cpu s")
    for k, (n, cpu) in sorted(kinds.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"{cpu:8.1f} {int(n):5d}  {k}")
    lines.append("\nfiles by cpu: total self children wall")
    for name, (o, c, w) in sorted(files.items(), key=lambda kv: -(kv[1][0] + kv[1][1]))[:top]:
        lines.append(f"{o + c:7.1f} {o:7.1f} {c:7.1f} {w:7.1f}  {name}")
    lines.append("\ntests by cpu: total self children wall")
    for name, (o, c, w) in sorted(tests.items(), key=lambda kv: -(kv[1][0] + kv[1][1]))[:top]:
        lines.append(f"{o + c:7.1f} {o:7.1f} {c:7.1f} {w:7.1f}  {name}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(summary(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 60))

"""tests/zygote.py: a child forked from the pre-imported zygote behaves as ``python ARGS`` would
(argv, environment, working directory, __main__, pipes, exit statuses, signals, timeouts), is a
process of its own, and imports kvdock itself (nothing of kvdock is preloaded)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import zygote

PY = sys.executable


@pytest.fixture(autouse=True)
def _forked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test here goes through the zygote (under --cov too: what it checks is the zygote)."""
    monkeypatch.setattr(zygote, "enabled", lambda: True)


def test_argv_environment_cwd_and_main_are_the_childs(tmp_path: Path) -> None:
    code = (
        "import json, os, sys, zmod\n"
        "print(json.dumps([sys.argv, os.environ.get('ZYGOTE_X'), os.getcwd(), __name__, sys.path[0],\n"
        "    'kvdock' in sys.modules, 'torch' in sys.modules, os.getpid(), os.getppid()]))"
    )
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "zmod.py").write_text("")  # on the child's PYTHONPATH only
    path = os.pathsep.join([str(tmp_path / "lib"), os.environ.get("PYTHONPATH", "")])
    env = os.environ | {"ZYGOTE_X": "y", "PYTHONPATH": path}
    r = zygote.run([PY, "-c", code, "a", "b"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    argv, x, cwd, name, path0, kvdock, torch, pid, ppid = __import__("json").loads(r.stdout)
    assert argv == ["-c", "a", "b"] and x == "y" and cwd == str(tmp_path) and name == "__main__" and path0 == ""
    assert not kvdock and torch  # torch is preloaded, kvdock is the child's own import
    assert pid != os.getpid() and ppid == zygote.Zygote.get(zygote.CLIENT).proc.pid  # a process of its own


def test_a_script_and_a_module_run_as_main(tmp_path: Path) -> None:
    script = tmp_path / "s.py"
    script.write_text("import sys\nif __name__ == '__main__':\n    print(sys.argv[1:], sys.path[0])\n")
    r = zygote.run([PY, str(script), "x"], capture_output=True, text=True, timeout=60)
    assert r.stdout.split() == ["['x']", str(tmp_path)], r.stderr
    r = zygote.run([PY, "-m", "kvdock.cli.main", "--version"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.startswith("kvdock "), (r.stdout, r.stderr)


@pytest.mark.parametrize(
    ("code", "want"),
    [
        ("import sys; sys.exit(3)", 3),
        ("raise ValueError('boom')", 1),
        ("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)", -signal.SIGSEGV),
        ("import atexit, sys; atexit.register(lambda: print('atexit', flush=True))", 0),
    ],
)
def test_exit_statuses_are_the_childs(code: str, want: int) -> None:
    r = zygote.run([PY, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == want, r.stderr
    assert ("ValueError: boom" in r.stderr) == (want == 1)
    assert ("atexit" in r.stdout) == ("atexit" in code)


def test_pipes_signals_and_timeouts() -> None:
    p = zygote.Popen(
        [PY, "-c", "import sys, time; print(sys.stdin.readline().upper(), flush=True); time.sleep(60)"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert p.stdin is not None and p.stdout is not None
        p.stdin.write("ping\n")
        p.stdin.flush()
        assert p.stdout.readline().strip() == "PING"
        os.kill(p.pid, signal.SIGSTOP)
        assert p.poll() is None  # stopped is not ended
        with pytest.raises(subprocess.TimeoutExpired):
            p.wait(0.2)
        os.kill(p.pid, signal.SIGCONT)
        p.terminate()
        assert p.wait(30) == -signal.SIGTERM
    finally:
        p.kill()
    with pytest.raises(subprocess.TimeoutExpired):
        zygote.run([PY, "-c", "import time; time.sleep(60)"], timeout=0.5)


def test_a_server_from_the_zygote_takes_its_flags_and_environment(tmp_path: Path) -> None:
    """A ``kvdock serve`` forked from the SERVER zygote (helpers.start_server) reads its flags
    and its KVDOCK_* variables as a fresh one: a fault variable given to this server applies."""
    import kvdock.sdk as kvd
    from helpers import MODEL, start_server

    srv = start_server(tmp_path, "--l1-size", "4MiB", env={"KVDOCK_FAULT_RETRIEVE_MISS": "1"})
    try:
        assert srv.proc.pid != os.getpid() and isinstance(srv.proc, zygote.Popen)
        assert srv.get("/status")["l1"]["capacity_bytes"] == 4 << 20
        kvd.register_model(srv.url, srv.http_url, MODEL, num_layers=1, num_kv_heads=1, head_dim=8, dtype="bfloat16")
        with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as c:
            import torch

            assert kvd.store(c, torch.ones(2, 1, 16, 8, dtype=torch.bfloat16), list(range(16)))
            assert kvd.retrieve(c, list(range(16))) is None  # the fault: every retrieve misses
    finally:
        assert srv.stop() == 0, srv.log()
    assert "kvdock serving" in srv.log()


def test_only_python_children() -> None:
    with pytest.raises(ValueError, match=r"sys\.executable"):
        zygote.Popen(["/bin/true"])


def test_off_it_is_a_plain_subprocess(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(zygote, "enabled", lambda: False)
    code = "import os, sys; print(os.getppid(), 'torch' in sys.modules)"
    r = zygote.run([PY, "-c", code], capture_output=True, text=True)
    assert r.stdout.split() == [str(os.getpid()), "False"]


def test_a_dead_zygote_fails_its_childrens_waits_and_a_new_one_takes_over() -> None:
    """Its children's exit statuses die with it: wait raises (it never hangs), and the next child
    comes from a new zygote (a preload set of this test's own: the shared zygotes are left alone)."""
    own = ("json",)
    p = zygote.Popen([PY, "-c", "import time; time.sleep(60)"], preload=own)
    first = zygote.Zygote.get(own)
    try:
        first.proc.kill()
        first.proc.wait(30)
        with pytest.raises(RuntimeError, match=f"exit status of its child {p.pid} is lost"):
            p.wait(30)
        r = zygote.run([PY, "-c", "print('again')"], preload=own, capture_output=True, text=True, timeout=60)
        assert r.stdout == "again\n" and zygote.Zygote.get(own) is not first
    finally:
        os.kill(p.pid, signal.SIGKILL)


def test_a_child_of_a_reused_pid_gets_its_own_exit_status() -> None:
    """Regression (R-ZYG): statuses were kept by pid, so a child that got the pid of an earlier,
    reaped child of the zygote was at once 'exited' with the earlier one's status (a failing child
    reported 0). The kernel hands out the pid we ask for through ns_last_pid (root, as in CI)."""
    first = zygote.Popen([PY, "-c", "pass"])
    assert first.wait(30) == 0
    for _ in range(20):
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(first.pid - 1))
        code = "import sys, time; time.sleep(0.3); print('failing', file=sys.stderr); sys.exit(1)"
        again = zygote.Popen([PY, "-c", code], stderr=subprocess.PIPE, text=True)
        _, err = again.communicate(timeout=30)
        if again.pid == first.pid:
            assert (again.returncode, err.strip()) == (1, "failing")
            return
    raise AssertionError(f"no child got pid {first.pid} again in 20 tries")


def test_umask_and_limits_are_the_test_processs_at_the_fork() -> None:
    """Regression (R-ZYG): a child had the zygote's umask and resource limits (those of the test
    process when the zygote started), not the test process's now, as an exec'd child has."""
    import resource

    zygote.run([PY, "-c", "pass"], timeout=30)  # (the zygote exists before the changes)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    old = os.umask(0o077)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    try:
        code = "import os, resource; print(oct(os.umask(0)), resource.getrlimit(resource.RLIMIT_NOFILE)[0])"
        r = zygote.run([PY, "-c", code], capture_output=True, text=True, timeout=30)
    finally:
        os.umask(old)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert r.stdout.split() == ["0o77", "256"], r.stderr


def test_a_variable_read_at_start_that_differs_gets_a_fresh_interpreter() -> None:
    """Regression (R-ZYG): PYTHONWARNINGS, OMP_NUM_THREADS ... are read when python or torch starts,
    which a forked child never does: such a child now gets a fresh python (its parent is us)."""
    code = "import os, sys; print(os.getppid(), sys.warnoptions)"
    r = zygote.run(
        [PY, "-c", code], capture_output=True, text=True, timeout=30, env=os.environ | {"PYTHONWARNINGS": "error"}
    )
    assert r.stdout.strip().split(maxsplit=1) == [str(os.getpid()), "['error']"], r.stderr
    r = zygote.run([PY, "-c", code], capture_output=True, text=True, timeout=30)
    assert r.stdout.split()[0] != str(os.getpid())  # (the same variables: forked by the zygote)


def test_what_a_fork_cannot_give_is_refused() -> None:
    for kw in ({"umask": 0o077}, {"user": 65534}, {"restore_signals": False}):
        with pytest.raises(ValueError, match="umask, user or group"):
            zygote.Popen([PY, "-c", "pass"], **kw)

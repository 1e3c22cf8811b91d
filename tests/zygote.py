"""Python child processes forked from a pre-imported zygote instead of a fresh interpreter each.

Before it does anything, a client child that imports ``kvdock.sdk`` spends ~1.5 CPU-s importing
torch, and a ``kvdock serve`` ~0.6 CPU-s importing the server (issue 25: the suite's time is CPU
on 2 cores; the suite starts ~60 such clients and ~170 servers). ``Popen`` here starts
``[sys.executable, "-c", CODE, *args]``, ``[sys.executable, SCRIPT, *args]`` or
``[sys.executable, "-m", MODULE, *args]`` as a fork of a zygote: a python of this test process
(same interpreter and sys.path) that imported one of the preload sets and nothing else, and runs
no thread. CLIENT is third-party modules only (every kvdock module is the child's own import);
SERVER is the modules ``kvdock serve`` imports at its start, none of which reads the environment
at import (kvdock reads KVDOCK_* when it is called: config, faults, sdk). The child is a real
process of its own (own pid, memory, signals, exit status, stdin/stdout/stderr), runs its code
as ``__main__`` with its own argv, environment, working directory and sys.path[0], and ends
through the interpreter's normal exit (atexit, thread joins, flushes), as python would. The
zygote freezes its objects (gc.freeze) before it forks: a collection in a child never writes to
(and so copies) the pages it shares with the zygote.

``Popen`` is a ``subprocess.Popen`` (pipes, text mode, communicate, wait/poll/kill/send_signal)
whose child the zygote forks; the zygote reaps it and reports its wait status. Use it only for
children that would import the preload anyway and whose test looks at nothing a preloaded
interpreter changes (what the child imports, its memory use, the interpreter's own start):
``test_cli_light``, the packaging tests, test_lifecycle's and test_resources' memory checks keep
plain subprocesses. Under coverage (``--cov``) or with KVDOCK_TEST_ZYGOTE=0 it is a plain
``subprocess.Popen``."""

from __future__ import annotations

import atexit
import json
import os
import resource
import select
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Any, ClassVar

CLIENT = ("torch", "numpy", "zmq", "msgspec")
SERVER = ("kvdock.cli.main", "kvdock.cli.serve", "kvdock.server.launch", "kvdock.storage.redis")
# (command, CPU seconds) of each child the zygote reaped, for tests/cpu_table.py to take
REAPED: list[tuple[str, float]] = []
_MAX = 1 << 20  # one request: argv, environment, working directory


# read by the interpreter or a preloaded library when it starts (a forked child would keep the
# zygote's): a child whose value differs from the zygote's is started as a fresh interpreter
_AT_START = ("PYTHON", "OMP_", "MKL_", "MALLOC_", "LD_", "TORCH_", "PYTORCH_", "LC_", "LANG", "GLIBC_TUNABLES")
# the process attributes a child gets from the test process at its fork, as an exec'd child would
_LIMITS = ("RLIMIT_NOFILE", "RLIMIT_AS", "RLIMIT_DATA", "RLIMIT_CORE", "RLIMIT_STACK")


def _at_start(name: str) -> bool:
    return name.startswith(_AT_START) and name != "PYTHONPATH"


@dataclass
class Child:
    """One forked child: its pid once forked, its wait status once reaped. A record per child,
    not per pid: a later child of the same pid (reused once the earlier one was reaped) never
    sees the earlier one's status."""

    command: str
    pid: int = 0
    status: int | None = None


def enabled() -> bool:
    """Whether children come from the zygote: not under coverage (whose subprocess patch starts
    a tracer per python process), nor with KVDOCK_TEST_ZYGOTE=0."""
    return (
        os.environ.get("KVDOCK_TEST_ZYGOTE", "1") != "0"
        and sys.gettrace() is None
        and not any(k.startswith("COVERAGE_PROCESS") for k in os.environ)
    )


class Zygote:
    """The test process's end: one zygote per preload set and test process, started at its
    first child."""

    _lock = threading.Lock()
    _all: ClassVar[dict[tuple[str, ...], Zygote]] = {}

    def __init__(self, preload: tuple[str, ...]) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.proc = subprocess.Popen(
            [sys.executable, __file__, str(theirs.fileno()), *preload],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            env={k: v for k, v in os.environ.items() if not k.startswith("KVDOCK_")},
        )
        theirs.close()
        self.sock = ours
        self.send_lock = threading.Lock()
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("KVDOCK_")}  # (the zygote's)
        self.requests = 0
        self.forking: dict[int, Child] = {}  # request number -> its child, until its pid is known
        self.live: dict[int, Child] = {}  # pid -> the child of that pid not reaped yet
        self.dead = False  # the zygote hung up: its children's statuses are lost
        self.changed = threading.Condition()
        threading.Thread(target=self._read, name="zygote-reader", daemon=True).start()

    @classmethod
    def get(cls, preload: tuple[str, ...]) -> Zygote:
        with cls._lock:
            one = cls._all.get(preload)
            if one is None or one.proc.poll() is not None:
                one = cls._all[preload] = Zygote(preload)
            return one

    @classmethod
    def close(cls) -> None:
        """Stop this process's zygotes (their children, if any still run, run on) and reap them."""
        with cls._lock:
            gone, cls._all = list(cls._all.values()), {}
        for one in gone:
            one.sock.shutdown(socket.SHUT_RDWR)  # (close alone: the reader's recv holds the socket open)
            one.sock.close()
            one.proc.wait(30)

    def _read(self) -> None:
        while True:
            try:
                msg = self.sock.recv(4096)
            except OSError:
                msg = b""
            with self.changed:
                if not msg:  # the zygote is gone: its children's statuses with it
                    self.dead = True
                    self.changed.notify_all()
                    return
                kind, pid, status, *cpu = msg.decode().split()
                if kind == "pid":  # ("pid CHILD REQUEST"; a pid's exit comes before its reuse's pid)
                    child = self.forking.pop(int(status))
                    child.pid = int(pid)
                    self.live[child.pid] = child
                else:
                    child = self.live.pop(int(pid))
                    child.status = int(status)
                    REAPED.append((child.command, float(cpu[0])))
                self.changed.notify_all()

    def fork(self, request: dict[str, Any], fds: list[int]) -> Child:
        argv = request["argv"]
        child = Child(" ".join([sys.executable, *argv[: 1 if argv[0] == "-c" else 3]]).replace("\n", " "))
        with self.send_lock, self.changed:
            self.requests += 1
            number = self.requests
            self.forking[number] = child
            socket.send_fds(self.sock, [json.dumps(request | {"number": number}).encode()], fds)
            self.changed.wait_for(lambda: child.pid != 0 or self.dead, timeout=120)
            if not child.pid:
                raise RuntimeError("the test zygote did not fork a child (see its output above)")
            return child

    def wait(self, child: Child, timeout: float | None) -> int | None:
        """The child's wait status once reaped (None if not within ``timeout``); RuntimeError if
        the zygote died first (no one can tell it then)."""
        with self.changed:
            self.changed.wait_for(lambda: child.status is not None or self.dead, timeout=timeout)
            if child.status is None and self.dead:
                raise RuntimeError(f"the test zygote died: the exit status of its child {child.pid} is lost")
            return child.status


class Popen(subprocess.Popen):  # type: ignore[type-arg]
    """subprocess.Popen for a python child (``args[0]`` is sys.executable) forked by the zygote
    of ``preload``; a plain subprocess.Popen where the zygote is off (``enabled``)."""

    def __init__(self, args: list[str], preload: tuple[str, ...] = CLIENT, **kw: Any) -> None:
        self._zygote = Zygote.get(preload) if enabled() else None
        env = os.environ if kw.get("env") is None else kw["env"]
        if self._zygote is not None and any(
            env.get(k) != self._zygote.env.get(k) for k in {*env, *self._zygote.env} if _at_start(k)
        ):
            self._zygote = None  # (a variable read at start differs from the zygote's: a fresh python)
        self._child: Child | None = None
        super().__init__(args, **kw)

    def _execute_child(  # type: ignore[override]
        self, args: Any, executable: Any, preexec_fn: Any, close_fds: bool, pass_fds: Any, cwd: Any, env: Any,
        startupinfo: Any, creationflags: Any, shell: bool, p2cread: int, p2cwrite: int, c2pread: int,
        c2pwrite: int, errread: int, errwrite: int, *rest: Any,
    ) -> None:  # fmt: skip
        if self._zygote is None:
            return super()._execute_child(  # type: ignore[misc]
                args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo, creationflags, shell,
                p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite, *rest,
            )  # fmt: skip
        argv = [os.fsdecode(a) for a in args]
        restore_signals, gid, gids, uid, umask, start_new_session, process_group = rest[-7:]
        if argv[0] != sys.executable or shell or preexec_fn or pass_fds or executable or start_new_session:
            raise ValueError(f"zygote.Popen runs [sys.executable, ...] only, not {argv[:2]}")
        if process_group not in (None, -1) or not restore_signals or umask != -1 or (gid, gids, uid) != (None,) * 3:
            raise ValueError("zygote.Popen: no process_group, restore_signals=False, umask, user or group")
        std = [p2cread if p2cread != -1 else 0, c2pwrite if c2pwrite != -1 else 1, errwrite if errwrite != -1 else 2]
        request = {
            "argv": argv[1:],
            "env": dict(os.environ if env is None else env),
            "cwd": os.fsdecode(cwd) if cwd is not None else os.getcwd(),
            "umask": _umask(),
            "limits": {name: resource.getrlimit(getattr(resource, name)) for name in _LIMITS},
        }
        try:
            self._child = self._zygote.fork(request, std)
            self.pid = self._child.pid
            self._child_created = True
        finally:
            self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)  # type: ignore[attr-defined]

    def _internal_poll(self, _deadstate: Any = None, *args: Any) -> int | None:  # type: ignore[override]
        if self._zygote is None:
            return super()._internal_poll(_deadstate, *args)  # type: ignore[misc, no-any-return]
        if self.returncode is None:
            try:
                assert self._child is not None
                status = self._zygote.wait(self._child, 0)
            except RuntimeError:
                if _deadstate is None:
                    raise
                status = None  # (Popen's __del__ and cleanup of a child the zygote took along)
            if status is not None:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def _wait(self, timeout: float | None) -> int:  # type: ignore[override]
        if self._zygote is None:
            return super()._wait(timeout)  # type: ignore[misc, no-any-return]
        if self.returncode is None:
            assert self._child is not None
            status = self._zygote.wait(self._child, timeout)
            if status is None:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode


def run(
    args: list[str], *, timeout: float | None = None, check: bool = False, **kw: Any
) -> subprocess.CompletedProcess[Any]:
    """subprocess.run for a python child (``Popen``; ``preload`` too): same arguments
    (capture_output, text, ...)."""
    if kw.pop("capture_output", False):
        kw["stdout"] = kw["stderr"] = subprocess.PIPE
    with Popen(args, **kw) as p:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            raise
    done = subprocess.CompletedProcess(args, p.returncode, out, err)
    if check:
        done.check_returncode()
    return done


# ---- the zygote's side (run as ``python zygote.py FD``) ----


atexit.register(Zygote.close)


def _serve(sock: socket.socket) -> dict[str, Any]:
    """Fork a child per request; report each one's pid, and its wait status once reaped. Returns
    (in a child only) its request; exits when the test process hangs up."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    while True:
        ready, _, _ = select.select([sock, wake_r], [], [])
        if wake_r in ready:
            os.read(wake_r, 4096)
            while True:
                try:
                    pid, status, usage = os.wait4(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    break
                sock.send(f"exit {pid} {status} {usage.ru_utime + usage.ru_stime}".encode())
        if sock in ready:
            msg, fds, _, _ = socket.recv_fds(sock, _MAX, 3)
            if not msg:
                os._exit(0)
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                for target, fd in enumerate(fds):
                    os.dup2(fd, target)
                for fd in {*fds, wake_r, wake_w, sock.detach()} - {0, 1, 2}:
                    os.close(fd)
                return dict(json.loads(msg))
            for fd in fds:
                os.close(fd)
            sock.send(f"pid {pid} {json.loads(msg)['number']}".encode())


def _child(request: dict[str, Any]) -> None:
    """Become ``python ARGV...`` with the request's environment and working directory."""
    import runpy
    import types

    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    os.umask(request["umask"])
    for name, limits in request["limits"].items():  # (lower than the zygote's, or equal: it is the test's)
        resource.setrlimit(getattr(resource, name), tuple(limits))
    argv: list[str] = request["argv"]
    # sys.path as python makes it: the script's place, PYTHONPATH (the child's), the rest
    if argv[0] == "-c":
        first = ""
    elif argv[0] == "-m":
        first = os.getcwd()
    else:
        first = os.path.dirname(os.path.abspath(argv[0]))
    given = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    rest = [p for p in sys.path[1:] if p not in _STARTED_WITH]
    sys.path[:] = [first, *given, *rest]
    if argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        main = types.ModuleType("__main__")
        main.__dict__["__builtins__"] = __builtins__
        sys.modules["__main__"] = main
        exec(compile(argv[1], "<string>", "exec"), main.__dict__)
    elif argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        runpy.run_path(argv[0], run_name="__main__")


def _umask() -> int:
    """This process's umask, read without setting it (os.umask would, for a moment, in every thread)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))


def _preload(names: list[str]) -> None:
    import gc
    import importlib

    for name in names:
        importlib.import_module(name)
    if threading.active_count() != 1:
        raise RuntimeError(f"importing {names} started threads: {threading.enumerate()} (a fork keeps one)")
    gc.collect()
    gc.freeze()


_STARTED_WITH = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]  # (the zygote's PYTHONPATH)

if __name__ == "__main__":
    _sock = socket.socket(fileno=int(sys.argv[1]))
    _preload(sys.argv[2:])
    _child(_serve(_sock))  # (returns in a forked child only; the interpreter then exits as python does)

"""The pool door over a real UNIX socket: a descriptor handed over with the reply, callers of
any user, and callers that send too much, nothing, or descriptors of their own."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvdock.transport import door as door_mod
from kvdock.transport import listener
from kvdock.transport.door import MAX_PER_USER, MAX_REQUEST, MAX_WAITING, Caller, PoolDoor, knock


class Served:
    """A door on an event loop in a thread; ``handled`` the requests its handler saw."""

    def __init__(self, fd: int = -1) -> None:
        self.handled: list[bytes] = []
        self.callers: list[Caller] = []
        self.fd = fd
        self.loop = asyncio.new_event_loop()
        self.door = PoolDoor()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.loop.call_soon_threadsafe(self.door.start, self.loop, self._handle)
        self.thread.start()

    def _handle(self, request: bytes, caller: Caller) -> tuple[bytes, int]:
        self.handled.append(request)
        self.callers.append(caller)
        return b"re:" + request, (self.fd,)

    def call(self, fn, *args):  # type: ignore[no-untyped-def]
        """``fn(*args)`` on the loop's thread, waited for."""
        done = threading.Event()
        out: list[object] = []
        self.loop.call_soon_threadsafe(lambda: (out.append(fn(*args)), done.set()))
        assert done.wait(5)
        return out[0]

    def close(self) -> None:
        self.call(self.door.close)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


@pytest.fixture
def memfd() -> Iterator[int]:
    fd = os.memfd_create("door-test", os.MFD_CLOEXEC)
    os.ftruncate(fd, 4096)
    os.pwrite(fd, b"door!", 0)
    yield fd
    os.close(fd)


@pytest.fixture
def served(memfd: int) -> Iterator[Served]:
    s = Served(memfd)
    yield s
    s.close()


def test_knock_gets_the_reply_and_a_descriptor_of_the_same_file(served: Served, memfd: int) -> None:
    reply, (fd,) = knock(served.door.url, b"ticket-1", 5.0)
    try:
        assert reply == b"re:ticket-1" and served.handled == [b"ticket-1"]
        assert served.callers == [Caller(os.getpid(), os.getuid())]  # who knocked, as the kernel says
        assert fd >= 0 and fd != memfd
        assert not os.get_inheritable(fd)  # close-on-exec: no program this client runs inherits the pool
        assert os.fstat(fd).st_ino == os.fstat(memfd).st_ino and os.pread(fd, 5, 0) == b"door!"
    finally:
        os.close(fd)
    served.call(served.door.check_integrity)


def test_the_door_is_reachable_by_path_but_its_directory_is_not_listable(served: Served) -> None:
    path = Path(served.door.path)
    assert path.name == listener.DOOR_SOCKET_NAME and stat.S_ISSOCK(path.stat().st_mode)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o711


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a caller as another user")
def test_another_user_may_knock_and_is_handed_the_descriptor(served: Served) -> None:
    """Tenants may run as other users: the ticket opens the door, not the caller's uid."""
    code = f"""
import os, sys
sys.path[:0] = {sys.path!r}
from kvdock.transport.door import knock  # (imported as root: nobody may not read this venv)
os.setgroups([]); os.setgid(65534); os.setuid(65534)
try:
    os.listdir({str(Path(served.door.path).parent)!r})
    print("listed")
except PermissionError:
    print("not listed")
reply, (fd,) = knock({served.door.url!r}, b"from-nobody", 5.0)
print(reply.decode(), os.pread(fd, 5, 0).decode())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["not listed", "re:from-nobody door!"]


def test_a_request_over_the_limit_is_hung_up_on_unanswered(served: Served) -> None:
    with pytest.raises(OSError, match="hung up without a reply"):
        knock(served.door.url, b"x" * (MAX_REQUEST + 1), 5.0)
    assert served.handled == []
    reply, (fd,) = knock(served.door.url, b"y" * MAX_REQUEST, 5.0)  # the limit itself is fine
    os.close(fd)
    assert reply == b"re:" + b"y" * MAX_REQUEST


def test_a_silent_caller_is_hung_up_on_at_the_deadline_and_others_are_served_meanwhile(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(door_mod, "DEADLINE_S", 0.3)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as silent:
        silent.connect(served.door.path)
        reply, (fd,) = knock(served.door.url, b"meanwhile", 5.0)
        os.close(fd)
        assert reply == b"re:meanwhile"
        silent.settimeout(5)
        started = time.monotonic()
        assert silent.recv(10) == b""  # hung up on, unanswered
        assert time.monotonic() - started < 4
    assert served.handled == [b"meanwhile"]
    served.call(served.door.check_integrity)


def _hold(served: Served, n: int) -> list[socket.socket]:
    """``n`` silent callers, once the door has taken them all in."""
    callers = []
    for _ in range(n):
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        c.connect(served.door.path)
        callers.append(c)
    deadline = time.monotonic() + 5
    while served.call(lambda: len(served.door._waiting)) < n and time.monotonic() < deadline:
        time.sleep(0.01)
    return callers


def test_past_max_per_user_a_users_callers_are_turned_away_and_other_users_are_served(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(review) One user holding connections open shut the door on every tenant."""
    callers = _hold(served, MAX_PER_USER)
    try:
        with pytest.raises(OSError):  # this user's next one: hung up on unanswered
            knock(served.door.url, b"one too many", 5.0)
        served.call(served.door.check_integrity)
        if os.geteuid() == 0:  # another user is still let in
            code = f"""
import os, sys
sys.path[:0] = {sys.path!r}
from kvdock.transport.door import knock
os.setgroups([]); os.setgid(65534); os.setuid(65534)
reply, (fd,) = knock({served.door.url!r}, b"other user", 5.0)
print(reply.decode())
"""
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
            assert out.returncode == 0 and out.stdout.strip() == "re:other user", out.stderr
    finally:
        for c in callers:
            c.close()
    assert b"one too many" not in served.handled


def test_past_max_waiting_callers_are_turned_away_at_once(served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(door_mod, "MAX_PER_USER", MAX_WAITING)
    callers = _hold(served, MAX_WAITING)
    try:
        with pytest.raises(OSError):  # hung up on (or reset) unanswered
            knock(served.door.url, b"one too many", 5.0)
        served.call(served.door.check_integrity)
    finally:
        for c in callers:
            c.close()
    # once they are gone the door answers again
    deadline = time.monotonic() + 5
    while served.call(lambda: len(served.door._waiting)) and time.monotonic() < deadline:
        time.sleep(0.01)
    reply, (fd,) = knock(served.door.url, b"again", 5.0)
    os.close(fd)
    assert reply == b"re:again" and b"one too many" not in served.handled


def test_descriptors_a_caller_sends_are_never_taken_in(served: Served) -> None:
    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    before = open_fds()
    r, w = os.pipe()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
            c.connect(served.door.path)
            socket.send_fds(c, [b"with fds"], [r, w])
            c.shutdown(socket.SHUT_WR)
            c.settimeout(5)
            data, fds, _, _ = socket.recv_fds(c, 1024, 1)
            for fd in fds:
                os.close(fd)
        assert data == b"re:with fds"
    finally:
        os.close(r)
        os.close(w)
    assert served.handled == [b"with fds"]
    served.call(lambda: None)  # (the door hangs up in the step that answered)
    assert open_fds() == before  # the door kept none of them


def test_a_dead_servers_door_directory_is_cleaned_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """A killed server's door directory goes, a live one's stays. Under a temporary directory of
    the test's own: CI once saw another test's starting server (its own cleanup_stale, in another
    xdist worker) remove the dead directory first, so this test's call found nothing."""
    root = tempfile.mkdtemp(prefix="kd")  # short: a socket path has at most 107 bytes
    monkeypatch.setattr(listener.tempfile, "gettempdir", lambda: root)
    code = f"""
import sys, time
sys.path[:0] = {sys.path!r}
from kvdock.transport.door import PoolDoor
door = PoolDoor()
print(door.path, flush=True)
time.sleep(60)
"""
    env = {**os.environ, "TMPDIR": root}
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        path = Path(proc.stdout.readline().strip())
        assert path.exists() and str(path.parent.parent) == root
        assert str(path.parent) not in listener.cleanup_stale()  # alive: left alone
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    try:
        assert listener.cleanup_stale() == [str(path.parent)]
        assert not path.parent.exists()
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_out_of_descriptors_the_door_pauses_instead_of_spinning() -> None:
    """(adversarial review) A server out of descriptors left a caller in the door's backlog, and
    the door tried to accept it again at once, forever: a core spent and the log flooded."""
    code = f"""
import asyncio, logging, os, resource, socket, sys, threading, time
sys.path[:0] = {sys.path!r}
from kvdock.transport.door import PoolDoor
warnings = []
class Count(logging.Handler):
    def emit(self, record):
        warnings.append(record)
logging.getLogger("kvdock.transport").addHandler(Count())
loop = asyncio.new_event_loop()
door = PoolDoor()
loop.call_soon(door.start, loop, lambda req, caller: (b"ok", ()))
threading.Thread(target=loop.run_forever, daemon=True).start()
time.sleep(0.2)
caller = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
held = []
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 8, hard))
try:
    while True:
        held.append(os.open("/dev/null", os.O_RDONLY))
except OSError:
    pass
caller.connect(door.path)  # waits in the backlog: the door has no descriptor to take it with
cpu = time.process_time()
time.sleep(1.2)
spent = time.process_time() - cpu
for fd in held:
    os.close(fd)
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
caller.sendall(b"knock")
caller.shutdown(socket.SHUT_WR)
caller.settimeout(5)
print(len(warnings), round(spent, 2), caller.recv(10).decode())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    warned, spent, reply = out.stdout.split()
    assert 1 <= int(warned) <= 4, out.stdout  # one try per pause, not thousands
    assert float(spent) < 0.5, out.stdout
    assert reply == "ok"  # and once descriptors are free again, the caller is answered

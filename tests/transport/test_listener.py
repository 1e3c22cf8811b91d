"""LocalListener (the server's end of the local channel) on a real UNIX socket, in an event loop
of the test, against real client sockets: garbage, floods, a reader that stops, another user,
descriptors running out."""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from kvdock.errors import ConnectionLost
from kvdock.transport import listener as lismod
from kvdock.transport.listener import LocalListener
from kvdock.transport.local import HEAD, LocalChannel, pack


def _wire(frames: list[bytes]) -> bytes:
    return b"".join(bytes(b) for b in pack(frames))


class _Loop:
    """A LocalListener served by an event loop in a thread; ``handler`` answers each message
    (by default it echoes the frames back)."""

    def __init__(self, handler: Callable[[LocalListener, int, list[memoryview]], None] | None = None) -> None:
        self.listener = LocalListener(1 << 20)
        self.seen: list[tuple[int, list[bytes]]] = []
        self._handler = handler or (lambda lis, cid, frames: lis.send(cid, frames))
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self.listener.start(self.loop, self._handle)
            self.loop.call_soon(ready.set)
            self.loop.run_forever()

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        assert ready.wait(10)

    def _handle(self, cid: int, frames: list[memoryview]) -> None:
        self.seen.append((cid, [bytes(f) for f in frames]))
        self._handler(self.listener, cid, frames)

    def call(self, fn: Callable[[], object]) -> object:
        """Run ``fn`` in the loop's thread (the listener's only thread) and return its result."""
        fut = asyncio.run_coroutine_threadsafe(self._wrap(fn), self.loop)
        return fut.result(10)

    @staticmethod
    async def _wrap(fn: Callable[[], object]) -> object:
        return fn()

    def close(self) -> None:
        self.call(self.listener.close)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


@pytest.fixture
def served() -> Iterator[_Loop]:
    lp = _Loop()
    yield lp
    lp.close()


def _ask(chan: LocalChannel, frames: list[bytes], timeout: float = 10.0) -> list[bytes]:
    chan.send(frames, time.monotonic() + timeout)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = chan.receive()
        if got:
            assert len(got) == 1
            return [bytes(f) for f in got[0]]
        time.sleep(0.001)
    raise AssertionError("no reply")


def test_the_socket_is_private_and_gone_after_close() -> None:
    lp = _Loop()
    path = lp.listener.path
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert len(os.path.basename(os.path.dirname(path))) >= 12  # mkdtemp's random part
    lp.close()
    assert not os.path.exists(os.path.dirname(path))


def test_garbage_closes_only_its_own_connection(served: _Loop) -> None:
    good = LocalChannel(served.listener.url, 5)
    assert _ask(good, [b"s1", b"hello"]) == [b"s1", b"hello"]
    bad = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    bad.connect(served.listener.path)
    bad.sendall(HEAD.pack(0xFFFFFFFF, 3) + b"garbage")
    bad.settimeout(10)
    assert bad.recv(100) == b""  # the server closed it
    assert _ask(good, [b"s2", b"still here", b"x" * 100_000]) == [b"s2", b"still here", b"x" * 100_000]
    served.call(served.listener.check_integrity)
    good.close()


def test_a_client_that_stops_reading_is_dropped_and_the_others_go_on(
    served: _Loop, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lismod, "MAX_UNSENT", 256 << 10)
    stuck = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stuck.connect(served.listener.path)
    msg = _wire([b"s", b"y" * (64 << 10)])  # each echoed back, never read
    stuck.settimeout(0.05)
    sent = 0
    with pytest.raises((BlockingIOError, TimeoutError, BrokenPipeError, ConnectionResetError)):
        for _ in range(10_000):
            stuck.sendall(msg)
            sent += 1
    assert sent >= 4  # the kernel buffers filled, then the server's unsent bytes passed the cap
    other = LocalChannel(served.listener.url, 5)
    assert _ask(other, [b"s", b"ok"]) == [b"s", b"ok"]
    served.call(served.listener.check_integrity)
    assert len(served.call(lambda: served.listener._conns)) == 1  # type: ignore[arg-type]
    other.close()
    stuck.close()


def test_a_closed_server_fails_the_client_at_once() -> None:
    lp = _Loop()
    chan = LocalChannel(lp.listener.url, 5)
    assert _ask(chan, [b"a", b"b"]) == [b"a", b"b"]
    lp.close()
    deadline = time.monotonic() + 10
    with pytest.raises(ConnectionLost):
        while time.monotonic() < deadline:
            chan.receive()
            time.sleep(0.01)
    with pytest.raises(ConnectionLost):
        chan.send([b"c", b"d"], None)


def test_frames_beyond_what_sendmsg_takes_still_make_one_message(served: _Loop) -> None:
    frames = [b"seq", b"header", *(bytes([i % 256]) * (i % 7) for i in range(2000))]
    chan = LocalChannel(served.listener.url, 5)
    assert _ask(chan, frames) == frames  # both ways: the client's send and the server's echo
    chan.close()


def test_no_more_of_a_batch_is_served_once_a_reply_dropped_its_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lismod, "MAX_UNSENT", 1000)
    lp = _Loop(lambda lis, cid, frames: lis.send(cid, [frames[0], b"r" * (16 << 20)]))  # past the cap at once
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(lp.listener.path)
        s.sendall(b"".join(_wire([b"%d" % i, b"ask"]) for i in range(50)))  # one read brings them all
        s.settimeout(10)
        while s.recv(1 << 20):  # dropped: read to the EOF
            pass
        assert [seq for _, (seq, _) in lp.seen] == [b"0"]  # the other 49 were never run
        lp.call(lp.listener.check_integrity)
    finally:
        lp.close()


def test_the_last_messages_of_a_client_that_hung_up_still_run() -> None:
    """Regression: a reply that failed with EPIPE dropped the connection and the rest of its
    batch, so a closing client's CloseClient (sent last, not awaited) never ran."""
    lp = _Loop()
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(lp.listener.path)
        s.sendall(b"".join(_wire([b"%d" % i, b"bye"]) for i in range(50)))
        s.close()  # before the server read any of it: every reply hits a closed peer
        deadline = time.monotonic() + 10
        while len(lp.seen) < 50 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [seq for _, (seq, _) in lp.seen] == [b"%d" % i for i in range(50)]
        deadline = time.monotonic() + 10
        while lp.call(lambda: len(lp.listener._conns)) and time.monotonic() < deadline:  # its EOF drops it
            time.sleep(0.01)
        assert lp.call(lambda: len(lp.listener._conns)) == 0
    finally:
        lp.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user needs root")
def test_another_user_cannot_connect(served: _Loop) -> None:
    def try_as_nobody() -> int:
        pid = os.fork()
        if pid == 0:  # the child: become nobody, then try
            code = 3
            try:
                os.setgid(65534)
                os.setuid(65534)
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    s.connect(served.listener.path)
                except PermissionError:
                    code = 0  # refused by the directory's and socket's modes
                else:
                    s.settimeout(5)
                    code = 1 if s.recv(1) == b"" else 2  # 1: the server hung up (SO_PEERCRED)
            finally:
                os._exit(code)
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])

    assert try_as_nobody() == 0
    os.chmod(os.path.dirname(served.listener.path), 0o777)  # even past the modes, the server hangs up
    os.chmod(served.listener.path, 0o777)
    assert try_as_nobody() == 1
    served.call(served.listener.check_integrity)
    assert served.seen == []


# --- found in review ---------------------------------------------------------------------------


# --- found by the adversarial test --------------------------------------------------------------


def test_unfinished_messages_are_bounded_across_connections(monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: each connection could make the server buffer a body of nearly its cap that
    never completes, 1024 times over."""
    monkeypatch.setattr(lismod, "MAX_BUFFERED", 1 << 20)
    lp = _Loop()
    try:
        socks = []
        for _ in range(3):  # 3 x 600 KiB of messages that never end: the second passes the bound
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(lp.listener.path)
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # dropped while sending
                s.sendall(HEAD.pack(900 << 10, 2) + b"\0" * (600 << 10))
            socks.append(s)
        open_ = 0
        for s in socks:
            s.settimeout(2)
            try:
                open_ += s.recv(1) != b""
            except TimeoutError:
                open_ += 1  # still open: its bytes are held
            except ConnectionResetError:
                pass  # dropped with bytes unread
        assert open_ == 1
        good = LocalChannel(lp.listener.url, 5)
        assert _ask(good, [b"s", b"fine"]) == [b"s", b"fine"]
        lp.call(lp.listener.check_integrity)
        good.close()
        for s in socks:
            s.close()
    finally:
        lp.close()


def test_a_reply_counts_as_unsent_until_the_socket_takes_it(served: _Loop) -> None:
    """Regression: a local reply was released from the server's unsent-bytes accounting as soon
    as it was copied into the connection's buffer, so clients that never read could pile up
    64 MiB per connection past the server-wide cap."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(served.listener.path)
    s.sendall(_wire([b"s", b"hi"]))
    deadline = time.monotonic() + 10
    while not served.seen and time.monotonic() < deadline:
        time.sleep(0.01)
    cid = served.seen[0][0]
    mark = served.call(lambda: served.listener.send(cid, [b"s", b"z" * (8 << 20)]))
    assert served.call(lambda: served.listener.written(cid, mark)) is False  # unread: still held
    got, s_total = 0, 8 << 20
    s.settimeout(10)
    while got < s_total:
        got += len(s.recv(1 << 20))
    deadline = time.monotonic() + 10
    while not served.call(lambda: served.listener.written(cid, mark)):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    served.call(served.listener.check_integrity)
    s.close()


def test_running_out_of_descriptors_pauses_accepting_instead_of_spinning(
    served: _Loop, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lismod, "ACCEPT_PAUSE_S", 0.3)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    clients = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(5)]  # made first
    fillers: list[int] = []
    try:
        fds = os.listdir("/proc/self/fd")
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(int(fd) for fd in fds) + 1, hard))
        with contextlib.suppress(OSError):
            while True:  # and the holes below it filled: no descriptor left
                fillers.append(os.open(os.devnull, os.O_RDONLY))
        for s in clients:  # a connect needs no new descriptor here, the server's accept does
            s.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                s.connect(served.listener.path)
        time.sleep(1.0)
    finally:
        for fd in fillers:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    failed = [r for r in caplog.records if "accept failed" in r.getMessage()]
    assert 1 <= len(failed) <= 6  # one per pause, not tens of thousands
    chan = LocalChannel(served.listener.url, 5)  # descriptors back: accepting again
    assert _ask(chan, [b"s", b"back"]) == [b"s", b"back"]
    chan.close()
    for s in clients:
        s.close()


def test_a_flood_on_one_connection_lets_the_others_in_between(served: _Loop) -> None:
    """Regression: every message of a 1 MiB read (tens of thousands) ran in one callback, so
    another client waited for all of them."""
    flood = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    flood.connect(served.listener.path)
    other = LocalChannel(served.listener.url, 30)
    n = 50_000
    sender = threading.Thread(target=flood.sendall, args=(_wire([b"f", b"x"]) * n,), daemon=True)
    sender.start()
    deadline = time.monotonic() + 10
    while len(served.seen) < 300 and time.monotonic() < deadline:  # the flood is being served
        time.sleep(0.001)
    before = len(served.seen)
    assert _ask(other, [b"o", b"me"], timeout=30) == [b"o", b"me"]
    order = [seq for _, (seq, _) in served.seen]
    # a read holds up to 1 MiB (~50,000 of these): without a cap per turn, all of it ran first
    assert order.index(b"o") - before < 8 * lismod.MAX_BATCH, (before, order.index(b"o"))
    sender.join(30)
    other.close()
    flood.close()


def test_stale_directories_go_and_nothing_else(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """cleanup_stale removes a dead server's directory only: not a live one (even with its backlog
    full: the probe never waits), not one holding a plain file of that name, not a link."""
    monkeypatch.setattr(lismod.tempfile, "gettempdir", lambda: str(tmp_path))
    dead, busy, plain, target = (tmp_path / f"kvdock-{n}" for n in ("dead", "busy", "plain", "target"))
    for d in (dead, busy, plain, target):
        d.mkdir(mode=0o700)
    gone = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    gone.bind(str(dead / "control.sock"))
    gone.close()  # bound, never listening again: what a killed server leaves
    full = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    full.bind(str(busy / "control.sock"))
    full.listen(0)  # a stalled server: nobody accepts
    waiting = []
    for _ in range(4):
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        c.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            c.connect(str(busy / "control.sock"))
        waiting.append(c)
    (plain / "control.sock").write_text("not a socket")
    (target / "control.sock").symlink_to(dead / "control.sock")
    (tmp_path / "kvdock-link").symlink_to(dead, target_is_directory=True)
    started = time.monotonic()
    removed = lismod.cleanup_stale()
    assert time.monotonic() - started < 5
    assert removed == [str(dead)] and not dead.exists()
    assert busy.exists() and plain.exists() and target.exists()
    full.close()
    for c in waiting:
        c.close()

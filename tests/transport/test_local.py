"""The local control channel: framing, and a LocalListener on a real UNIX socket (in an event
loop of the test) against real client sockets: garbage, a reader that stops, another user."""

from __future__ import annotations

import asyncio
import os
import random
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from kvdock.errors import ConnectionLost, ProtocolError
from kvdock.transport import local as localmod
from kvdock.transport.local import HEAD, FrameReader, LocalChannel, LocalListener, pack


def _wire(frames: list[bytes]) -> bytes:
    return b"".join(bytes(b) for b in pack(frames))


def test_frames_round_trip_whatever_the_cuts() -> None:
    msgs = [[b"seq1", b"header", b"x" * 1000], [b"", b"h"], [b"s" * 8, b"", b"", b"\0" * 70_000]]
    data = b"".join(_wire(f) for f in msgs)
    rng = random.Random(7)
    for _ in range(50):
        reader, got, at = FrameReader(1 << 20), [], 0
        while at < len(data):
            step = rng.randint(1, 5000)
            reader.feed(data[at : at + step])
            got += [[bytes(f) for f in m] for m in reader.messages()]
            at += step
        assert got == msgs and reader.pending == 0


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        (HEAD.pack(4, 0) + b"\0" * 4, "0 frames"),
        (HEAD.pack(8 * 70_000, 70_000), "70000 frames"),
        (HEAD.pack(2_000_000, 1), "at most 1048576 bytes"),
        (HEAD.pack(10, 1) + struct.pack("<I", 5) + b"abcdef", "do not add up"),
    ],
    ids=["no-frames", "too-many-frames", "too-long", "lengths-disagree"],
)
def test_a_message_that_cannot_be_one_is_refused(raw: bytes, match: str) -> None:
    reader = FrameReader(1 << 20)
    reader.feed(raw)
    with pytest.raises(ProtocolError, match=match):
        list(reader.messages())


def test_pack_refuses_a_message_without_frames() -> None:
    with pytest.raises(ProtocolError, match="1 to 65536 frames, not 0"):
        pack([])


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
    monkeypatch.setattr(localmod, "MAX_UNSENT", 256 << 10)
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


class _Deaf:
    """A UNIX listener that accepts one connection and reads nothing until told to."""

    def __init__(self, tmp_path) -> None:  # type: ignore[no-untyped-def]
        self.path = str(tmp_path / "deaf.sock")
        self._lis = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._lis.bind(self.path)
        self._lis.listen(1)
        self.conn: socket.socket | None = None

    def accept(self) -> socket.socket:
        self.conn, _ = self._lis.accept()
        return self.conn

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self._lis.close()


def test_a_message_cut_off_by_its_deadline_hangs_up_even_on_a_descriptor_past_1024(tmp_path) -> None:
    deaf = _Deaf(tmp_path)
    fillers = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]  # select() fails past 1024
    try:
        chan = LocalChannel(localmod.SCHEME + deaf.path, 5)
        assert chan.fileno() > 1024
        peer = deaf.accept()
        with pytest.raises(ConnectionLost, match="cut off") as info:
            chan.send([b"s", b"x" * (16 << 20)], time.monotonic() + 0.3)  # more than the socket holds
        assert info.value.sent is False  # the server drops the half it holds: it may go another way
        with pytest.raises(ConnectionLost):
            chan.send([b"s", b"again"], None)
        peer.settimeout(10)
        while peer.recv(1 << 20):  # the half message, then the hang-up
            pass
    finally:
        for fd in fillers:
            os.close(fd)
        deaf.close()


def test_frames_beyond_what_sendmsg_takes_still_make_one_message(served: _Loop) -> None:
    frames = [b"seq", b"header", *(bytes([i % 256]) * (i % 7) for i in range(2000))]
    chan = LocalChannel(served.listener.url, 5)
    assert _ask(chan, frames) == frames  # both ways: the client's send and the server's echo
    chan.close()


def test_no_more_of_a_batch_is_served_once_a_reply_dropped_its_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(localmod, "MAX_UNSENT", 1000)
    lp = _Loop(lambda lis, cid, frames: lis.send(cid, [frames[0], b"r" * 1_000_000]))  # past the cap
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


def test_a_write_to_a_closed_peer_raises_instead_of_killing_with_sigpipe(tmp_path) -> None:
    import subprocess
    import sys

    script = f"""
import signal, socket
from kvdock.errors import ConnectionLost
from kvdock.transport.local import LocalChannel
signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # what embedding programs do
lis = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
lis.bind({str(tmp_path / "gone.sock")!r}); lis.listen(1)
chan = LocalChannel("unix://" + {str(tmp_path / "gone.sock")!r}, 5)
conn, _ = lis.accept(); conn.close(); lis.close()
for _ in range(3):
    try:
        chan.send([b"s", b"x" * 100000], None)
    except ConnectionLost as e:
        assert e.sent is False
        print("lost")
        break
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, (r.returncode, r.stderr)
    assert r.stdout.strip() == "lost"


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

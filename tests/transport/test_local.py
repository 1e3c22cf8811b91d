"""The local control channel's framing, and its client end (LocalChannel) against real sockets:
a peer that stops reading, one that hung up, descriptors past 1024."""

from __future__ import annotations

import os
import random
import socket
import struct
import time

import pytest

from kvdock.errors import ConnectionLost, ProtocolError
from kvdock.transport import local as localmod
from kvdock.transport.local import HEAD, FrameReader, LocalChannel, pack


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


def test_a_peer_watch_sees_the_peer_hang_up_and_never_a_reused_descriptor(tmp_path) -> None:
    deaf = _Deaf(tmp_path)
    try:
        chan = LocalChannel(localmod.SCHEME + deaf.path, 5)
        peer = deaf.accept()
        watch = chan.watch()
        assert watch.pid == os.getpid()  # SO_PEERCRED: the process that listened
        peer.sendall(b"unread bytes")  # data waiting is not a hang-up
        assert watch.alive()
        chan.close()  # our own end closed: the watch keeps the connection open and alive
        other = os.open(os.devnull, os.O_RDONLY)  # may take the closed descriptor's number
        try:
            assert watch.alive()
        finally:
            os.close(other)
        peer.close()  # the peer hangs up
        assert not watch.alive()
        watch.close()
        watch.close()  # harmless twice
        assert not watch.alive()
    finally:
        deaf.close()


def test_a_fire_and_forget_message_on_a_broken_channel_is_not_sent_and_raises_nothing(tmp_path) -> None:
    from kvdock.protocol import messages as m
    from kvdock.transport.client import ControlClient

    deaf = _Deaf(tmp_path)
    try:
        client = ControlClient(localmod.SCHEME + deaf.path, 5)
        deaf.accept().close()  # the server drops the connection
        sent = [client.send_nowait(m.Ping()) for _ in range(3)]  # the first may still reach the socket
        assert sent[-1] is False and not client.usable
        client.close()
        assert client.send_nowait(m.Ping()) is False
    finally:
        deaf.close()

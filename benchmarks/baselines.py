"""Physical baselines for the transfer benchmark, measured in the same process and run as the SDK.

* :func:`memmove2`: glibc ``memmove`` (through ctypes, which releases the GIL) of the same
  contiguous runs the SDK copies, split between two threads, between memory that is already
  allocated and touched: the bandwidth a copy can reach on this machine with two threads.
* :class:`RawZmq`: a child process with a ROUTER socket on loopback TCP that answers a request
  with N payload bytes (sent zero-copy), or swallows N bytes and answers; the client side is a
  plain pyzmq DEALER (``recv(copy=False)``): what the inline transport could reach at best.
* :class:`RawUnix`: a child process that echoes on a UNIX stream socket, read and written by the
  two Python threads themselves: the round trip the local control channel could reach at best.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import socket
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import zmq


def chunk_runs(kv: torch.Tensor, chunks: list[torch.Tensor], chunk: int) -> list[tuple[int, int, int]]:
    """(address in ``kv``, address in the chunk buffer, bytes) of every contiguous run: one per
    plane and layer of every chunk."""
    planes, layers, _, d = kv.shape
    esz = kv.element_size()
    run = chunk * d * esz
    out = []
    for j, buf in enumerate(chunks):
        for p in range(planes):
            for layer in range(layers):
                out.append((kv[p, layer, j * chunk].data_ptr(), buf[p, layer].data_ptr(), run))
    return out


def memmove2(runs: list[tuple[int, int, int]], to_chunks: bool) -> None:
    """Copy every run (kv -> chunks, or back), half of them on a second thread."""
    half = len(runs) // 2

    def part(rs: list[tuple[int, int, int]]) -> None:
        for kv_addr, buf_addr, n in rs:
            if to_chunks:
                ctypes.memmove(buf_addr, kv_addr, n)
            else:
                ctypes.memmove(kv_addr, buf_addr, n)

    t = threading.Thread(target=part, args=(runs[half:],))
    t.start()
    part(runs[:half])
    t.join()


def _serve(url: str, nbytes: int, ready: Any) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(url)
    payload = bytearray(nbytes)
    payload[::4096] = b"x" * len(payload[::4096])  # touched once, then sent zero-copy every time
    ready.set()
    while True:
        frames = sock.recv_multipart(copy=False)
        what = frames[-1].bytes
        if what == b"stop":
            break
        sock.send_multipart([frames[0], b"ok", payload] if what == b"get" else [frames[0], b"ok"], copy=False)
    sock.close(linger=0)
    ctx.term()


class RawZmq:
    """A raw pyzmq peer in another process (see the module docstring)."""

    def __init__(self, url: str, nbytes: int) -> None:
        self.nbytes = nbytes
        ready = mp.get_context("spawn").Event()
        self._proc = mp.get_context("spawn").Process(target=_serve, args=(url, nbytes, ready), daemon=True)
        self._proc.start()
        if not ready.wait(60):
            raise RuntimeError("the raw zmq peer did not start")
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.connect(url)
        self._src = bytearray(nbytes)
        self._src[::4096] = b"y" * len(self._src[::4096])

    def get(self) -> None:
        """Ask for ``nbytes`` and receive them (into zmq's own fresh message, as a client must)."""
        self._sock.send(b"get")
        frames = self._sock.recv_multipart(copy=False)
        if len(frames[-1]) != self.nbytes:
            raise RuntimeError("raw zmq peer sent a short reply")

    def put(self) -> None:
        """Send ``nbytes`` zero-copy and wait for the answer."""
        self._sock.send_multipart([self._src, b"put"], copy=False)
        self._sock.recv_multipart()

    def ping(self) -> None:
        self._sock.send(b"ping")
        self._sock.recv_multipart()

    def close(self) -> None:
        self._sock.send(b"stop")
        self._proc.join(10)
        self._sock.close(linger=0)
        self._ctx.term()


@contextmanager
def raw_zmq(url: str, nbytes: int) -> Iterator[RawZmq]:
    peer = RawZmq(url, nbytes)
    try:
        yield peer
    finally:
        peer.close()


def _echo_unix(path: str, ready: Any) -> None:
    lis = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lis.bind(path)
    lis.listen(1)
    ready.set()
    conn, _ = lis.accept()
    while True:
        data = conn.recv(65536)
        if not data or data == b"stop":
            break
        conn.sendall(data)
    conn.close()
    lis.close()


class RawUnix:
    """A child process that echoes small messages on a UNIX socket (see the module docstring)."""

    def __init__(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="kvdock-bench-")
        path = os.path.join(self._dir, "echo.sock")
        ready = mp.get_context("spawn").Event()
        self._proc = mp.get_context("spawn").Process(target=_echo_unix, args=(path, ready), daemon=True)
        self._proc.start()
        if not ready.wait(60):
            raise RuntimeError("the raw unix peer did not start")
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.connect(path)
        self._buf = bytearray(65536)

    def ping(self) -> None:
        self._sock.sendall(b"p" * 64)
        got = 0
        while got < 64:
            got += self._sock.recv_into(self._buf)

    def close(self) -> None:
        self._sock.sendall(b"stop")
        self._proc.join(10)
        self._sock.close()
        os.unlink(os.path.join(self._dir, "echo.sock"))
        os.rmdir(self._dir)


@contextmanager
def raw_unix() -> Iterator[RawUnix]:
    peer = RawUnix()
    try:
        yield peer
    finally:
        peer.close()

"""Physical baselines for the transfer benchmark, measured in the same process and run as the SDK.

* :func:`memmove2`: glibc ``memmove`` (through ctypes, which releases the GIL) of the same
  contiguous runs the SDK copies, split between two threads, between memory that is already
  allocated and touched: the bandwidth a copy can reach on this machine with two threads.
* :class:`RawZmq`: a child process with a ROUTER socket on loopback TCP that answers a request
  with N payload bytes (sent zero-copy), or swallows N bytes and answers; the client side is a
  plain pyzmq DEALER (``recv(copy=False)``): what the inline transport could reach at best.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
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

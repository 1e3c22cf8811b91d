"""The L3 tier's fast read (kvdock.storage.resp): values received straight into the slot are
byte-exact, for many sizes and piece sizes; a reply cut short (a connection that drops, a
redis-server killed in the middle of it, one that stalls) is a fallback, a clear error or a miss,
never a slot reported as filled, and a connection whose reply was not read to its end never goes
back to the pool with its leftovers; on a Redis Cluster, reads go to the key's node and MOVED and
ASK redirections (a slot migrated under the client) still give the right bytes."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis as redis_py
import torch
from blake3 import blake3

from helpers import RedisProc
from kvdock.keys import ObjectKey
from kvdock.layout import KVGeometry
from kvdock.storage import objfile, resp
from kvdock.storage.redis import ERRORS, RedisTier, redis_key
from kvdock.storage.tier import Head
from kvdock.testing import RedisCluster
from tierworld import K as WK
from tierworld import World, payload, run

pytestmark = pytest.mark.valkey  # each test that uses the L3 on redis-server and on valkey-server (conftest)


def K(i: int, salt: str = "") -> ObjectKey:
    return ObjectKey("fast", 0, salt, bytes([i]) * 32)


def kv(geo: KVGeometry, chunk: int, seed: int) -> torch.Tensor:
    """A random canonical chunk of ``geo`` (bfloat16 bit patterns of every kind, NaNs included)."""
    g = torch.Generator().manual_seed(seed)
    n = geo.chunk_nbytes(chunk) // 2
    return torch.randint(-(2**15), 2**15, (n,), generator=g, dtype=torch.int16).view(torch.bfloat16)


def put(store: RedisTier, key: ObjectKey, t: torch.Tensor, geo: KVGeometry, chunk: int, head: Head) -> bytes:
    data = t.view(torch.uint8).numpy().tobytes()
    shape = list(geo.chunk_shape(chunk))
    block = objfile.encode_header(key, geo.dtype, shape, memoryview(data), *head[:2], identity=geo.digest(chunk))
    store.write_from(key, block, memoryview(data))
    return data


def read(store: RedisTier, key: ObjectKey, geo: KVGeometry, chunk: int) -> tuple[Head | None, torch.Tensor]:
    """read_into a slot inside a larger buffer full of 0x5A (so a write outside it shows)."""
    n = geo.chunk_nbytes(chunk)
    pool = torch.full((n + 2 * 4096,), 0x5A, dtype=torch.uint8)
    got = store.read_into(key, memoryview(pool.numpy())[4096 : 4096 + n], geo, chunk)
    assert torch.all(pool[:4096] == 0x5A) and torch.all(pool[4096 + n :] == 0x5A), "written outside the slot"
    return got, pool[4096 : 4096 + n].view(torch.bfloat16)


class PlainReads:
    """Counts the reads that fell back to redis-py's GET."""

    def __init__(self, store: RedisTier, monkeypatch: pytest.MonkeyPatch) -> None:
        self.n = 0
        plain = store._read_plain

        def counted(*args: object) -> Head | None:
            self.n += 1
            return plain(*args)  # type: ignore[arg-type]

        monkeypatch.setattr(store, "_read_plain", counted)


@pytest.fixture
def store(redis_server: RedisProc) -> Iterator[RedisTier]:
    s = RedisTier(redis_server.url, timeout=2.0)
    yield s
    s.close()


GEOS = [
    (KVGeometry(3, 2, 5, "bfloat16"), 16),  # 1920 bytes: one piece
    (KVGeometry(3, 3, 37, "bfloat16"), 113),  # 150516 bytes: an odd size
    (KVGeometry(4, 8, 128, "bfloat16"), 256),  # 4 MiB: four whole pieces
    (KVGeometry(5, 8, 128, "bfloat16"), 200),  # 4000 KiB: a partial last piece
]


@pytest.mark.parametrize("piece", [resp.PIECE, 4099, 65536])
@pytest.mark.parametrize(("geo", "chunk"), GEOS, ids=[str(g.chunk_nbytes(c)) for g, c in GEOS])
def test_fast_reads_are_byte_exact(
    store: RedisTier, geo: KVGeometry, chunk: int, piece: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(resp, "PIECE", piece)
    plain = PlainReads(store, monkeypatch)
    tensors = [kv(geo, chunk, seed) for seed in range(3)]
    for i, t in enumerate(tensors, 1):
        put(store, K(i), t, geo, chunk, Head(100 + i, 99 + i))
    for _ in range(2):
        for i, t in enumerate(tensors, 1):
            got, out = read(store, K(i), geo, chunk)
            assert got == Head(100 + i, 99 + i)
            assert torch.equal(out.view(torch.int16), t.view(torch.int16))  # bit-exact, NaNs too
    assert read(store, K(9), geo, chunk)[0] is None  # absent: a miss, answered by the fast read too
    assert plain.n == 0, "a read fell back to redis-py's GET"
    pool = store._redis.connection_pool
    assert pool._created_connections == 1 and not pool._in_use_connections  # one connection, reused
    assert store._redis.ping()  # and left clean: the next command reads its own reply


def test_the_incremental_checksum_is_the_objfile_checksum() -> None:
    data = torch.randint(0, 256, (3 * resp.PIECE + 12345,), dtype=torch.uint8).numpy().tobytes()
    h = objfile.hasher()
    for a in range(0, len(data), 4099):
        h.update(memoryview(data)[a : a + 4099])
    assert h.digest() == objfile.checksum(data) == blake3(data).digest()  # and that is plain blake3


def test_a_header_longer_than_one_block_is_read_fast(store: RedisTier, monkeypatch: pytest.MonkeyPatch) -> None:
    geo, chunk = GEOS[1]
    key = K(1, salt="s" * 5000)  # a header block of two pages
    t = kv(geo, chunk, 7)
    data = put(store, key, t, geo, chunk, Head(5, 0))
    assert store._redis.strlen(redis_key(key)) == 2 * objfile.ALIGN + len(data)
    plain = PlainReads(store, monkeypatch)
    got, out = read(store, key, geo, chunk)
    assert got == Head(5, 0) and torch.equal(out.view(torch.int16), t.view(torch.int16)) and plain.n == 0


def test_a_value_that_is_not_the_expected_object_is_left_to_the_plain_read(
    store: RedisTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another length, a bad header, a flipped payload byte: the plain read decides (a counted,
    deleted corruption), whatever the fast read had put in the slot is not reported as good."""
    geo, chunk = GEOS[2]
    plain = PlainReads(store, monkeypatch)
    data = put(store, K(1), kv(geo, chunk, 1), geo, chunk, Head(1, 0))
    value = store._redis.get(redis_key(K(1)))
    for i, bad in enumerate([value[:-1], value + b"x", b"\0" * len(value), value[:-1] + bytes([value[-1] ^ 1])]):
        store._redis.set(redis_key(K(1)), bad)
        assert read(store, K(1), geo, chunk)[0] is None
        assert store.counters.corrupted == i + 1 and plain.n == i + 1
        assert not store._redis.exists(redis_key(K(1)))
    put(store, K(1), kv(geo, chunk, 1), geo, chunk, Head(1, 0))
    got, out = read(store, K(1), geo, chunk)
    assert got == Head(1, 0) and out.view(torch.uint8).numpy().tobytes() == data and plain.n == 4


# ---------------------------------------------------------------- replies cut short


class Proxy:
    """A TCP proxy in front of a redis-server. ``cut(n, then)`` forwards ``n`` more bytes of the
    server's replies, then runs ``then`` (kill the server, wait for an event: a stall), then
    closes that connection both ways."""

    def __init__(self, upstream: int) -> None:
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.lock = threading.Lock()
        self.budget: int | None = None
        self.then: Callable[[], None] = lambda: None
        self.down_bytes = 0  # server -> client, all connections
        self.cuts = 0
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def cut(self, n: int, then: Callable[[], None] = lambda: None) -> None:
        with self.lock:
            self.budget, self.then = n, then

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(("127.0.0.1", self.upstream))
            except OSError:
                client.close()
                continue
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, down: bool) -> None:
        try:
            while data := src.recv(65536):
                then = None
                if down:
                    with self.lock:
                        if self.budget is not None and len(data) >= self.budget:
                            data, then, self.budget = data[: self.budget], self.then, None
                            self.cuts += 1
                        elif self.budget is not None:
                            self.budget -= len(data)
                        self.down_bytes += len(data)
                dst.sendall(data)
                if then is not None:
                    then()
                    break
        except OSError:
            pass
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def close(self) -> None:
        self.listener.close()


@pytest.fixture
def proxy(redis_server: RedisProc) -> Iterator[Proxy]:
    p = Proxy(redis_server.port)
    yield p
    p.close()


def reply_size(store: RedisTier, proxy: Proxy, key: ObjectKey, geo: KVGeometry, chunk: int) -> int:
    """How many bytes the server sends for one fast read of ``key`` (reading it once)."""
    before = proxy.down_bytes
    assert read(store, key, geo, chunk)[0] is not None
    return proxy.down_bytes - before


def cut_points(total: int, nbytes: int) -> list[int]:
    """Where to cut a reply of ``total`` bytes whose value ends in an ``nbytes`` payload: in the
    MULTI/QUEUED lines, in the header, at and around the payload's start, inside it, in the last
    CRLF."""
    start = total - nbytes - 2 - len(str(min(nbytes, resp.PIECE))) - 3  # the first piece's "$n\r\n"
    points = {0, 1, 4, 30, start - 100, start, start + 1, start + 2000, total // 2, total - 100, total - 2, total - 1}
    return sorted(p for p in points if 0 <= p < total)


@pytest.mark.parametrize("piece", [resp.PIECE, 1000])
def test_a_reply_cut_short_falls_back_and_the_server_answers(
    redis_server: RedisProc, proxy: Proxy, piece: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The connection drops mid-reply but the server is fine: the plain GET reads the object."""
    monkeypatch.setattr(resp, "PIECE", piece)
    geo, chunk = GEOS[1]
    store = RedisTier(proxy.url, timeout=2.0)
    plain = PlainReads(store, monkeypatch)
    try:
        t = kv(geo, chunk, 3)
        put(store, K(1), t, geo, chunk, Head(3, 0))
        total = reply_size(store, proxy, K(1), geo, chunk)
        for n, at in enumerate(cut_points(total, geo.chunk_nbytes(chunk)), 1):
            proxy.cut(at)
            got, out = read(store, K(1), geo, chunk)
            assert proxy.cuts == n, f"the cut at {at} of {total} never happened"
            assert got == Head(3, 0) and torch.equal(out.view(torch.int16), t.view(torch.int16)), at
            assert plain.n == n
        assert read(store, K(1), geo, chunk)[0] == Head(3, 0) and plain.n == n  # fast again
    finally:
        store.close()


def test_a_reply_cut_short_by_a_killed_server_is_an_error_never_a_filled_slot(
    redis_server: RedisProc, proxy: Proxy
) -> None:
    geo, chunk = GEOS[2]
    store = RedisTier(proxy.url, timeout=2.0)
    try:
        t = kv(geo, chunk, 4)
        put(store, K(1), t, geo, chunk, Head(4, 0))
        total = reply_size(store, proxy, K(1), geo, chunk)
        for at in (40, total // 3, total - 1):
            proxy.cut(at, then=redis_server.stop)
            with pytest.raises(ERRORS):
                read(store, K(1), geo, chunk)
            assert proxy.cuts and redis_server.proc is not None and redis_server.proc.poll() is not None
            proxy.cuts = 0
            redis_server.start()  # empty (no persistence)
            assert read(store, K(1), geo, chunk)[0] is None
            put(store, K(1), t, geo, chunk, Head(4, 0))
            got, out = read(store, K(1), geo, chunk)
            assert got == Head(4, 0) and torch.equal(out.view(torch.int16), t.view(torch.int16))
    finally:
        store.close()


def test_a_stalled_reply_times_out_and_its_connection_never_returns_to_the_pool(
    redis_server: RedisProc, proxy: Proxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    geo, chunk = GEOS[2]
    store = RedisTier(proxy.url, timeout=0.5)
    plain = PlainReads(store, monkeypatch)
    try:
        t = kv(geo, chunk, 5)
        put(store, K(1), t, geo, chunk, Head(5, 0))
        total = reply_size(store, proxy, K(1), geo, chunk)
        release = threading.Event()
        proxy.cut(total // 2, then=lambda: release.wait(10))
        with pytest.raises(redis_py.TimeoutError):
            read(store, K(1), geo, chunk)
        pool = store._redis.connection_pool
        assert not pool._in_use_connections
        assert all(c._sock is None for c in pool._available_connections), "a half-read connection went back"
        release.set()
        for _ in range(3):  # the rest of the old reply is never taken for a new one
            got, out = read(store, K(1), geo, chunk)
            assert got == Head(5, 0) and torch.equal(out.view(torch.int16), t.view(torch.int16))
            assert store._redis.ping() and store._redis.strlen(redis_key(K(1))) == objfile.ALIGN + t.numel() * 2
        assert plain.n == 0
    finally:
        store.close()


@pytest.mark.parametrize("kill", [False, True], ids=["dropped", "killed"])
def test_a_load_cut_short_never_leaves_a_slot_in_l1(
    tmp_path: Path, redis_server: RedisProc, proxy: Proxy, kill: bool
) -> None:
    """Through the manager: a prefetch whose L3 reply is cut mid-payload either loads the right
    bytes (the plain read after a dropped connection) or is a miss with the slot freed."""

    async def body(w: World) -> None:
        assert w.redis is not None
        w.store([WK(1)])
        await w.drain()
        w.evict_l1([WK(1)])
        proxy.cut(200 + objfile.ALIGN, then=redis_server.stop if kill else lambda: None)
        session = await w.prefetch("r", [WK(1)])
        assert proxy.cuts == 1
        if kill:
            assert session.pinned == [] and w.l1.get(WK(1)) is None and not w.redis.up()
        else:
            assert [o.key for o in session.pinned] == [WK(1)] and w.l1_bytes(WK(1)) == payload(WK(1))
        assert w.l1.reserved_count() == 0
        w.mgr.end_session("c", "r")
        w.check()

    run(tmp_path, body, check=False, redis_url=proxy.url, disk=False)


# ---------------------------------------------------------------- cluster


def test_cluster_reads_are_fast_and_follow_moved_and_ask(
    redis_cluster: RedisCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    geo, chunk = GEOS[1]
    store = RedisTier(redis_cluster.url, timeout=2.0)
    try:
        store.probe()
        assert store.up()
        plain = PlainReads(store, monkeypatch)
        tensors = {i: kv(geo, chunk, i) for i in range(1, 31)}
        for i, t in tensors.items():
            put(store, K(i), t, geo, chunk, Head(i, 0))

        def check_all() -> None:
            for i, t in tensors.items():
                got, out = read(store, K(i), geo, chunk)
                assert got == Head(i, 0) and torch.equal(out.view(torch.int16), t.view(torch.int16)), i

        check_all()
        assert plain.n == 0, "cluster reads fell back"

        client = store._redis
        rkey = redis_key(K(1))
        slot = client.keyslot(rkey)
        src = client.get_node_from_key(rkey).port
        dst = next(p for p, role in redis_cluster.roles().items() if role == "master" and p != src)
        src_id, dst_id = (redis_cluster.cli(p, "cluster", "myid").strip() for p in (src, dst))
        redis_cluster.cli(dst, "cluster", "setslot", str(slot), "importing", src_id)
        redis_cluster.cli(src, "cluster", "setslot", str(slot), "migrating", dst_id)
        redis_cluster.cli(src, "migrate", "127.0.0.1", str(dst), "", "0", "5000", "keys", rkey.decode())
        got, out = read(store, K(1), geo, chunk)  # src answers ASK: the plain read asks dst
        assert got == Head(1, 0) and torch.equal(out.view(torch.int16), tensors[1].view(torch.int16))
        assert plain.n == 1
        for p in (dst, src):
            redis_cluster.cli(p, "cluster", "setslot", str(slot), "node", dst_id)
        got, out = read(store, K(1), geo, chunk)  # src answers MOVED: the plain read follows it
        assert got == Head(1, 0) and torch.equal(out.view(torch.int16), tensors[1].view(torch.int16))
        assert plain.n == 2 and client.get_node_from_key(rkey).port == dst  # the client learnt the move
        check_all()
        assert plain.n == 2, "reads after the move fell back"
    finally:
        store.close()

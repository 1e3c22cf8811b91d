"""kvdock.storage.redis: the L3 store against a real redis-server (put/get, namespaces, corruption,
outage and reconnect, URL display)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis as redis_py

from helpers import RedisProc
from kvdock.keys import ObjectKey
from kvdock.storage import objfile
from kvdock.storage.objfile import ALIGN, CorruptObject
from kvdock.storage.redis import ERRORS, RedisStore, redis_key

DTYPE = "float32"
SHAPE = [2, 3, 16, 10]
NB = 2 * 3 * 16 * 10 * 4


def K(i: int, model: str = "tiny", rank: int = 0, salt: str = "") -> ObjectKey:
    return ObjectKey(model, rank, salt, bytes([i]) * 32)


def payload(i: int) -> bytes:
    return bytes((j * 5 + i * 17) % 256 for j in range(NB))


def put(store: RedisStore, key: ObjectKey, data: bytes | None = None) -> bytes:
    data = payload(key.chunk[0]) if data is None else data
    store.put(key, objfile.encode_header(key, DTYPE, SHAPE, memoryview(data)), memoryview(data))
    return data


def get(store: RedisStore, key: ObjectKey) -> bytes | None:
    out = memoryview(bytearray(NB))
    return bytes(out) if store.get_into(key, out, DTYPE, SHAPE) else None


@pytest.fixture
def store(redis_server: RedisProc) -> Iterator[RedisStore]:
    s = RedisStore(redis_server.url, timeout=2.0)
    yield s
    s.close()


@pytest.fixture
def raw(redis_server: RedisProc) -> Iterator[redis_py.Redis]:
    c = redis_py.Redis.from_url(redis_server.url)
    yield c
    c.close()


def test_put_then_get_is_byte_exact(store: RedisStore, raw: redis_py.Redis) -> None:
    data = put(store, K(1))
    assert get(store, K(1)) == data
    value = raw.get(redis_key(K(1)))
    assert value is not None and len(value) == ALIGN + NB and value[ALIGN:] == data
    assert raw.keys("kvdock:tmp:*") == []  # the temporary key was renamed away
    assert raw.dbsize() == 1


def test_get_into_fills_a_slice_only(store: RedisStore) -> None:
    data = put(store, K(2))
    pool = bytearray(b"\x55" * (2 * ALIGN))
    assert store.get_into(K(2), memoryview(pool)[ALIGN : ALIGN + NB], DTYPE, SHAPE)
    assert pool[ALIGN : ALIGN + NB] == data
    assert pool[:ALIGN] == b"\x55" * ALIGN and pool[ALIGN + NB :] == b"\x55" * (ALIGN - NB)


def test_put_replaces_an_older_value(store: RedisStore) -> None:
    put(store, K(1), payload(1))
    put(store, K(1), payload(99))
    assert get(store, K(1)) == payload(99)


def test_missing_key_returns_false_and_leaves_out_alone(store: RedisStore) -> None:
    out = memoryview(bytearray(b"\x07" * NB))
    assert store.get_into(K(9), out, DTYPE, SHAPE) is False
    assert bytes(out) == b"\x07" * NB


def test_key_format() -> None:
    k = redis_key(K(3))
    assert k.startswith(b"kvdock:v1:") and k.endswith(b":" + (bytes([3]) * 32).hex().encode())
    ns = k.split(b":")[2]
    assert len(ns) == 32 and int(ns, 16) >= 0
    assert redis_key(K(3)) == k  # stable


@pytest.mark.parametrize(
    "other",
    [K(1, salt="tenant-b"), K(1, model="other"), K(1, rank=1), K(2)],
    ids=["salt", "model", "rank", "chunk"],
)
def test_identities_do_not_collide(store: RedisStore, raw: redis_py.Redis, other: ObjectKey) -> None:
    mine = K(1, salt="tenant-a") if other.salt == "tenant-b" else K(1)
    data = put(store, mine)
    assert redis_key(other) != redis_key(mine)
    assert get(store, other) is None
    assert get(store, mine) == data
    assert raw.dbsize() == 1


def test_ambiguous_fields_do_not_collide() -> None:
    """The namespace separates its fields: ("a", 0, "b") and ("a\\x000", ...) style shifts differ."""
    assert redis_key(ObjectKey("ab", 0, "", b"\1" * 32)) != redis_key(ObjectKey("a", 0, "b", b"\1" * 32))
    assert redis_key(ObjectKey("m", 1, "2", b"\1" * 32)) != redis_key(ObjectKey("m", 12, "", b"\1" * 32))


@pytest.mark.parametrize(
    "mangle",
    [
        lambda v: b"garbage",
        lambda v: b"",
        lambda v: b"\0" * len(v),
        lambda v: v[:-1],
        lambda v: v + b"\0",
        lambda v: v[: ALIGN // 2],
        lambda v: v[:ALIGN] + bytes([v[ALIGN] ^ 1]) + v[ALIGN + 1 :],
        lambda v: v[:20] + b"\xff" * 10 + v[30:],
    ],
    ids=["garbage", "empty", "zeros", "short", "long", "half-header", "flipped", "header-bytes"],
)
def test_corrupted_value_raises(store: RedisStore, raw: redis_py.Redis, mangle) -> None:  # type: ignore[no-untyped-def]
    put(store, K(1))
    value = raw.get(redis_key(K(1)))
    assert value is not None
    raw.set(redis_key(K(1)), mangle(value))
    out = memoryview(bytearray(NB))
    with pytest.raises(CorruptObject):
        store.get_into(K(1), out, DTYPE, SHAPE)


def test_foreign_value_under_the_key_raises(store: RedisStore, raw: redis_py.Redis) -> None:
    """A valid object of another identity or layout stored under our key is refused."""
    data = payload(1)
    raw.set(redis_key(K(1)), objfile.encode_header(K(2), DTYPE, SHAPE, memoryview(data)) + data)
    with pytest.raises(CorruptObject, match="identity differs"):
        get(store, K(1))
    raw.set(redis_key(K(1)), objfile.encode_header(K(1), "bfloat16", SHAPE, memoryview(data)) + data)
    with pytest.raises(CorruptObject, match="layout differs"):
        get(store, K(1))
    with pytest.raises(CorruptObject, match="layout differs"):  # a slot of another size
        store.get_into(K(1), memoryview(bytearray(NB - 4)), "bfloat16", SHAPE)


def test_count_present_counts_the_leading_run(store: RedisStore) -> None:
    for i in (1, 2, 3, 5):
        put(store, K(i))
    assert store.count_present([]) == 0
    assert store.count_present([K(1), K(2), K(3), K(4), K(5)]) == 3
    assert store.count_present([K(4), K(1), K(2)]) == 0
    assert store.count_present([K(5), K(1)]) == 2
    assert store.count_present([K(1), K(1, salt="x")]) == 1
    store.delete(K(2))
    assert store.count_present([K(1), K(2), K(3)]) == 1
    assert get(store, K(2)) is None


def test_outage_marks_down_and_probe_reconnects(redis_server: RedisProc, store: RedisStore) -> None:
    data = put(store, K(1))
    assert store.up and store.available() and store.probe() and store.last_error == ""
    redis_server.stop()

    calls = [
        lambda: put(store, K(2)),
        lambda: get(store, K(1)),
        lambda: store.count_present([K(1)]),
        lambda: store.delete(K(1)),
    ]
    for call in calls:
        with pytest.raises(ERRORS) as info:
            call()
        store.failed(info.value)
        assert not store.up and not store.available()
        assert store.last_error.startswith(type(info.value).__name__ + ": ")
    assert not store.probe_due()  # backoff: 1 + 2 + 4 + 8 s
    assert store._backoff == 16.0

    store._retry_at = 0
    assert store.probe_due()
    assert store.probe() is False and not store.up
    assert store.last_error and not store.probe_due()

    redis_server.start()  # same port, empty (no persistence)
    assert store.probe() is True
    assert store.up and store.available() and store._backoff == 1.0 and not store.probe_due()
    assert get(store, K(1)) is None  # the restarted server lost the data; the store works again
    put(store, K(1), data)
    assert get(store, K(1)) == data


def test_backoff_is_capped(store: RedisStore) -> None:
    for _ in range(10):
        store.failed(ConnectionError("x"))
    assert store._backoff == 30.0
    assert store.last_error == "ConnectionError: x"


def test_display_url_hides_the_password() -> None:
    assert RedisStore("redis://:s3cret@10.0.0.1:6379/0").display_url == "redis://***@10.0.0.1:6379/0"
    assert RedisStore("rediss://user:s3cret@h:6380/2").display_url == "rediss://***@h:6380/2"
    assert RedisStore("redis://10.0.0.1:6379/0").display_url == "redis://10.0.0.1:6379/0"


def test_display_url_of_a_password_with_an_at_sign(redis_server: RedisProc, raw: redis_py.Redis) -> None:
    """redis-py parses ``redis://:p@ss@host`` as password ``p@ss`` (the host follows the last ``@``):
    a server really accepts it, and no part of the password may show."""
    raw.config_set("requirepass", "p@ss")
    store = RedisStore(f"redis://:p@ss@127.0.0.1:{redis_server.port}/0", timeout=2.0)
    try:
        assert store.probe() is True  # the URL works: this is the password
        assert "ss" not in store.display_url, store.display_url
        assert store.display_url == f"redis://***@127.0.0.1:{redis_server.port}/0"
    finally:
        store.close()

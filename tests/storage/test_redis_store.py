"""kvdock.storage.redis: the L3 tier against a real redis-server (write_from / read_into / heads,
namespaces, corruption, outage and reconnect, URL display)."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import redis as redis_py

from helpers import RedisProc
from kvdock.errors import NoRoom
from kvdock.keys import ObjectKey
from kvdock.layout import KVGeometry
from kvdock.storage import StorageTier, objfile
from kvdock.storage._coherence_lua import OBJECT_TTL_MS
from kvdock.storage._redisread import HEAD_BYTES
from kvdock.storage.objfile import ALIGN
from kvdock.storage.redis import ERRORS, RedisTier, redis_key
from kvdock.storage.tier import Head
from tierworld import legacy_header

pytestmark = pytest.mark.valkey  # each test that uses the L3 on redis-server and on valkey-server (conftest)

DTYPE = "float32"
SHAPE = [2, 3, 16, 10]
NB = 2 * 3 * 16 * 10 * 4
GEO, CHUNK = KVGeometry(3, 2, 5, DTYPE), 16  # chunks of SHAPE


def K(i: int, model: str = "tiny", rank: int = 0, salt: str = "") -> ObjectKey:
    return ObjectKey(model, rank, salt, bytes([i]) * 32)


def payload(i: int) -> bytes:
    return bytes((j * 5 + i * 17) % 256 for j in range(NB))


def H(i: int) -> Head:
    """The head put() gives object K(i): a nonzero version, its predecessor's as parent."""
    return Head(1000 + i, 1000 + i - 1 if i > 1 else 0)


def put(store: RedisTier, key: ObjectKey, data: bytes | None = None, head: Head | None = None) -> bytes:
    data = payload(key.chunk[0]) if data is None else data
    head = H(key.chunk[0]) if head is None else head
    block = objfile.encode_header(key, DTYPE, SHAPE, memoryview(data), *head[:2], identity=GEO.digest(CHUNK))
    size = store.write_from(key, block, memoryview(data))
    assert size == len(block) + len(data)
    return data


def get(store: RedisTier, key: ObjectKey, head: Head | None = None) -> bytes | None:
    """The payload of ``key``, None on a miss; the head read_into returns must be ``head`` (H(i)
    for K(i) by default): the one in the value's header."""
    out = memoryview(bytearray(NB))
    got = store.read_into(key, out, GEO, CHUNK)
    if got is None:
        return None
    assert got == (H(key.chunk[0]) if head is None else head), got
    return bytes(out)


@pytest.fixture(params=["fast", "plain"])
def store(redis_server: RedisProc, request: pytest.FixtureRequest) -> Iterator[RedisTier]:
    """The tier, reading with its fast read (the default) or with redis-py's GET only."""
    s = RedisTier(redis_server.url, timeout=2.0)
    s.fast_reads = request.param == "fast"
    yield s
    s.close()


@pytest.fixture
def raw(redis_server: RedisProc) -> Iterator[redis_py.Redis]:
    c = redis_py.Redis.from_url(redis_server.url)
    yield c
    c.close()


def test_l3_is_the_redis_tier() -> None:
    assert RedisTier.name == "l3" and issubclass(RedisTier, StorageTier)


def test_the_server_is_the_one_the_test_id_names(raw: redis_py.Redis, l3_server: str) -> None:
    """[valkey] runs on valkey-server, [redis] on redis-server (never the same server twice)."""
    info = raw.info("server")
    assert info.get("server_name", "redis") == l3_server, info
    assert ("valkey_version" in info) == (l3_server == "valkey"), info


def test_put_then_get_is_byte_exact(store: RedisTier, raw: redis_py.Redis) -> None:
    data = put(store, K(1))
    assert get(store, K(1)) == data
    value = raw.get(redis_key(K(1)))
    assert value is not None and len(value) == ALIGN + NB and value[ALIGN:] == data
    assert raw.dbsize() == 1  # one key: no temporary one left beside it
    # every object expires after OBJECT_TTL_MS (volatile-* policies evict objects only), not sooner
    # (a temporary key's TTL of 300 s once came along)
    assert OBJECT_TTL_MS // 1000 - 60 < raw.ttl(redis_key(K(1))) <= OBJECT_TTL_MS // 1000
    assert store.counters.corrupted == 0


def test_read_into_fills_a_slice_only(store: RedisTier) -> None:
    data = put(store, K(2))
    pool = bytearray(b"\x55" * (2 * ALIGN))
    assert store.read_into(K(2), memoryview(pool)[ALIGN : ALIGN + NB], GEO, CHUNK) == H(2)
    assert pool[ALIGN : ALIGN + NB] == data
    assert pool[:ALIGN] == b"\x55" * ALIGN and pool[ALIGN + NB :] == b"\x55" * (ALIGN - NB)


def test_put_replaces_an_older_value(store: RedisTier) -> None:
    put(store, K(1), payload(1))
    put(store, K(1), payload(99), Head(99, 0))
    assert get(store, K(1), Head(99, 0)) == payload(99)
    assert store.heads([K(1)]) == [Head(99, 0)]


def test_missing_key_returns_none_and_leaves_out_alone(store: RedisTier) -> None:
    out = memoryview(bytearray(b"\x07" * NB))
    assert store.read_into(K(9), out, GEO, CHUNK) is None
    assert bytes(out) == b"\x07" * NB


def test_key_format() -> None:
    k = redis_key(K(3))
    assert k.startswith(b"kvdock:v2:{") and k.endswith(b":" + (bytes([3]) * 32).hex().encode() + b"}")
    ns = k.split(b":")[2].lstrip(b"{")
    assert len(ns) == 32 and int(ns, 16) >= 0
    assert redis_key(K(3)) == k  # stable
    # the namespace covers the geometry digest the object is written under
    assert redis_key(K(3), GEO.digest(CHUNK)) != k != redis_key(K(3), GEO.digest(2 * CHUNK))
    assert redis_key(K(3), GEO.digest(CHUNK)).endswith(k.split(b":", 3)[3])  # the same chunk, slot-tagged


@pytest.mark.parametrize(
    "other",
    [K(1, salt="tenant-b"), K(1, model="other"), K(1, rank=1), K(2)],
    ids=["salt", "model", "rank", "chunk"],
)
def test_identities_do_not_collide(store: RedisTier, raw: redis_py.Redis, other: ObjectKey) -> None:
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


MANGLES = [
    lambda v: b"garbage",
    lambda v: b"",
    lambda v: b"\0" * len(v),
    lambda v: v[:-1],
    lambda v: v + b"\0",
    lambda v: v[: ALIGN // 2],
    lambda v: v[:ALIGN] + bytes([v[ALIGN] ^ 1]) + v[ALIGN + 1 :],
    lambda v: v[:20] + b"\xff" * 10 + v[30:],
]
MANGLE_IDS = ["garbage", "empty", "zeros", "short", "long", "half-header", "flipped", "header-bytes"]


@pytest.mark.parametrize("mangle", MANGLES, ids=MANGLE_IDS)
def test_corrupted_value_is_a_counted_miss(
    store: RedisTier, raw: redis_py.Redis, mangle, caplog: pytest.LogCaptureFixture
) -> None:  # type: ignore[no-untyped-def]
    # changed on purpose: read_into reports a corrupted value as absent (and counts it) instead of
    # raising CorruptObject; the plain read never touches ``out`` with it, the fast read only with
    # a value of the expected length (received into ``out`` before its checks: like a disk read,
    # a miss leaves the slot's bytes undefined, and the manager frees the slot)
    put(store, K(1))
    value = raw.get(redis_key(K(1)))
    assert value is not None
    mangled = mangle(value)
    raw.set(redis_key(K(1)), mangled)
    out = memoryview(bytearray(b"\x07" * NB))
    with caplog.at_level(logging.WARNING, "kvdock.storage.redis"):
        assert store.read_into(K(1), out, GEO, CHUNK) is None
    if not store.fast_reads or len(mangled) != len(value):
        assert bytes(out) == b"\x07" * NB
    assert store.counters.corrupted == 1
    assert "L3: corrupted value for " + K(1).chunk.hex()[:16] in caplog.text


def test_corrupted_value_is_removed_from_the_tier(store: RedisTier, raw: redis_py.Redis) -> None:
    put(store, K(1))
    put(store, K(2))
    raw.set(redis_key(K(1)), b"garbage")
    assert store.heads([K(1), K(2)]) == []  # a value without a header has no head: the run stops
    assert store.read_into(K(1), memoryview(bytearray(NB)), GEO, CHUNK) is None
    assert store.heads([K(1), K(2)]) == [], "a lookup still counts the corrupted object"
    assert not raw.exists(redis_key(K(1)))
    assert store.heads([K(2)]) == [H(2)]


def test_foreign_value_under_the_key_is_refused(
    store: RedisTier, raw: redis_py.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """A valid object of another identity or layout stored under our key is refused (a counted miss)."""
    data = payload(1)
    caplog.set_level(logging.WARNING, "kvdock.storage.redis")
    raw.set(redis_key(K(1)), objfile.encode_header(K(2), DTYPE, SHAPE, memoryview(data)) + data)
    assert get(store, K(1)) is None
    assert "(object identity differs)" in caplog.text
    raw.set(redis_key(K(1)), objfile.encode_header(K(1), "bfloat16", SHAPE, memoryview(data)) + data)
    caplog.clear()
    assert get(store, K(1)) is None
    assert "(layout differs: bfloat16[2, 3, 16, 10] vs float32[2, 3, 16, 10])" in caplog.text
    caplog.clear()
    assert raw.get(redis_key(K(1))) is None  # a refused value is deleted, so lookups stop counting it
    raw.set(redis_key(K(1)), objfile.encode_header(K(1), DTYPE, SHAPE, memoryview(data)) + data)
    other = KVGeometry(3, 2, 5, "bfloat16")  # a slot of another dtype and size
    assert store.read_into(K(1), memoryview(bytearray(other.chunk_nbytes(CHUNK))), other, CHUNK) is None
    assert "layout differs" in caplog.text
    assert store.counters.corrupted == 3


def test_heads_of_the_leading_run(store: RedisTier) -> None:
    # changed on purpose: heads() (each value's head, read from its header) replaces count_present
    for i in (1, 2, 3, 5):
        put(store, K(i))
    assert store.indexed is False  # no local index: heads() asks the server
    with pytest.raises(NotImplementedError):
        store.knows(K(1))
    assert store.heads([]) == []
    assert store.heads([K(1), K(2), K(3), K(4), K(5)]) == [H(1), H(2), H(3)]
    assert store.heads([K(4), K(1), K(2)]) == []
    assert store.heads([K(5), K(1)]) == [H(5), H(1)]
    assert store.heads([K(1), K(1, salt="x")]) == [H(1)]
    store.delete(K(2))
    assert store.heads([K(1), K(2), K(3)]) == [H(1)]
    assert get(store, K(2)) is None
    store.delete(K(2))  # absent: harmless


def test_heads_of_a_header_longer_than_the_first_read(store: RedisTier) -> None:
    """A long cache_salt makes the header longer than the bytes heads() fetches at first: it
    fetches the rest of that header, not a wrong or missing head."""
    key = K(1, salt="s" * 3 * HEAD_BYTES)
    assert len(objfile.encode_header(key, DTYPE, SHAPE, memoryview(payload(1)))) > HEAD_BYTES
    put(store, key, head=Head(31, 0))
    put(store, K(2))
    assert store.heads([key, K(2)]) == [Head(31, 0), H(2)]
    assert get(store, key, Head(31, 0)) == payload(1)


def test_a_value_whose_header_names_no_geometry_is_a_miss(store: RedisTier, raw: redis_py.Redis) -> None:
    data = payload(1)  # written before geometry digests (here also before version chains)
    raw.set(redis_key(K(1)), legacy_header(K(1), DTYPE, SHAPE, data) + data)
    assert store.heads([K(1)]) == [Head(0, 0)]
    assert get(store, K(1)) is None and not raw.exists(redis_key(K(1)))  # refused and deleted


def test_clear_never_clears_the_shared_tier(store: RedisTier, raw: redis_py.Redis) -> None:
    put(store, K(1))
    assert store.clear() == 0
    assert raw.dbsize() == 1 and get(store, K(1)) is not None


def test_outage_marks_down_and_probe_reconnects(
    redis_server: RedisProc, store: RedisTier, caplog: pytest.LogCaptureFixture
) -> None:
    data = put(store, K(1))
    store.probe()
    assert store.up() and store.last_error == "" and not store.probe_due()
    redis_server.stop()

    calls = [
        lambda: put(store, K(2)),
        lambda: get(store, K(1)),
        lambda: store.heads([K(1)]),
        lambda: store.delete(K(1)),
    ]
    with caplog.at_level(logging.WARNING, "kvdock.storage.redis"):
        for call in calls:
            with pytest.raises(ERRORS) as info:
                call()
            store.failed(info.value)
            assert not store.up()
            assert store.last_error.startswith(type(info.value).__name__ + ": ")
    assert caplog.text.count("is down") == 1  # logged on the transition only
    assert not store.probe_due()  # backoff: 1 + 2 + 4 + 8 s
    assert store._backoff == 16.0
    assert store.status() == {"kind": "redis", "up": False, "url": store.display_url, "last_error": store.last_error}

    store.probe_soon()  # the coherence poll got through: probe without waiting out the backoff
    assert store.probe_due() and store._backoff == 16.0
    store.probe()
    assert not store.up() and store.last_error and not store.probe_due()

    redis_server.start()  # same port, empty (no persistence)
    store.probe()
    assert store.up() and store._backoff == 1.0 and not store.probe_due()
    assert get(store, K(1)) is None  # the restarted server lost the data; the tier works again
    put(store, K(1), data)
    assert get(store, K(1)) == data


def test_backoff_is_capped(store: RedisTier) -> None:
    for _ in range(10):
        store.failed(ConnectionError("x"))
    assert store._backoff == 30.0
    assert store.last_error == "ConnectionError: x"


def test_display_url_hides_the_password() -> None:
    assert RedisTier("redis://:s3cret@10.0.0.1:6379/0").display_url == "redis://***@10.0.0.1:6379/0"
    assert RedisTier("rediss://user:s3cret@h:6380/2").display_url == "rediss://***@h:6380/2"
    assert RedisTier("redis://10.0.0.1:6379/0").display_url == "redis://10.0.0.1:6379/0"
    assert "s3cret" not in str(RedisTier("redis://:s3cret@10.0.0.1:6379/0").status())


def test_display_url_of_a_password_with_an_at_sign(redis_server: RedisProc, raw: redis_py.Redis) -> None:
    """redis-py parses ``redis://:p@ss@host`` as password ``p@ss`` (the host follows the last ``@``):
    a server really accepts it, and no part of the password may show."""
    raw.config_set("requirepass", "p@ss")
    store = RedisTier(f"redis://:p@ss@127.0.0.1:{redis_server.port}/0", timeout=2.0)
    try:
        store.probe()
        assert store.up() and store.last_error == ""  # the URL works: this is the password
        assert "ss" not in store.display_url, store.display_url
        assert store.display_url == f"redis://***@127.0.0.1:{redis_server.port}/0"
    finally:
        store.close()


def test_a_budget_keeps_this_servers_writes_within_max_bytes_lru_first(redis_server: RedisProc, raw) -> None:
    size = len(objfile.encode_header(K(1), DTYPE, SHAPE, memoryview(payload(1)), 1, 0)) + NB
    store = RedisTier(redis_server.url, timeout=2.0, max_bytes=3 * size)
    try:
        for i in (1, 2, 3):
            put(store, K(i))
        assert store.status()["used_bytes"] == 3 * size and store.status()["capacity_bytes"] == 3 * size
        assert get(store, K(1)) == payload(1)  # read here: K(1) is now the most recently used
        put(store, K(4))  # over budget: the least recently used of this server's writes goes
        assert get(store, K(2)) is None and raw.dbsize() == 3
        assert [get(store, K(i)) is not None for i in (1, 3, 4)] == [True, True, True]
        put(store, K(4), payload(40), Head(40, 0))  # rewriting a key takes no more room
        assert raw.dbsize() == 3 and store.status()["used_bytes"] == 3 * size
        store.delete(K(3))
        assert store.status()["used_bytes"] == 2 * size
        big = RedisTier(redis_server.url, timeout=2.0, max_bytes=size - 1)
        with pytest.raises(NoRoom, match="do not fit in the L3 budget"):
            put(big, K(9))
        assert get(store, K(9)) is None and raw.dbsize() == 2
        big.close()
    finally:
        store.close()


def test_tenants_quotas_keep_each_tenants_writes_within_its_share(redis_server: RedisProc, raw) -> None:
    from kvdock.storage.shares import Shares

    size = len(objfile.encode_header(K(1), DTYPE, SHAPE, memoryview(payload(1)), 1, 0)) + NB
    shares = Shares(lambda salt: salt or None, {"a": 2 * size, "b": size})
    store = RedisTier(redis_server.url, timeout=2.0, max_bytes=4 * size, shares=shares)
    try:
        put(store, K(1, salt="b"))
        put(store, K(2, salt=""))  # nobody's
        for i in (3, 4, 5):  # a's quota is two values: its own oldest goes
            put(store, K(i, salt="a"))
        assert [get(store, K(i, salt="a")) is not None for i in (3, 4, 5)] == [False, True, True]
        assert get(store, K(1, salt="b")) == payload(1) and get(store, K(2)) == payload(2)
        assert shares.used == {"a": 2 * size, "b": size, None: size}
        put(store, K(6, salt=""))  # the budget is full: nobody's may evict nobody's only
        assert get(store, K(2)) is None and get(store, K(1, salt="b")) == payload(1)
        with pytest.raises(NoRoom, match="quota of tenant 'b'"):
            put(store, K(7, salt="b"), payload(7) * 2)  # more than b's whole quota
        store.delete(K(4, salt="a"))
        store.check_integrity()
        assert shares.used == {"a": size, "b": size, None: size} and raw.dbsize() == 3
        put(store, K(8, salt="a"))
        store.delete(K(6))  # left: a, a, b (3 of the 4 sizes of the budget)
        with pytest.raises(NoRoom, match="held by tenants' shares"):  # (review: it wrote past max_bytes)
            put(store, K(9), payload(9) * 2)  # nobody's may not evict a's or b's
        assert store.status()["used_bytes"] == 3 * size and get(store, K(9)) is None
    finally:
        store.close()

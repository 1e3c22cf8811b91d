"""kvdock.storage.objfile: the self-describing object form (header round trip, alignment, checks)."""

from __future__ import annotations

import struct

import msgspec
import pytest

from kvdock.keys import ObjectKey
from kvdock.layout import KV_LATENT, KVGeometry
from kvdock.storage import objfile
from kvdock.storage.objfile import ALIGN, MAGIC, CorruptObject, ObjectHeader
from tierworld import legacy_header

KEY = ObjectKey("tiny", 1, "salt-a", bytes(range(32)))
DTYPE = "float32"
SHAPE = [2, 3, 16, 10]
NBYTES = 2 * 3 * 16 * 10 * 4
GEO, CHUNK = KVGeometry(3, 2, 5, DTYPE), 16  # the geometry whose chunk that is
IDENTITY = GEO.digest(CHUNK)


def payload(n: int = NBYTES, seed: int = 7) -> bytes:
    return bytes((i * 31 + seed) % 251 for i in range(n))


def encode(
    data: bytes = b"", key: ObjectKey = KEY, shape: list[int] | None = None, identity: str = IDENTITY
) -> bytes:
    data = data or payload()
    return objfile.encode_header(key, DTYPE, shape or SHAPE, memoryview(data), identity=identity)


def test_header_round_trip() -> None:
    data = payload()
    block = encode(data)
    header, offset = objfile.decode_header(block)
    assert header == ObjectHeader(
        "tiny", 1, "salt-a", bytes(range(32)), DTYPE, SHAPE, NBYTES, objfile.checksum(data), 0, 0, IDENTITY
    )
    assert header.key == KEY
    assert offset == len(block) == ALIGN
    assert objfile.header_size_hint(block[:12]) == ALIGN
    objfile.check(header, KEY, GEO, CHUNK)
    objfile.verify_payload(header, memoryview(data))


def test_header_carries_version_and_parent() -> None:
    data = payload()
    block = objfile.encode_header(KEY, DTYPE, SHAPE, memoryview(data), 2**62 + 5, 7)
    header, offset = objfile.decode_header(block)
    assert (header.version, header.parent) == (2**62 + 5, 7)
    assert header == ObjectHeader(
        "tiny", 1, "salt-a", bytes(range(32)), DTYPE, SHAPE, NBYTES, objfile.checksum(data), 2**62 + 5, 7
    )
    assert offset == len(block) == ALIGN
    end = objfile.header_end(block)  # what a reader of the head alone needs (Redis heads())
    assert end < ALIGN and objfile.decode_header(block[:end])[0] == header


def test_a_header_written_before_version_chains_decodes_but_names_no_geometry() -> None:
    data = payload()
    block = legacy_header(KEY, DTYPE, SHAPE, data)
    header, offset = objfile.decode_header(block)
    assert (header.version, header.parent, header.identity) == (0, 0, "")
    assert header.key == KEY and header.checksum == objfile.checksum(data) and offset == ALIGN
    # it cannot say which split of the heads its bytes are: never read as this geometry's
    with pytest.raises(CorruptObject, match="written under another geometry"):
        objfile.check(header, KEY, GEO, CHUNK)


def test_a_header_written_before_geometry_digests_decodes_and_is_refused() -> None:
    data = payload()
    block = objfile.encode_header(KEY, DTYPE, SHAPE, memoryview(data), 5, 3)  # no identity: ""
    header, _ = objfile.decode_header(block)
    assert (header.version, header.parent, header.identity) == (5, 3, "")
    with pytest.raises(CorruptObject, match=r"written under another geometry \(none recorded, not [0-9a-f]{32}\)"):
        objfile.check(header, KEY, GEO, CHUNK)


@pytest.mark.parametrize(
    "geometry",
    [
        KVGeometry(3, 1, 10, DTYPE),  # [2, 3, 16, 10]: the same chunk, another split of the heads
        KVGeometry(3, 1, 5, DTYPE, world_size=2),  # heads 1 of 2 per shard: [2, 3, 16, 5] x 2 shards
        KVGeometry(3, 2, 5, DTYPE, world_size=2),  # 2 shards of 2 heads: shard 0 has other heads than GEO
    ],
)
def test_a_chunk_of_the_same_layout_but_another_geometry_is_refused(geometry: KVGeometry) -> None:
    shape = list(geometry.chunk_shape(CHUNK))
    data = payload(geometry.chunk_nbytes(CHUNK))
    block = objfile.encode_header(KEY, DTYPE, shape, memoryview(data), identity=geometry.digest(CHUNK))
    header, _ = objfile.decode_header(block)
    objfile.check(header, KEY, geometry, CHUNK)  # its own geometry reads it
    if shape == SHAPE:
        with pytest.raises(CorruptObject, match="written under another geometry"):
            objfile.check(header, KEY, GEO, CHUNK)
    with pytest.raises(CorruptObject):
        objfile.check(header, KEY, geometry, CHUNK * 2)  # nor does another chunk size


def test_block_is_prefix_body_and_zero_padding() -> None:
    block = encode()
    magic, n = struct.unpack_from("<8sI", block, 0)
    assert magic == MAGIC
    body = msgspec.msgpack.decode(block[12 : 12 + n], type=ObjectHeader)
    assert body.key == KEY
    assert block[12 + n :] == b"\0" * (len(block) - 12 - n)


@pytest.mark.parametrize("model_len", [0, 100, ALIGN - 200, ALIGN, 3 * ALIGN + 5])
def test_payload_starts_on_a_4k_boundary(model_len: int) -> None:
    """Whatever the header's size, the padded block (so the payload offset) is a multiple of 4096."""
    key = ObjectKey("m" * model_len, 0, "", b"\x01" * 32)
    block = encode(key=key)
    header, offset = objfile.decode_header(block)
    assert header.key == key
    assert offset == len(block)
    _, n = struct.unpack_from("<8sI", block, 0)
    assert n > model_len
    assert offset % ALIGN == 0 and offset - ALIGN < 12 + n <= offset  # the smallest page multiple
    assert objfile.header_size_hint(block[:12]) == offset
    # the hint from the first page alone, as the disk reader does it
    assert objfile.header_size_hint(block[:ALIGN]) == offset


def test_checksum_mismatch_raises() -> None:
    data = bytearray(payload())
    header, _ = objfile.decode_header(encode(bytes(data)))
    data[NBYTES // 2] ^= 0x01
    with pytest.raises(CorruptObject, match="checksum mismatch"):
        objfile.verify_payload(header, memoryview(data))
    with pytest.raises(CorruptObject, match="checksum mismatch"):
        objfile.verify_payload(header, memoryview(bytes(data[:-1])))


def test_checksum_is_blake3_of_the_payload() -> None:
    from blake3 import blake3

    data = payload()
    assert objfile.checksum(data) == blake3(data).digest()
    assert objfile.checksum(memoryview(data)) == objfile.checksum(data)
    assert len(objfile.checksum(b"")) == 32


@pytest.mark.parametrize("bad", [b"KVDOCKO2", b"\0" * 8, b"kvdocko1"])
def test_bad_magic(bad: bytes) -> None:
    block = bad + encode()[8:]
    with pytest.raises(CorruptObject, match="bad magic"):
        objfile.decode_header(block)
    with pytest.raises(CorruptObject, match="bad magic"):
        objfile.header_size_hint(block)


@pytest.mark.parametrize("n", [0, 1, 8, 11])
def test_too_short_for_a_header(n: int) -> None:
    block = encode()[:n]
    with pytest.raises(CorruptObject, match="too short"):
        objfile.decode_header(block)
    with pytest.raises(CorruptObject, match="too short"):
        objfile.header_size_hint(block)


def test_truncated_header_body() -> None:
    block = encode()
    _, n = struct.unpack_from("<8sI", block, 0)
    for cut in (12, 13, 12 + n - 1):
        with pytest.raises(CorruptObject, match="header truncated"):
            objfile.decode_header(block[:cut])
    header, _ = objfile.decode_header(block[: 12 + n])  # the body alone is enough to parse
    assert header.key == KEY


def test_garbage_header_body() -> None:
    body = b"\xc1" * 20  # 0xc1 is never valid msgpack
    block = struct.pack("<8sI", MAGIC, len(body)) + body
    with pytest.raises(CorruptObject, match="bad header"):
        objfile.decode_header(block)
    # a valid msgpack value of the wrong shape is refused too
    body = msgspec.msgpack.encode(["tiny", 1])
    with pytest.raises(CorruptObject, match="bad header"):
        objfile.decode_header(struct.pack("<8sI", MAGIC, len(body)) + body)


@pytest.mark.parametrize(
    "other",
    [
        ObjectKey("other", 1, "salt-a", bytes(range(32))),
        ObjectKey("tiny", 0, "salt-a", bytes(range(32))),
        ObjectKey("tiny", 1, "salt-b", bytes(range(32))),
        ObjectKey("tiny", 1, "salt-a", bytes(range(1, 33))),
    ],
)
def test_foreign_identity(other: ObjectKey) -> None:
    header, _ = objfile.decode_header(encode())
    with pytest.raises(CorruptObject, match="identity differs"):
        objfile.check(header, other, GEO, CHUNK)


@pytest.mark.parametrize(
    ("geometry", "chunk"),
    [
        (KVGeometry(3, 2, 5, "bfloat16"), CHUNK),  # another dtype
        (KVGeometry(3, 1, 5, DTYPE), 32),  # [2, 3, 32, 5]: the same size
        (KVGeometry(3, 2, 8, DTYPE), 10),  # [2, 3, 10, 16]: the same size
        (KVGeometry(6, 1, 10, DTYPE, kv_kind=KV_LATENT), CHUNK),  # [1, 6, 16, 10]: the same size
        (GEO, 8),
    ],
)
def test_different_layout(geometry: KVGeometry, chunk: int) -> None:
    header, _ = objfile.decode_header(encode())
    with pytest.raises(CorruptObject, match="layout differs"):
        objfile.check(header, KEY, geometry, chunk)


@pytest.mark.parametrize(("shape", "nbytes"), [([*SHAPE, 1], NBYTES), (SHAPE, NBYTES - 4)])
def test_a_header_of_another_shape_or_size_differs(shape: list[int], nbytes: int) -> None:
    header, _ = objfile.decode_header(encode(payload(nbytes), shape=shape))
    with pytest.raises(CorruptObject, match="layout differs"):
        objfile.check(header, KEY, GEO, CHUNK)


def test_corrupt_object_is_a_value_error() -> None:
    assert issubclass(CorruptObject, ValueError)

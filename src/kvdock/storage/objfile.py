"""The self-describing byte form of one object, shared by the disk (L2) and Redis (L3) tiers.

    [8s magic "KVDOCKO1"][u32 header length][msgpack ObjectHeader][zero padding to 4 KiB][payload]

The payload starts on a 4 KiB boundary (page-aligned reads straight into an L1 slot). The header
names the object (model, rank, salt, chunk hash), its layout (dtype and canonical chunk shape), the
geometry it was written under (``identity``: :meth:`kvdock.layout.KVGeometry.digest`, which also
covers the KV heads' split and the chunk size) and the blake3 checksum of the payload, so a reader
can refuse anything torn, corrupted or foreign: an object of another geometry of the same model
name (registered again after a lost registry, or by another server sharing the tier) is a miss,
never bytes. Headers written before the identity decode with ``identity`` "" and are refused.
"""

from __future__ import annotations

import struct
from typing import Any

import msgspec
from blake3 import blake3

from kvdock.errors import CorruptObject
from kvdock.keys import ObjectKey
from kvdock.layout import KVGeometry

__all__ = ["CorruptObject"]  # re-exported for the tiers' readers

MAGIC = b"KVDOCKO1"
ALIGN = 4096
_PREFIX = struct.Struct("<8sI")


class ObjectHeader(msgspec.Struct, frozen=True, array_like=True):
    model: str
    rank: int
    salt: str
    chunk: bytes
    dtype: str
    shape: list[int]
    nbytes: int
    checksum: bytes
    version: int = 0  # this version of the object (unique, random)
    parent: int = 0  # the version of the chunk before it in its prefix when it was stored (0: first)
    identity: str = ""  # the geometry digest it was written under ("": written before it existed)
    # an overwrite's version: its second stream entry (E2, "ms-seq", storage.coherence), "" for a
    # plain store's (a holder serves it only while it keeps that overwrite's floor alive in L3)
    overwrite: str = ""

    @property
    def key(self) -> ObjectKey:
        return ObjectKey(self.model, self.rank, self.salt, self.chunk)


def hasher() -> Any:
    """The payload's checksum, fed piece by piece (a blake3 digest does not depend on how its
    input is split: the L3 fast read hashes each piece as it lands)."""
    return blake3(max_threads=blake3.AUTO)


def checksum(data: memoryview | bytes) -> bytes:
    h = hasher()
    h.update(data)
    return bytes(h.digest())


def encode_header(
    key: ObjectKey,
    dtype: str,
    shape: list[int],
    payload: memoryview,
    version: int = 0,
    parent: int = 0,
    identity: str = "",
    overwrite: str = "",
) -> bytes:
    """The padded header block for ``payload`` (computes its checksum); ``identity``: the digest
    of the geometry it holds a chunk of (``geometry.digest(chunk_size)``; :func:`check` refuses
    any other); ``overwrite``: an overwrite's E2 ("" for a plain store's version)."""
    digest = checksum(payload)
    k = key
    n, v, p = len(payload), version, parent
    return _block(ObjectHeader(k.model, k.rank, k.salt, k.chunk, dtype, shape, n, digest, v, p, identity, overwrite))


def mark(version: int, parent: int, identity: str, overwrite: str) -> bytes:
    """How a header of this version ends: the msgpack body of every header written with these
    fields ends with exactly these bytes (its last four fields, encoded as msgpack encodes them in
    the array). With the key, the random ``version`` names one stored version: the fleet's KEEP
    script compares it with the end of the header in L3 (storage.coherence) without hashing the
    payload again."""
    enc = msgspec.msgpack.encode
    return enc(version) + enc(parent) + enc(identity) + enc(overwrite)


def header_block_size(key: ObjectKey, dtype: str, shape: list[int], nbytes: int, identity: str = "") -> int:
    """The size encode_header will produce for such an object (the checksum has a fixed size)."""
    k = key
    return len(_block(ObjectHeader(k.model, k.rank, k.salt, k.chunk, dtype, shape, nbytes, bytes(32), 0, 0, identity)))


def _block(header: ObjectHeader) -> bytes:
    body = msgspec.msgpack.encode(header)
    raw = _PREFIX.pack(MAGIC, len(body)) + body
    return raw + b"\0" * (-len(raw) % ALIGN)


def _body_end(block: bytes | memoryview) -> int:
    """Where the msgpack header body ends, from the fixed prefix (CorruptObject if not ours)."""
    if len(block) < _PREFIX.size:
        raise CorruptObject("too short for a header")
    magic, n = _PREFIX.unpack_from(block, 0)
    if magic != MAGIC:
        raise CorruptObject("bad magic")
    return int(_PREFIX.size + n)


def header_end(first: bytes | memoryview) -> int:
    """How many leading bytes :func:`decode_header` needs (the header without its padding)."""
    return _body_end(first)


def header_size_hint(first: bytes | memoryview) -> int:
    """How many bytes the padded header block spans, from its first 12 bytes."""
    end = _body_end(first)
    return end + (-end % ALIGN)


def decode_header(block: bytes | memoryview) -> tuple[ObjectHeader, int]:
    """Parse a header block; returns the header and the payload's offset. CorruptObject if invalid.

    ``block`` must hold at least the whole padded header (read ``header_size_hint`` first)."""
    end = _body_end(block)
    if len(block) < end:
        raise CorruptObject("header truncated")
    try:
        header = msgspec.msgpack.decode(bytes(block[_PREFIX.size : end]), type=ObjectHeader)
    except msgspec.DecodeError as e:
        raise CorruptObject(f"bad header: {e}") from None
    return header, end + (-end % ALIGN)


def check(header: ObjectHeader, key: ObjectKey, geometry: KVGeometry, chunk_size: int) -> None:
    """CorruptObject unless ``header`` describes exactly this object: one canonical chunk of
    ``chunk_size`` tokens of ``geometry``, written under that geometry (its digest; an empty one,
    from before digests, is refused too)."""
    if header.key != key:
        raise CorruptObject("object identity differs")
    dtype, shape, nbytes = geometry.dtype, list(geometry.chunk_shape(chunk_size)), geometry.chunk_nbytes(chunk_size)
    if header.dtype != dtype or list(header.shape) != shape or header.nbytes != nbytes:
        raise CorruptObject(f"layout differs: {header.dtype}{header.shape} vs {dtype}{shape}")
    identity = geometry.digest(chunk_size)  # the same shape may hold another split of the heads, ...
    if header.identity != identity:
        raise CorruptObject(f"written under another geometry ({header.identity or 'none recorded'}, not {identity})")


def verify_payload(header: ObjectHeader, payload: memoryview) -> None:
    if checksum(payload) != header.checksum:
        raise CorruptObject("checksum mismatch")

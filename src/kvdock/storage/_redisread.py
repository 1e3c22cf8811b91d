"""The L3 tier's reads (storage.redis): the fast read (a value received straight into an L1 slot),
the plain checked GET, and the heads of leading keys."""

from __future__ import annotations

import enum
from typing import Any

from kvdock.errors import CorruptObject
from kvdock.keys import ObjectKey
from kvdock.layout import KVGeometry
from kvdock.storage import objfile, resp
from kvdock.storage._redisclient import ERRORS
from kvdock.storage.tier import Head

__all__ = ["FALLBACK", "HEAD_BYTES", "Fallback", "read_fast", "read_heads", "read_plain"]


class Fallback(enum.Enum):
    FALLBACK = 0


FALLBACK = Fallback.FALLBACK  # what a fast read answers when a plain GET must decide


def read_fast(
    client: Any, cluster: bool, rkey: bytes, key: ObjectKey, out: memoryview, geometry: KVGeometry, chunk_size: int
) -> Head | Fallback | None:
    """Receive the value of ``rkey`` straight into ``out`` (:func:`resp.receive`, on a connection
    of the pool of the key's node, hashing it as it lands) and verify it as the plain read does:
    its head, None if absent, FALLBACK where the plain read must decide (a value of another size
    or failing a check, which it deletes if it really is corrupt; a MOVED or ASK redirection,
    which it follows; a connection that failed, after which it reconnects and refreshes a
    cluster's topology). ``out`` holds undefined bytes unless a head is returned (the manager
    then frees the slot)."""
    nbytes = geometry.chunk_nbytes(chunk_size)
    if out.nbytes != nbytes or out.itemsize != 1 or not out.c_contiguous:
        return FALLBACK
    try:
        node = client.get_redis_connection(client.get_node_from_key(rkey)) if cluster else client
    except ERRORS:  # no node known for the slot (a cluster being re-sharded or failing over)
        return FALLBACK
    pool = node.connection_pool
    if getattr(pool, "cache", None) is not None:  # client-side caching: the pool's own reads only
        return FALLBACK
    shape = list(geometry.chunk_shape(chunk_size))
    identity = geometry.digest(chunk_size)
    head = memoryview(bytearray(objfile.header_block_size(key, geometry.dtype, shape, nbytes, identity)))
    digest = objfile.hasher()
    present = resp.receive(pool, rkey, head, out, digest.update)
    if present is None:
        return FALLBACK
    if not present:
        return None
    try:
        header, offset = objfile.decode_header(head)
        objfile.check(header, key, geometry, chunk_size)
        if offset != len(head) or header.nbytes != nbytes:
            raise CorruptObject("value length does not match its header")
        if digest.digest() != header.checksum:
            raise CorruptObject("checksum mismatch")
    except CorruptObject:
        return FALLBACK
    return Head(header.version, header.parent, header.overwrite)


def read_plain(
    client: Any, key: ObjectKey, rkey: bytes, out: memoryview, geometry: KVGeometry, chunk_size: int
) -> Head | CorruptObject | None:
    """One GET through redis-py (its parser makes the value a bytes object), checked, then copied
    into ``out``: its head, None if absent, the CorruptObject that a torn, foreign or corrupted
    value raised (the tier deletes it)."""
    value = client.get(rkey)
    if value is None:
        return None
    try:
        view = memoryview(value)
        header, offset = objfile.decode_header(view[: objfile.header_size_hint(view)])
        objfile.check(header, key, geometry, chunk_size)
        if len(view) != offset + header.nbytes:
            raise CorruptObject("value length does not match its header")
        payload = view[offset:]
        objfile.verify_payload(header, payload)
    except CorruptObject as e:
        return e
    out[:] = payload
    return Head(header.version, header.parent, header.overwrite)


HEAD_BYTES = 512  # enough for the header of any object (fetched whole if it is longer)


def read_heads(client: Any, rkeys: list[bytes]) -> list[Head]:
    """The heads of the leading ``rkeys`` present (shorter at the first absent or corrupted: a read
    finds and deletes that one): one pipelined round trip reading the first bytes of each value."""
    if not rkeys:
        return []
    pipe = client.pipeline(transaction=False)
    for rkey in rkeys:
        pipe.getrange(rkey, 0, HEAD_BYTES - 1)
    out = []
    for rkey, first in zip(rkeys, pipe.execute(), strict=True):
        if not first:
            break
        try:
            end = objfile.header_end(first)
            block = first if end <= len(first) else client.getrange(rkey, 0, end - 1)
            header, _ = objfile.decode_header(block)
        except CorruptObject:
            break
        out.append(Head(header.version, header.parent))
    return out

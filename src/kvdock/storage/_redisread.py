"""The L3 tier's fast read (storage.redis): a value received straight into an L1 slot."""

from __future__ import annotations

import enum
from typing import Any

from kvdock.errors import CorruptObject
from kvdock.keys import ObjectKey
from kvdock.layout import KVGeometry
from kvdock.storage import objfile, resp
from kvdock.storage._redisclient import ERRORS
from kvdock.storage.tier import Head

__all__ = ["FALLBACK", "Fallback", "read_fast"]


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

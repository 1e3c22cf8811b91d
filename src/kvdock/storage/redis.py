"""L3: objects as Redis/Valkey values, shared by kvdock servers on several hosts.

Keys are ``kvdock:v1:<namespace>:<chunk hash hex>`` where the namespace is a hash of (model,
rank, cache_salt), so salts and models never see each other's objects. Values use the same
self-describing form as disk files (:mod:`kvdock.storage.objfile`), checked on every read.

All methods that talk to Redis run in worker threads. A failure marks the tier down (logged
once); while it is down, callers skip it, and :meth:`probe` (driven by the server) reconnects
with exponential backoff.
"""

from __future__ import annotations

import logging
import secrets
import time
from typing import Any

import redis as redis_py
from blake3 import blake3

from kvdock.keys import ObjectKey
from kvdock.storage import objfile

log = logging.getLogger(__name__)

BACKOFF_MAX = 30.0
ERRORS = (redis_py.RedisError, OSError)


def redis_key(key: ObjectKey) -> bytes:
    ns = blake3(key.model.encode() + b"\0" + str(key.rank).encode() + b"\0" + key.salt.encode()).hexdigest()[:32]
    return f"kvdock:v1:{ns}:{key.chunk.hex()}".encode()


class RedisStore:
    def __init__(self, url: str, timeout: float = 5.0) -> None:
        self.url = url
        self._client: Any = redis_py.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
        self.up = True
        self.last_error = ""
        self._backoff = 1.0
        self._retry_at = 0.0

    @property
    def display_url(self) -> str:
        """The URL without its password."""
        if "@" in self.url:
            scheme, rest = self.url.split("://", 1)
            return f"{scheme}://***@{rest.rsplit('@', 1)[1]}"
        return self.url

    def available(self) -> bool:
        return self.up

    def failed(self, err: BaseException) -> None:
        """Mark the tier down after an error (logs on the transition only)."""
        self.last_error = f"{type(err).__name__}: {err}"
        if self.up:
            log.warning(
                "L3 %s is down (%s); serving from L1/L2, retrying with backoff", self.display_url, self.last_error
            )
        self.up = False
        self._retry_at = time.monotonic() + self._backoff
        self._backoff = min(self._backoff * 2, BACKOFF_MAX)

    def probe_due(self) -> bool:
        return not self.up and time.monotonic() >= self._retry_at

    def probe(self) -> bool:
        """PING; on success mark the tier up again (worker thread)."""
        try:
            self._client.ping()
        except ERRORS as e:
            self.failed(e)
            return False
        if not self.up:
            log.warning("L3 %s is back", self.display_url)
        self.up = True
        self._backoff = 1.0
        return True

    def put(self, key: ObjectKey, header: bytes, payload: memoryview) -> None:
        """Store atomically: build the value under a temporary key, then RENAME (worker thread)."""
        tmp = b"kvdock:tmp:" + secrets.token_hex(8).encode()
        pipe = self._client.pipeline(transaction=True)
        pipe.set(tmp, header)
        pipe.append(tmp, payload)
        pipe.rename(tmp, redis_key(key))
        pipe.execute()

    def get_into(self, key: ObjectKey, out: memoryview, dtype: str, shape: list[int]) -> bool:
        """Copy the object's payload into ``out``; False if absent. CorruptObject if the value is
        torn, foreign or fails its checksum (worker thread)."""
        value = self._client.get(redis_key(key))
        if value is None:
            return False
        view = memoryview(value)
        header, offset = objfile.decode_header(view[: objfile.header_size_hint(view)])
        objfile.check(header, key, dtype, shape, len(out))
        if len(view) != offset + header.nbytes:
            raise objfile.CorruptObject("value length does not match its header")
        payload = view[offset:]
        objfile.verify_payload(header, payload)
        out[:] = payload
        return True

    def count_present(self, keys: list[ObjectKey]) -> int:
        """How many leading ``keys`` exist (worker thread)."""
        if not keys:
            return 0
        pipe = self._client.pipeline(transaction=False)
        for k in keys:
            pipe.exists(redis_key(k))
        n = 0
        for present in pipe.execute():
            if not present:
                break
            n += 1
        return n

    def delete(self, key: ObjectKey) -> None:
        self._client.delete(redis_key(key))

    def close(self) -> None:
        self._client.close()

"""One connector role's connection to kvdock, built so that kvdock can never fail or stall vLLM.

A :class:`Link` connects lazily, registers the engine's layout when the server does not know the
model -- at start, and again at once when a call finds that a restarted server forgot it (both
roles have the layout: the scheduler gets it from the workers through vLLM's handshake metadata,
so whichever talks to the server first registers it) -- and turns every kvdock
failure into a *miss*: :meth:`Link.run` returns the caller's miss value, logs once, and keeps the
link down for ``retry_s`` so that a dead server costs at most one ``timeout`` per ``retry_s``,
never one per request. Time comes from an injected clock. :attr:`Link.slow` says that the last
failure took most of a ``timeout`` (a hung or stopped server, not a refused connection): the
scheduler then answers requests a miss at once rather than holding them for its next try.

A link with the engine's model fingerprint never serves another model's KV: when kvdock holds the
name with another fingerprint (or refuses the engine's registration: another geometry, another
fingerprint, also on another server sharing its L3), the link is *refused* for good
(:attr:`Link.refused` says why; every call is a miss and the worker turns kvdock off). A name
registered without a fingerprint gets the engine's (the worker registers again).

Thread: a Link is used by one thread at a time (the scheduler's lookup thread, or the worker's
model-runner thread).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import TypeVar

import kvdock.sdk as kvd
from kvdock.errors import (
    KVCacheSDKError,
    LeaseExpiredError,
    PoolFullError,
    ServerError,
    StoreConflictError,
    UnknownModelError,
)
from kvdock.integrations.vllm.config import ConnectorConfig
from kvdock.layout import KVGeometry
from kvdock.protocol.messages import ModelLayout

log = logging.getLogger("kvdock.vllm")
T = TypeVar("T")

SLOW_SHARE = 0.5  # a failure that took this share of kvdock.timeout: the server hangs (Link.slow)
# failures that say nothing about the server's health: the call is a miss, the link stays up
_TRANSIENT = (LeaseExpiredError, PoolFullError, StoreConflictError)


class Link:
    def __init__(
        self,
        cfg: ConnectorConfig,
        layout: ModelLayout | None = None,
        clock: Callable[[], float] = time.monotonic,
        rank_for: Callable[[KVGeometry], int | None] | None = None,
        fingerprint: str = "",
    ) -> None:
        self.cfg = cfg
        self.fingerprint = fingerprint  # the engine's model's ("": not checked)
        self.refused = ""  # why kvdock holds the name as another model: the link stays down for good
        self.layout = layout  # registered when the server does not know the model (workers only)
        # the SDK context's kv_rank, from the geometry the server stores the model in (None: the
        # whole model's context, without asking)
        self.rank_for = rank_for
        self._clock = clock
        self._ctx: kvd.KVCacheContext | None = None
        self._down_until = float("-inf")
        self.failures = 0
        # the last call failed after at least SLOW_SHARE of a timeout (the server hangs); cleared
        # by the next call that succeeds. Read by other threads (a plain bool)
        self.slow = False

    @property
    def up(self) -> bool:
        return self._ctx is not None

    def context(self) -> kvd.KVCacheContext | None:
        """The connected SDK context, connecting (and registering) first if the retry time has
        come; None while kvdock is down."""
        if self._ctx is not None:
            return self._ctx
        if self.refused or self._clock() < self._down_until:
            return None
        try:
            self._ctx = self._connect()
        except KVCacheSDKError as e:
            self._down(f"cannot connect to kvdock at {self.cfg.url}: {e}")
        return self._ctx

    def _connect(self) -> kvd.KVCacheContext:
        try:
            ctx = self._open()
        except UnknownModelError:
            if self.layout is None:
                raise
            self._register()
            ctx = self._open()
        else:
            if self.layout is not None and self.fingerprint and not ctx.layout.fingerprint:
                ctx.close(wait_s=0.0)  # registered without one (an SDK user, ...): record the engine's
                self._register()
                ctx = self._open()
        theirs = ctx.layout.fingerprint
        if self.fingerprint and theirs and theirs != self.fingerprint:
            ctx.close(wait_s=0.0)
            self._refuse(
                f"kvdock holds {self.cfg.model_name!r} as another model of the same geometry: fingerprint {theirs} "
                f"(this engine's: {self.fingerprint}); use another kvdock.model_name"
            )
        return ctx

    def _register(self) -> None:
        cfg = self.cfg
        assert self.layout is not None
        try:
            kvd.register_layout(cfg.url, cfg.http_url, self.layout, cfg.timeout, cfg.admin_token, **cfg.keys)
        except ServerError as e:
            if e.code == "registration":  # another model under the name (here or fleet-wide)
                self._refuse(f"kvdock holds {cfg.model_name!r} as another model: {e}")
            raise
        log.info("registered %r with kvdock at %s", cfg.model_name, cfg.url)

    def _refuse(self, why: str) -> None:
        self.refused = why
        log.error("%s; kvdock is off for this engine", why)
        raise KVCacheSDKError(why)

    def _open(self) -> kvd.KVCacheContext:
        cfg = self.cfg
        rank = None
        if self.rank_for is not None:
            lay = kvd.describe_server(cfg.url, cfg.model_name, cfg.timeout, **cfg.keys).layout
            if lay is None:
                raise UnknownModelError(f"model {cfg.model_name!r} is not registered with kvdock at {cfg.url}")
            rank = self.rank_for(lay.geometry)
        return kvd.connect(cfg.url, cfg.http_url, cfg.model_name, cfg.timeout, kv_rank=rank, **cfg.keys)

    def run(self, what: str, fn: Callable[[kvd.KVCacheContext], T], miss: T) -> T:
        """``fn(ctx)``, or ``miss`` when kvdock is down or ``fn`` fails with a kvdock error (which
        is logged; a server failure takes the link down for ``retry_s``, and sets :attr:`slow`
        when it took at least ``SLOW_SHARE`` of ``timeout``)."""
        start, failures = time.monotonic(), self.failures
        try:
            return self._run(what, fn, miss)
        finally:
            if self.failures != failures:
                self.slow = time.monotonic() - start >= SLOW_SHARE * self.cfg.timeout

    def _run(self, what: str, fn: Callable[[kvd.KVCacheContext], T], miss: T) -> T:
        ctx = self.context()
        if ctx is None:
            return miss
        try:
            result = fn(ctx)
            self.slow = False
            return result
        except UnknownModelError as e:
            if self.layout is None:
                self._down(f"kvdock {what} failed: {e}")
                return miss
            # the server is up but forgot the model (restarted without disk): whoever talks to it
            # first registers the layout again, at once, and the call is tried once more
            log.info("kvdock %s: %s; registering %r again", what, e, self.cfg.model_name)
            self._forget()
            ctx = self.context()
            if ctx is None:
                return miss
            try:
                return fn(ctx)
            except _TRANSIENT as e2:
                log.info("kvdock %s: %s", what, e2)
            except KVCacheSDKError as e2:
                self._down(f"kvdock {what} failed: {e2}")
        except _TRANSIENT as e:
            log.info("kvdock %s: %s", what, e)
        except KVCacheSDKError as e:
            self._down(f"kvdock {what} failed: {e}")
        return miss

    def _forget(self) -> None:
        """Close the context without taking the link down (the next call connects afresh)."""
        if self._ctx is not None:
            ctx, self._ctx = self._ctx, None
            with contextlib.suppress(KVCacheSDKError):
                ctx.close(wait_s=0.0)

    def drop(self, why: str) -> None:
        """Treat kvdock as down for ``retry_s`` (closing the context): the next call after that
        connects afresh."""
        self._down(why)

    def _down(self, why: str) -> None:
        self.failures += 1
        self._down_until = self._clock() + self.cfg.retry_s
        log.warning("%s; treating kvdock as a miss for %.1fs", why, self.cfg.retry_s)
        if self._ctx is not None:
            ctx, self._ctx = self._ctx, None
            with contextlib.suppress(KVCacheSDKError):
                ctx.close(wait_s=0.0)  # the server may be gone: do not wait for its goodbye

    def close(self) -> None:
        if self._ctx is not None:
            self._ctx.close()
            self._ctx = None

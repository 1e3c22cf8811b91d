"""kvdock.sdk.aio: the SDK's calls as coroutines, for asyncio programs (an HTTP server that
serves KV, an agent loop).

    import kvdock.sdk.aio as kva

    async with await kva.connect("tcp://127.0.0.1:5555", "http://127.0.0.1:9000", "my-model") as ctx:
        kv = await kva.retrieve(ctx, tokens)
        kvs = await asyncio.gather(*(kva.retrieve(ctx, p) for p in prompts))

The same core as :mod:`kvdock.sdk`, not a second protocol implementation: each coroutine runs the
synchronous call on a worker thread of the context's own pool. Waiting for the server blocks
that thread, never the event loop, and copies run there too (torch and numpy copy without the
GIL). A context takes many calls at once: up to ``max_concurrency`` run together (the client
shares one socket among them; each waits only for its own reply), the others queue.

Cancelling a task that awaits a call does not stop a call that has started: it runs to its end
on its thread (a store commits or not, a retrieve's pins are released) and its result is
dropped; a call still queued for a thread never starts. Closing the context is
:meth:`KVCacheContext.close`: copies in progress finish, calls still waiting for the server or
for a thread fail with KVCacheSDKError, and so does every call made afterwards.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import Future, ThreadPoolExecutor
from types import TracebackType
from typing import Any, Concatenate, ParamSpec, TypeVar

from kvdock.errors import InvalidInputError, KVCacheSDKError
from kvdock.sdk import _http as http
from kvdock.sdk import batch, bundle, inspection, ops, registration
from kvdock.sdk import context as sync_context
from kvdock.sdk.context import KVCacheContext

P = ParamSpec("P")
R = TypeVar("R")

DEFAULT_CONCURRENCY = 64


class AsyncKVCacheContext:
    """A :class:`~kvdock.sdk.KVCacheContext` (``.sync``) with the worker threads that run its
    calls. From :func:`connect`; close it with :func:`close` or ``async with``."""

    def __init__(self, ctx: KVCacheContext, max_concurrency: int = DEFAULT_CONCURRENCY) -> None:
        self.sync = ctx
        self._pool = ThreadPoolExecutor(max_concurrency, thread_name_prefix="kvdock-aio")

    @property
    def model_name(self) -> str:
        return self.sync.model_name

    @property
    def chunk_size(self) -> int:
        return self.sync.chunk_size

    @property
    def transport(self) -> str:
        return self.sync.transport

    @property
    def closed(self) -> bool:
        return self.sync.closed

    async def run(self, fn: Callable[..., R], *args: Any, **kwargs: Any) -> R:
        """``fn(self.sync, *args, **kwargs)`` on a worker thread; KVCacheSDKError once closed."""
        loop = asyncio.get_running_loop()
        try:
            if self.sync.closed:
                raise RuntimeError
            fut = loop.run_in_executor(self._pool, functools.partial(fn, self.sync, *args, **kwargs))
        except RuntimeError:  # the pool refuses work once shut down
            raise KVCacheSDKError("this AsyncKVCacheContext is closed") from None
        return await fut

    async def close(self) -> None:
        """Close the context (waiting for calls still running, see KVCacheContext.close) and its threads."""
        await asyncio.get_running_loop().run_in_executor(None, self._close)

    def _close(self) -> None:
        self.sync.close()
        self._pool.shutdown(wait=True)

    async def __aenter__(self) -> AsyncKVCacheContext:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"Async{self.sync!r}"


def _context(ctx: object) -> AsyncKVCacheContext:
    if not isinstance(ctx, AsyncKVCacheContext):
        raise InvalidInputError(
            f"ctx must be an AsyncKVCacheContext from kvdock.sdk.aio.connect(), got {type(ctx).__name__}"
        )
    return ctx


def _on_context(
    fn: Callable[Concatenate[KVCacheContext, P], R],
) -> Callable[Concatenate[AsyncKVCacheContext, P], Coroutine[Any, Any, R]]:
    """The coroutine version of an SDK call that takes a context first."""

    @functools.wraps(fn)
    async def call(ctx: AsyncKVCacheContext, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return await _context(ctx).run(fn, *args, **kwargs)

    call.__doc__ = f"Coroutine of :func:`kvdock.sdk.{fn.__name__}` (run on the context's threads).\n\n{fn.__doc__}"
    return call


def _off_context(fn: Callable[P, R]) -> Callable[P, Coroutine[Any, Any, R]]:
    """The coroutine version of an SDK call that takes no context (on the loop's default threads)."""

    @functools.wraps(fn)
    async def call(*args: P.args, **kwargs: P.kwargs) -> R:
        return await asyncio.to_thread(fn, *args, **kwargs)

    call.__doc__ = f"Coroutine of :func:`kvdock.sdk.{fn.__name__}`.\n\n{fn.__doc__}"
    return call


async def connect(
    url: str,
    http_url: str,
    model_name: str,
    timeout: float = 60.0,
    max_concurrency: int = DEFAULT_CONCURRENCY,
    *,
    kv_rank: int | None = None,
    server_key: str | None = None,
    client_key: str | None = None,
    token: str | None = None,
) -> AsyncKVCacheContext:
    """Coroutine of :func:`kvdock.sdk.connect` (``kv_rank``, the keys and the token as there);
    ``max_concurrency`` calls of the context run at once (the others queue). Cancelled while
    connecting, the connection is closed once made."""
    if isinstance(max_concurrency, bool) or not isinstance(max_concurrency, int) or not 1 <= max_concurrency <= 1024:
        raise InvalidInputError(f"max_concurrency must be an int in [1, 1024], got {max_concurrency!r:.40}")
    loop = asyncio.get_running_loop()
    fut = loop.run_in_executor(
        None,
        functools.partial(
            sync_context.connect,
            url,
            http_url,
            model_name,
            timeout,
            kv_rank=kv_rank,
            server_key=server_key,
            client_key=client_key,
            token=token,
        ),
    )
    try:
        ctx = await asyncio.shield(fut)
    except asyncio.CancelledError:
        fut.add_done_callback(_close_unwanted)
        raise
    return AsyncKVCacheContext(ctx, max_concurrency)


def _close_unwanted(fut: asyncio.Future[KVCacheContext] | Future[KVCacheContext]) -> None:
    if not fut.cancelled() and fut.exception() is None:  # closing blocks a little: not on the loop
        threading.Thread(target=fut.result().close, name="kvdock-aio-close", daemon=True).start()


async def close(ctx: AsyncKVCacheContext) -> None:
    """Coroutine of :func:`kvdock.sdk.close`. Harmless twice."""
    await _context(ctx).close()


lookup = _on_context(ops.lookup)
lookup_many = _on_context(batch.lookup_many)
retrieve = _on_context(ops.retrieve)
retrieve_many = _on_context(batch.retrieve_many)
retrieve_into = _on_context(ops.retrieve_into)
store = _on_context(ops.store)
store_chunks = _on_context(ops.store_chunks)
store_from = _on_context(ops.store_from)
check_server_integrity = _on_context(ops.check_server_integrity)
export_bundle = _on_context(bundle.export_bundle)
import_bundle = _on_context(bundle.import_bundle)
inspect_prefix = _on_context(inspection.inspect_prefix)
register_model = _off_context(registration.register_model)
server_status = _off_context(http.server_status)
server_config = _off_context(http.server_config)


async def diff_prefixes(
    ctx: AsyncKVCacheContext,
    tokens: object,
    other_tokens: object,
    cache_salt: str = "",
    other_cache_salt: str | None = None,
    other_ctx: AsyncKVCacheContext | None = None,
) -> inspection.PrefixDiff:
    """Coroutine of :func:`kvdock.sdk.diff_prefixes` (``other_ctx`` an AsyncKVCacheContext too)."""
    other = _context(other_ctx).sync if other_ctx is not None else None
    return await _context(ctx).run(inspection.diff_prefixes, tokens, other_tokens, cache_salt, other_cache_salt, other)


__all__ = [
    "AsyncKVCacheContext",
    "check_server_integrity",
    "close",
    "connect",
    "diff_prefixes",
    "export_bundle",
    "import_bundle",
    "inspect_prefix",
    "lookup",
    "lookup_many",
    "register_model",
    "retrieve",
    "retrieve_into",
    "retrieve_many",
    "server_config",
    "server_status",
    "store",
    "store_chunks",
    "store_from",
]

"""The SDK's retry rules, in one place: what is tried again, how often, and for how long.

* **A server restart** (:func:`registers_again`): a request the server refused because it no
  longer knows this client (``UNKNOWN_CLIENT``) registers the context again and is sent once more,
  if it starts a flow (:data:`RESTARTABLE`: a lookup or a prepare; a commit's session is gone
  with the server, it is not retried). ``KVCacheContext.call`` applies it.
* **A chunk another client is writing** (:func:`conflict_pauses`): a store asks again after
  5 ms, 10 ms, ... (at most 200 ms apart) for up to ``CONFLICT_WAIT_S`` (at most the context's
  timeout), then reports those chunks in flight. An overwrite never waits.
* **A read** (:func:`read`): from the pool directory first (``kvdock.sdk._fastpath``; None: it
  cannot answer, ask the server), then through the server; a copy that outlived its lease (the
  process was paused, the slots were reused) is done once more, except for a read of given
  versions (``tips``), whose sink already holds garbage and whose versions may be gone.
* **The pool directory's lookup** (:data:`DIRECTORY_LOOKS`): an entry being rewritten by an
  overwrite's commit (its version chain broken) is looked at once more before asking the server.

Below the SDK's calls, the transport has its own fallbacks, which never resend what the server
may have received: a request that could not leave over the local socket goes over zmq
(``kvdock.sdk._connection``, which tries the local socket again every ``LOCAL_RETRY_S``), and the
pool door is knocked at a few times (``kvdock.sdk._handshake``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator

from kvdock.errors import KVCacheSDKError, LeaseExpiredError
from kvdock.protocol import ErrorCode
from kvdock.protocol import messages as m

log = logging.getLogger("kvdock.sdk")

RESTARTABLE = (m.Lookup, m.PrepareStore, m.PrepareRetrieve, m.LookupMany, m.PrepareRetrieveMany, m.Locate)
CONFLICT_WAIT_S = 2.0  # how long a store waits for another client's write of the same chunks
CONFLICT_FIRST_S, CONFLICT_MAX_S = 0.005, 0.2  # its pauses: doubling from the first, up to the max
DIRECTORY_LOOKS = 2  # looks at the pool directory while an entry's version chain is broken


def registers_again(msg: object, err: KVCacheSDKError) -> bool:
    """Whether ``msg``, refused with ``err``, is sent again after registering again."""
    return err.code == ErrorCode.UNKNOWN_CLIENT and isinstance(msg, RESTARTABLE)


def conflict_pauses(wait_s: float, timeout: float) -> Iterator[float]:
    """The pauses (already slept when yielded) between a store's attempts while chunks are in
    flight elsewhere: none once ``min(wait_s, timeout)`` from now would be passed."""
    return _pauses(time.monotonic() + min(wait_s, timeout))


def _pauses(deadline: float) -> Iterator[float]:
    delay = CONFLICT_FIRST_S
    while time.monotonic() + delay <= deadline:
        time.sleep(delay)
        yield delay
        delay = min(delay * 2, CONFLICT_MAX_S)


def read(fast: Callable[[], int | None] | None, once: Callable[[], int], exact: bool = False) -> int:
    """A read's hit in tokens: ``fast()`` (None: ask the server; not tried when ``fast`` is None),
    else ``once()`` through the server, done again once if its copy outlived its lease, unless
    ``exact`` (a read of given versions: LeaseExpiredError then)."""
    hit = fast() if fast is not None else None
    if hit is not None:
        return hit
    try:
        return once()
    except LeaseExpiredError:
        if exact:
            raise
        log.warning("a retrieve outlived its lease; trying once more")
        return once()

"""The guard of a context's transfer: which registration is current, and who copies through it
(``KVCacheContext.transfer``, ``_hold_transfer``, ``_drop_transfer``)."""

from __future__ import annotations

from typing import Protocol

from kvdock.sdk._handshake import Registration
from kvdock.sdk._transfer import Transfer


class Held:
    """A registration and how many threads are copying through its transfer. Once retired (by
    close() or a re-registration) the transfer is closed by whoever sees it unused last."""

    __slots__ = ("reg", "retired", "users")

    def __init__(self, reg: Registration) -> None:
        self.reg = reg
        self.users = 0
        self.retired = False

    @property
    def transfer(self) -> Transfer:
        return self.reg.transfer


class Guarded(Protocol):
    """What holds the current registration (a KVCacheContext)."""

    def _hold_transfer(self, answered: bool = True) -> Held: ...
    def _drop_transfer(self, ref: Held) -> None: ...


class Holding:
    """``with ctx.transfer() as t``: a class, not a generator (this is on every copy's path)."""

    __slots__ = ("_answered", "_ctx", "_ref")

    def __init__(self, ctx: Guarded, answered: bool) -> None:
        self._ctx, self._answered = ctx, answered

    def __enter__(self) -> Transfer:
        self._ref = self._ctx._hold_transfer(self._answered)
        return self._ref.transfer

    def __exit__(self, *exc: object) -> None:
        self._ctx._drop_transfer(self._ref)

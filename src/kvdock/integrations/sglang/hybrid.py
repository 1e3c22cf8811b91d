"""A hybrid model's extra host pools (Mamba, SWA, DSA: SGLang's ``*_v2`` calls): not stored by
kvdock, every page a miss (never an exception into SGLang's cache controller)."""

from __future__ import annotations

import collections
import logging
from typing import Any

log = logging.getLogger("kvdock.sglang")


class NoExtraPools:
    """A hybrid model's extra pools (Mamba, SWA, DSA: SGLang's ``*_v2`` calls) are not stored:
    every page a miss, logged once, counted in ``stats``."""

    stats: collections.Counter[str]

    def batch_exists_v2(self, keys: list[str], pool_transfers: Any = None, extra_info: Any = None) -> Any:
        from sglang.srt.mem_cache.hicache_storage import PoolTransferResult

        self._unsupported("batch_exists_v2")
        return PoolTransferResult.empty()

    def batch_get_v2(self, transfers: Any, extra_info: Any = None) -> dict[str, list[bool]]:
        self._unsupported("batch_get_v2")
        return {t.name: [False] * len(t.keys or []) for t in transfers}

    def batch_set_v2(self, transfers: Any, extra_info: Any = None) -> dict[str, list[bool]]:
        self._unsupported("batch_set_v2")
        return {t.name: [False] * len(t.keys or []) for t in transfers}

    def _unsupported(self, what: str) -> None:
        self.stats[f"{what}_unsupported"] += 1
        if self.stats[f"{what}_unsupported"] == 1:
            log.error("kvdock: %s (a hybrid model's extra pools) is not supported: misses", what)


__all__ = ["NoExtraPools"]

"""The connector's numbers in vLLM's own metrics and logs (``get_kv_connector_stats`` on each
worker, aggregated over the workers and reduced by vLLM's logger through
``build_kv_connector_stats``): loads (count, tokens, bytes, seconds, failed blocks), saves (count,
tokens, bytes, seconds, copy-out seconds and bytes, dropped because staging was full)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvdock.integrations.vllm._jobs import STAT_KEYS


@dataclass
class KvdockStats(KVConnectorStats):
    """Counters since the last report, summed over workers (``data``: :data:`STAT_KEYS`)."""

    def __post_init__(self) -> None:
        for key in STAT_KEYS:
            self.data.setdefault(key, 0.0)

    def reset(self) -> None:
        self.data = dict.fromkeys(STAT_KEYS, 0.0)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, value in other.data.items():
            self.data[key] = self.data.get(key, 0.0) + float(value)
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        return {
            "kvdock loads": int(d["loads"]),
            "kvdock loaded tokens": int(d["loaded_tokens"]),
            "kvdock load MB": round(d["load_bytes"] / 1e6, 3),
            "kvdock load s": round(d["load_s"], 4),
            "kvdock failed load blocks": int(d["load_errors"]),
            "kvdock saves": int(d["saves"]),
            "kvdock saved tokens": int(d["saved_tokens"]),
            "kvdock save MB": round(d["save_bytes"] / 1e6, 3),
            "kvdock save s": round(d["save_s"], 4),
            "kvdock copy-out s": round(d["copy_s"], 4),
            "kvdock copy-out MB": round(d["copy_bytes"] / 1e6, 3),
            "kvdock dropped saves": int(d["saves_dropped"]),
        }

    def is_empty(self) -> bool:
        return not any(self.data.get(k) for k in STAT_KEYS)


def build(data: dict[str, Any] | None) -> KvdockStats:
    return KvdockStats(data=dict(data or {}))

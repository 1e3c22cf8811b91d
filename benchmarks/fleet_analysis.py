"""The analysis of a fleet soak's records (benchmarks/fleet.py): every read checked against the
writer's acknowledgements (mixed, foreign, stale after the bound), counts per phase and server,
and each overwrite's invalidation window per server."""

from __future__ import annotations

import bisect
import statistics
from collections import defaultdict
from typing import Any


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))] if xs else float("nan")


def analyze(writes: list[tuple], reads: dict[int, list[tuple]], bound: float, phase_of: Any) -> dict[str, Any]:
    """Count reads per (phase, server) and their violations; the invalidation windows."""
    acks: dict[int, list[tuple[float, int]]] = defaultdict(list)  # prompt -> (ack time, version)
    sent: dict[tuple[int, int], float] = {}
    refused: set[tuple[int, int]] = set()
    for p, v, _s, t0, t1, outcome in writes:
        sent[p, v] = t0
        if outcome == "ok":
            acks[p].append((t1, v))
        elif outcome.startswith("refused"):
            refused.add((p, v))
    times = {p: [t for t, _ in a] for p, a in acks.items()}
    rows: dict[tuple[str, Any], dict[str, Any]] = defaultdict(lambda: defaultdict(int))
    bad: list[str] = []
    for s, recs in reads.items():
        for t0, t1, p, res, *_kind in recs:
            row, tot = rows[phase_of(t0), s], rows[phase_of(t0), "all"]
            for r in (row, tot):
                r["reads"] += 1
            if res is None:
                kind = "misses"
            elif isinstance(res, str):
                kind = "errors"
            else:
                kind = "hits"
                vs = [x for x in res if isinstance(x, int)]
                why = ""
                if len(vs) < len(res) or any((p, v) not in sent and v != 0 for v in vs):
                    why = "foreign"
                elif any(v and sent[p, v] > t1 for v in vs):
                    why = "foreign"  # a version sent after the read ended
                elif len(set(vs)) > 1:
                    why = "mixed"
                else:
                    i = bisect.bisect_right(times[p], t0 - bound)
                    if i and min(vs) < acks[p][i - 1][1]:
                        why = "stale_after_bound"
                    j = bisect.bisect_right(times[p], t0)
                    if j and min(vs) < acks[p][j - 1][1]:
                        for r in (row, tot):
                            r["stale_within_bound"] += 1
                if any((p, v) in refused for v in vs):
                    for r in (row, tot):
                        r["refused_served"] += 1
                if why:
                    for r in (row, tot):
                        r[why] += 1
                    j = bisect.bisect_right(times[p], t0)
                    last = acks[p][j - 1] if j else None
                    bad.append(f"{why}: server {s} prompt {p} read {t0:.4f}-{t1:.4f} got {res}; "
                               f"last ack before it {last}")  # fmt: skip
            for r in (row, tot):
                r[kind] += 1
    windows: dict[tuple[str, Any], list[float]] = defaultdict(list)
    found, gaps = _windows(acks, reads)
    for (s, t_ack), w in found.items():
        windows[phase_of(t_ack), s].append(w)
        windows[phase_of(t_ack), "all"].append(w)
    latency: dict[tuple[str, Any], list[float]] = defaultdict(list)
    for _p, v, s, _t0, t1, outcome in writes:
        if v == 0:  # (the versions stored before the run are no overwrites)
            continue
        key = "acked" if outcome == "ok" else "partial" if outcome.startswith("partial") else "refused"
        for who in (s, "all"):  # (the latency of every overwrite call, whatever its outcome)
            rows[phase_of(t1), who][key] += 1
            latency[phase_of(t1), who].append(t1 - _t0)
    reasons = sorted({o.split(":")[0] for *_, o in writes if o != "ok"})
    gap = statistics.median(gaps) * 1e3 if gaps else None
    return {"rows": rows, "windows": windows, "latency": latency, "bad": bad, "gap_p50_ms": gap, "refusals": reasons}


def _windows(
    acks: dict[int, list[tuple[float, int]]], reads: dict[int, list[tuple]]
) -> tuple[dict[tuple[int, float], float], list[float]]:
    """Per (server, ack): seconds from the ack to the first read of the prompt after which no read
    (until the next ack of the prompt) served an older version; and the gaps between that read
    and the read before it (the resolution)."""
    out: dict[tuple[int, float], float] = {}
    gaps: list[float] = []
    for s, recs in reads.items():
        by_p: dict[int, list[tuple]] = defaultdict(list)
        for r in recs:
            by_p[r[2]].append(r)
        for p, a in acks.items():
            rs = sorted(by_p[p])
            starts = [r[0] for r in rs]
            for k, (t_ack, v) in enumerate(a):
                if v == 0:
                    continue
                end = a[k + 1][0] if k + 1 < len(a) else float("inf")
                lo, hi = bisect.bisect_left(starts, t_ack), bisect.bisect_left(starts, end)
                span = rs[lo:hi]
                olds = [i for i, r in enumerate(span) if isinstance(r[3], tuple) and
                        any(isinstance(x, int) and x < v for x in r[3])]  # fmt: skip
                first = olds[-1] + 1 if olds else 0
                if first < len(span):
                    out[s, t_ack] = span[first][0] - t_ack
                    before = span[first - 1][0] if first else (rs[lo - 1][0] if lo else t_ack)
                    gaps.append(span[first][0] - max(before, t_ack))
    return out, gaps

"""StoreResult counts each chunk of a store once, also when the store asked again (chunks in
flight) after a chunk of an earlier attempt was written but not kept (superseded by a fleet
overwrite: tests/fleet/test_fleet_superseded.py). The server's answers are scripted here: the
interleaving (a superseded chunk that a retry then finds being loaded from L3, or writes again)
needs three servers' timing that no real part produces on demand."""

from __future__ import annotations

import pytest

import kvdock.sdk as kvd
from helpers import CHUNK, MODEL, make_tokens
from kvdock.protocol import messages as m
from kvdock.sdk import ops


def scripted(monkeypatch: pytest.MonkeyPatch, answers: list[tuple[m.StorePrepared, int]]) -> None:
    """Each attempt of a store gets the next of ``answers`` (the last one again once used up)."""
    left = list(answers)

    def once(*args: object, **kw: object) -> tuple[m.StorePrepared, int]:
        return left.pop(0) if len(left) > 1 else left[0]

    monkeypatch.setattr(ops, "_store_once", once)


def slots(*chunks: int) -> list[m.SlotRef]:
    return [m.SlotRef(i, 0) for i in chunks]


@pytest.mark.parametrize(
    ("answers", "want"),
    [
        pytest.param(  # chunk 0 lost, then in flight (the other overwrite's version being loaded)
            [(m.StorePrepared(slots(0), 0, 0, 1), 0), (m.StorePrepared([], 0, 0, 2), 0)],
            kvd.StoreResult(0, 0, 0, 2, 0, 0),
            id="lost-then-loading",
        ),
        pytest.param(  # chunk 0 lost, then written again and kept, then held
            [
                (m.StorePrepared(slots(0), 0, 0, 1), 0),
                (m.StorePrepared(slots(0), 0, 0, 1), 1),
                (m.StorePrepared([], 1, 0, 1), 0),
            ],
            kvd.StoreResult(1, 0, 0, 1, 0, 0),
            id="lost-then-stored",
        ),
        pytest.param(  # chunk 0 lost, then held by the overwrite that superseded it; chunk 1 stored
            [(m.StorePrepared(slots(0), 0, 0, 1), 0), (m.StorePrepared(slots(1), 1, 0, 0), 1)],
            kvd.StoreResult(1, 1, 0, 0, 0, 0),
            id="lost-then-held",
        ),
        pytest.param(  # one attempt: chunk 1 lost
            [(m.StorePrepared(slots(0, 1), 0, 0, 0), 1)],
            kvd.StoreResult(1, 0, 0, 0, 0, 1),
            id="one-attempt",
        ),
    ],
)
def test_every_chunk_is_counted_once_across_a_stores_attempts(
    make_server, monkeypatch, answers: list[tuple[m.StorePrepared, int]], want: kvd.StoreResult
) -> None:
    """Before: superseded = every attempt's written - stored, and the last attempt's plan counted
    the same chunk again: StoreResult(0, -1, 0, 2, 0, 1) for 'lost-then-loading', a negative
    deduped count (callers such as the SGLang backend add it to what kvdock holds)."""
    srv = make_server()
    with kvd.connect(srv.url, srv.http_url, MODEL, timeout=10) as ctx:
        scripted(monkeypatch, answers)
        r = kvd.store_from(ctx, object(), make_tokens(2 * CHUNK), conflict_wait_s=0.2)  # type: ignore[arg-type]
        assert r == want
        assert sum(getattr(r, f) for f in r.__dataclass_fields__) == 2 and min(vars(r).values()) >= 0

"""Review R1 of the SDK restructure (issue 25 item 2, issue 27 'the SDK's first call'):
regressions found by the review, each against real servers."""

from __future__ import annotations

import pytest

import kvdock.sdk as kvd
from helpers import MODEL, make_kv, make_tokens
from kvdock.errors import LimitExceededError
from kvdock.protocol import ErrorCode
from kvdock.protocol import messages as m


def test_another_kvdock_servers_http_url_of_the_same_chunk_size_is_refused(make_server) -> None:
    """connect checked only the chunk size of the http_url's /config: the HTTP API of another
    server with the same settings (two servers on one box, both with the default chunk size)
    was accepted and kept as ctx.http_url, so /status read from it described the wrong server."""
    a, b = make_server(), make_server()
    with pytest.raises(kvd.ServerUnavailableError, match=rf"^http_url '{b.http_url}' is another server's HTTP API"):
        kvd.connect(a.url, b.http_url, MODEL, timeout=10)
    assert a.get("/status")["clients"] == 0  # the context it registered was closed again
    with kvd.connect(a.url, a.http_url, MODEL, timeout=10) as ctx:  # its own is still fine
        assert ctx.http_url == a.http_url


def test_a_request_over_the_limit_is_the_limits_exception_whichever_side_refuses_it(make_server) -> None:
    """Wire codes are one-to-one with exceptions (LIMIT <-> LimitExceededError), but the SDK's own
    checks of the same limits (max_request_tokens, the salt length) raised a plain
    InvalidInputError: ``except LimitExceededError`` caught the server's refusal only."""
    srv = make_server("--max-request-tokens", "64")
    with kvd.connect(srv.url, None, MODEL, timeout=10) as ctx:
        long = make_tokens(128)
        for call in (
            lambda: kvd.lookup(ctx, long),
            lambda: kvd.retrieve(ctx, long),
            lambda: kvd.store(ctx, make_kv(128), long),
        ):
            with pytest.raises(LimitExceededError, match="over the server's limit of 64 tokens") as e:
                call()
            assert e.value.code == ErrorCode.LIMIT
        with pytest.raises(LimitExceededError) as server_side:  # the server's own refusal: the same class
            ctx.ask(m.Lookup(ctx.client_id, b"\0" * 4 * 128, ""))
        assert server_side.value.code == ErrorCode.LIMIT
        salt = "s" * 300
        with pytest.raises(LimitExceededError, match="cache_salt has 300 characters") as e:
            kvd.lookup(ctx, make_tokens(32), cache_salt=salt)
        assert e.value.code == ErrorCode.LIMIT
        with pytest.raises(LimitExceededError) as server_side:
            ctx.ask(m.Lookup(ctx.client_id, b"\0" * 4 * 32, salt))
        assert server_side.value.code == ErrorCode.LIMIT

"""``kvdock events``: a server's KV events as JSON lines."""

from __future__ import annotations

import argparse
import json
from typing import Any

from kvdock.cli.keys import add_key_flags, token
from kvdock.errors import ConfigError


def add_events_command(sub: Any) -> None:
    """Add ``events`` to the ``kvdock`` subcommands ``sub`` (argparse's subparsers)."""
    ev = sub.add_parser(
        "events",
        help="print a server's KV events (serve --kv-events-port) as JSON lines",
        description="Subscribe to a server's KV events and print one JSON line per event (chunk "
        'hashes in hex). A gap in the batches\' seq is printed as {"missed_batches": n}.',
    )
    ev.add_argument("--url", required=True, help="the events URL, e.g. tcp://127.0.0.1:5557")
    ev.add_argument("--count", type=int, help="stop after this many events (exit 1 if they do not come)")
    ev.add_argument("--timeout", type=float, help="stop after this many seconds without an event")
    add_key_flags(ev)
    ev.set_defaults(func=events)


def events(args: argparse.Namespace) -> int:
    """Print each KV event as a JSON line until ``--count`` events (or ``--timeout`` s of silence)."""
    import msgspec

    from kvdock.cli.keys import client_keys
    from kvdock.transport.events import EventSubscriber

    check_reachable(args.url)
    sub = EventSubscriber(args.url, client_keys(args), token(args))
    seen = 0
    expect: dict[bytes, int] = {}  # topic -> its next seq (with tenants, an admin sees several)
    try:
        while args.count is None or seen < args.count:
            got = sub.receive(args.timeout)
            if got is None:
                return 0 if args.count is None else 1
            seq, batch = got
            if sub.topic in expect and seq != expect[sub.topic]:
                print(json.dumps({"missed_batches": seq - expect[sub.topic]}), flush=True)
            expect[sub.topic] = seq + 1
            if batch.dropped:
                print(json.dumps({"dropped_chunks": batch.dropped}), flush=True)  # the server's backlog overflowed
            for event in batch.events:
                # the tag names the event ("type": "ChunkStored", ...)
                doc = {"seq": seq, "ts": batch.ts, "server": batch.server, **msgspec.to_builtins(event)}
                if "chunk_hashes" in doc:
                    doc["chunk_hashes"] = [h.hex() for h in event.chunk_hashes]  # type: ignore[union-attr]
                print(json.dumps(doc), flush=True)
                seen += 1
    finally:
        sub.close()
    return 0


def check_reachable(url: str) -> None:
    """ConfigError if nothing listens at a ``tcp://HOST:PORT`` URL (a SUB socket would wait
    silently forever, which looks like a server with no events)."""
    import socket

    if not url.startswith("tcp://"):
        return
    host, _, port = url.removeprefix("tcp://").rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=5).close()
    except (OSError, ValueError) as e:
        raise ConfigError(f"nothing answers at {url} ({e}); is the server running with --kv-events-port?") from None

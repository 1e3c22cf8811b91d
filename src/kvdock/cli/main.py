"""The ``kvdock`` command: serve, keygen, status, register, lookup, retrieve, store, export, import,
inspect, diff, events."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import pickle
import signal
import sys
from pathlib import Path

from kvdock import __version__
from kvdock.cli.keys import add_key_flags, keys, token
from kvdock.config import DEFAULT_HTTP_URL, DEFAULT_URL, load_server_config
from kvdock.errors import ConfigError, KVDockError


def _serve(args: argparse.Namespace) -> int:
    from kvdock.server.launch import serve

    names = (
        "host http_host port http_port chunk_size l1_size session_ttl client_ttl max_models max_request_tokens "
        "admin_token log_level disk_dir disk_size redis_url redis_max_bytes l3_coherence_ms kv_events_port "
        "curve_secret_key curve_authorized_dir tenants"
    )
    cli: dict[str, object] = {k: getattr(args, k) for k in names.split()}
    cli["no_shm"] = True if args.no_shm else None
    cli["no_disk"] = True if args.no_disk else None
    cli["no_local_socket"] = True if args.no_local_socket else None
    cli["no_fast_reads"] = True if args.no_fast_reads else None
    cli["insecure_allow_remote"] = True if args.insecure_allow_remote else None
    config = load_server_config(cli, config_file=args.config)
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # until the event loop installs its own handlers, SIGTERM unwinds like Ctrl-C (cleanup runs)
    signal.signal(signal.SIGTERM, _interrupt)
    asyncio.run(serve(config))
    return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _status(args: argparse.Namespace) -> int:
    from kvdock.sdk.http import get_json

    print(json.dumps(get_json(args.http_url, "/status", args.timeout, token(args)), indent=2))
    return 0


def _register(args: argparse.Namespace) -> int:
    import msgspec

    from kvdock.layout import KV_PAIR, KVGeometry
    from kvdock.sdk import make_layout, register_layout

    geo = dict(num_layers=args.num_layers, num_kv_heads=args.num_kv_heads, head_dim=args.head_dim, dtype=args.dtype)
    kv_kind = KV_PAIR
    if args.hf_config:
        try:
            hf = KVGeometry.from_hf_config(json.loads(Path(args.hf_config).read_text()))
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot use {args.hf_config}: {e}") from None
        # explicit flags win over the config file
        geo = {k: v if v is not None else getattr(hf, k) for k, v in geo.items()}
        kv_kind = hf.kv_kind
    missing = [k for k, v in geo.items() if v is None]
    if missing:
        raise ConfigError(f"missing {', '.join('--' + k.replace('_', '-') for k in missing)} (or give --hf-config)")
    lay = make_layout(
        args.model, tokens_per_block=args.tokens_per_block, kv_format=args.kv_format, world_size=args.world_size, **geo
    )  # type: ignore[arg-type]
    if kv_kind != lay.geometry.kv_kind:  # an MLA config: registered as such (the server says if it can store it)
        lay = msgspec.structs.replace(lay, geometry=msgspec.structs.replace(lay.geometry, kv_kind=kv_kind))
    admin = args.admin_token if args.admin_token is not None else os.environ.get("KVDOCK_ADMIN_TOKEN", "")
    reg = register_layout(args.url, args.http_url, lay, args.timeout, admin, **keys(args))
    print(json.dumps({"model_name": reg.model_name, "created": reg.created, "chunk_nbytes": reg.chunk_nbytes}))
    return 0


def _token_ids(args: argparse.Namespace) -> list[int]:
    """Token ids from the positional argument, or ``--tokens-file`` (a JSON list)."""
    if args.tokens_file:
        try:
            ids = json.loads(Path(args.tokens_file).read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot read token ids from {args.tokens_file}: {e}") from None
        if not isinstance(ids, list):
            raise ConfigError(f"{args.tokens_file} must hold a JSON list of token ids")
        return ids
    if not args.tokens:
        raise ConfigError("give token ids (comma or space separated) or --tokens-file")
    try:
        return [int(t) for t in args.tokens.replace(",", " ").split()]
    except ValueError as e:
        raise ConfigError(f"token ids must be integers: {e}") from None


def _retrieve(args: argparse.Namespace) -> int:
    import torch

    from kvdock import sdk

    tokens = _token_ids(args)
    with sdk.connect(args.url, args.http_url, args.model, args.timeout, **keys(args)) as ctx:
        kv = sdk.retrieve(ctx, tokens, args.cache_salt)
    hit = 0 if kv is None else kv.shape[2]
    if kv is not None:
        torch.save(kv, args.out)
    print(json.dumps({"hit_tokens": hit, "tokens": len(tokens), "out": args.out if kv is not None else None}))
    return 0 if kv is not None else 1


def _store(args: argparse.Namespace) -> int:
    import torch

    from kvdock import sdk

    tokens = _token_ids(args)
    try:
        kv = torch.load(args.kv, weights_only=True)  # tensors only: no code from the file runs
    except (OSError, RuntimeError, ValueError, EOFError, pickle.UnpicklingError) as e:
        raise ConfigError(f"cannot load a tensor from {args.kv}: {e}") from None
    with sdk.connect(args.url, args.http_url, args.model, args.timeout, **keys(args)) as ctx:
        r = sdk.store_chunks(ctx, kv, tokens, args.cache_salt, overwrite=args.overwrite)
    print(
        json.dumps(
            {
                "stored_chunks": r.stored_chunks,
                "deduped_chunks": r.deduped_chunks,
                "pool_full_chunks": r.pool_full_chunks,
            }
        )
    )
    return 0


def _lookup(args: argparse.Namespace) -> int:
    from kvdock import sdk

    tokens = _token_ids(args)
    with sdk.connect(args.url, args.http_url, args.model, args.timeout, **keys(args)) as ctx:
        print(json.dumps({"hit_tokens": sdk.lookup(ctx, tokens, args.cache_salt), "tokens": len(tokens)}))
    return 0


def _export(args: argparse.Namespace) -> int:
    from kvdock import sdk

    tokens = _token_ids(args)
    with sdk.connect(args.url, args.http_url, args.model, args.timeout, **keys(args)) as ctx:
        m = sdk.export_bundle(ctx, tokens, args.out, args.cache_salt, args.note)
    hit = 0 if m is None else m.tokens
    print(json.dumps({"hit_tokens": hit, "tokens": len(tokens), "out": args.out if m is not None else None}))
    return 0 if m is not None else 1


def _import(args: argparse.Namespace) -> int:
    from kvdock import sdk

    bundle = sdk.read_bundle(args.bundle)  # before connecting: a bad file fails alone
    manifest = bundle.manifest
    model = args.model or manifest.model_name
    with sdk.connect(args.url, args.http_url, model, args.timeout, **keys(args)) as ctx:
        r = sdk.import_bundle(ctx, bundle, args.cache_salt, args.overwrite, args.allow_other_model)
    out = {
        "model_name": model,
        "tokens": r.tokens,
        "dropped_tokens": r.dropped_tokens,
        "stored_chunks": r.stored.stored_chunks,
        "deduped_chunks": r.stored.deduped_chunks,
        "pool_full_chunks": r.stored.pool_full_chunks,
        "note": manifest.note,
    }
    print(json.dumps(out))
    return 0


def _events(args: argparse.Namespace) -> int:
    """Print each KV event as a JSON line until ``--count`` events (or ``--timeout`` s of silence)."""
    import msgspec

    from kvdock.cli.keys import client_keys
    from kvdock.transport.events import EventSubscriber

    _check_reachable(args.url)
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


def _keygen(args: argparse.Namespace) -> int:
    from kvdock.transport.curve import keygen

    public, secret = keygen(args.directory, args.name)
    print(json.dumps({"public": str(public), "secret": str(secret)}))
    return 0


def _check_reachable(url: str) -> None:
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


def _client_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=DEFAULT_URL, help=f"ZMQ control URL (default {DEFAULT_URL})")
    p.add_argument("--http-url", default=DEFAULT_HTTP_URL, help=f"HTTP URL (default {DEFAULT_HTTP_URL})")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the server")
    add_key_flags(p)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvdock", description="kvdock KV-cache server and tools")
    parser.add_argument("--version", action="version", version=f"kvdock {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    s = sub.add_parser(
        "serve",
        help="run a server",
        description=(
            "Run a kvdock server. Each flag has a KVDOCK_<NAME> env variable and a key in the "
            "--config TOML file; CLI > env > file > default."
        ),
    )
    s.add_argument("--config", help="TOML config file (also KVDOCK_CONFIG)")
    s.add_argument(
        "--host", help="bind address for ZMQ and HTTP (default 127.0.0.1; others need --insecure-allow-remote)"
    )
    s.add_argument(
        "--insecure-allow-remote",
        action="store_true",
        help="bind a non-loopback --host although clients are not authenticated (see docs/security.md)",
    )
    s.add_argument(
        "--curve-secret-key",
        help="the server's secret certificate (kvdock keygen): zmq clients and event subscribers must speak CURVE",
    )
    s.add_argument("--curve-authorized-dir", help="directory of the public certificates (*.key) CURVE lets in")
    s.add_argument(
        "--tenants",
        help="tenants file (TOML): each tenant's CURVE keys or tokens, models, cache_salt namespaces and quotas",
    )
    s.add_argument(
        "--http-host",
        help="bind address for HTTP (default: --host; loopback when only CURVE opens --host to the network)",
    )
    s.add_argument("--port", type=int, help="ZMQ control port (default 5555)")
    s.add_argument("--http-port", type=int, help="HTTP port (default 9000)")
    s.add_argument("--chunk-size", type=int, help="tokens per stored chunk (default 256)")
    s.add_argument("--l1-size", help="L1 pool size, e.g. 2GiB (default: 1/4 of available memory)")
    s.add_argument("--no-shm", action="store_true", help="share no memory: every client uses the inline transport")
    s.add_argument(
        "--no-local-socket",
        action="store_true",
        help="offer shared-memory clients no local UNIX socket: their control messages go over zmq too",
    )
    s.add_argument(
        "--no-fast-reads",
        action="store_true",
        help="publish no pool directory: shared-memory clients ask the server for every lookup and retrieve",
    )
    s.add_argument("--session-ttl", type=float, help="seconds before a silent session's pins are released (default 30)")
    s.add_argument(
        "--client-ttl", type=float, help="seconds before a silent client's registration is forgotten (default 300)"
    )
    s.add_argument("--max-models", type=int, help="model registrations the server keeps (default 64)")
    s.add_argument("--max-request-tokens", type=int, help="token ids one request may name (default 1048576 = 2**20)")
    s.add_argument("--disk-dir", help="L2 directory, kept across restarts (default ~/.cache/kvdock/l2)")
    s.add_argument("--disk-size", help="L2 budget, e.g. 100GiB (default: 1/5 of the free space there)")
    s.add_argument("--no-disk", action="store_true", help="no L2 tier")
    s.add_argument(
        "--redis-url",
        help="L3 shared by servers: a Redis/Valkey (redis://[:PASSWORD@]HOST:PORT/DB, rediss://) or a Redis "
        "Cluster (redis+cluster://[:PASSWORD@]HOST:PORT,HOST:PORT/, rediss+cluster://)",
    )
    s.add_argument(
        "--redis-max-bytes",
        help="L3 budget of this server's own writes, e.g. 50GiB: past it, its least recently used are deleted",
    )
    s.add_argument(
        "--l3-coherence-ms",
        type=float,
        help="with an L3: within this many ms of an overwrite acknowledged by any server sharing it, no server "
        "serves the replaced version (it answers misses while it cannot tell; default 100)",
    )
    s.add_argument("--kv-events-port", type=int, help="publish KV events (chunks stored / removed) on this port")
    s.add_argument(
        "--admin-token", help="token required (Authorization: Bearer) by HTTP admin actions and to register models"
    )
    s.add_argument("--log-level", help="DEBUG, INFO (default), WARNING")
    s.set_defaults(func=_serve)

    st = sub.add_parser("status", help="print a server's /status")
    _client_flags(st)
    st.set_defaults(func=_status)

    r = sub.add_parser("register", help="register a model's KV layout without an engine")
    _client_flags(r)
    r.add_argument("--model", required=True, help="model name clients will use")
    r.add_argument("--hf-config", help="HuggingFace config.json to read the geometry from")
    r.add_argument("--num-layers", type=int)
    r.add_argument("--num-kv-heads", type=int)
    r.add_argument("--head-dim", type=int)
    r.add_argument("--dtype", help="float32, bfloat16, float16, ...")
    r.add_argument("--tokens-per-block", type=int, default=16)
    r.add_argument("--kv-format", default="NHD", help="NHD or HND")
    r.add_argument("--world-size", type=int, default=1)
    r.add_argument("--admin-token", help="the server's admin token, if it has one (default: $KVDOCK_ADMIN_TOKEN)")
    r.set_defaults(func=_register)

    def token_cmd(name: str, help: str, func: object) -> argparse.ArgumentParser:
        c = sub.add_parser(name, help=help, description=help)
        _client_flags(c)
        c.add_argument("--model", required=True)
        c.add_argument("--cache-salt", default="")
        c.add_argument("tokens", nargs="?", help="token ids, comma or space separated")
        c.add_argument("--tokens-file", help="a JSON list of token ids instead")
        c.set_defaults(func=func)
        return c

    token_cmd("lookup", "how many leading tokens are cached (in any tier)", _lookup)
    rt = token_cmd(
        "retrieve", "save the cached prefix's KV [2, L, T, D] to a file (torch.save); exit 1 on a miss", _retrieve
    )
    rt.add_argument("--out", required=True, help="where to write the tensor (.pt)")
    so = token_cmd("store", "store a KV tensor file ([2, L, T, D], torch.save) under token ids", _store)
    so.add_argument("--kv", required=True, help="the tensor file (.pt)")
    so.add_argument("--overwrite", action="store_true", help="replace chunks that are already stored")
    ex = token_cmd("export", "write the cached prefix to a KV bundle (.kvb); exit 1 on a miss", _export)
    ex.add_argument("-o", "--out", required=True, help="the bundle file to write")
    ex.add_argument("--note", default="", help="free text kept in the bundle (e.g. the edit that made it)")
    im = sub.add_parser(
        "import",
        help="store a KV bundle's KV (checked first: a bad bundle stores nothing)",
        description="Store a KV bundle's KV under its token ids. Every checksum is verified first; a "
        "server with another chunk size gets the whole chunks of its size.",
    )
    _client_flags(im)
    im.add_argument("bundle", help="the bundle file (.kvb)")
    im.add_argument("--model", help="the model to store under (default: the bundle's)")
    im.add_argument("--cache-salt", help="namespace (default: the bundle's)")
    im.add_argument("--overwrite", action="store_true", help="replace chunks that are already stored")
    im.add_argument(
        "--allow-other-model", action="store_true", help="store under --model although the bundle names another"
    )
    im.set_defaults(func=_import)
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
    ev.set_defaults(func=_events)
    kg = sub.add_parser(
        "keygen",
        help="write a CURVE keypair: NAME.key (public) and NAME.key_secret (0600)",
        description="Write a CURVE keypair for a server (--curve-secret-key) or a client (--client-key); give "
        "a client's NAME.key to the server's --curve-authorized-dir and the server's NAME.key to its clients "
        "(--server-key). Existing files are never overwritten.",
    )
    kg.add_argument("directory", help="where to write the two files (created 0700 if missing)")
    kg.add_argument("--name", default="kvdock", help="the files' base name (default kvdock)")
    kg.set_defaults(func=_keygen)
    from kvdock.cli.inspection import add_commands

    add_commands(sub, token_cmd, _token_ids)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (KVDockError, OSError) as e:
        print(f"kvdock {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

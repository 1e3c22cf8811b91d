"""The ``kvdock`` command: serve, keygen, status, register, lookup, retrieve, store, export, import,
inspect, diff, events."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pickle
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvdock import __version__
from kvdock.cli.events import add_events_command
from kvdock.cli.keys import add_key_flags, keys, token
from kvdock.cli.serve import add_serve_flags, serve_command
from kvdock.config import DEFAULT_HTTP_URL, DEFAULT_URL, MAX_NAME_LEN
from kvdock.errors import ConfigError, KVDockError, UnknownModelError
from kvdock.layout import KV_LATENT, KV_PAIR

if TYPE_CHECKING:
    from kvdock.layout import KVGeometry


def _status(args: argparse.Namespace) -> int:
    from kvdock.httpjson import get_json

    print(json.dumps(get_json(args.http_url, "/status", args.timeout, token(args)), indent=2))
    return 0


def _register(args: argparse.Namespace) -> int:
    """Register a layout from flags or a HuggingFace config (no torch: see cli/light.py)."""
    from kvdock.cli.light import register
    from kvdock.layout import KVGeometry

    geo = dict(num_layers=args.num_layers, num_kv_heads=args.num_kv_heads, head_dim=args.head_dim, dtype=args.dtype)
    kv_kind = args.kv_kind
    if args.hf_config:
        try:
            hf = KVGeometry.from_hf_config(json.loads(Path(args.hf_config).read_text()))
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot use {args.hf_config}: {e}") from None
        # explicit flags win over the config file
        geo = {k: v if v is not None else getattr(hf, k) for k, v in geo.items()}
        kv_kind = kv_kind or hf.kv_kind
    missing = [k for k, v in geo.items() if v is None]
    if missing:
        raise ConfigError(f"missing {', '.join('--' + k.replace('_', '-') for k in missing)} (or give --hf-config)")
    geometry = KVGeometry(
        geo["num_layers"], geo["num_kv_heads"], geo["head_dim"], geo["dtype"], kv_kind or KV_PAIR,
        world_size=args.world_size, total_kv_heads=args.total_kv_heads, pp_size=args.pp_size,
    )  # fmt: skip
    lay = _layout(args.model, geometry, args.tokens_per_block, args.kv_format, args.fingerprint)
    reg = register(args.url, lay, args.timeout, _admin_token(args), **keys(args))
    print(json.dumps({"model_name": lay.model_name, "created": reg.created, "chunk_nbytes": reg.slot_nbytes}))
    return 0


def _admin_token(args: argparse.Namespace) -> str:
    return str(args.admin_token if args.admin_token is not None else os.environ.get("KVDOCK_ADMIN_TOKEN", ""))


def _layout(model: str, geometry: KVGeometry, tokens_per_block: int, kv_format: str, fingerprint: str = "") -> Any:
    """The ModelLayout the SDK's make_layout would build (checked: ConfigError naming the value)."""
    from kvdock.layout import concrete_shape
    from kvdock.protocol import messages as m

    if not model or len(model) > MAX_NAME_LEN:
        raise ConfigError(f"--model must be 1 to {MAX_NAME_LEN} characters, got {len(model)}")
    if tokens_per_block <= 0:
        raise ConfigError(f"--tokens-per-block must be positive, got {tokens_per_block}")
    try:
        geometry = geometry.check()
        shape = concrete_shape(kv_format, 1, tokens_per_block, geometry.num_kv_heads, geometry.head_dim)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    engine = m.EngineInfo(kv_cache_layout=kv_format, view_shape=shape, pp_size=geometry.pp_size)
    return m.ModelLayout(model, geometry, tokens_per_block, engine, fingerprint)


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
    print(json.dumps(dataclasses.asdict(r)))  # every outcome, in flight and superseded too
    return 1 if args.overwrite and r.superseded_chunks else 0  # (an overwrite not kept whole, as store() raises)


def _lookup(args: argparse.Namespace) -> int:
    """What ``kvdock.sdk.lookup`` answers, without the SDK (no torch: see cli/light.py)."""
    from kvdock.cli.light import lookup

    tokens = _token_ids(args)
    hit = lookup(args.url, args.http_url, args.model, tokens, args.cache_salt, args.timeout, **keys(args))
    print(json.dumps({"hit_tokens": hit, "tokens": len(tokens)}))
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
    registered = False
    if args.register:
        from kvdock.cli.light import register

        lay = _layout(model, manifest.geometry, 16, "NHD")
        registered = register(args.url, lay, args.timeout, _admin_token(args), **keys(args)).created
    try:
        ctx = sdk.connect(args.url, args.http_url, model, args.timeout, **keys(args))
    except UnknownModelError as e:
        raise UnknownModelError(
            f"{e}. The bundle carries its geometry: add --register to register {model!r} from it "
            "(with --admin-token when the server has one)"
        ) from None
    with ctx:
        r = sdk.import_bundle(ctx, bundle, args.cache_salt, args.overwrite, args.allow_other_model)
    out = {
        "model_name": model,
        "tokens": r.tokens,
        "dropped_tokens": r.dropped_tokens,
        **dataclasses.asdict(r.stored),
        "note": manifest.note,
    }
    if args.register:
        out["registered"] = registered
    print(json.dumps(out))
    return 1 if args.overwrite and r.stored.superseded_chunks else 0


def _keygen(args: argparse.Namespace) -> int:
    from kvdock.transport.curve import keygen

    public, secret = keygen(args.directory, args.name)
    print(json.dumps({"public": str(public), "secret": str(secret)}))
    return 0


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
            "--config TOML file; CLI > env > file > default. The first log line says what it takes "
            "(L1 memory, L2 disk, L3)."
        ),
    )
    add_serve_flags(s)
    s.set_defaults(func=serve_command)

    st = sub.add_parser("status", help="print a server's /status")
    _client_flags(st)
    st.set_defaults(func=_status)

    r = sub.add_parser("register", help="register a model's KV layout without an engine")
    _client_flags(r)
    r.add_argument("--model", required=True, help="model name clients will use")
    r.add_argument("--hf-config", help="HuggingFace config.json to read the geometry from (flags given win)")
    r.add_argument("--num-layers", type=int, help="layers (of each pipeline stage with --pp-size)")
    r.add_argument("--num-kv-heads", type=int, help="KV heads of each tensor-parallel rank (MLA: 1)")
    r.add_argument("--head-dim", type=int, help="head dimension (MLA: kv_lora_rank + qk_rope_head_dim)")
    r.add_argument("--dtype", help="float32, bfloat16, float16, ...")
    r.add_argument(
        "--kv-kind",
        choices=(KV_PAIR, KV_LATENT),
        help=f"{KV_PAIR}: K and V per head (default); {KV_LATENT}: an MLA latent, one per token "
        "(default with --hf-config: what the config says)",
    )
    r.add_argument("--world-size", type=int, default=1, help="tensor-parallel ranks (default 1)")
    r.add_argument(
        "--total-kv-heads",
        type=int,
        default=0,
        help="the model's KV heads over all ranks, when fewer than --world-size x --num-kv-heads "
        "(replicated heads; default: that product)",
    )
    r.add_argument("--pp-size", type=int, default=1, help="pipeline stages of --num-layers layers each (default 1)")
    r.add_argument("--tokens-per-block", type=int, default=16, help="the engine's block size in tokens (default 16)")
    r.add_argument("--kv-format", default="NHD", help="the engine's axis order of a block: NHD (default) or HND")
    r.add_argument(
        "--fingerprint", default="", help="what identifies the weights beyond the shapes (default: none asserted)"
    )
    r.add_argument("--admin-token", help="the server's admin token, if it has one (default: $KVDOCK_ADMIN_TOKEN)")
    r.set_defaults(func=_register)

    def token_cmd(name: str, help: str, func: object) -> argparse.ArgumentParser:
        c = sub.add_parser(name, help=help, description=help)
        _client_flags(c)
        c.add_argument("--model", required=True, help="the registered model name")
        c.add_argument("--cache-salt", default="", help="namespace of the tokens (default: none)")
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
    so.add_argument(
        "--overwrite", action="store_true", help="replace chunks that are already stored (exit 1 if not kept whole)"
    )
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
    im.add_argument(
        "--overwrite", action="store_true", help="replace chunks that are already stored (exit 1 if not kept whole)"
    )
    im.add_argument(
        "--allow-other-model", action="store_true", help="store under --model although the bundle names another"
    )
    im.add_argument(
        "--register",
        action="store_true",
        help="register the model from the bundle's geometry first if the server does not know it",
    )
    im.add_argument(
        "--admin-token", help="with --register: the server's admin token, if it has one (default: $KVDOCK_ADMIN_TOKEN)"
    )
    im.set_defaults(func=_import)
    add_events_command(sub)
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


# the optional packages a command may need, and the extra that installs each (pyproject.toml)
EXTRAS = {"torch": "sdk", "safetensors": "sdk", "transformers": "hf", "matplotlib": "plot"}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ModuleNotFoundError as e:
        extra = EXTRAS.get((e.name or "").partition(".")[0])
        if extra is None:
            raise
        need = f"this command needs {e.name}: pip install 'kvdock[{extra}]'"
        print(f"kvdock {args.command}: error: {need}", file=sys.stderr)
        return 2
    except (KVDockError, OSError) as e:
        print(f"kvdock {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

"""``kvdock serve``: its flags are generated from :class:`~kvdock.config.ServerConfig` (one flag per
field, its help from the field's metadata, its default from the field: written nowhere else)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import signal

from kvdock.config import SIZE_FIELDS, ServerConfig, load_server_config, startup_line, with_sizes

_TYPES: dict[str, type] = {"int": int, "float": float, "str": str}


def flag(name: str) -> str:
    """The command-line flag of ServerConfig field ``name``."""
    return "--" + name.replace("_", "-")


def add_serve_flags(p: argparse.ArgumentParser) -> None:
    """One flag per ServerConfig field. Every flag defaults to None ("not given"), so that the
    environment, the config file and then the field's default apply (load_server_config)."""
    p.add_argument("--config", help="TOML config file, one key per flag (also KVDOCK_CONFIG)")
    for f in dataclasses.fields(ServerConfig):
        text = str(f.metadata["help"])
        if f.default not in ("", 0, False) and "default" not in text:
            text += f" (default {f.default})"
        text = f"{text}; env KVDOCK_{f.name.upper()}".replace("%", "%%")
        kind = str(f.type)
        if kind == "bool":
            p.add_argument(flag(f.name), action="store_true", default=None, help=text)
        else:
            parse = str if f.name in SIZE_FIELDS else _TYPES[kind]  # sizes: "2GiB", parsed by load_server_config
            p.add_argument(flag(f.name), type=parse, default=None, metavar=f.metadata.get("metavar"), help=text)


def serve_command(args: argparse.Namespace) -> int:
    """Run a server until SIGINT/SIGTERM, after one log line saying what it takes from the machine."""
    from kvdock.server.launch import serve

    cli = {f.name: getattr(args, f.name) for f in dataclasses.fields(ServerConfig)}
    given = load_server_config(cli, config_file=args.config)
    logging.basicConfig(level=given.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # until the event loop installs its own handlers, SIGTERM unwinds like Ctrl-C (cleanup runs)
    signal.signal(signal.SIGTERM, _interrupt)
    config = with_sizes(given)
    logging.getLogger("kvdock.server").info("%s", startup_line(config, given))
    asyncio.run(serve(config))
    return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt

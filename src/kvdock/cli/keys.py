"""The flags every client command takes to prove who it is: ``--server-key``, ``--client-key`` (CURVE)
and ``--token`` (a tenant's)."""

from __future__ import annotations

import argparse
import os
from typing import Any

from kvdock.config import TOKEN_ENV
from kvdock.transport.curve import CLIENT_KEY_ENV, SERVER_KEY_ENV, ClientCurve, resolve_client


def add_key_flags(p: argparse.ArgumentParser, token: bool = True) -> None:
    p.add_argument("--server-key", help=f"the server's public certificate, for CURVE (default: ${SERVER_KEY_ENV})")
    p.add_argument("--client-key", help=f"this client's secret certificate, for CURVE (default: ${CLIENT_KEY_ENV})")
    if token:
        p.add_argument("--token", help=f"a tenant's token, for a server with tenants (default: ${TOKEN_ENV})")


def keys(args: argparse.Namespace) -> dict[str, Any]:
    """The SDK's keyword arguments for the flags (unset flags fall back to the environment)."""
    return {"server_key": args.server_key, "client_key": args.client_key, "token": args.token}


def token(args: argparse.Namespace) -> str:
    """``--token``, else the environment's (for the calls that are not the SDK's: HTTP, events)."""
    return str(args.token or os.environ.get(TOKEN_ENV, ""))


def client_keys(args: argparse.Namespace) -> ClientCurve | None:
    """The flags (else the environment) as CURVE settings; ConfigError for unusable ones."""
    return resolve_client(args.server_key, args.client_key)

"""``kvdock inspect`` and ``kvdock diff``: reports on cached prefixes, as text or ``--json``."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvdock.cli.keys import keys
from kvdock.errors import ConfigError

if TYPE_CHECKING:  # the SDK imports torch: not for every kvdock command
    from kvdock.sdk.inspection import Inspection, PrefixDiff


def inspect_command(args: argparse.Namespace, token_ids: Callable[[argparse.Namespace], list[int]]) -> int:
    """Print the inspection of the tokens' prefix; with ``--plot``, also draw its norms. Exit 0."""
    from kvdock import sdk
    from kvdock.sdk.inspection import check_plot_path

    tokens = token_ids(args)
    if args.plot:
        check_plot_path(args.plot)  # before the work: a bad path fails at once
    with sdk.connect(args.url, args.http_url, args.model, args.timeout, **keys(args)) as ctx:
        found = sdk.inspect_prefix(ctx, tokens, args.cache_salt)
    print(json.dumps(found.to_dict()) if args.json else render_inspection(found, len(tokens)))
    if args.plot and found.hit_tokens:
        sdk.plot_norms(found, args.plot)
    return 0


def render_inspection(found: Inspection, asked: int) -> str:
    chunks = len(found.chunks)
    hit = found.hit_tokens // found.chunk_size if found.chunk_size else 0
    salt = f", cache_salt {found.cache_salt!r}" if found.cache_salt else ""
    lines = [
        f"model {found.model_name!r}{salt}: {found.hit_tokens} of {asked} tokens cached "
        f"({hit} of {chunks} whole chunks of {found.chunk_size})",
        *([f"tiers down (not asked): {', '.join(found.unreachable_tiers)}"] if found.unreachable_tiers else []),
        "",
        f"{'chunk':>5}  {'tokens':>13}  {'tiers':<12} {'bytes':>10}  blake3",
    ]
    for c in found.chunks:
        span = f"{c.start}-{c.start + found.chunk_size - 1}"
        tiers = ",".join(c.tiers) or "-"
        lines.append(
            f"{c.index:>5}  {span:>13}  {tiers:<12} {c.nbytes:>10}  {c.blake3 or '(not in the cached prefix)'}"
        )
    if found.k_norms:
        lines += ["", f"{'layer':>5}  {'K norm':>12}  {'V norm':>12}"]
        v = found.v_norms or [float("nan")] * len(found.k_norms)
        lines += [f"{i:>5}  {k:>12.6g}  {vv:>12.6g}" for i, (k, vv) in enumerate(zip(found.k_norms, v, strict=True))]
    return "\n".join(lines)


def diff_command(args: argparse.Namespace, token_ids: Callable[[argparse.Namespace], list[int]]) -> int:
    """Compare two cached prefixes; exit 0 when identical, 1 when they differ (like diff(1))."""
    from kvdock import sdk

    mine = token_ids(args)
    if not (args.other_tokens or args.other_tokens_file):
        raise ConfigError("give the other prompt's token ids: --other-tokens or --other-tokens-file")
    theirs = token_ids(argparse.Namespace(tokens=args.other_tokens, tokens_file=args.other_tokens_file))
    with sdk.connect(args.url, args.http_url, args.model, args.timeout, **keys(args)) as ctx:
        if args.other_model and args.other_model != args.model:
            with sdk.connect(args.url, args.http_url, args.other_model, args.timeout, **keys(args)) as other:
                d = sdk.diff_prefixes(ctx, mine, theirs, args.cache_salt, args.other_cache_salt, other)
        else:
            d = sdk.diff_prefixes(ctx, mine, theirs, args.cache_salt, args.other_cache_salt)
    print(json.dumps(d.to_dict()) if args.json else render_diff(d))
    return 0 if d.identical else 1


def render_diff(d: PrefixDiff) -> str:
    head = f"cached: {d.tokens} and {d.other_tokens} tokens; compared the first {d.compared_tokens}"
    if not d.compared_tokens:
        return head + "\nnothing to compare"
    if d.identical:
        return head + "\nidentical"
    first = "none" if d.first_differing_chunk is None else str(d.first_differing_chunk)
    lines = [head, f"first differing chunk: {first}"]
    if d.k_max_abs:
        lines += ["", f"{'layer':>5}  {'K max |diff|':>14}  {'V max |diff|':>14}"]
        v = d.v_max_abs or [float("nan")] * len(d.k_max_abs)
        lines += [f"{i:>5}  {k:>14.6g}  {vv:>14.6g}" for i, (k, vv) in enumerate(zip(d.k_max_abs, v, strict=True))]
    return "\n".join(lines)


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser],
                 token_cmd: Callable[..., argparse.ArgumentParser],
                 token_ids: Callable[[argparse.Namespace], list[int]]) -> None:  # fmt: skip
    """Add ``inspect`` and ``diff`` to the ``kvdock`` parser (``token_cmd``: main's maker of a
    command that takes --model, --cache-salt and token ids)."""
    ins = token_cmd(
        "inspect",
        "per chunk of the tokens: the tiers holding it, its size and checksum; per layer the K and V norms",
        lambda args: inspect_command(args, token_ids),
    )
    ins.add_argument("--plot", metavar="OUT.png", help="also draw the per-layer norms to this image (matplotlib)")
    ins.add_argument("--json", action="store_true", help="print JSON instead of a table")
    df = token_cmd(
        "diff",
        "compare two cached prefixes: max |difference| per layer, the first differing chunk; exit 1 if they differ",
        lambda args: diff_command(args, token_ids),
    )
    df.add_argument("--other-tokens", help="the other prompt's token ids, comma or space separated")
    df.add_argument("--other-tokens-file", help="... or a JSON list of them")
    df.add_argument("--other-cache-salt", help="the other prompt's namespace (default: --cache-salt)")
    df.add_argument("--other-model", help="the other prompt's model, same layers and hidden size (default: --model)")
    df.add_argument("--json", action="store_true", help="print JSON instead of a table")

"""`ft top`: a live terminal view of a running server (see `freetoken.tui`)."""

from __future__ import annotations

import argparse

from freetoken.cli.client import add_server_args


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add `ft top` and its flags to the subcommands of `ft` (`freetoken.cli.main.build_parser`)."""
    p = sub.add_parser(
        "top",
        help="live view of a running server: tok/s, latency, expert-cache split per layer, queue",
        description="A live view of a running freetoken server, refreshed twice a second from /v1/stats: decode "
        "and prefill tok/s, TTFT p50/p99, the expert cache's hit/fill/cpu split per layer, q, measured against "
        "profiled bandwidths, slot and KV occupancy, the prefix cache (when the server has one) and the requests "
        "in flight. q quits. Plain text when not on a terminal; no colour with NO_COLOR.",
    )
    add_server_args(p)
    p.add_argument("--once", action="store_true", help="print one frame and exit (for scripts)")
    p.set_defaults(func=run, parser=p)


def run(args: argparse.Namespace) -> int:
    """Start the view (imports rich only for this verb)."""
    from freetoken.tui.app import run_top

    return run_top(args.server, args.api_key, once=args.once)

"""`ft ctl status`: what a running server serves and how it is doing, as one short report (or --json)."""

from __future__ import annotations

import argparse
import json
import sys

from freetoken.cli.client import ServerError, add_server_args, base_url, get_json


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add `ft ctl` and its flags to the subcommands of `ft` (`freetoken.cli.main.build_parser`)."""
    p = sub.add_parser("ctl", help="talk to a running server", description="Talk to a running freetoken server.")
    verbs = p.add_subparsers(dest="ctl_command", required=True, metavar="VERB")
    status = verbs.add_parser(
        "status",
        help="the served model, backend, caches and requests of a running server",
        description="Print the served model, its context, the expert backend and its slots, KV-cache use, "
        "requests and throughput of a running server (from /v1/models and /v1/stats).",
    )
    add_server_args(status)
    status.add_argument("--json", action="store_true", help="print /v1/stats as JSON instead")
    status.set_defaults(func=run_status, parser=status)
    p.set_defaults(parser=p)


def status_lines(models: dict, stats: dict) -> list[str]:
    """The report's lines from ``GET /v1/models`` and ``GET /v1/stats`` bodies."""
    card = (models.get("data") or [{}])[0]
    server = stats.get("server") or {}
    moe = stats.get("moe_backend") or {}
    total, free = stats.get("kv_blocks_total", 0), stats.get("kv_blocks_free", 0)
    lines = [
        f"model      {card.get('id', '?')} (context {card.get('max_model_len', '?')} tokens)",
        f"backend    {moe.get('backend', '?')}",
    ]
    if moe.get("num_slots") is not None:
        gb = moe["num_slots"] * moe.get("expert_nbytes", 0) / 1e9
        lines.append(f"experts    {moe.get('num_resident', 0)}/{moe['num_slots']} slots resident ({gb:.2f} GB)")
    lines += [
        f"kv cache   {total - free}/{total} blocks in use",
        (
            f"requests   {stats.get('num_running', 0)} running, {stats.get('num_waiting', 0)} waiting, "
            f"{server.get('num_requests', 0)} answered"
        ),
        (
            f"tokens     {server.get('num_generation_tokens', 0)} generated, "
            f"{server.get('num_prompt_tokens', 0)} prompt; decode {server.get('decode_tokens_per_s', 0):.1f} tok/s"
        ),
    ]
    if isinstance(stats.get("prefix_cache"), dict):
        items = ", ".join(f"{k} {v}" for k, v in stats["prefix_cache"].items() if isinstance(v, (int, float)))
        lines.append(f"prefix     {items}")
    return lines


def run_status(args: argparse.Namespace) -> int:
    """Print the status report; 1 with a one-line reason when the server does not answer."""
    try:
        stats = get_json(args.server, "/v1/stats", args.api_key)
        if args.json:
            print(json.dumps(stats, indent=2))
            return 0
        models = get_json(args.server, "/v1/models", args.api_key)
    except ServerError as exc:
        print(f"ft ctl status: {exc}", file=sys.stderr)
        return 1
    print(f"server     {base_url(args.server)}")
    print("\n".join(status_lines(models, stats)))
    return 0

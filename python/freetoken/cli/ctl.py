"""`ft ctl status`: what a running server serves and how it is doing, as one short report (or --json); `ft ctl cache`:
the expert-slot cache's and the KV cache's sizes, and resizing them while the server serves (`POST /v1/cache/resize`,
`freetoken.engine.resize`)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable

from freetoken.cli.client import ServerError, add_server_args, base_url, get_json, post_json


def _positive(kind: type) -> Callable[[str], float | int]:
    """An argparse type: a finite number of `kind` above 0 (the flag is named in argparse's message), so a bad size
    is refused before the server is asked, in the flag's own spelling."""

    def parse(text: str) -> float | int:
        try:
            value = kind(text)
        except ValueError:
            what = "an integer" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not math.isfinite(value) or value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    return parse


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add `ft ctl` and its flags to the subcommands of `ft` (`freetoken.cli.main.build_parser`)."""
    p = sub.add_parser("ctl", help="talk to a running server", description="Talk to a running freetoken server.")
    add_server_args(p)
    verbs = p.add_subparsers(dest="ctl_command", required=True, metavar="VERB")
    status = verbs.add_parser(
        "status",
        help="the served model, backend, caches and requests of a running server",
        description="Print the served model, its context, the expert backend and its slots, KV-cache use, "
        "requests and throughput of a running server (from /v1/models and /v1/stats).",
    )
    add_server_args(status, inherited=True)
    status.add_argument("--json", action="store_true", help="print /v1/stats as JSON instead")
    status.set_defaults(func=run_status, parser=status)
    cache = verbs.add_parser(
        "cache",
        help="show or resize the expert-slot cache and the KV cache of a running server",
        description="Without sizes: print the expert-slot cache's and the KV cache's sizes and the memory headroom "
        "(GET /v1/cache). With sizes: resize them while the server serves (POST /v1/cache/resize): requests wait "
        "for it, resident experts and cached prefixes that still fit survive; a size that does not fit is "
        "refused before anything changes.",
    )
    add_server_args(cache, inherited=True)
    cache.add_argument("--expert-gb", type=_positive(float), help="the expert-slot cache's new size in GB (1e9 bytes)")
    cache.add_argument("--kv-gb", type=_positive(float), help="the KV cache's new size in GB (1e9 bytes)")
    cache.add_argument("--expert-slots", type=_positive(int), help="the expert-slot cache's new size in slots")
    cache.add_argument("--kv-blocks", type=_positive(int), help="the KV cache's new size in blocks")
    cache.add_argument("--json", action="store_true", help="print the server's JSON answer instead")
    cache.set_defaults(func=run_cache, parser=cache)
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
    kv_gb = ((stats.get("cache") or {}).get("kv_cache") or {}).get("gb")
    lines += [
        f"kv cache   {total - free}/{total} blocks in use" + ("" if kv_gb is None else f" ({kv_gb:.2f} GB)"),
        (
            f"requests   {stats.get('num_running', 0)} running, {stats.get('num_waiting', 0)} waiting, "
            f"{server.get('num_requests', 0)} answered"
        ),
        (
            f"tokens     {server.get('num_generation_tokens', 0)} generated, "
            f"{server.get('num_prompt_tokens', 0)} prompt; decode {server.get('decode_tokens_per_s', 0):.1f} tok/s"
        ),
    ]
    prefix = stats.get("prefix_cache")
    if isinstance(prefix, dict):
        lines.append(f"prefix     {_prefix_line(prefix)}")
    return lines


def _prefix_line(prefix: dict) -> str:
    """The prefix cache in one line: off, or the prompt tokens it served since start and the blocks it holds."""
    if prefix.get("enabled") is False:
        return "off (--no-prefix-cache, or a model it cannot serve yet)"
    hit, looked_up = prefix.get("num_hit_tokens", 0), prefix.get("num_lookup_tokens", 0)
    share = f"{100 * hit / looked_up:.0f}%" if looked_up else "–"
    return (
        f"{hit} of {looked_up} prompt tokens reused ({share}); {prefix.get('num_cached_blocks', 0)} blocks "
        f"cached, {prefix.get('num_evictions', 0)} evictions"
    )


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


def cache_lines(cache: dict) -> list[str]:
    """The report's lines from a ``GET /v1/cache`` body."""
    experts, kv, budget = cache.get("expert_cache"), cache.get("kv_cache") or {}, cache.get("budget") or {}
    lines = []
    if experts is None:
        lines.append("experts    no expert-slot cache (fused or cpu backend)")
    else:
        lines.append(
            f"experts    {experts['gb']:.4g} GB: {experts['num_slots']} slots of "
            f"{experts['slot_nbytes'] / 1e6:.3g} MB, "
            f"{experts['num_resident']} resident of {experts['num_experts']} experts ({experts['policy']})"
        )
    lines.append(
        f"kv cache   {kv.get('gb', 0):.4g} GB: {kv.get('num_blocks')} blocks x {kv.get('block_size')} tokens, "
        f"{kv.get('num_held_blocks')} held, {kv.get('num_cached_blocks')} cached prefix blocks"
    )
    headroom = budget.get("headroom_gb")
    lines.append("headroom   " + ("unknown" if headroom is None else f"{headroom:.4g} GB ({budget.get('bounded_by')})"))
    if cache.get("resizing"):
        lines.append("resizing   a resize is running")
    return lines


def describe(answer: dict) -> str:
    """One line for a resize's answer: each cache's old and new size, what survived, the time."""
    parts = []
    before, after = answer["before"], answer["after"]
    if before["expert_cache"] is not None and before["expert_cache"]["num_slots"] != after["expert_cache"]["num_slots"]:
        b, a = before["expert_cache"], after["expert_cache"]
        parts.append(
            f"expert cache {b['gb']:g} -> {a['gb']:g} GB ({b['num_slots']} -> {a['num_slots']} slots, "
            f"{a['num_resident']} of {b['num_resident']} resident experts kept)"
        )
    b, a = before["kv_cache"], after["kv_cache"]
    if b["num_blocks"] != a["num_blocks"]:
        parts.append(
            f"KV cache {b['gb']:g} -> {a['gb']:g} GB ({b['num_tokens']} -> {a['num_tokens']} tokens, "
            f"{a['num_cached_blocks']} of {b['num_cached_blocks']} prefix blocks kept)"
        )
    return "; ".join(parts) or "sizes unchanged"


def run_cache(args: argparse.Namespace) -> int:
    """Print the caches' sizes, or resize them and print one line; 1 with a one-line reason on failure."""
    sizes = {name: getattr(args, name) for name in ("expert_gb", "kv_gb", "expert_slots", "kv_blocks")}
    sizes = {name: value for name, value in sizes.items() if value is not None}
    try:
        if not sizes:
            cache = get_json(args.server, "/v1/cache", args.api_key)
            print(json.dumps(cache, indent=2) if args.json else "\n".join(cache_lines(cache)))
            return 0
        answer = post_json(args.server, "/v1/cache/resize", sizes, args.api_key)
    except ServerError as exc:
        print(f"ft ctl cache: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(answer, indent=2))
    else:
        print(f"resized in {answer['seconds']:.2f} s: {describe(answer)}" + "".join(f"; {n}" for n in answer["notes"]))
    return 0

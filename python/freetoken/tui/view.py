"""One frame of `ft top`, drawn from stats snapshots (``GET /v1/stats``: `freetoken.server.telemetry`).

`Frame` turns the latest snapshot, and the one before it, into a rich renderable: pure, so tests render recorded
snapshots through rich's console recording. Rates of the expert cache's counters (the split of the last interval)
come from the difference of the two snapshots; decode/prefill tok/s and the latency percentiles come from the
server's own figures. Keys that a server does not report (a fused backend has no layers, a prefix cache may not
exist yet) leave their panel out rather than show zeros.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from freetoken.server.telemetry import layer_split

# Shades of the per-layer heat map, empty to full (a fraction f picks SHADES[round(f * (len - 1))]).
SHADES = " ░▒▓█"
SPLIT_STYLES = {"hit": "green", "fill": "yellow", "cpu": "blue"}
MAX_IN_FLIGHT_ROWS = 8


@dataclass
class Frame:
    """The inputs of one frame.

    Attributes:
        stats: the latest snapshot, or None before the first answer.
        previous: the snapshot before it (for the last interval's split), or None.
        server: the server's URL (shown in the title).
        status: None while the server answers; else why it does not (the last numbers stay on screen).
        live: False for `ft top --once`'s single frame: its header leaves out "live" (nothing is redrawn); a
            `status` still shows.
        quit_hint: how the view is left, at the header's end: "q quits" on a terminal, "Ctrl-C quits" where no key
            is read (frames into a pipe), "" for the one frame of --once.
    """

    stats: dict[str, Any] | None
    previous: dict[str, Any] | None = None
    server: str = ""
    status: str | None = None
    live: bool = True
    quit_hint: str = "q quits"

    def __rich__(self) -> RenderableType:
        """The frame: a header line and the panels the snapshot has data for."""
        parts: list[RenderableType] = [self._header()]
        if self.stats is not None:
            parts += [self._throughput(), self._requests()]
            moe = self.stats.get("moe_backend") or {}
            if layer_split(moe):
                parts.append(self._expert_cache(moe))
            if moe.get("bandwidth"):
                parts.append(self._bandwidth(moe["bandwidth"]))
            prefix = self.stats.get("prefix_cache")
            if isinstance(prefix, dict) and prefix.get("enabled", True):
                parts.append(self._prefix_cache(prefix))
        return Group(*parts)

    # -- panels ----------------------------------------------------------------------------------------------

    def _header(self) -> Text:
        stats = self.stats or {}
        server = stats.get("server") or {}
        moe = stats.get("moe_backend") or {}
        text = Text()
        text.append("freetoken ", style="bold")
        text.append(f"{server.get('model', '?')} ", style="bold cyan")
        text.append(f"backend {moe.get('backend', '?')}  {self.server}  ")
        if "uptime_s" in server:
            text.append(f"up {_duration(server['uptime_s'])}  ", style="dim")
        if self.status is not None:
            text.append(self.status, style="bold red")
        elif self.live:
            text.append("live", style="green")
        if self.quit_hint:
            # In the header, not below the panels: a view taller than the terminal is cropped at the bottom.
            text.append(f"  {self.quit_hint}", style="dim")
        text.rstrip()  # the separator after the last field, when --once leaves both out
        return text

    def _throughput(self) -> Panel:
        server = self.stats.get("server") or {}
        table = Table.grid(padding=(0, 3))
        for _ in range(4):
            table.add_column()
        ttft, tpot = server.get("ttft_s") or {}, server.get("tpot_s") or {}
        table.add_row(
            _figure("decode tok/s", _num(server.get("decode_tokens_per_s"))),
            _figure("prefill tok/s", _num(server.get("prefill_tokens_per_s"))),
            _figure("TTFT p50 / p99", f"{_ms(ttft.get('p50'))} / {_ms(ttft.get('p99'))}"),
            _figure("time/token p50", _ms(tpot.get("p50"))),
        )
        by_status = server.get("num_requests_by_status") or {}
        statuses = " ".join(f"{code}:{n}" for code, n in sorted(by_status.items())) or "none yet"
        table.add_row(
            _figure("tokens generated", str(server.get("num_generation_tokens", "–"))),
            _figure("prompt tokens", str(server.get("num_prompt_tokens", "–"))),
            _figure("requests", statuses),
            _figure("engine steps", str(self.stats.get("num_steps", "–"))),
        )
        return Panel(table, title="throughput and latency", title_align="left")

    def _requests(self) -> Panel:
        stats = self.stats
        server = stats.get("server") or {}
        moe = stats.get("moe_backend") or {}
        total, free = stats.get("kv_blocks_total") or 0, stats.get("kv_blocks_free") or 0
        lines = Text()
        lines.append(f"running {stats.get('num_running', '–')}  waiting {stats.get('num_waiting', '–')}  ")
        sizes = stats.get("cache") or {}  # GB of each cache (`freetoken.engine.resize.cache_sizes`), when served
        lines.append("KV blocks ")
        lines.append_text(_bar(total - free, total))
        if sizes.get("kv_cache"):
            lines.append(f" ({sizes['kv_cache']['gb']:.3g} GB)")
        if moe.get("num_slots"):
            lines.append("  expert slots ")
            lines.append_text(_bar(moe.get("num_resident", 0), moe["num_slots"]))
            if sizes.get("expert_cache"):
                lines.append(f" ({sizes['expert_cache']['gb']:.3g} GB)")
        table = Table(box=None, padding=(0, 2), show_edge=False)
        for name in ("endpoint", "age", "prompt", "output"):
            table.add_column(name, style="dim" if name == "endpoint" else None)
        in_flight = server.get("in_flight") or []
        for request in in_flight[:MAX_IN_FLIGHT_ROWS]:
            table.add_row(
                request["endpoint"],
                f"{request['age_s']:.1f} s",
                str(request["num_prompt_tokens"]),
                str(request["num_output_tokens"]),
            )
        parts: list[RenderableType] = [lines]
        if in_flight:
            parts.append(table)
            if len(in_flight) > MAX_IN_FLIGHT_ROWS:
                parts.append(Text(f"… and {len(in_flight) - MAX_IN_FLIGHT_ROWS} more", style="dim"))
        return Panel(Group(*parts), title="requests and slots", title_align="left")

    def _expert_cache(self, moe: dict[str, Any]) -> Panel:
        split = layer_split(moe)
        window = "since start"
        if self.previous is not None:
            before = layer_split(self.previous.get("moe_backend") or {})
            # strict=False: a restarted server may report other layers; the check below then drops the delta
            delta = [
                tuple(a - b for a, b in zip(now, then, strict=False)) for now, then in zip(split, before, strict=False)
            ]
            # a restarted server's counters fall: its cumulative split is then the honest view
            if len(before) == len(split) and all(v >= 0 for row in delta for v in row) and any(map(any, delta)):
                split, window = delta, "last interval"
        hits, fills, cpu = (sum(row[i] for row in split) for i in range(3))
        all_ = hits + fills + cpu
        summary = Text(f"{window}: ")
        for name, value in (("hit", hits), ("fill", fills), ("cpu", cpu)):
            summary.append(f"{name} {_pct(value, all_)}  ", style=SPLIT_STYLES[name])
        if fills + cpu:
            summary.append(f"q (misses on the CPU) {cpu / (fills + cpu):.2f}", style="bold")
        if moe.get("q_star") is not None:
            summary.append(f"  q* {moe['q_star']:.2f}", style="bold")
        grid = Table.grid(padding=(0, 1))
        grid.add_column(justify="right")
        grid.add_column()
        for i, name in enumerate(("hit", "fill", "cpu")):
            strip = Text()
            for row in split:
                total = sum(row)
                strip.append(_shade(row[i] / total if total else 0.0), style=SPLIT_STYLES[name])
            grid.add_row(Text(name, style=SPLIT_STYLES[name]), strip)
        grid.add_row("", Text(f"{len(split)} MoE layers, one column each", style="dim"))
        return Panel(Group(summary, grid), title="expert cache: hit / fill / cpu per layer", title_align="left")

    def _bandwidth(self, bandwidth: dict[str, Any]) -> Panel:
        table = Table(box=None, padding=(0, 2), show_edge=False)
        for name in ("path", "measured GB/s", "profiled GB/s (by tokens per expert)", "measured / profiled"):
            table.add_column(name)
        for path, figures in bandwidth.items():
            profiled = figures.get("profiled_gbps") or {}
            curve = "  ".join(f"b{b}: {v:.1f}" for b, v in sorted(profiled.items(), key=lambda kv: int(kv[0])))
            ratio = figures.get("measured_over_profiled")
            table.add_row(
                path,
                _num(figures.get("measured_gbps")),
                curve or "no profile (ft bench bw)",
                "–" if ratio is None else f"{ratio:.2f}",
            )
        return Panel(table, title="miss-path bandwidth", title_align="left")

    def _prefix_cache(self, prefix: dict[str, Any]) -> Panel:
        """Hit rate (of the last interval when both snapshots have the counters), reuse, blocks, evictions; any
        other numeric key as it is."""
        text = Text()
        known = {
            "enabled",
            "hit_rate",
            "num_lookups",
            "num_lookup_tokens",
            "num_hit_tokens",
            "num_cached_blocks",
            "num_evictable_blocks",
            "num_evictions",
            "capacity_tokens",
        }
        hit, looked_up, window = prefix.get("num_hit_tokens"), prefix.get("num_lookup_tokens"), "since start"
        before = (self.previous or {}).get("prefix_cache") or {}
        if None not in (hit, looked_up, before.get("num_hit_tokens"), before.get("num_lookup_tokens")):
            if 0 < looked_up - before["num_lookup_tokens"] and before["num_hit_tokens"] <= hit:
                hit, looked_up = hit - before["num_hit_tokens"], looked_up - before["num_lookup_tokens"]
                window = "last interval"
        if hit is not None and looked_up is not None:
            text.append(f"hit {_pct(hit, looked_up)} ", style="bold green")
            text.append(f"({hit} of {looked_up} prompt tokens, {window})   ", style="dim")
        if "num_cached_blocks" in prefix:
            text.append(
                f"blocks {prefix['num_cached_blocks']} cached, {prefix.get('num_evictable_blocks', '–')} evictable   "
            )
        if "num_evictions" in prefix:
            text.append(f"evictions {prefix['num_evictions']}   ")
        if "capacity_tokens" in prefix:
            text.append(f"capacity {prefix['capacity_tokens']} tokens   ", style="dim")
        for key, value in prefix.items():
            if key in known or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            text.append(f"{key} {value:.3f}   " if isinstance(value, float) else f"{key} {value}   ")
        return Panel(text, title="prefix cache", title_align="left")


def _figure(label: str, value: str) -> Text:
    text = Text(value + "\n", style="bold")
    text.append(label, style="dim")
    return text


def _num(value: float | None) -> str:
    return "–" if value is None else f"{value:.1f}"


def _ms(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds * 1e3:.0f} ms"


def _pct(part: int, total: int) -> str:
    return "–" if not total else f"{100 * part / total:.0f}%"


def _duration(seconds: float) -> str:
    minutes, s = divmod(int(seconds), 60)
    hours, m = divmod(minutes, 60)
    return f"{hours}h{m:02d}m" if hours else f"{m}m{s:02d}s"


def _shade(fraction: float) -> str:
    return SHADES[round(max(0.0, min(1.0, fraction)) * (len(SHADES) - 1))]


def _bar(used: int, total: int, width: int = 20) -> Text:
    filled = round(width * used / total) if total else 0
    text = Text("█" * filled, style="magenta")
    text.append("·" * (width - filled), style="dim")
    text.append(f" {used}/{total}")
    return text

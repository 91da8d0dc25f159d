"""Request telemetry and the one stats snapshot that `/v1/stats`, `/metrics`, `ft top` and the status page read.

`Telemetry` times every HTTP request (an ASGI middleware): its endpoint (the route's path template), status and
end-to-end latency; and, for requests that generate, the time to the first token (TTFT), the time per output
token after it (TPOT), and the prompt and generated token counts as chunks arrive (`observe_chunk`, called where
the server reads the engine's stream). The figures go to `prometheus_client` metrics in the app's own registry
and to short windows of recent values, from which `snapshot` reports decode/prefill tok/s and p50/p99.

`snapshot` = the engine's `stats()` (`freetoken.engine.LLMEngine.stats`: requests, KV blocks, the expert
backend's per-layer counters, and whatever counters other parts add, such as a prefix cache's) plus a "server"
section from here. `/metrics` renders the same snapshot in Prometheus' text format (`EngineCollector`), so the
terminal view, the page and a scraper never disagree.

Metric names follow the Prometheus conventions: a `freetoken_` prefix, base units in the name (`_seconds`,
`_bytes`), `_total` on counters.
"""

from __future__ import annotations

import contextvars
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# Latency buckets (seconds): TTFT and end-to-end span milliseconds (a cached prompt on the GPU) to minutes (a long
# prompt through host experts); TPOT spans sub-millisecond to a second per token.
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TPOT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)
# tok/s is measured over this trailing window (seconds): long enough to smooth step granularity at ~2 refreshes/s.
RATE_WINDOW_S = 3.0
# p50/p99 are taken over this many most recent requests.
RECENT_REQUESTS = 1000
# The per-layer expert-cache counters exported with a `layer` label (bounded by the model's layer count, < 100).
LAYER_COUNTERS = {
    "hits": ("expert_cache_hits_total", "expert lookups served from a GPU slot"),
    "fills": ("expert_cache_fills_total", "missing experts copied host -> GPU slot"),
    "cpu_runs": ("expert_cache_cpu_runs_total", "missing experts run on the host CPU"),
    "evictions": ("expert_cache_evictions_total", "experts evicted from a GPU slot"),
    "bytes_h2d": ("expert_cache_h2d_bytes_total", "expert weight bytes copied host -> device by fills"),
    "bytes_cpu": ("expert_cache_cpu_read_bytes_total", "expert weight bytes read by host CPU runs"),
}

_current: contextvars.ContextVar[RequestRecord | None] = contextvars.ContextVar("freetoken_request", default=None)


@dataclass
class RequestRecord:
    """One HTTP request in flight.

    Attributes:
        telemetry: the app's `Telemetry`, which the request's chunks are counted into.
        endpoint: the route's path template (``/v1/chat/completions``), or "other" for unknown URLs.
        start_s: `time.monotonic()` when it arrived.
        first_token_s: monotonic time of its first generated token, None before it.
        last_token_s: monotonic time of its latest generated token.
        num_prompt_tokens: prompt tokens of its generations (summed over choices).
        num_output_tokens: tokens generated so far (summed over choices).
    """

    telemetry: Telemetry
    endpoint: str
    start_s: float
    first_token_s: float | None = None
    last_token_s: float | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    _prompted: set[str] = field(default_factory=set, repr=False)


def observe_chunk(stream_id: str, num_prompt_tokens: int, num_new_tokens: int) -> None:
    """Count one chunk of the engine's stream into the current HTTP request's record (the one whose context this
    runs in: `TelemetryMiddleware` sets it); a no-op outside a recorded request, as in engine tests.

    Args:
        stream_id: the engine request id; it tells a request's choices apart, so that each choice's prompt is
            counted once, when its first chunk arrives (its prefill is done by then).
        num_prompt_tokens: the chunk's `num_prompt_tokens`.
        num_new_tokens: tokens the chunk carries (``len(chunk.token_ids)``).
    """
    record = _current.get()
    if record is not None:
        record.telemetry.observe_chunk(record, stream_id, num_prompt_tokens, num_new_tokens)


class _RateWindow:
    """Rate of a cumulative counter over the trailing `RATE_WINDOW_S`: the counter is a step function that changes
    only at recorded samples, so its value at the window's start is the last sample at or before it."""

    def __init__(self, now_s: float) -> None:
        self.samples: deque[tuple[float, int]] = deque([(now_s, 0)])

    def record(self, now_s: float, total: int) -> None:
        self.samples.append((now_s, total))

    def rate(self, now_s: float, total: int) -> float:
        start = now_s - RATE_WINDOW_S
        while len(self.samples) >= 2 and self.samples[1][0] <= start:
            self.samples.popleft()
        return (total - self.samples[0][1]) / RATE_WINDOW_S


def quantile(values: Iterable[float], q: float) -> float | None:
    """The `q` quantile (0..1) of `values` by the nearest-rank method, None when there are none."""
    ordered = sorted(values)
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, max(0, int(q * len(ordered) + 0.5) - 1))]


class Telemetry:
    """Request metrics of one app, in its own `prometheus_client` registry (so two apps in one process, as in
    tests, never share counters), and the recent windows behind the snapshot's rates and percentiles.

    Args:
        engine: the served engine; its ``stats()`` is the engine part of every snapshot.
        served_model_name: the model name the snapshot reports.
    """

    def __init__(self, engine: Any, served_model_name: str) -> None:
        self.engine = engine
        self.served_model_name = served_model_name
        self.registry = CollectorRegistry(auto_describe=True)
        self.start_s = time.monotonic()
        self.requests = Counter(
            "freetoken_requests", "HTTP requests answered, by endpoint and status",
            ["endpoint", "status"], registry=self.registry,
        )  # fmt: skip
        self.e2e = Histogram(
            "freetoken_request_duration_seconds", "end-to-end request latency, arrival to last byte",
            ["endpoint"], buckets=LATENCY_BUCKETS_S, registry=self.registry,
        )  # fmt: skip
        self.ttft = Histogram(
            "freetoken_time_to_first_token_seconds", "request arrival to its first generated token",
            buckets=LATENCY_BUCKETS_S, registry=self.registry,
        )  # fmt: skip
        self.tpot = Histogram(
            "freetoken_time_per_output_token_seconds", "mean time per generated token after the first, per request",
            buckets=TPOT_BUCKETS_S, registry=self.registry,
        )  # fmt: skip
        self.prompt_tokens = Counter("freetoken_prompt_tokens", "prompt tokens prefilled", registry=self.registry)
        self.generation_tokens = Counter("freetoken_generation_tokens", "tokens generated", registry=self.registry)
        self.registry.register(EngineCollector(self))
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.prefill_rate = _RateWindow(self.start_s)
        self.decode_rate = _RateWindow(self.start_s)
        self.recent_ttft_s: deque[float] = deque(maxlen=RECENT_REQUESTS)
        self.recent_tpot_s: deque[float] = deque(maxlen=RECENT_REQUESTS)
        self.recent_e2e_s: deque[float] = deque(maxlen=RECENT_REQUESTS)
        self.in_flight: dict[int, RequestRecord] = {}
        self.num_by_status: dict[str, int] = {}

    # -- recording --------------------------------------------------------------------------------------------

    def observe_chunk(self, record: RequestRecord, stream_id: str, num_prompt_tokens: int, num_new_tokens: int) -> None:
        """Count one streamed chunk of `record` (see the module-level `observe_chunk`)."""
        now = time.monotonic()
        if stream_id not in record._prompted:
            record._prompted.add(stream_id)
            record.num_prompt_tokens += num_prompt_tokens
            self.num_prompt_tokens += num_prompt_tokens
            self.prompt_tokens.inc(num_prompt_tokens)
            self.prefill_rate.record(now, self.num_prompt_tokens)
        if num_new_tokens:
            if record.first_token_s is None:
                record.first_token_s = now
                self.ttft.observe(now - record.start_s)
                self.recent_ttft_s.append(now - record.start_s)
            record.last_token_s = now
            record.num_output_tokens += num_new_tokens
            self.num_generation_tokens += num_new_tokens
            self.generation_tokens.inc(num_new_tokens)
            self.decode_rate.record(now, self.num_generation_tokens)

    def _finish(self, record: RequestRecord, status: int) -> None:
        now = time.monotonic()
        self.requests.labels(record.endpoint, str(status)).inc()
        self.num_by_status[str(status)] = self.num_by_status.get(str(status), 0) + 1
        self.e2e.labels(record.endpoint).observe(now - record.start_s)
        self.recent_e2e_s.append(now - record.start_s)
        if record.first_token_s is not None and record.last_token_s is not None and record.num_output_tokens > 1:
            tpot = (record.last_token_s - record.first_token_s) / (record.num_output_tokens - 1)
            self.tpot.observe(tpot)
            self.recent_tpot_s.append(tpot)

    # -- reading ----------------------------------------------------------------------------------------------

    def server_stats(self) -> dict[str, Any]:
        """The snapshot's "server" section (JSON-able): model, uptime, request counts by status, token totals,
        decode/prefill tok/s over the last `RATE_WINDOW_S`, TTFT/TPOT/end-to-end p50 and p99 in seconds over the
        last `RECENT_REQUESTS` requests (None before any), and the requests in flight (oldest first)."""
        now = time.monotonic()

        def percentiles(values: deque[float]) -> dict[str, float | None]:
            return {"p50": quantile(values, 0.5), "p99": quantile(values, 0.99)}

        return {
            "model": self.served_model_name,
            "uptime_s": round(now - self.start_s, 3),
            "num_requests": sum(self.num_by_status.values()),
            "num_requests_by_status": dict(self.num_by_status),
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_generation_tokens": self.num_generation_tokens,
            "decode_tokens_per_s": round(self.decode_rate.rate(now, self.num_generation_tokens), 3),
            "prefill_tokens_per_s": round(self.prefill_rate.rate(now, self.num_prompt_tokens), 3),
            "ttft_s": percentiles(self.recent_ttft_s),
            "tpot_s": percentiles(self.recent_tpot_s),
            "e2e_s": percentiles(self.recent_e2e_s),
            "in_flight": [
                {
                    "endpoint": r.endpoint,
                    "age_s": round(now - r.start_s, 3),
                    "num_prompt_tokens": r.num_prompt_tokens,
                    "num_output_tokens": r.num_output_tokens,
                }
                for r in sorted(self.in_flight.values(), key=lambda r: r.start_s)
            ],
        }

    def snapshot(self) -> dict[str, Any]:
        """The engine's ``stats()`` with this server's section under "server" (JSON-able)."""
        return {**self.engine.stats(), "server": self.server_stats()}


# The status recorded for a request whose client left before any response began (a non-streaming request
# abandoned mid-generation, a body cut off): no status reached anyone, and it is not a server error. 499 is nginx's
# "client closed request".
CLIENT_CLOSED_REQUEST = 499


class TelemetryMiddleware:
    """ASGI middleware: one `RequestRecord` per HTTP request, made current for the request's tasks (so the
    streaming body's chunks are counted into it), and finished with the response's status (`CLIENT_CLOSED_REQUEST`
    when the client left before one began).

    The status page, `/metrics` and `/health` are not recorded: a scraper or an open page would otherwise
    dominate the request counts.
    """

    UNRECORDED = frozenset({"/", "/metrics", "/health", "/v1/stats"})

    def __init__(self, app: ASGIApp, telemetry: Telemetry) -> None:
        self.app = app
        self.telemetry = telemetry

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Run one request, recording it."""
        if scope["type"] != "http" or scope["path"] in self.UNRECORDED:
            await self.app(scope, receive, send)
            return
        record = RequestRecord(self.telemetry, endpoint=_endpoint(scope), start_s=time.monotonic())
        status: int | None = None
        disconnected = False

        async def recording_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        async def watching_receive() -> Message:
            nonlocal disconnected
            message = await receive()
            disconnected = disconnected or message["type"] == "http.disconnect"
            return message

        token = _current.set(record)
        self.telemetry.in_flight[id(record)] = record
        try:
            await self.app(scope, watching_receive, recording_send)
        finally:
            _current.reset(token)
            del self.telemetry.in_flight[id(record)]
            if status is None:  # no response began: the client left first (499), else the app failed (500)
                status = CLIENT_CLOSED_REQUEST if disconnected else 500
            self.telemetry._finish(record, status)


def _endpoint(scope: Scope) -> str:
    """The route template matching the request (bounded label values), else "other"."""
    from starlette.routing import Match

    app = scope.get("app")
    for route in getattr(getattr(app, "router", None), "routes", ()):
        match, _ = route.matches(scope)
        if match is Match.FULL:
            return getattr(route, "path", "other")
    return "other"


class EngineCollector(Collector):
    """Exports the engine part of `Telemetry.snapshot` at scrape time: queue depths, KV usage, engine steps, the
    expert cache's per-layer counters (label `layer`) and size, the measured and profiled bandwidths of both miss
    paths, and any numeric counters of a prefix cache, when the engine reports one."""

    def __init__(self, telemetry: Telemetry) -> None:
        self.telemetry = telemetry

    def describe(self) -> list[Metric]:
        """Nothing up front: the metrics depend on the engine's backend (prometheus_client then calls collect)."""
        return []

    def collect(self) -> Iterator[Metric]:
        """The metrics of one `Telemetry.snapshot`."""
        stats = self.telemetry.snapshot()
        server = stats["server"]
        yield _gauge("num_requests_running", "requests in the running batch", stats.get("num_running"))
        yield _gauge("num_requests_waiting", "requests waiting for a slot in the batch", stats.get("num_waiting"))
        yield _gauge("num_requests_in_flight", "HTTP requests in flight", len(server["in_flight"]))
        total, free = stats.get("kv_blocks_total"), stats.get("kv_blocks_free")
        yield _gauge("kv_cache_blocks", "paged KV-cache blocks", total)
        yield _gauge("kv_cache_free_blocks", "free paged KV-cache blocks", free)
        if total:
            yield _gauge("kv_cache_usage_ratio", "fraction of KV-cache blocks in use", (total - free) / total)
        yield _counter("engine_steps", "engine steps run", stats.get("num_steps"))
        yield _gauge(
            "decode_tokens_per_second",
            f"tokens generated per second over the last {RATE_WINDOW_S} s",
            server["decode_tokens_per_s"],
        )
        yield _gauge(
            "prefill_tokens_per_second",
            f"prompt tokens prefilled per second over the last {RATE_WINDOW_S} s",
            server["prefill_tokens_per_s"],
        )
        yield from _expert_cache_metrics(stats.get("moe_backend") or {})
        cache = stats.get("cache") or {}
        if cache.get("kv_cache"):
            yield _gauge("kv_cache_bytes", "bytes of the paged KV cache", cache["kv_cache"]["nbytes"])
        if cache.get("expert_cache"):
            yield _gauge("expert_cache_bytes", "bytes of the GPU expert-slot cache", cache["expert_cache"]["nbytes"])
        yield _counter("cache_resizes", "expert-slot / KV cache resizes done", cache.get("num_resizes"))
        prefix = stats.get("prefix_cache")
        if isinstance(prefix, dict) and prefix.get("enabled", True):
            yield from _section_metrics(prefix, PREFIX_CACHE_METRICS, "prefix_cache")
        kv_host = stats.get("kv_host")
        if isinstance(kv_host, dict):
            yield from _section_metrics(kv_host, KV_HOST_METRICS, "kv_host")
        checkpoints = stats.get("state_checkpoints")
        if isinstance(checkpoints, dict):
            yield from _section_metrics(checkpoints, STATE_CHECKPOINT_METRICS, "state_checkpoints")


# The prefix cache's counters (`freetoken.engine.prefix_cache.PrefixCache.stats`) -> (name, kind, help).
PREFIX_CACHE_METRICS = {
    "num_lookups": ("prefix_cache_lookups", "counter", "prompts looked up in the prefix cache"),
    "num_lookup_tokens": ("prefix_cache_lookup_tokens", "counter", "prompt tokens looked up in the prefix cache"),
    "num_hit_tokens": ("prefix_cache_hit_tokens", "counter", "prompt tokens reused from the prefix cache (cached)"),
    "num_evictions": ("prefix_cache_evictions", "counter", "blocks evicted from the prefix cache"),
    "hit_rate": ("prefix_cache_hit_ratio", "gauge", "hit tokens over looked-up tokens since start"),
    "num_cached_blocks": ("prefix_cache_blocks", "gauge", "KV blocks the prefix cache indexes"),
    "num_evictable_blocks": ("prefix_cache_evictable_blocks", "gauge", "cached blocks no request holds"),
    "capacity_tokens": ("prefix_cache_capacity_tokens", "gauge", "most tokens the prefix cache can hold"),
}


# The prefix cache's host-RAM tier (`freetoken.engine.kv_host.HostKVTier.stats`).
KV_HOST_METRICS = {
    "num_hit_tokens": ("kv_host_hit_tokens", "counter", "prompt tokens copied back from the KV host tier"),
    "num_skipped_tokens": (
        "kv_host_skipped_tokens",
        "counter",
        "host-tier prompt tokens prefilled again (below the crossover)",
    ),
    "bytes_h2d": ("kv_host_h2d_bytes", "counter", "bytes copied from the KV host tier to the device"),
    "bytes_d2h": ("kv_host_d2h_bytes", "counter", "bytes copied from the device KV cache to the host tier"),
    "num_demoted_blocks": ("kv_host_demoted_blocks", "counter", "KV blocks moved to the host tier"),
    "num_evicted_blocks": ("kv_host_evicted_blocks", "counter", "KV blocks evicted from the host tier"),
    "num_live_blocks": ("kv_host_blocks", "gauge", "KV blocks the host tier holds"),
    "capacity_tokens": ("kv_host_capacity_tokens", "gauge", "most tokens the KV host tier can hold"),
    "crossover_tokens": (
        "kv_host_crossover_tokens",
        "gauge",
        "host tokens from which copying back beats prefilling again",
    ),
}


# Hybrid models' state checkpoints (`freetoken.engine.state_checkpoints.StateCheckpoints.stats`).
STATE_CHECKPOINT_METRICS = {
    "num_restores": ("state_checkpoint_restores", "counter", "requests resumed from a recurrent-state snapshot"),
    "num_restored_tokens": ("state_checkpoint_restored_tokens", "counter", "prompt tokens not prefilled: restored"),
    "num_snapshots": ("state_checkpoint_snapshots", "counter", "recurrent-state snapshots taken"),
    "num_evicted": ("state_checkpoint_evictions", "counter", "snapshots evicted (least recently used)"),
    "num_invalidated": ("state_checkpoint_invalidations", "counter", "snapshots dropped with their KV blocks"),
    "num_demoted": ("state_checkpoint_demotions", "counter", "snapshots moved from the GPU to the host tier"),
    "num_live": ("state_checkpoint_live", "gauge", "snapshots held (GPU and host tier)"),
}


def _section_metrics(section: dict[str, Any], table: dict[str, tuple[str, str, str]], prefix: str) -> Iterator[Metric]:
    """`table`'s metrics for the keys of a stats section present, and any other numeric key as a gauge named
    `prefix`_key."""
    for key, value in section.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        name, kind, doc = table.get(key, (f"{prefix}_{key}", "gauge", f"{prefix.replace('_', ' ')} {key}"))
        yield _counter(name, doc, value) if kind == "counter" else _gauge(name, doc, value)


def _gauge(name: str, doc: str, value: float | None, labels: dict[str, str] | None = None) -> GaugeMetricFamily:
    family = GaugeMetricFamily("freetoken_" + name, doc, labels=list(labels or ()))
    if value is not None:
        family.add_metric(list((labels or {}).values()), value)
    return family


def _counter(name: str, doc: str, value: float | None) -> CounterMetricFamily:
    family = CounterMetricFamily("freetoken_" + name, doc)
    if value is not None:
        family.add_metric([], value)
    return family


def _expert_cache_metrics(moe: dict[str, Any]) -> Iterator[Metric]:
    yield _gauge("expert_cache_slots", "expert slots in the GPU expert cache", moe.get("num_slots"))
    yield _gauge("expert_cache_resident_experts", "experts resident in GPU slots", moe.get("num_resident"))
    yield _gauge("expert_size_bytes", "bytes of one expert's weights", moe.get("expert_nbytes"))
    layers = moe.get("layers") or {}
    for key, (name, doc) in LAYER_COUNTERS.items():
        values = layers.get(key)
        if values is None:
            continue
        family = CounterMetricFamily("freetoken_" + name, doc + " (per MoE layer)", labels=["layer"])
        for layer, value in enumerate(values):
            family.add_metric([str(layer)], value)
        yield family
    bandwidth = moe.get("bandwidth") or {}
    measured = GaugeMetricFamily(
        "freetoken_expert_bandwidth_measured_bytes_per_second",
        "bandwidth of a miss path measured while serving (EMA): pcie = host->device fills, cpu = host expert runs",
        labels=["path"],
    )
    profiled = GaugeMetricFamily(
        "freetoken_expert_bandwidth_profiled_bytes_per_second",
        "bandwidth of a miss path from the `ft bench bw` profile, by tokens per expert (batch)",
        labels=["path", "batch"],
    )
    for path, figures in bandwidth.items():
        if figures.get("measured_gbps") is not None:
            measured.add_metric([path], figures["measured_gbps"] * 1e9)
        for batch, gbps in sorted((figures.get("profiled_gbps") or {}).items()):
            profiled.add_metric([path, str(batch)], gbps * 1e9)
    yield measured
    yield profiled


def layer_split(moe: dict[str, Any]) -> list[tuple[int, int, int]]:
    """Per MoE layer (hits, fills, cpu runs) from the backend's cumulative counters; [] without them (fused)."""
    layers = moe.get("layers") or {}
    hits, fills, cpu = layers.get("hits"), layers.get("fills"), layers.get("cpu_runs")
    if not hits:
        return []
    return list(zip(hits, fills or [0] * len(hits), cpu or [0] * len(hits), strict=True))

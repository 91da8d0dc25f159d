"""GET /metrics (Prometheus text through prometheus_client) and the "server" section of GET /v1/stats: the figures
follow real requests on a real server, both read the same snapshot, and /metrics sits behind --api-key unless
--metrics-open lets loopback scrape it."""

from __future__ import annotations

import re
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import API_KEY, start_server
from freetoken.server.app import ApiMiddleware
from freetoken.server.telemetry import RATE_WINDOW_S, _RateWindow, quantile

CHAT = "/v1/chat/completions"


def scrape(http: httpx.Client, **kwargs) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of one /metrics answer."""
    response = http.get("/metrics", **kwargs)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    }


def value(metrics: dict, name: str, **labels: str) -> float:
    return metrics.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_follow_requests(http):
    before = scrape(http)
    stats_before = http.get("/v1/stats").json()["server"]
    prompt_text = "Read the failing test, find the cause, fix it, and run the suite again. " * 3  # a few KV blocks
    body = {"model": "m", "messages": [{"role": "user", "content": prompt_text}], "max_tokens": 6, "ignore_eos": True}
    usage = http.post(CHAT, json=body).json()["usage"]
    with http.stream("POST", CHAT, json=body | {"stream": True}) as response:
        assert response.status_code == 200 and sum(1 for _ in response.iter_lines()) > 2
    assert http.post(CHAT, json={"model": "m", "messages": "not a list"}).status_code == 400
    after = scrape(http)

    assert (
        value(after, "freetoken_requests_total", endpoint=CHAT, status="200")
        - value(before, "freetoken_requests_total", endpoint=CHAT, status="200")
        == 2
    )
    assert (
        value(after, "freetoken_requests_total", endpoint=CHAT, status="400")
        - value(before, "freetoken_requests_total", endpoint=CHAT, status="400")
        == 1
    )
    generated = value(after, "freetoken_generation_tokens_total") - value(before, "freetoken_generation_tokens_total")
    prompt = value(after, "freetoken_prompt_tokens_total") - value(before, "freetoken_prompt_tokens_total")
    assert generated == 2 * usage["completion_tokens"] and prompt == 2 * usage["prompt_tokens"]
    for histogram, count in (
        ("freetoken_time_to_first_token_seconds", 2),
        ("freetoken_time_per_output_token_seconds", 2),
    ):
        assert value(after, histogram + "_count") - value(before, histogram + "_count") == count
        assert value(after, histogram + "_sum") > value(before, histogram + "_sum")
    assert (
        value(after, "freetoken_request_duration_seconds_count", endpoint=CHAT)
        - value(before, "freetoken_request_duration_seconds_count", endpoint=CHAT)
        == 3
    )

    # engine and expert-cache figures: the demo model's 4 MoE layers, cpu backend
    assert value(after, "freetoken_kv_cache_blocks") > 0 and value(after, "freetoken_engine_steps_total") > 0
    cpu_runs = [value(after, "freetoken_expert_cache_cpu_runs_total", layer=str(i)) for i in range(4)]
    cpu_runs_before = [value(before, "freetoken_expert_cache_cpu_runs_total", layer=str(i)) for i in range(4)]
    assert all(a > b for a, b in zip(cpu_runs, cpu_runs_before, strict=True))
    assert value(after, "freetoken_expert_cache_cpu_read_bytes_total", layer="0") > 0
    assert ("freetoken_num_requests_waiting", ()) in after and ("freetoken_kv_cache_usage_ratio", ()) in after

    # /v1/stats's server section moved by the same amounts
    stats_after = http.get("/v1/stats").json()["server"]
    assert stats_after["num_generation_tokens"] - stats_before["num_generation_tokens"] == generated
    assert stats_after["num_prompt_tokens"] - stats_before["num_prompt_tokens"] == prompt
    assert stats_after["num_requests_by_status"]["400"] >= 1
    assert stats_after["ttft_s"]["p50"] > 0 and stats_after["tpot_s"]["p99"] >= stats_after["tpot_s"]["p50"]
    assert stats_after["in_flight"] == []
    # the prefix cache: an identical request reuses the first one's prompt blocks, and the counter says so
    cached = http.post(CHAT, json=body).json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    reused = scrape(http)
    assert cached > 0
    assert (
        value(reused, "freetoken_prefix_cache_hit_tokens_total")
        - value(after, "freetoken_prefix_cache_hit_tokens_total")
        == cached
    )
    assert (
        value(reused, "freetoken_prefix_cache_lookups_total") - value(after, "freetoken_prefix_cache_lookups_total")
        == 1
    )
    assert value(reused, "freetoken_prefix_cache_blocks") > 0
    # scrapes and stats reads are not requests
    assert ("freetoken_requests_total", (("endpoint", "/metrics"), ("status", "200"))) not in after


def test_a_client_that_leaves_before_the_response_is_a_499_not_a_500(http, server):
    """A non-streaming request abandoned mid-generation: no status reached anyone, and nothing failed in the server,
    so it is counted under 499 (nginx's "client closed request"), not 500."""
    before = scrape(http)
    body = {"model": "m", "messages": [{"role": "user", "content": "Go on and on."}], "max_tokens": 100_000}
    with httpx.Client(base_url=server.base_url, headers=http.headers, timeout=0.5) as client:
        with pytest.raises(httpx.ReadTimeout):
            client.post(CHAT, json=body | {"ignore_eos": True})
    deadline = time.monotonic() + 30
    while value(scrape(http), "freetoken_requests_total", endpoint=CHAT, status="499") == value(
        before, "freetoken_requests_total", endpoint=CHAT, status="499"
    ):
        assert time.monotonic() < deadline, "the abandoned request was never recorded"
        time.sleep(0.1)
    after = scrape(http)
    assert value(after, "freetoken_requests_total", endpoint=CHAT, status="500") == value(
        before, "freetoken_requests_total", endpoint=CHAT, status="500"
    )
    assert http.get("/v1/stats").json()["server"]["num_requests_by_status"]["499"] >= 1


# Name parts that are not base units (Prometheus naming: seconds, bytes, ratios; never ms, MB or percent).
NON_BASE_UNITS = {"ms", "milliseconds", "us", "microseconds", "minutes", "hours", "kb", "mb", "gb", "kib", "mib", "gib"}


def test_metric_names_follow_the_prometheus_conventions(http):
    """Every family: ``freetoken_`` and snake case; counters' samples end in ``_total``; base units only, named
    (histograms of time in ``_seconds``, byte figures in ``_bytes``, fractions in ``_ratio``, never percent)."""
    assert http.post(CHAT, json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    families = list(text_string_to_metric_families(http.get("/metrics").text))
    assert len(families) >= 20
    for family in families:
        name, parts = family.name, set(family.name.split("_"))
        assert re.fullmatch(r"freetoken_[a-z0-9_]+", name), name
        assert not parts & NON_BASE_UNITS and "percent" not in name, name
        if family.type == "counter":
            assert all(s.name.endswith(("_total", "_created")) for s in family.samples), name
        if family.type == "histogram":
            assert name.endswith("_seconds"), name
        if "bytes" in family.documentation.split() or "bytes" in parts:
            assert re.search(r"_bytes(_per_second)?$", name), name
        if "fraction" in family.documentation:
            assert name.endswith("_ratio"), name


def test_in_flight_and_decode_rate_while_streaming(http):
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 60,
        "ignore_eos": True,
        "stream": True,
    }
    with http.stream("POST", CHAT, json=body) as response:
        lines = response.iter_lines()
        for _ in range(10):
            next(lines)
        server = http.get("/v1/stats").json()["server"]
        assert len(server["in_flight"]) == 1 and server["in_flight"][0]["endpoint"] == CHAT
        assert server["in_flight"][0]["num_output_tokens"] > 0 and server["decode_tokens_per_s"] > 0
        for _ in lines:
            pass


def test_metrics_need_the_key(keyed_server):
    url = keyed_server.base_url + "/metrics"
    assert httpx.get(url).status_code == 401
    assert httpx.get(url, headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200


@pytest.fixture(scope="module")
def open_metrics_server(tmp_path_factory):
    proc = start_server(tmp_path_factory.mktemp("metrics-open"), "--api-key", API_KEY, "--metrics-open")
    yield proc
    proc.stop()


def test_metrics_open_on_loopback(open_metrics_server):
    base = open_metrics_server.base_url
    response = httpx.get(base + "/metrics")
    assert response.status_code == 200 and "freetoken_kv_cache_blocks" in response.text
    assert httpx.get(base + "/v1/stats").status_code == 401  # only /metrics opens


def test_metrics_open_is_loopback_only():
    middleware = ApiMiddleware(app=None, api_key="k", metrics_open=True)
    scope = {"path": "/metrics", "client": ("127.0.0.1", 5000)}
    assert middleware._open(scope)
    assert not middleware._open(scope | {"client": ("10.1.2.3", 5000)})
    assert not middleware._open(scope | {"path": "/v1/stats"})
    assert not ApiMiddleware(app=None, api_key="k")._open(scope)


def test_quantile_and_rate_window():
    assert quantile([], 0.5) is None
    assert quantile([3.0, 1.0, 2.0], 0.5) == 2.0 and quantile(range(1, 101), 0.99) == 99
    window = _RateWindow(now_s=0.0)
    window.record(100.0, 30)  # after a long idle, 30 tokens at t = 100 s
    assert window.rate(100.5, 30) == pytest.approx(30 / RATE_WINDOW_S)  # not 30 / 100.5
    assert window.rate(100.0 + RATE_WINDOW_S + 0.1, 30) == 0.0  # idle again: the rate falls to 0

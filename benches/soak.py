"""Soak: 32 concurrent clients against `ft serve --model demo` on loopback for a few minutes, mixing normal,
streamed, ``n: 8``, slow-reading, stalled, disconnecting, oversized and malformed requests (issue 20).

Checks (exit status 1 when one fails):
- no 5xx, and no error event inside a 200 stream of a client that read it through;
- every normal request (non-streamed, streamed, ``n: 8``, slow reader) answered with a finish reason;
- server RSS peak within ``--rss-bound-mb`` over the baseline, and back within 10 % of the baseline after the load
  (baseline: RSS after a warm-up round of every kind, before the clock starts);
- /health answers and the engine is idle with every KV block free afterwards.
Reports p50/p99 time to first token of the small streamed requests, latencies, counts per kind, RSS figures and
the most requests the engine held paused (sampled from /v1/stats).

    python benches/soak.py [--duration-s 180] [--clients 32] [--rss-bound-mb 1500]
    python benches/soak.py --fairness [--duration-s 90] [--server-arg=--max-seqs-per-request=16]

``--fairness`` measures one thing instead: the time to first token of small streamed requests (4 clients, 8
tokens each) beside a stream of ``n: 16`` requests of 256 tokens (2 clients), with the server's default share of
the batch per request, or with another one given as a server flag (16 = the whole batch: no share).

Stops by itself (the duration, then at most --drain-s for the last requests). Prints one line per kind and a
final JSON line. The server runs on the CPU on a free loopback port; its log goes to a temporary file whose tail
is printed when it fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import httpx

KINDS = {  # kind -> weight in the mix
    "normal": 6,
    "streamed": 6,
    "n8": 2,
    "slow_reader": 2,
    "stalled": 1,
    "disconnect": 2,
    "oversized": 1,
    "malformed": 3,
}
# Kinds whose every request must be answered with a finish reason.
ANSWERED_KINDS = ("normal", "streamed", "n8", "slow_reader")
MALFORMED = [
    b"{",
    b'{"model": "m", "messages": "hi"}',
    b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}',
    b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "logit_bias": {"' + b"9" * 5000 + b'": 1}',
    b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
    b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}',
    b'{"model": "m", "messages": [{"role": "user", "content": [[[[{"type": "text"}]]]]}]}',
    b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 1000}',
    b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "stop": [' + b'"a",' * 100 + b'"b"]}',
]


@dataclass
class Stats:
    """What the clients saw."""

    statuses: dict[str, dict[int, int]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(int)))
    latencies_s: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    ttft_s: list[float] = field(default_factory=list)
    unanswered: list[str] = field(default_factory=list)
    stream_errors: list[str] = field(default_factory=list)
    transport_errors: dict[str, int] = field(default_factory=lambda: defaultdict(int))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def chat(content: str = "Tell me a story about a fox.", **fields) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": content}], **fields}


async def one_request(client: httpx.AsyncClient, kind: str, stats: Stats, rng: random.Random) -> None:
    """Send one request of `kind` and record what came back."""
    url = "/v1/chat/completions"
    start = time.monotonic()
    status = None
    if kind == "normal":
        response = await client.post(url, json=chat(max_tokens=8))
        status = response.status_code
        if status != 200 or response.json()["choices"][0]["finish_reason"] is None:
            stats.unanswered.append(f"normal: {status} {response.text[:200]}")
    elif kind == "n8":
        response = await client.post(url, json=chat(n=8, max_tokens=32, temperature=1.0))
        status = response.status_code
        choices = response.json().get("choices", []) if status == 200 else []
        if len(choices) != 8 or any(c["finish_reason"] is None for c in choices):
            stats.unanswered.append(f"n8: {status} {response.text[:200]}")
    elif kind in ("streamed", "slow_reader", "disconnect"):
        max_tokens = {"streamed": 8, "slow_reader": 64, "disconnect": 200}[kind]
        # The long ones ask for 20 alternatives per token: ~2 KB an event, so their output is worth buffering.
        extra = {} if kind == "streamed" else {"logprobs": True, "top_logprobs": 20}
        body = chat(max_tokens=max_tokens, stream=True, **extra)
        finished = False
        async with client.stream("POST", url, json=body) as response:
            status = response.status_code
            events = 0
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    stats.stream_errors.append(f"{kind}: {data[:200]}")
                    break
                events += 1
                choices = event.get("choices", [])
                if kind == "streamed" and events == 2:  # the first after the role event carries the first token
                    stats.ttft_s.append(time.monotonic() - start)
                if any(c.get("finish_reason") for c in choices):
                    finished = True
                if kind == "slow_reader":
                    await asyncio.sleep(0.05)
                if kind == "disconnect" and events >= 3:
                    break  # leaves with the stream open: the server must abort and free the request
        if kind in ANSWERED_KINDS and not finished:
            stats.unanswered.append(f"{kind}: {status} no finish reason")
    elif kind == "stalled":
        status = await stalled_request(client, stats, rng)
    elif kind == "oversized":
        response = await client.post(url, json=chat("hello world " * 800_000, max_tokens=4))
        status = response.status_code
    elif kind == "malformed":
        response = await client.post(url, content=rng.choice(MALFORMED), headers={"content-type": "application/json"})
        status = response.status_code
    stats.statuses[kind][status] += 1
    stats.latencies_s[kind].append(time.monotonic() - start)


async def stalled_request(client: httpx.AsyncClient, stats: Stats, rng: random.Random) -> int:
    """A streamed request with a small receive window whose client reads the status line and then nothing for
    20-40 s, then leaves: the server must pause the request (its output is not buffered past a bound) and abort
    it after --stream-pause-timeout-s."""
    host, port = str(client.base_url).removeprefix("http://").rstrip("/").split(":")
    body = json.dumps(chat(max_tokens=400, stream=True, logprobs=True, top_logprobs=20, ignore_eos=True)).encode()
    request = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    try:
        await loop.sock_connect(sock, (host, int(port)))
        await loop.sock_sendall(sock, request)
        head = await loop.sock_recv(sock, 64)
        status = int(head.split(b" ")[1]) if head.startswith(b"HTTP/1.1 ") else 0
        await asyncio.sleep(rng.uniform(20.0, 40.0))
    finally:
        sock.close()
    return status


async def client_loop(client: httpx.AsyncClient, stats: Stats, deadline: float, seed: int) -> None:
    rng = random.Random(seed)
    kinds, weights = zip(*KINDS.items(), strict=True)
    while time.monotonic() < deadline:
        kind = rng.choices(kinds, weights)[0]
        try:
            await one_request(client, kind, stats, rng)
        except (httpx.TransportError, OSError) as exc:
            stats.transport_errors[f"{kind}: {type(exc).__name__}"] += 1
            if kind in ANSWERED_KINDS:
                stats.unanswered.append(f"{kind}: {type(exc).__name__}: {exc}")


async def sample_server(base_url: str, pid: int, stop: asyncio.Event, samples: dict) -> None:
    """RSS and paused requests, every 0.5 s, until `stop`."""
    async with httpx.AsyncClient(base_url=base_url, timeout=10) as client:
        while not stop.is_set():
            samples["rss_mb"].append(rss_mb(pid))
            try:
                engine = (await client.get("/v1/stats")).json()
                samples["paused"].append(engine.get("num_paused", 0))
            except (httpx.TransportError, ValueError):
                pass
            try:
                await asyncio.wait_for(stop.wait(), 0.5)
            except asyncio.TimeoutError:
                pass


def start_server(log_path: Path, port: int, extra: list[str]) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "freetoken.cli.main",
        "serve",
        "--model",
        "demo",
        "--device",
        "cpu",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        "1024",
        *extra,
    ]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"ft serve exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise SystemExit(f"ft serve did not start:\n{log_path.read_text()[-3000:]}")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


async def soak(args: argparse.Namespace, base_url: str, pid: int) -> tuple[Stats, dict]:
    limits = httpx.Limits(max_connections=args.clients * 2, max_keepalive_connections=args.clients)
    timeout = httpx.Timeout(args.request_timeout_s)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=timeout) as client:
        warm = Stats()
        rng = random.Random(0)
        for kind in KINDS:
            if kind != "stalled":
                await one_request(client, kind, warm, rng)
        await asyncio.sleep(2)
        samples: dict = {"rss_mb": [], "paused": [], "baseline_mb": rss_mb(pid)}
        stats = Stats()
        stop = asyncio.Event()
        sampler = asyncio.create_task(sample_server(base_url, pid, stop, samples))
        deadline = time.monotonic() + args.duration_s
        clients = [asyncio.create_task(client_loop(client, stats, deadline, seed)) for seed in range(args.clients)]
        done, pending = await asyncio.wait(clients, timeout=args.duration_s + args.drain_s)
        for task in pending:
            task.cancel()
            stats.unanswered.append("a client was still waiting after the drain time")
        await asyncio.gather(*pending, return_exceptions=True)
        for task in done:
            if task.exception() is not None:
                stats.unanswered.append(f"client failed: {task.exception()!r}")
        # After the load: idle until the server has let go of everything (aborted streams, paused requests).
        settle_deadline = time.monotonic() + args.settle_s
        while time.monotonic() < settle_deadline:
            engine = (await client.get("/v1/stats")).json()
            if engine["num_running"] == engine["num_waiting"] == engine.get("num_paused", 0) == 0:
                break
            await asyncio.sleep(0.5)
        await asyncio.sleep(2)
        stop.set()
        await sampler
        samples["after_mb"] = rss_mb(pid)
        health = await client.get("/health")
        samples["healthy"] = health.status_code == 200
        engine = (await client.get("/v1/stats")).json()
        samples["idle"] = engine["num_running"] == engine["num_waiting"] == 0
        samples["kv_free"] = engine["kv_blocks_free"] == engine["kv_blocks_total"]
        answer = await client.post("/v1/chat/completions", json=chat(max_tokens=4))
        samples["serves_after"] = answer.status_code == 200
    return stats, samples


async def fairness(args: argparse.Namespace, base_url: str) -> dict:
    """Small streamed requests beside a stream of n:16 ones: their TTFT, and the large ones' latency."""
    stats = Stats()
    big_latency_s: list[float] = []
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(args.request_timeout_s)) as client:
        rng = random.Random(0)
        await one_request(client, "streamed", Stats(), rng)  # warm-up
        deadline = time.monotonic() + args.duration_s

        async def large() -> None:
            while time.monotonic() < deadline:
                start = time.monotonic()
                body = chat(n=16, max_tokens=256, ignore_eos=True, temperature=1.0)
                response = await client.post("/v1/chat/completions", json=body)
                assert response.status_code == 200, response.text
                big_latency_s.append(time.monotonic() - start)

        async def small() -> None:
            await asyncio.sleep(1.0)  # the large requests are running first
            while time.monotonic() < deadline:
                await one_request(client, "streamed", stats, rng)

        await asyncio.gather(*(large() for _ in range(2)), *(small() for _ in range(4)))
    return {
        "bench": "fairness",
        "server_args": args.server_arg,
        "duration_s": args.duration_s,
        "small_requests": len(stats.ttft_s),
        "large_requests": len(big_latency_s),
        "ttft_small_s": {"p50": round(percentile(stats.ttft_s, 50), 3), "p99": round(percentile(stats.ttft_s, 99), 3)},
        "large_latency_s": {"p50": round(percentile(big_latency_s, 50), 2)},
        "unanswered": len(stats.unanswered),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration-s", type=float, default=180.0, help="load duration (default: 180)")
    parser.add_argument("--clients", type=int, default=32, help="concurrent clients (default: 32)")
    parser.add_argument(
        "--rss-bound-mb",
        type=float,
        default=1500.0,
        help="most RSS growth over the baseline during the load (default: 1500)",
    )
    parser.add_argument("--drain-s", type=float, default=120.0, help="most wait for the last requests (default: 120)")
    parser.add_argument("--settle-s", type=float, default=60.0, help="most wait for the server to go idle after")
    parser.add_argument("--request-timeout-s", type=float, default=300.0, help="client timeout per request")
    parser.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="extra ft serve flag (repeatable), e.g. --server-arg=--max-seqs-per-request=16",
    )
    parser.add_argument("--fairness", action="store_true", help="measure small requests' TTFT beside n:16 ones")
    args = parser.parse_args()

    log_path = Path(tempfile.mkdtemp(prefix="freetoken-soak-")) / "server.log"
    port = free_port()
    # The soak's stalled clients stay 20-40 s: paused requests are aborted within the run. (--fairness passes
    # no flag of its own, so it also runs against servers that predate them, for a before/after figure.)
    extra = args.server_arg if args.fairness else ["--stream-pause-timeout-s", "10", *args.server_arg]
    proc = start_server(log_path, port, extra)
    base_url = f"http://127.0.0.1:{port}"
    try:
        started = time.monotonic()
        if args.fairness:
            record = asyncio.run(fairness(args, base_url))
            ttft = record["ttft_small_s"]
            print(
                f"fairness {args.server_arg or 'default share'}: small streamed TTFT p50 {ttft['p50']:.2f} s "
                f"p99 {ttft['p99']:.2f} s over {record['small_requests']} requests beside "
                f"{record['large_requests']} n:16 requests (p50 {record['large_latency_s']['p50']:.1f} s)"
            )
            print(json.dumps(record))
            return 0
        stats, samples = asyncio.run(soak(args, base_url, proc.pid))
        wall_s = time.monotonic() - started
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()

    five_xx = sum(n for kind in stats.statuses.values() for status, n in kind.items() if status and status >= 500)
    for kind in KINDS:
        lat = stats.latencies_s.get(kind, [])
        codes = dict(sorted(stats.statuses.get(kind, {}).items()))
        print(
            f"{kind:12s} {len(lat):5d} requests  statuses {codes}  latency p50 {percentile(lat, 50):.2f} s "
            f"p99 {percentile(lat, 99):.2f} s"
        )
    baseline, peak, after = samples["baseline_mb"], max(samples["rss_mb"]), samples["after_mb"]
    ttft50, ttft99 = percentile(stats.ttft_s, 50), percentile(stats.ttft_s, 99)
    print(
        f"soak {wall_s:.0f} s, {args.clients} clients: {five_xx} x 5xx, {len(stats.unanswered)} unanswered, "
        f"{len(stats.stream_errors)} stream errors; small streamed TTFT p50 {ttft50:.2f} s p99 {ttft99:.2f} s; "
        f"RSS baseline {baseline:.0f} MB, peak {peak:.0f} MB, after {after:.0f} MB; most paused "
        f"{max(samples['paused'], default=0)}; healthy after: {samples['healthy']}"
    )
    for line in (stats.unanswered + stats.stream_errors)[:20]:
        print("  ", line)
    checks = {
        "no_5xx": five_xx == 0,
        "every_normal_answered": not stats.unanswered and not stats.stream_errors,
        "rss_peak_within_bound": peak - baseline <= args.rss_bound_mb,
        "rss_back_to_baseline": abs(after - baseline) <= 0.10 * baseline,
        "healthy_after": samples["healthy"] and samples["serves_after"],
        "idle_and_kv_free_after": samples["idle"] and samples["kv_free"],
    }
    record = {
        "bench": "soak",
        "duration_s": args.duration_s,
        "wall_s": round(wall_s, 1),
        "clients": args.clients,
        "requests": {kind: dict(codes) for kind, codes in stats.statuses.items()},
        "num_5xx": five_xx,
        "unanswered": len(stats.unanswered),
        "stream_errors": len(stats.stream_errors),
        "transport_errors": dict(stats.transport_errors),
        "ttft_small_s": {"p50": round(ttft50, 3), "p99": round(ttft99, 3), "n": len(stats.ttft_s)},
        "rss_mb": {
            "baseline": round(baseline),
            "peak": round(peak),
            "after": round(after),
            "bound_over_baseline": args.rss_bound_mb,
        },
        "most_paused": max(samples["paused"], default=0),
        "checks": checks,
    }
    print(json.dumps(record))
    if not all(checks.values()):
        print(f"FAILED: {[name for name, ok in checks.items() if not ok]}; server log {log_path}", file=sys.stderr)
        print(log_path.read_text()[-3000:], file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    os.environ.setdefault("NO_COLOR", "1")
    raise SystemExit(main())

"""`GET /v1/cache`, `POST /v1/cache/resize` and `ft ctl cache` against a real server: the demo model with the
`offload` expert cache on the CPU, served in this process (so a test can hold the engine thread between two steps,
and see a second resize refused while the first waits).
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from test_ctl import ft_ctl
from test_top import ft_top

from conftest import free_port, in_process_server

PROMPT = "Once upon a time there was a small cache that wanted to grow"


class Gate:
    """Holds the engine thread before its next step while `closed` (wraps `LLMEngine.step`)."""

    def __init__(self, engine) -> None:
        self.open = threading.Event()
        self.open.set()
        self.waiting = threading.Event()
        step = engine.step

        def gated():
            if not self.open.is_set():
                self.waiting.set()
                self.open.wait(60)
            return step()

        engine.step = gated


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[str, object, Gate]]:
    from freetoken.config import EngineConfig
    from freetoken.engine import AsyncEngine
    from freetoken.engine.llm_engine import LLMEngine
    from freetoken.models.demo import demo_checkpoint_dir
    from freetoken.server.app import build_app

    cfg = EngineConfig(
        device="cpu",
        dtype="float32",
        moe_backend="offload",
        expert_slots=12,
        max_model_len=128,
        kv_block_size=4,
        kv_cache_tokens=512,
    )
    engine = LLMEngine.from_dir(demo_checkpoint_dir(), cfg)
    gate = Gate(engine)
    app = build_app(AsyncEngine(engine, "demo"), served_model_name="demo")
    with in_process_server(app) as base_url:
        yield base_url, engine, gate
        gate.open.set()


def _stream(base_url: str, on_chunk=None, max_tokens: int = 12) -> str:
    """A streamed greedy completion's text; `on_chunk(i)` runs after content chunk i arrives."""
    body = {
        "model": "demo",
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    text, n = "", 0
    with (
        httpx.Client(base_url=base_url, timeout=120) as client,
        client.stream("POST", "/v1/completions", json=body) as r,
    ):
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            text += chunk["choices"][0]["text"]
            n += 1
            if on_chunk is not None:
                on_chunk(n)
    return text


def test_get_cache(served):
    base_url, engine, _ = served
    body = httpx.get(base_url + "/v1/cache").json()
    experts, kv = body["expert_cache"], body["kv_cache"]
    assert experts["num_slots"] == engine.experts.num_slots and experts["num_experts"] == 32
    assert experts["slot_nbytes"] == engine.experts.pool.expert_stride and experts["policy"] == "lfu"
    assert kv["num_blocks"] == engine.kv.num_blocks and kv["block_size"] == 4 and kv["max_model_len"] == 128
    assert body["budget"]["bounded_by"] == "host memory" and body["budget"]["headroom_gb"] > 0
    assert body["resizing"] is False


def test_resize_mid_stream_keeps_the_text_and_shows_everywhere(served):
    base_url, _, _ = served
    plain = _stream(base_url)
    answers = []

    def on_chunk(i: int) -> None:
        if i in (3, 7):
            sizes = (
                {"expert_slots": 20, "kv_blocks": 100} if i == 3 else {"expert_gb": 8 * 12288 / 1e9, "kv_blocks": 64}
            )
            r = httpx.post(base_url + "/v1/cache/resize", json=sizes, timeout=60)
            assert r.status_code == 200, r.text
            answers.append(r.json())

    assert _stream(base_url, on_chunk) == plain
    assert [a["after"]["expert_cache"]["num_slots"] for a in answers] == [20, 8]
    assert answers[0]["after"]["expert_cache"]["num_resident"] == answers[0]["before"]["expert_cache"]["num_resident"]
    assert answers[1]["after"]["expert_cache"]["num_resident"] == 8
    assert answers[1]["after"]["kv_cache"]["num_blocks"] == 64
    stats = httpx.get(base_url + "/v1/stats").json()
    assert stats["kv_blocks_total"] == 64 and stats["moe_backend"]["num_slots"] == 8
    metrics = httpx.get(base_url + "/metrics").text
    assert re.search(r"^freetoken_expert_cache_slots 8\.0$", metrics, re.MULTILINE)
    assert re.search(r"^freetoken_kv_cache_blocks 64\.0$", metrics, re.MULTILINE)
    assert re.search(rf"^freetoken_expert_cache_bytes {8 * 12288}\.0$", metrics, re.MULTILINE)
    assert re.search(r"^freetoken_cache_resizes_total [1-9]", metrics, re.MULTILINE)
    top = ft_top("--once", "--server", base_url)
    assert top.returncode == 0, top.stderr
    assert re.search(r"KV blocks \S* 0/64 \(0\.000\d+ GB\)", top.stdout), top.stdout
    assert re.search(r"expert slots \S* 8/8 \(0\.0001 GB\)", top.stdout), top.stdout


def test_second_resize_while_one_waits_gets_409(served):
    base_url, _, gate = served
    gate.open.clear()
    gate.waiting.clear()
    results = {}
    stream = threading.Thread(target=lambda: results.setdefault("text", _stream(base_url)))
    stream.start()
    assert gate.waiting.wait(30), "the engine thread never reached its next step"
    first = threading.Thread(
        target=lambda: results.setdefault(
            "first", httpx.post(base_url + "/v1/cache/resize", json={"expert_slots": 10}, timeout=60)
        )
    )
    first.start()
    deadline = time.monotonic() + 30
    while not httpx.get(base_url + "/v1/cache").json()["resizing"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    second = httpx.post(base_url + "/v1/cache/resize", json={"expert_slots": 14}, timeout=60)
    assert second.status_code == 409 and second.json()["error"]["code"] == "resize_in_progress"
    gate.open.set()
    first.join(60)
    stream.join(120)
    assert results["first"].status_code == 200 and results["first"].json()["after"]["expert_cache"]["num_slots"] == 10
    assert results["text"] == _stream(base_url)  # the request that waited through the resize is unharmed
    assert httpx.get(base_url + "/v1/cache").json()["resizing"] is False


@pytest.mark.parametrize(
    "body,status,code",
    [
        ({"expert_gb": -1}, 400, "invalid_value"),
        ({"expert_slots": 1.5}, 400, "invalid_type"),
        ({"slots": 3}, 400, "invalid_value"),
        ({}, 400, "missing_field"),
        ({"kv_blocks": 3}, 422, "resize_refused"),
        ({"kv_gb": 1e6}, 422, "resize_refused"),
        ({"kv_gb": 1e308}, 422, "resize_refused"),  # its bytes overflow a float: still a refusal, not a 500
        ({"expert_gb": 1e308, "kv_gb": 1e308}, 422, "resize_refused"),
    ],
)
def test_bad_and_refused_resizes(served, body, status, code):
    base_url, engine, _ = served
    slots, blocks = engine.experts.num_slots, engine.kv.num_blocks
    r = httpx.post(base_url + "/v1/cache/resize", json=body)
    assert r.status_code == status and r.json()["error"]["code"] == code, r.text
    assert (engine.experts.num_slots, engine.kv.num_blocks) == (slots, blocks)


def test_ft_ctl_cache(served):
    base_url, engine, _ = served
    show = ft_ctl("cache", "--server", base_url)
    assert show.returncode == 0, show.stderr
    assert f"{engine.experts.num_slots} slots of 0.0123 MB" in show.stdout and "headroom" in show.stdout
    done = ft_ctl("cache", "--server", base_url, "--expert-slots", "16", "--kv-blocks", "80")
    assert done.returncode == 0, done.stderr
    line = done.stdout.strip()
    assert "\n" not in line and line.startswith("resized in ") and "-> 16 slots" in line and "-> 320 tokens" in line
    refused = ft_ctl("cache", "--server", base_url, "--kv-blocks", "2")
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 1 and len(lines) == 1 and "HTTP 422" in lines[0] and "max_model_len" in lines[0]
    assert json.loads(ft_ctl("cache", "--json", "--server", base_url).stdout)["kv_cache"]["num_blocks"] == 80


def test_ft_ctl_cache_without_a_server():
    result = ft_ctl("cache", "--server", f"http://127.0.0.1:{free_port()}", "--expert-gb", "4")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1 and "ft serve --model" in lines[0], result.stderr

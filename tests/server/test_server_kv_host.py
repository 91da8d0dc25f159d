"""The KV prefix cache's host tier (`--kv-host-gb`) through a real `ft serve` on the CPU (the tier is a second
buffer there): sessions evicting each other from 512 tokens of KV get their history back from the host tier,
report it as cached tokens, and answer exactly as a server without the prefix cache; /v1/stats and /metrics show
the tier's counters and crossover.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from test_server_prefix_cache import SYSTEM, chat, cold  # noqa: F401  (cold: the --no-prefix-cache server fixture)

from conftest import ServerProcess, start_server


@pytest.fixture(scope="module")
def tiered(tmp_path_factory) -> Iterator[ServerProcess]:
    proc = start_server(
        tmp_path_factory.mktemp("tiered"), "--kv-cache-tokens", "512", "--max-num-seqs", "4", "--kv-host-gb", "0.05"
    )
    yield proc
    proc.stop()


def test_sessions_get_their_history_back_from_the_host_tier(tiered, cold):  # noqa: F811  (the fixture)
    sessions = [
        [
            {"role": "system", "content": f"Session {s}. " + SYSTEM * 2},
            {"role": "user", "content": f"Question {s}: what is in the repository?"},
        ]
        for s in range(4)
    ]
    previous = [0] * len(sessions)

    def skipped() -> int:  # host hits the tier chose to recompute (below its measured crossover: timing-dependent)
        return httpx.get(f"{tiered.base_url}/v1/stats").json()["kv_host"]["num_skipped_tokens"]

    for turn in range(3):
        for s, history in enumerate(sessions):
            before = skipped()
            got = chat(tiered, history, max_tokens=8)
            recomputed = skipped() - before
            assert got.choices[0].message.content == chat(cold, history, max_tokens=8).choices[0].message.content, (
                s,
                turn,
            )
            if turn:  # the previous turn's prompt (its full blocks) came back, from whichever tier held it
                assert got.usage.prompt_tokens_details.cached_tokens + recomputed >= previous[s] // 16 * 16, (s, turn)
            previous[s] = got.usage.prompt_tokens
            history += [
                {"role": "assistant", "content": got.choices[0].message.content or "ok"},
                {"role": "user", "content": f"Turn {turn} of session {s}: go on."},
            ]
    stats = httpx.get(tiered.base_url + "/v1/stats", timeout=30).json()
    host = stats["kv_host"]
    assert host["num_hit_tokens"] > 0 and host["bytes_h2d"] > 0 and host["num_demoted_blocks"] > 0
    assert host["capacity_tokens"] > 512 and "crossover_tokens" in host and host["h2d_gbps"] > 0
    metrics = httpx.get(tiered.base_url + "/metrics", timeout=30).text
    hit = next(line for line in metrics.splitlines() if line.startswith("freetoken_kv_host_hit_tokens_total"))
    assert float(hit.split()[-1]) == host["num_hit_tokens"]
    assert "freetoken_kv_host_crossover_tokens" in metrics and "freetoken_kv_host_h2d_bytes_total" in metrics


def test_no_host_tier_by_default_on_the_cpu(cold):  # noqa: F811
    assert httpx.get(cold.base_url + "/v1/stats", timeout=30).json()["kv_host"] is None

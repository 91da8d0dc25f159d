"""`benches/engine_prefill.py` stays runnable: the Qwen3.5 demo through the whole engine on the CPU, with the profile,
prints a row per prompt length whose chunk counts add up, and refuses flags `ft serve` would refuse."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benches" / "engine_prefill.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    """The bench in a child process with this one's environment (the freetoken it imports is the one under test)."""
    return subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=300, check=False)


def test_demo_prefill_rows_and_profile():
    done = _run("--model", "demo-qwen3.5", "--prompts", "32", "96", "--repeats", "1", "--profile", "--serve-args",
                "--device cpu --dummy-weights --max-prefill-tokens 64")  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert [row["prompt"] for row in out["rows"]] == [32, 96]
    for row in out["rows"]:
        # first + repeats prompts, each in ceil(prompt / 64) chunks, all on the CPU backend's own strategy
        assert sum(row["chunks_by_strategy"].values()) == 2 * -(-row["prompt"] // 64), row
        assert row["tok_per_s"] > 0 and len(row["times_s"]) == 1
    assert out["profile"]["wall_s"] > 0
    assert "Self CPU time total" in done.stderr  # the profiler's tables


def test_serve_flags_are_checked():
    done = _run("--model", "demo-qwen3.5", "--serve-args", "--device cpu --no-such-flag")
    assert done.returncode == 2 and "not `ft serve` engine flags" in done.stderr

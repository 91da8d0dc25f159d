"""`ft ctl status` against a real server: the report, --json, and a one-line answer when no server runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import freetoken
from conftest import API_KEY, MAX_MODEL_LEN, SERVED_MODEL_NAME, free_port


def ft_ctl(*args: str, **run_kwargs) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "FREETOKEN_API_KEY"}
    package_root = str(Path(freetoken.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    run_kwargs = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **run_kwargs}
    return subprocess.run(
        [sys.executable, "-m", "freetoken.cli.main", "ctl", *args],
        text=True,
        env=env,
        timeout=60,
        stdin=subprocess.DEVNULL,
        check=False,
        **run_kwargs,
    )


def test_status_report(server, http):
    http.post(
        "/v1/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "ignore_eos": True},
    )
    result = ft_ctl("status", "--server", server.base_url)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    stats = http.get("/v1/stats").json()
    assert f"model      {SERVED_MODEL_NAME} (context {MAX_MODEL_LEN} tokens)" in out
    assert "backend    cpu" in out
    assert f"kv cache   0/{stats['kv_blocks_total']} blocks in use" in out
    assert f"{stats['server']['num_generation_tokens']} generated" in out
    prefix = stats["prefix_cache"]
    assert (
        f"prefix     {prefix['num_hit_tokens']} of {prefix['num_lookup_tokens']} prompt tokens reused" in out
        and "hit_rate" not in out
    ), out


def test_status_into_a_closed_pipe(server):
    """`ft ctl status | head -1`: the reader leaves before ft writes; ft stops without a traceback."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # closed before ft writes a byte: its first write fails with EPIPE
    try:
        done = ft_ctl("status", "--server", server.base_url, stdout=write_end)
    finally:
        os.close(write_end)
    assert done.returncode == 1 and "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr


def test_status_json_and_key(keyed_server):
    refused = ft_ctl("status", "--server", keyed_server.base_url)
    assert refused.returncode == 1 and "needs its API key" in refused.stderr
    wrong = ft_ctl("status", "--server", keyed_server.base_url, "--api-key", "not-" + API_KEY)
    assert wrong.returncode == 1 and "refused the API key given" in wrong.stderr, wrong.stderr
    result = ft_ctl("status", "--json", "--server", keyed_server.base_url, "--api-key", API_KEY)
    assert result.returncode == 0 and json.loads(result.stdout)["server"]["model"] == SERVED_MODEL_NAME


def test_status_without_a_server():
    result = ft_ctl("status", "--server", f"http://127.0.0.1:{free_port()}")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1 and "ft serve --model" in lines[0], result.stderr


def test_server_flags_go_before_or_after_the_verb():
    """`ft ctl --server URL status` asks the same server as `ft ctl status --server URL`; given in both places,
    the verb's wins."""
    url = f"http://127.0.0.1:{free_port()}"
    other = f"http://127.0.0.1:{free_port()}"
    for args in (
        ("--server", url, "status"),
        ("status", "--server", url),
        ("--server", other, "status", "--server", url),
    ):
        result = ft_ctl(*args)
        assert result.returncode == 1 and f"no freetoken server at {url}" in result.stderr, (args, result.stderr)
    result = ft_ctl("--server", url, "cache")
    assert result.returncode == 1 and f"no freetoken server at {url}" in result.stderr, result.stderr


def test_cache_sizes_are_checked_in_the_flags_own_spelling():
    """A bad size is refused by `ft ctl cache` itself, naming the flag (not the API field), before any server is
    asked (none runs here)."""
    port = free_port()
    for args, says in (
        (("--kv-gb", "-1"), "argument --kv-gb: must be > 0, got -1"),
        (("--expert-slots", "2.5"), "argument --expert-slots: expected an integer, got '2.5'"),
        (("--expert-gb", "nan"), "argument --expert-gb: must be > 0, got nan"),
    ):
        result = ft_ctl("cache", "--server", f"http://127.0.0.1:{port}", *args)
        assert result.returncode == 2 and says in result.stderr, result.stderr
        assert "Traceback" not in result.stderr

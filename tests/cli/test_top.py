"""`ft top`: frames rendered from recorded /v1/stats snapshots (rich's console recording), the plain and
NO_COLOR outputs of `ft top --once`, and the live view in a real pty under tmux: it draws, keeps going across a
server restart, and quits on `q`.

The snapshots in tests/data/stats/ were recorded from `ft serve --model demo --device cpu` (cpu backend) and with
`--moe-backend offload --expert-slots 12` while a request decoded (busy_1, then busy_2 half a second later).
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console

import freetoken
from conftest import SERVED_MODEL_NAME, free_port, start_server
from freetoken.cli.client import ServerError
from freetoken.tui.app import Poller
from freetoken.tui.view import SHADES, Frame

DATA = Path(__file__).parents[1] / "data" / "stats"
ANSI_COLOR = re.compile(r"\x1b\[[0-9;]*3[0-9][;m]")  # a foreground colour


def snapshot(name: str) -> dict:
    return json.loads((DATA / f"{name}.json").read_text())


def render(frame: Frame, width: int = 120) -> str:
    with open(os.devnull, "w") as sink:
        console = Console(record=True, width=width, force_terminal=True, color_system="truecolor", file=sink)
        console.print(frame)
    return console.export_text()


def test_frame_of_a_busy_offload_server():
    before, now = snapshot("offload_busy_1"), snapshot("offload_busy_2")
    text = render(Frame(now, before, "http://127.0.0.1:1919"))
    server = now["server"]
    assert "demo" in text and "backend offload" in text and "live" in text
    assert f"{server['decode_tokens_per_s']:.1f}" in text and f"{server['ttft_s']['p50'] * 1e3:.0f} ms" in text
    # the last interval's split, from the difference of the two snapshots
    layers_now, layers_before = now["moe_backend"]["layers"], before["moe_backend"]["layers"]
    delta = {k: sum(layers_now[k]) - sum(layers_before[k]) for k in ("hits", "fills", "cpu_runs")}
    total = sum(delta.values())
    assert total > 0
    assert f"last interval: hit {100 * delta['hits'] / total:.0f}%" in text
    assert f"fill {100 * delta['fills'] / total:.0f}%" in text
    # one heat-map column per MoE layer on each of the hit / fill / cpu rows
    num_layers = len(layers_now["hits"])
    for row in ("hit", "fill"):
        strip = re.search(rf"^\W*{row} ([{re.escape(SHADES)}]+)", text, re.M)
        assert strip and len(strip.group(1).rstrip()) == num_layers, text
    in_flight = server["in_flight"][0]
    assert in_flight["endpoint"] in text and f"{in_flight['age_s']:.1f} s" in text
    assert f"{now['moe_backend']['num_resident']}/{now['moe_backend']['num_slots']}" in text
    assert "prefix cache" not in text  # no such key in this snapshot


def test_once_frame_does_not_advertise_live_keys():
    """`ft top --once` prints one frame and exits: no "live" status and no "q quits" (nothing would read it); the
    live view keeps both, frames into a pipe say Ctrl-C instead, and a status (unreachable) still shows once."""
    stats = snapshot("offload_busy_2")
    header = lambda frame: render(frame).splitlines()[0]
    live = header(Frame(stats, None, "http://127.0.0.1:1919"))
    assert "live" in live and "q quits" in live
    once = header(Frame(stats, None, "http://127.0.0.1:1919", live=False, quit_hint=""))
    assert "q quits" not in once and "live" not in once and "backend offload" in once, once
    down = header(Frame(stats, None, "s", status="server unreachable, retrying…", live=False, quit_hint=""))
    piped = header(Frame(stats, None, "s", quit_hint="Ctrl-C quits"))
    assert "live" in piped and "Ctrl-C quits" in piped and "q quits" not in piped
    assert "unreachable" in down and "q quits" not in down


def test_frame_without_a_previous_snapshot_shows_the_cumulative_split():
    text = render(Frame(snapshot("offload_busy_2"), None, "s"))
    assert "since start: hit" in text


def test_a_restarted_servers_counters_do_not_make_negative_rates():
    text = render(Frame(snapshot("offload_idle"), snapshot("offload_busy_2"), "s"))  # counters went down
    assert "since start: hit –" in text and not re.search(r"-\d+%", text)  # idle: nothing yet, not negatives


def test_frame_of_the_cpu_backend_and_its_queue():
    stats = snapshot("cpu_busy")
    text = render(Frame(stats, None, "s"))
    assert "backend cpu" in text and "cpu 100%" in text and "q (misses on the CPU) 1.00" in text
    assert f"running {stats['num_running']}" in text
    assert text.count("/v1/chat/completions") == len(stats["server"]["in_flight"]) == 2
    assert "expert slots" not in text  # the cpu backend has none


def test_prefix_cache_panel():
    stats = snapshot("offload_prefix_cache")  # the same 47-token prompt twice: 32 tokens reused the second time
    prefix = stats["prefix_cache"]
    text = render(Frame(stats, None, "s"))
    assert f"hit 34% ({prefix['num_hit_tokens']} of {prefix['num_lookup_tokens']} prompt tokens, since start)" in text
    assert f"blocks {prefix['num_cached_blocks']} cached, {prefix['num_evictable_blocks']} evictable" in text
    before = copy.deepcopy(stats)
    before["prefix_cache"].update(num_hit_tokens=0, num_lookup_tokens=47)
    assert "hit 68% (32 of 47 prompt tokens, last interval)" in render(Frame(stats, before, "s"))
    stats_extra = copy.deepcopy(stats)
    stats_extra["prefix_cache"]["num_promotions"] = 5  # a counter this view does not know yet is still shown
    assert "num_promotions 5" in render(Frame(stats_extra, None, "s"))
    stats["prefix_cache"]["enabled"] = False  # --no-prefix-cache
    assert "prefix cache" not in render(Frame(stats, None, "s"))


def test_fused_backend_has_no_expert_panel():
    stats = copy.deepcopy(snapshot("cpu_busy"))
    stats["moe_backend"] = {"backend": "fused"}
    text = render(Frame(stats, None, "s"))
    assert "backend fused" in text and "expert cache" not in text and "bandwidth" not in text


def test_poller_keeps_the_last_numbers_while_the_server_is_down():
    answers = [snapshot("offload_busy_1"), ServerError("down", unreachable=True), snapshot("offload_busy_2")]

    def fetch():
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    poller = Poller(fetch, "s")
    assert poller.poll().status is None
    down = poller.poll()
    assert down.status and "unreachable" in down.status and down.stats == snapshot("offload_busy_1")
    assert "unreachable" in render(down)
    back = poller.poll()
    assert back.status is None and back.previous is None  # no rates across a restart
    refused = Poller(lambda: (_ for _ in ()).throw(ServerError("needs its API key")), "s")
    with pytest.raises(ServerError):
        refused.poll()


def _top_env(env_extra: dict | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "FORCE_COLOR", "TTY_COMPATIBLE")}
    env.update(env_extra or {})
    package_root = str(Path(freetoken.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    return env


def ft_top(*args: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = _top_env(env_extra)
    return subprocess.run(
        [sys.executable, "-m", "freetoken.cli.main", "top", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )


def test_once_plain_and_no_color(server):
    plain = ft_top("--once", "--server", server.base_url)
    assert plain.returncode == 0, plain.stderr
    assert SERVED_MODEL_NAME in plain.stdout and "\x1b[" not in plain.stdout  # not a terminal: plain text
    assert "q quits" not in " ".join(plain.stdout.split())  # one frame, then exit: no key read (80 columns wrap)
    coloured = ft_top("--once", "--server", server.base_url, env_extra={"FORCE_COLOR": "1"})
    assert ANSI_COLOR.search(coloured.stdout)
    no_color = ft_top("--once", "--server", server.base_url, env_extra={"FORCE_COLOR": "1", "NO_COLOR": "1"})
    assert SERVED_MODEL_NAME in no_color.stdout and not ANSI_COLOR.search(no_color.stdout)


def test_live_into_a_pipe_prints_plain_frames(server):
    """Without --once and not on a terminal (a pipe, a CI log): frame after frame as plain text, no cursor
    movement or colour, until interrupted (exit 0)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "freetoken.cli.main", "top", "--server", server.base_url],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, env=_top_env(), text=True,
    )  # fmt: skip
    try:
        seen, deadline = "", time.monotonic() + 60
        while seen.count(SERVED_MODEL_NAME) < 2 and time.monotonic() < deadline:
            seen += proc.stdout.readline()
        assert seen.count(SERVED_MODEL_NAME) >= 2, seen
        assert "\x1b" not in seen  # no escape sequence: neither colour nor cursor movement
        words = " ".join(seen.split())  # the header wraps at 80 columns
        assert "Ctrl-C quits" in words and "q quits" not in words.replace("Ctrl-C quits", "")  # no key is read
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err


def test_once_without_a_server():
    result = ft_top("--once", "--server", f"127.0.0.1:{free_port()}")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1 and "ft serve --model" in lines[0], result.stderr


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("tmux") is None, reason="no tmux installed")
def test_live_view_in_a_pty_survives_a_restart_and_quits_on_q(tmp_path):
    socket, session = f"ft-top-{os.getpid()}", "top"
    tmux = lambda *a: subprocess.run(["tmux", "-L", socket, *a], capture_output=True, text=True)

    def screen() -> str:
        return tmux("capture-pane", "-p", "-t", session).stdout

    def wait_for(predicate, timeout_s: float = 60.0) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            text = screen()
            if predicate(text):
                return text
            time.sleep(0.2)
        raise AssertionError(f"screen never matched:\n{screen()}")

    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    srv = start_server(tmp_path / "a")
    port = int(srv.base_url.rsplit(":", 1)[1])
    package_root = str(Path(freetoken.__file__).resolve().parents[1])
    # COLUMNS/LINES: the pane's size, which rich reads first (under pytest it measured 80x25 in the 120x60 pane).
    command = (
        f"env PYTHONPATH={package_root} TERM=xterm-256color COLUMNS=120 LINES=60 {sys.executable} -m "
        f"freetoken.cli.main top "
        f"--server {srv.base_url}"
    )
    try:
        assert tmux("new-session", "-d", "-s", session, "-x", "120", "-y", "60", command).returncode == 0
        wait_for(lambda t: SERVED_MODEL_NAME in t and "live" in t and "q quits" in t)
        srv.stop()
        wait_for(lambda t: "unreachable" in t and SERVED_MODEL_NAME in t)  # the last numbers stay
        srv = start_server(tmp_path / "b", port=port)
        wait_for(lambda t: "live" in t and "unreachable" not in t)
        tmux("send-keys", "-t", session, "q")
        deadline = time.monotonic() + 10
        while tmux("has-session", "-t", session).returncode == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert tmux("has-session", "-t", session).returncode != 0, "ft top did not quit on q"
    finally:
        tmux("kill-server")
        srv.stop()

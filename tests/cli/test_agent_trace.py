"""`benches/agent_trace.py` stays runnable: a tiny run of every variant against a real `ft serve` on the demo model
with `--dummy-weights --replay-routing synthetic` (the routing it reports comes from `/v1/stats`), both APIs; and
the harness variants send what those harnesses send (thinking stripped from earlier turns; OpenCode's pruning).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from conftest import SERVED_MODEL_NAME, start_server

BENCH = Path(__file__).resolve().parents[2] / "benches" / "agent_trace.py"


def _bench():
    spec = importlib.util.spec_from_file_location("agent_trace", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


agent_trace = _bench()


@pytest.fixture(scope="module")
def replay_server(tmp_path_factory):
    server = start_server(
        tmp_path_factory.mktemp("agent-trace"),
        "--dummy-weights",
        "--replay-routing",
        "synthetic",
        "--max-model-len",
        "2048",
    )
    yield server
    server.stop()


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("api", "variants", "sessions"), [("openai", agent_trace.VARIANTS, (1, 2)), ("anthropic", ("openclaw",), (1,))]
)
def test_tiny_run_against_the_demo(replay_server, capsys, api, variants, sessions):
    turns = 3
    code = agent_trace.main(
        [
            "--server",
            replay_server.base_url,
            "--api",
            api,
            "--scale",
            "0.005",
            "--turns",
            str(turns),
            "--sessions",
            *map(str, sessions),
            "--max-tokens",
            "3",
            "--variants",
            *variants,
            "--alone-repeats",  # one fresh prompt per size: 16 tokens and a session's first turn (90)
            "1",
        ]
    )
    assert code == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["bench"] == "agent_trace"
    assert record["routing"]["source"] == "replay" and "synthetic" in record["routing"]["trace"]
    assert [(r["variant"], r["sessions"]) for r in record["runs"]] == [(v, n) for v in variants for n in sessions]
    for run in record["runs"]:
        assert run["errors"] == []
        assert run["turns"] == turns * run["sessions"] and run["watchdog_violations"] == 0
        assert 0 < run["ttft_p50_s"] <= run["ttft_p99_s"] <= run["ttft_max_s"]
        by_session: dict[str, list] = {}
        for turn in run["per_turn"]:
            assert turn["completion_tokens"] == 3
            assert turn["reprefilled_tokens"] == turn["prompt_tokens"] - turn["cached_tokens"] >= 1
            by_session.setdefault(turn["session"], []).append(turn["prompt_tokens"])
        for prompts in by_session.values():  # each turn resends the conversation, one reply and result longer
            assert prompts == sorted(prompts) and prompts[0] < prompts[-1]
        # The bound of each turn: 0.3 s + the fresh-prompt TTFT at its re-prefilled tokens, measured before it.
        alone = agent_trace.AloneCurve(run["alone"]["tokens"], run["alone"]["seconds"])
        assert len(alone.tokens) >= 2 and all(t > 0 for t in alone.seconds)
        for turn in run["per_turn"]:
            assert turn["alone_s"] == alone(turn["reprefilled_tokens"])
            assert turn["bound_s"] == pytest.approx(agent_trace.BOUND_ALLOWANCE_S + turn["alone_s"])
        assert run["over_bound"] == sum(t["ttft_s"] > t["bound_s"] for t in run["per_turn"])
        assert run["cut_at_time_limit"] is False
        # the server's prefill counters so far: every prompt (the fresh ones and the turns) ran in >= 1 chunk
        assert sum(run["prefill"]["steps_by_strategy"].values()) >= turns * run["sessions"]


@pytest.mark.timeout(120)
def test_a_time_limit_cuts_the_run_after_each_session_s_first_turn(replay_server, capsys):
    """--time-limit-s 0: every session runs its first turn and starts no other; the run says it was cut."""
    args = "--scale 0.005 --turns 3 --sessions 2 --max-tokens 2 --variants plain --alone-sizes --time-limit-s 0"
    code = agent_trace.main(["--server", replay_server.base_url, *args.split()])
    assert code == 0
    run = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["runs"][0]
    assert run["turns"] == 2 and sorted(t["session"] for t in run["per_turn"]) == ["s0", "s1"]
    assert run["cut_at_time_limit"] is True and run["errors"] == []
    assert run["alone"] is None and all(t["bound_s"] is None for t in run["per_turn"]) and run["over_bound"] == 0


def test_alone_curve_interpolates_and_extends_the_measured_times():
    curve = agent_trace.AloneCurve([100, 1000, 5000], [0.2, 1.0, 1.4])
    assert curve(100) == 0.2 and curve(1000) == 1.0
    assert curve(550) == pytest.approx(0.6)
    assert curve(10) == 0.2  # below the first point: its time
    assert curve(9000) == pytest.approx(1.4 + 0.4 / 4000 * 4000)  # past the last: the line from 1000 (<= 5000 / 2)
    # Two last points a token apart (the H200's 17,857 and 17,858) do not make the slope: the base is 4,105.
    close = agent_trace.AloneCurve([4105, 16330, 17857, 17858], [0.977, 1.014, 1.001, 1.011])
    assert close(58567) == pytest.approx(1.011 + (1.011 - 0.977) / (17858 - 4105) * (58567 - 17858))
    assert agent_trace.AloneCurve([100, 1000], [0.5, 0.4])(5000) == 0.4  # never below the last point
    assert agent_trace.AloneCurve([500], [0.7])(5000) == 0.7
    with pytest.raises(ValueError, match="strictly ascending"):  # CI once measured two sizes at 107 tokens each
        agent_trace.AloneCurve([40, 107, 107], [0.02, 0.024, 0.024])


def test_a_failed_session_is_reported_and_the_run_goes_on(replay_server, capsys):
    """A conversation past the server's context (2048 tokens) ends its session with the API's error; exit 1."""
    code = agent_trace.main(
        [
            "--server",
            replay_server.base_url,
            "--scale",
            "0.2",
            "--turns",
            "2",
            "--sessions",
            "1",
            "--max-tokens",
            "2",
            "--variants",
            "plain",
        ]
    )
    assert code == 1
    run = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["runs"][0]
    assert run["turns"] == 0 and len(run["errors"]) == 1 and "s0 turn 0" in run["errors"][0]


def _session(variant: str, turns: int, scale: float = 0.01):
    session = agent_trace.new_session("s0", variant, 0, 100, (20, 20), scale)
    for turn in range(turns):
        agent_trace.advance(session, turn, f"reply {turn}")
    return session


def test_openclaw_keeps_thinking_on_the_latest_reply_only():
    plain = agent_trace.harness_view(_session("plain", 4))
    view = agent_trace.harness_view(_session("openclaw", 4))
    assert [e.text for e in view] == [e.text for e in plain]
    thinking = [bool(e.thinking) for e in view if e.role == "assistant"]
    assert thinking == [False, False, False, True]
    assert all(e.thinking for e in plain if e.role == "assistant")
    messages = agent_trace.openai_messages(_session("openclaw", 4), view)
    assert sum("reasoning_content" in m for m in messages) == 1


def test_opencode_prunes_old_tool_outputs_in_batches():
    """Scale 0.01: results of 20 tokens, the newest 400 protected, pruned once more than 200 are past them."""
    session = _session("opencode", 40)
    view = agent_trace.harness_view(session)
    tools = [e for e in view if e.role == "tool"]
    pruned = [e.text == agent_trace.PRUNED for e in tools]
    assert pruned[-20:] == [False] * 20  # within the protected 400 tokens
    assert any(pruned) and pruned == sorted(pruned, reverse=True)  # the oldest ones
    assert sum(pruned) > 10  # more than the 200-token minimum at once
    # A pruned output stays pruned, and the next turn's view prunes nothing new below the minimum.
    agent_trace.advance(session, 40, "reply")
    again = [e.text == agent_trace.PRUNED for e in agent_trace.harness_view(session) if e.role == "tool"]
    assert again[: len(pruned)] == pruned and sum(again) == sum(pruned)
    assert all(e.text != agent_trace.PRUNED for e in agent_trace.harness_view(_session("plain", 40)))


def test_text_is_seeded():
    a = agent_trace.openai_messages(_session("plain", 3), agent_trace.harness_view(_session("plain", 3)))
    b = agent_trace.openai_messages(_session("plain", 3), agent_trace.harness_view(_session("plain", 3)))
    assert a == b
    other = agent_trace.new_session("s1", "plain", 0, 100, (20, 20), 0.01)
    assert other.system != _session("plain", 0).system


def test_prompt_diff_measures_what_changed_since_the_previous_turn():
    """OpenClaw's second turn strips the first reply's thinking: the change starts inside that reply, and the mark
    bound reaches back to the last mark before it (the turn end before the reply)."""
    from freetoken.models.demo import demo_checkpoint_dir

    diff = agent_trace.PromptDiff(demo_checkpoint_dir())
    session = agent_trace.new_session("s0", "openclaw", 0, 100, (20, 20), 0.01)
    prompts = []
    for turn in range(3):
        view = agent_trace.harness_view(session)
        prompts.append(diff.encode(session, view))
        changed, bound = diff.measure(session, view, len(prompts[-1]))
        previous = prompts[-2] if turn else []
        same = next((i for i, (a, b) in enumerate(zip(previous, prompts[-1], strict=False)) if a != b), len(previous))
        assert changed == len(prompts[-1]) - same
        start = len(prompts[-1]) - bound
        assert bound >= changed and (start == 0 or diff.marks.ends_at(prompts[-1], start))
        assert not diff.marks.positions(prompts[-1], start, same)  # no later mark before the change
        agent_trace.advance(session, turn, f"reply {turn}")
    assert 0 < len(prompts[2]) - changed < len(prompts[1])  # turn 2 changed inside turn 1's prompt
    assert diff.measure(session, agent_trace.harness_view(session), 5) == (None, None)  # another count: no figure


@pytest.mark.timeout(120)
def test_a_turn_records_what_changed_and_the_mark_bound(replay_server):
    """`run_turn` with a `PromptDiff` puts its two figures in the turn's changed/mark-bound fields (not in the
    alone time, which the run fills later): the targets of issue 22 read them."""
    from types import SimpleNamespace

    from freetoken.models.demo import demo_checkpoint_dir

    args = SimpleNamespace(api_key="x", request_timeout_s=60.0)
    client = agent_trace.make_client(replay_server.base_url, "openai", args)
    diff, reference = agent_trace.PromptDiff(demo_checkpoint_dir()), agent_trace.PromptDiff(demo_checkpoint_dir())
    session = agent_trace.new_session("s0", "openclaw", 0, 100, (20, 20), 0.01)
    for turn in range(3):
        view = agent_trace.harness_view(session)
        expected = reference.measure(session, view, len(reference.encode(session, view)))
        r = agent_trace.run_turn(client, "openai", SERVED_MODEL_NAME, session, turn, 2, 0, diff=diff)
        assert None not in expected and (r.changed_tokens, r.mark_bound_tokens) == expected
        assert r.alone_s is None
    assert r.changed_tokens < r.mark_bound_tokens  # OpenClaw's third turn changes inside a reply, after its mark


def test_checkpoint_targets_per_variant():
    def run(server, variant, reprefilled, bounds):
        per_turn = [
            {
                "turn": t,
                "reprefilled_tokens": r,
                "changed_tokens": b - 2,
                "mark_bound_tokens": b,
                "prompt_tokens": 99,
                "ttft_s": 0.1,
            }
            for t, (r, b) in enumerate(zip(reprefilled, bounds, strict=True))
        ]
        return {"server": server, "variant": variant, "sessions": 1, "per_turn": per_turn}

    runs = [
        run("checkpoints marks", "opencode", [100, 10, 50], [100, 10, 40]),
        run("checkpoints chunk", "opencode", [100, 90, 40], [100, 10, 40]),
    ]
    assert agent_trace.checkpoint_targets(runs) == {
        "opencode": {
            "over_bound": [2],
            "marks_over_chunk": [2],
            "marks": 160,
            "chunk": 230,
            "changed": 144,
            "chunk_over_marks": 1.44,
        }
    }

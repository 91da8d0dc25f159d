"""Recurrent-state checkpoints (issue 22): the snapshot pool, marks, and the engine on the Qwen3.5 demo (CPU, float32).

Every answer is compared with a cold run: the same prompt alone on an engine with `--state-checkpoints off` (every
hybrid prompt prefilled in full), greedy. Reuse is checked where clients see it (`num_cached_tokens`) and in the
checkpoints' counters.
"""

from __future__ import annotations

import pytest
import torch
from test_engine import Result, assert_all_blocks_free, collect, greedy, run

from freetoken.config import EngineConfig, ModelConfig
from freetoken.engine.llm_engine import LLMEngine
from freetoken.engine.state_checkpoints import MarkSet, Snapshot, SnapshotPool, StateCheckpoints, select_marks
from freetoken.engine.types import SamplingParams
from freetoken.models.demo_qwen3_5 import build_qwen3_5_demo_checkpoint
from freetoken.models.loader import load_checkpoint
from freetoken.moe import FusedExperts
from freetoken.tokenizer import Tokenizer

BS = 16

# ---------------------------------------------------------------------------------------------------------------------
# The snapshot pool and marks, alone.


def make_pool(capacity: int, dropped: list) -> SnapshotPool:
    return SnapshotPool(capacity, lambda p: Snapshot(p, {}, []), dropped.append)


def test_pool_budget_and_lru_eviction():
    dropped: list[Snapshot] = []
    pool = make_pool(3, dropped)
    snaps = [pool.allocate(p) for p in (10, 20, 30)]
    for s in snaps:
        pool.unpin(s)
    pool.touch(snaps[0])  # 20 is now the least recently used
    fourth = pool.allocate(40)
    assert dropped == [snaps[1]] and len(pool) == 3 and pool.num_evicted == 1
    pool.unpin(fourth)
    pool.allocate(50)
    assert dropped == [snaps[1], snaps[2]]


def test_pool_never_evicts_a_pinned_snapshot():
    dropped: list[Snapshot] = []
    pool = make_pool(2, dropped)
    a, b = pool.allocate(1), pool.allocate(2)
    assert pool.allocate(3) is None  # both are being written
    pool.unpin(a)
    pool.pin(a)  # a restore (or a second writer) holds it again
    assert pool.allocate(3) is None and not dropped
    pool.unpin(a)
    c = pool.allocate(3)
    assert dropped == [a] and c is not None and b.pins == 1
    with pytest.raises(ValueError, match="unpinned more often"):
        pool.unpin(a)
    pool.drop(b)  # a failed step's snapshot leaves at once, pinned or not
    assert dropped == [a, b] and len(pool) == 1


def test_pool_host_tier_takes_what_the_device_evicts():
    dropped: list[Snapshot] = []
    demoted: list[Snapshot] = []
    pool = SnapshotPool(2, lambda p: Snapshot(p, {}, []), dropped.append, host_capacity=2, demote=demoted.append)
    snaps = []
    for p in range(5):
        snaps.append(pool.allocate(p))
        pool.unpin(snaps[-1])
    # Device: 3, 4; host: 1, 2 (0 was demoted first, then evicted from the full host tier).
    assert demoted == snaps[:3] and dropped == [snaps[0]]
    assert pool.num_device == 2 and pool.num_host == 2 and len(pool) == 4
    pool.touch(snaps[1])  # a restore read it: 2 is now the host tier's least recently used
    pool.unpin(pool.allocate(5))
    assert dropped == [snaps[0], snaps[2]] and pool.num_evicted == 2 and pool.num_demoted == 4
    pool.drop(snaps[1])
    assert pool.num_host == 1


def test_demote_moves_every_tensor_into_one_host_buffer():
    states = {
        0: (torch.randn(6, 3, dtype=torch.bfloat16), torch.randn(2, 4, 4)),
        2: (torch.randn(5, 3, dtype=torch.bfloat16), torch.randn(2, 4, 4)),
    }
    tail = [(torch.randn(16, 2, 8), torch.randn(16, 2, 8))]
    snap = Snapshot(5, dict(states), list(tail))
    StateCheckpoints._demote(snap)
    for layer, (conv, ssm) in states.items():
        assert torch.equal(snap.states[layer][0], conv) and torch.equal(snap.states[layer][1], ssm)
        assert snap.states[layer][0].dtype == torch.bfloat16
    assert torch.equal(snap.tail[0][0], tail[0][0]) and torch.equal(snap.tail[0][1], tail[0][1])
    storages = {t.untyped_storage().data_ptr() for pair in [*snap.states.values(), *snap.tail] for t in pair}
    assert len(storages) == 1


def test_pool_of_zero_capacity_takes_nothing():
    assert make_pool(0, []).allocate(5) is None


def test_marks_single_and_multi_token():
    marks = MarkSet([[7], [3, 4, 5], [9, 4]])
    tokens = [1, 7, 3, 4, 5, 2, 4, 5, 9, 4, 7]
    assert marks.positions(tokens, 0, len(tokens)) == [2, 5, 10, 11]
    assert marks.positions(tokens, 2, 10) == [5, 10]  # start exclusive, stop inclusive
    assert marks.ends_at(tokens, 5) and not marks.ends_at(tokens, 8) and not marks.ends_at(tokens, 0)


def test_marks_come_from_the_template_and_tokenizer(qwen35):
    marks = MarkSet.from_tokenizer(qwen35.tokenizer)
    expected = {
        tuple(qwen35.tokenizer.encode(s))
        for s in ("</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<|im_end|>")
    }
    assert set(marks.sequences) == expected


def test_select_marks_keeps_the_tail_a_spacing_and_the_end():
    marks = list(range(10, 1000, 10))  # a mark every 10 tokens: 99 of them
    kept = select_marks(marks, 0, 1000, spacing=250, tail=3)
    assert kept == [10, 260, 510, 760, 970, 980, 990, 1000]
    assert select_marks([], 5, 40, spacing=250) == [40]
    assert select_marks([30, 35], 0, 40, spacing=250, tail=0) == [30, 40]
    # The last turn ends too, however many marks follow them.
    kept = select_marks(marks, 0, 1000, spacing=250, tail=3, turn_ends=[100, 500, 700, 900], tail_turns=2)
    assert kept == [10, 260, 510, 700, 900, 970, 980, 990, 1000]  # spaced from the kept turn ends on
    # And tool outputs' starts wherever they are (spacing counts from them too).
    kept = select_marks(marks, 0, 1000, spacing=250, tail=3, always=[300, 320])
    assert kept == [10, 260, 300, 320, 570, 820, 970, 980, 990, 1000]


def test_turn_ends_and_tool_outputs_among_marks():
    marks = MarkSet([[7], [3, 4]], turn_end=[3, 4], tool_output=[7])
    tokens = [1, 7, 3, 4, 2, 7, 3, 4]
    found = marks.positions(tokens, 0, len(tokens))
    assert marks.turn_ends(tokens, found) == [4, 8] and marks.tool_outputs(tokens, found) == [2, 6]
    assert MarkSet([[7]]).turn_ends(tokens, [2, 6]) == [] == MarkSet([[7]]).tool_outputs(tokens, [2, 6])


def test_marks_name_turn_ends_and_tool_outputs(qwen35):
    marks = MarkSet.from_tokenizer(qwen35.tokenizer)
    assert marks.turn_end == tuple(qwen35.tokenizer.encode("<|im_end|>"))
    assert marks.tool_output == tuple(qwen35.tokenizer.encode("<tool_response>"))
    assert marks.query_open == tuple(qwen35.tokenizer.encode("<|im_start|>user"))


def test_query_ends_among_marks():
    """A user turn ends a query unless its text is a tool output; other roles' turns never do."""
    start, user, system, newline, end, tool = 1, 2, 3, 4, 5, 6
    marks = MarkSet([[end], [tool]], turn_end=[end], tool_output=[tool], query_open=[start, user])
    tokens = [start, system, newline, 9, end]  # system: turn end at 5
    tokens += [start, user, newline, 9, 9, end]  # a query: 11
    tokens += [start, 7, newline, 9, end]  # the assistant: 16
    tokens += [start, user, newline, tool, 9, end]  # a tool output: 22
    tokens += [start, user, newline, 8, end]  # a query: 27
    found = marks.positions(tokens, 0, len(tokens))
    assert marks.turn_ends(tokens, found) == [5, 11, 16, 22, 27]
    assert marks.query_ends(tokens, found) == [11, 27]
    assert marks.query_ends(tokens, [27]) == [27]  # its opener before the marks asked about
    assert MarkSet([[end]], turn_end=[end]).query_ends(tokens, found) == []  # no opener known: none


# ---------------------------------------------------------------------------------------------------------------------
# Through the engine.


class Qwen35:
    """The Qwen3.5 demo model, loaded once; engines of any settings around it. A hybrid model reads the state pool
    of the last engine built around it (`attach_state`), so the cold runs' engines get a model of their own."""

    def __init__(self, path) -> None:
        self.path = path
        self.cfg = ModelConfig.from_dir(path)
        self.model, self.cold_model = (
            load_checkpoint(path, FusedExperts(), torch.device("cpu"), torch.float32, cfg=self.cfg) for _ in range(2)
        )
        self.tokenizer = Tokenizer.from_dir(path)

    def engine(self, cold: bool = False, **kwargs) -> LLMEngine:
        kwargs.setdefault("max_model_len", 1024)
        kwargs.setdefault("kv_cache_tokens", 4096)
        cfg = EngineConfig(device="cpu", dtype="float32", kv_block_size=BS, **kwargs)
        return LLMEngine(self.cold_model if cold else self.model, self.cfg, cfg, self.tokenizer)

    def encode(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        return self.tokenizer.encode(self.tokenizer.apply_chat_template(messages, tools=tools))


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory) -> Qwen35:
    return Qwen35(build_qwen3_5_demo_checkpoint(tmp_path_factory.mktemp("qwen35"), seed=0))


def one(engine: LLMEngine, prompt: list[int], params: SamplingParams | None = None, rid: str = "x") -> Result:
    return run(engine, {rid: (prompt, params or greedy())})[rid]


_cold_cache: dict[tuple, list[int]] = {}


def cold(qwen35: Qwen35, prompt: list[int], max_tokens: int = 12) -> list[int]:
    """`prompt` alone on an engine without checkpoints (so without any reuse), greedy."""
    key = (tuple(prompt), max_tokens)
    if key not in _cold_cache:
        _cold_cache[key] = one(qwen35.engine(cold=True, state_checkpoints="off"), prompt, greedy(max_tokens)).token_ids
    return _cold_cache[key]


def first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


SYSTEM = "You are a coding agent. Read files with the tools, keep answers short, cite paths. " * 3
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read",
            "description": "Read a file",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    }
]


def session(turns: int, salt: str = "") -> list[dict]:
    """A harness-shaped history: system, then per turn a user message, an assistant turn with thinking and a tool
    call, and the tool's output."""
    messages = [{"role": "system", "content": SYSTEM + salt}]
    for t in range(turns):
        messages += [
            {"role": "user", "content": f"{salt}Step {t}: what does module {t} do?"},
            {
                "role": "assistant",
                "content": "",
                "reasoning_content": f"I should read module {t} first.",
                "tool_calls": [
                    {
                        "type": "function",
                        "id": f"c{t}",
                        "function": {"name": "read", "arguments": {"path": f"src/m{t}.py"}},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": f"c{t}", "content": f"def f{t}(x):\n    return x * {t}\n" * 3},
        ]
    return messages


def test_follow_up_turn_resumes_at_the_prompt_end_and_equals_cold(qwen35):
    engine = qwen35.engine()
    history = session(2)
    p1 = qwen35.encode(history, TOOLS)
    r1 = one(engine, p1)
    assert r1.last.num_cached_tokens == 0 and r1.token_ids == cold(qwen35, p1)
    # The next turn: the answer and a new message appended (token ids, so the answer is exactly what ran).
    p2 = (
        p1
        + r1.token_ids
        + qwen35.tokenizer.encode("<|im_end|>\n<|im_start|>user\nAnd the next one?<|im_end|>\n<|im_start|>assistant\n")
    )
    r2 = one(engine, p2)
    # The deepest snapshot: the first turn's last decoded mark or its prompt end (the answer's last token, sampled
    # but never run, has no state).
    assert len(p1) <= r2.last.num_cached_tokens < len(p1) + len(r1.token_ids)
    assert r2.token_ids == cold(qwen35, p2)
    stats = engine.stats()["state_checkpoints"]
    assert stats["num_restores"] == 1 and stats["num_restored_tokens"] == r2.last.num_cached_tokens
    assert stats["num_live"] == stats["num_snapshots"] > 0
    assert_all_blocks_free(engine)


def test_edited_early_message_resumes_before_the_edit(qwen35):
    engine = qwen35.engine()
    history = session(3)
    p1 = qwen35.encode(history, TOOLS)
    one(engine, p1)
    edited = [dict(m) for m in history]
    edited[1]["content"] = "Step 0: what does module ZERO do, in one word?"
    p2 = qwen35.encode(edited, TOOLS)
    r2 = one(engine, p2)
    changed = first_diff(p1, p2)
    assert 0 < r2.last.num_cached_tokens <= changed  # the system prompt's first mark, never one past the edit
    assert r2.token_ids == cold(qwen35, p2)
    assert r2.token_ids != cold(qwen35, p1)  # the answer follows the edit
    assert_all_blocks_free(engine)


def test_thinking_stripped_resumes_at_the_last_unchanged_mark(qwen35):
    """Thinking stripped from earlier turns (by OpenClaw, and by Qwen's template itself once a new user message
    follows them): the prompt changes right after the first assistant header since the previous user message. The
    session ran as a harness runs it, a request per turn; the resume point is the mark the turn that asked that
    user message left at its end (or within a few tokens before it)."""
    engine = qwen35.engine()
    history = session(2)
    one(engine, qwen35.encode(history[:-2], TOOLS), greedy(4))  # the user asks step 1
    base = qwen35.encode(history, TOOLS)  # its tool call and output came back
    # The turn as the model wrote it, thinking included (run as a prompt: the demo model writes no thinking).
    p1 = base + qwen35.tokenizer.encode(
        "<think>\nThe tool output shows x * 1.\n</think>\n\nModule 1 multiplies by one."
    )
    one(engine, p1)
    stripped = history + [
        {"role": "assistant", "content": "Module 1 multiplies by one."},
        {"role": "user", "content": "Now module 2?"},
    ]
    p2 = qwen35.encode(stripped, TOOLS)
    changed = first_diff(p1, p2)
    # The template drops the thinking of every turn before the last user message: the tool-call turn's too.
    assert changed < len(base) and qwen35.tokenizer.encode("</think>")[0] not in p2[changed:]
    r2 = one(engine, p2)
    assert changed - 6 <= r2.last.num_cached_tokens <= changed
    assert r2.token_ids == cold(qwen35, p2)
    assert_all_blocks_free(engine)


def test_openclaw_turns_resume_at_the_turn_end_before_the_stripped_reply(qwen35):
    """OpenClaw keeps thinking on the latest reply only: each turn strips the previous reply's thinking, whose
    reply, tool call and tool response hold more marks than `TAIL_MARKS`. The turn end before that reply (kept as
    one of the prompt's last `TAIL_TURNS` turn ends) is where the turn resumes, within its header's few tokens."""
    engine = qwen35.engine()

    def turn(k: int) -> list[int]:
        messages = session(1)[:2]  # the system prompt and the task
        for t in range(k):
            call = {"type": "function", "id": f"r{t}", "function": {"name": "read", "arguments": {"path": f"f{t}"}}}
            reply = {"role": "assistant", "content": f"Reading f{t}.", "tool_calls": [call]}
            if t == k - 1:
                reply["reasoning_content"] = f"File f{t} should say what module {t} does."
            messages += [reply, {"role": "tool", "tool_call_id": f"r{t}", "content": f"x = {t}\n" * 4}]
        return qwen35.encode(messages, TOOLS)

    prompts = [turn(k) for k in range(1, 5)]
    for k, prompt in enumerate(prompts):
        r = one(engine, prompt, greedy(2), rid=f"t{k}")
        if k >= 2:
            changed = first_diff(prompts[k - 1], prompt)
            assert changed - 6 <= r.last.num_cached_tokens <= changed, (k, changed, r.last.num_cached_tokens)
            assert r.token_ids == cold(qwen35, prompt, 2)
    assert_all_blocks_free(engine)


def test_replaced_tool_output_resumes_at_its_start(qwen35):
    """OpenCode replaces old tool outputs by a placeholder, deep in the history (past the spacing of kept marks):
    every tool output's start is kept, so the prompt resumes right at the replaced output."""
    engine = qwen35.engine()
    history = session(4)
    p1 = qwen35.encode(history, TOOLS)
    one(engine, p1, greedy(2))
    pruned = [dict(m) for m in history]
    pruned[3]["content"] = "[Old tool result content cleared]"  # the first tool output (system, user, call, output)
    p2 = qwen35.encode(pruned, TOOLS)
    changed = first_diff(p1, p2)
    assert len(p2) - changed > 200  # deep: most of the prompt follows the change
    r2 = one(engine, p2, greedy(2))
    assert changed - 2 <= r2.last.num_cached_tokens <= changed, (changed, r2.last.num_cached_tokens)
    assert r2.token_ids == cold(qwen35, p2, 2)
    assert_all_blocks_free(engine)


def test_new_query_resumes_at_the_previous_query_s_end(qwen35):
    """A new user query makes the template drop the thinking of every reply since the previous query: the prompt
    changes right after that query's end, which more tool turns than the kept last turn ends followed."""
    engine = qwen35.engine()
    base = session(7)  # system, then (user, assistant with thinking and a call, tool output) x 7
    query = {"role": "user", "content": "Now fix module 0."}
    history = [*base[:4], query, *(m for m in base[4:] if m["role"] != "user")]  # 6 tool turns after the query
    p1 = qwen35.encode(history, TOOLS)
    one(engine, p1, greedy(2))
    p2 = qwen35.encode([*history, {"role": "user", "content": "Thanks. Next?"}], TOOLS)
    changed = first_diff(p1, p2)
    marks = MarkSet.from_tokenizer(qwen35.tokenizer)
    query_end = max(marks.query_ends(p1, marks.positions(p1, 0, changed)))
    assert changed - query_end <= 6 and len(p1) - changed > 200  # right after the query; deep
    r2 = one(engine, p2, greedy(2))
    assert r2.last.num_cached_tokens == query_end, (query_end, changed, r2.last.num_cached_tokens)
    assert r2.token_ids == cold(qwen35, p2, 2)
    assert_all_blocks_free(engine)


def test_strict_prefixes_of_an_earlier_prompt(qwen35):
    engine = qwen35.engine()
    p1 = qwen35.encode(session(2), TOOLS)
    r1 = one(engine, p1, greedy(8))
    marks = MarkSet.from_tokenizer(qwen35.tokenizer).positions(p1, 0, len(p1))
    for cut in (marks[0], marks[0] + 1, marks[-1], len(p1) - 3, len(p1)):
        prompt = p1[:cut]
        r = one(engine, prompt)
        assert r.last.num_cached_tokens < cut, cut  # never the snapshot at the prompt's own end: no logits there
        assert r.token_ids == cold(qwen35, prompt), cut
    # A prefix of the prompt plus part of the answer.
    prompt = p1 + r1.token_ids[:4]
    assert one(engine, prompt).token_ids == cold(qwen35, prompt)
    assert_all_blocks_free(engine)


def test_sessions_evicting_each_others_snapshots(qwen35):
    """Two sessions alternate over room for twelve snapshots (a turn takes more than eight: marks, turn ends, tool
    outputs' starts): each evicts the other's oldest snapshots, the newest survive to resume the next turn, and
    answers stay cold's."""
    nbytes = qwen35.engine(cold=True).checkpoints.nbytes_each
    engine = qwen35.engine(state_checkpoint_gb=12.5 * nbytes / 1e9)
    assert engine.checkpoints.pool.capacity == 12
    prompts = {s: qwen35.encode(session(1, salt=f"S{s}. "), TOOLS) for s in range(2)}
    cached = []
    for turn in range(3):
        for s, prompt in prompts.items():
            r = one(engine, prompt, greedy(4), rid=f"s{s}t{turn}")
            assert r.token_ids == cold(qwen35, prompt, 4), (s, turn)
            cached.append(r.last.num_cached_tokens)
            prompts[s] = (
                prompt
                + r.token_ids
                + qwen35.tokenizer.encode(
                    f"<|im_end|>\n<|im_start|>user\nTurn {turn}.<|im_end|>\n<|im_start|>assistant\n"
                )
            )
    stats = engine.stats()["state_checkpoints"]
    assert stats["num_evicted"] > 0 and stats["num_live"] <= 12
    assert cached[:2] == [0, 0] and all(c > 0 for c in cached[2:]), cached
    assert_all_blocks_free(engine)


def test_kv_eviction_invalidates_snapshots(qwen35):
    """A snapshot whose KV blocks the prefix cache evicted is dropped, never used without its KV."""
    engine = qwen35.engine(kv_cache_tokens=512)
    p1 = qwen35.encode(session(1, salt="first "), TOOLS)
    one(engine, p1, greedy(4))
    live = engine.stats()["state_checkpoints"]["num_live"]
    assert live > 0
    for s in range(3):  # other prompts take every block
        one(engine, qwen35.encode(session(1, salt=f"other {s} "), TOOLS), greedy(4))
    stats = engine.stats()["state_checkpoints"]
    assert stats["num_invalidated"] > 0
    r = one(engine, p1 + [11, 12, 13])
    assert r.token_ids == cold(qwen35, p1 + [11, 12, 13])
    assert_all_blocks_free(engine)


def test_hybrid_uses_kv_blocks_only_up_to_a_snapshot(qwen35):
    """The prefix cache holds every full block of an earlier prompt, but a hybrid prompt resumes at a snapshot:
    with only the prompt's first mark snapshotted, the reuse stops there."""
    engine = qwen35.engine()
    p1 = qwen35.encode(session(2), TOOLS)
    one(engine, p1, greedy(2))
    ck = engine.checkpoints
    first = min(ck._index[n][t].position for n in ck._index for t in ck._index[n])
    for by_tail in list(ck._index.values()):
        for snap in list(by_tail.values()):
            if snap.position != first:
                ck.pool.drop(snap)
    prompt = p1 + [100, 101]
    assert engine.scheduler.prefix_cache.match(prompt).num_blocks * BS > first + BS
    r = one(engine, prompt)
    assert r.last.num_cached_tokens == first
    assert r.token_ids == cold(qwen35, prompt)


def test_n_choices_and_concurrent_requests(qwen35):
    engine = qwen35.engine(max_prefill_tokens=64)
    base = qwen35.encode(session(2), TOOLS)
    prompts = {f"c{i}": base + qwen35.tokenizer.encode(f"extra {i}") for i in range(3)}
    got = run(engine, {rid: (p, greedy(8)) for rid, p in prompts.items()})
    for rid, p in prompts.items():
        assert got[rid].token_ids == cold(qwen35, p, 8), rid
    # n = 2 of one prompt, sampled with seeds: each choice equals the same seed alone.
    params = [SamplingParams(max_tokens=8, temperature=0.8, seed=s, ignore_eos=True) for s in (1, 2)]
    for i, p in enumerate(params):
        engine.add_request(f"n{i}", prompts["c0"], p, group="n")
    both = collect(engine, {})
    for i, p in enumerate(params):
        alone = one(qwen35.engine(cold=True, state_checkpoints="off"), prompts["c0"], p)
        assert both[f"n{i}"].token_ids == alone.token_ids
    assert engine.stats()["state_checkpoints"]["num_restores"] >= 2
    assert_all_blocks_free(engine)


def test_aborted_and_failed_steps_leave_no_snapshot(qwen35, monkeypatch):
    engine = qwen35.engine(max_prefill_tokens=48)
    prompt = qwen35.encode(session(2), TOOLS)
    engine.add_request("a", prompt, greedy())
    engine.step()
    engine.step()  # mid-prefill: snapshots of the first chunks are taken
    engine.abort("a")
    assert not engine.checkpoints.pool._pinned
    # A step that fails: the snapshots it was taking are dropped, none is indexed.
    engine.add_request("b", prompt[:40] + [5, 6, 7, 8] * 20, greedy())
    live = len(engine.checkpoints.pool)

    def boom(step):
        raise RuntimeError("injected")

    monkeypatch.setattr(engine.runner, "run", boom)
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    monkeypatch.undo()
    assert len(engine.checkpoints.pool) == live and not engine.checkpoints.pool._pinned
    engine.abort("b")
    r = one(engine, prompt)
    assert r.token_ids == cold(qwen35, prompt)
    assert_all_blocks_free(engine)


def test_chunk_mode_snapshots_each_chunk_end(qwen35):
    engine = qwen35.engine(state_checkpoints="chunk", max_prefill_tokens=64)
    p1 = qwen35.encode(session(2), TOOLS)
    one(engine, p1, greedy(4))
    positions = sorted(s.position for by_tail in engine.checkpoints._index.values() for s in by_tail.values())
    assert positions == [*range(64, len(p1), 64), len(p1)]
    edited = list(p1)
    edited[150] += 1
    r = one(engine, edited)
    assert r.last.num_cached_tokens == 128
    assert r.token_ids == cold(qwen35, edited)


def test_marks_mode_resumes_closer_to_an_edit_than_chunk_mode(qwen35):
    """A tool output replaced deep in the history (OpenCode's pruning): marks resume at the tool response's
    opening, chunk ends only at the chunk boundary before it."""
    history = session(4)
    pruned = [dict(m) for m in history]
    pruned[4]["content"] = "[output pruned]"  # the first tool output
    saved = {}
    for mode in ("marks", "chunk"):
        engine = qwen35.engine(state_checkpoints=mode, max_prefill_tokens=256, state_checkpoint_spacing=16)
        p1 = qwen35.encode(history, TOOLS)
        one(engine, p1, greedy(2))
        p2 = qwen35.encode(pruned, TOOLS)
        r = one(engine, p2, greedy(6))
        assert r.token_ids == cold(qwen35, p2, 6)
        saved[mode] = r.last.num_cached_tokens
        changed = first_diff(p1, p2)
    assert changed - 16 <= saved["marks"] <= changed
    assert saved["chunk"] < saved["marks"]


def test_off_mode_and_no_prefix_cache_prefill_everything(qwen35):
    for kwargs in ({"state_checkpoints": "off"}, {"no_prefix_cache": True}):
        engine = qwen35.engine(**kwargs)
        assert engine.checkpoints is None and not engine.scheduler.prefix_cache.enabled
        p = qwen35.encode(session(1), TOOLS)
        one(engine, p, greedy(2))
        assert one(engine, p + [3, 4]).last.num_cached_tokens == 0
        assert "state_checkpoints" not in engine.stats()


def test_bad_mode_is_refused():
    with pytest.raises(ValueError, match="--state-checkpoints"):
        EngineConfig(state_checkpoints="sometimes").validate()
    with pytest.raises(ValueError, match="--state-checkpoint-gb"):
        EngineConfig(state_checkpoint_gb=-1).validate()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graphs_and_host_tier_equal_cold(tmp_path):
    """On CUDA (Triton kernels, decode in CUDA graphs): two sessions alternate over room for three snapshots on the
    GPU, so snapshots go to the host tier and are restored from there; every answer equals a cold engine's."""
    from freetoken.engine.state_checkpoints import snapshot_nbytes

    path = build_qwen3_5_demo_checkpoint(tmp_path, seed=0)
    cfg = ModelConfig.from_dir(path)
    each = snapshot_nbytes(cfg, torch.float32, BS)

    def engine(**kwargs) -> LLMEngine:
        return LLMEngine.from_dir(
            path,
            EngineConfig(
                device="cuda", dtype="float32", moe_backend="fused", max_model_len=1024, kv_cache_tokens=4096, **kwargs
            ),
        )

    warm = engine(state_checkpoint_gb=3.5 * each / 1e9, state_checkpoint_host_gb=40 * each / 1e9)
    tokenizer = warm.tokenizer
    prompts = {
        s: tokenizer.encode(tokenizer.apply_chat_template(session(1, salt=f"S{s}. "), tools=TOOLS)) for s in range(2)
    }
    turns = []
    for turn in range(3):
        for s in list(prompts):
            r = one(warm, prompts[s], greedy(6), rid=f"s{s}t{turn}")
            turns.append((prompts[s], r))
            prompts[s] = (
                prompts[s]
                + r.token_ids
                + tokenizer.encode(f"<|im_end|>\n<|im_start|>user\nTurn {turn}.<|im_end|>\n<|im_start|>assistant\n")
            )
    stats = warm.stats()["state_checkpoints"]
    assert stats["num_demoted"] > 0 and stats["num_live_host"] > 0 and stats["num_restores"] >= 4
    del warm
    reference = engine(state_checkpoints="off")
    for prompt, r in turns:
        assert r.token_ids == one(reference, prompt, greedy(6)).token_ids

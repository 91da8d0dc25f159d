"""Agent sessions through `ft serve`: multi-turn sessions shaped like coding-agent harnesses, over HTTP, streamed.

A session opens with a long system prompt and tool schemas (`--system-tokens`, 18k by default, tools included)
and a task; each turn sends the whole conversation again, as harnesses do: the assistant's last reply (its text,
its thinking and a tool call) and that call's result (`--tool-tokens`, 0.5-4k), and every `USER_EVERY`-th turn a
user message. `--turns` turns (18: about 60k tokens at the end). Variants of what the harness sends back:
- `plain`: everything, every time (thinking included);
- `openclaw`: thinking blocks stripped from all assistant turns but the latest (as OpenClaw does), so the prompt
  changes at the previous reply on every turn;
- `opencode`: OpenCode's pruning: tool outputs older than the newest `PRUNE_PROTECT_TOKENS` of them are replaced
  by a placeholder once they add up to `PRUNE_MINIMUM_TOKENS` (then the prompt changes in its middle).
With dummy weights the model writes no thinking of its own, so each reply gets a seeded thinking text (about
`THINKING_TOKENS`) as a thinking model's would have. All text is seeded (`--seed`; the model samples greedily,
`ignore_eos` on the OpenAI API), so two runs send the same requests.

Runs: each variant with 1 session and with 3 concurrent ones (`--sessions`: subagents); and, when the bench starts
the server itself, the `plain` single session again on a server started with `--no-prefix-cache`
(`--compare-variants`), the figure the prefix cache replaces (skipped, and said so, when the server does not
know the flag). Per turn: TTFT (request sent to first streamed token), prompt tokens, cached tokens (OpenAI
`usage.prompt_tokens_details.cached_tokens`, Anthropic `usage.cache_read_input_tokens`; 0 when absent),
re-prefilled tokens (prompt - cached), decode tok/s ((completion tokens - 1) over first to last token), and issue
21's bound on the turn, TTFT <= 0.3 s + the time to prefill the re-prefilled tokens alone: before the sessions, each
server answers fresh prompts (`--alone-sizes`, a random nonce first so nothing of them is cached) and their TTFT by
prefilled tokens, interpolated (`AloneCurve`), is that time, measured through the same path as the turns. Per run:
p50/p99/max TTFT, turns over the bound, turns over the harness watchdog (`--watchdog-s`, 120 s: a request that
streams nothing for that long is killed), last-turn over first-turn decode tok/s; `--time-limit-s` stops a run's
sessions from starting more turns past a wall-clock limit and reports what ran (marked cut). Prints the routing the
server runs (`/v1/stats`), the expert backend's prefill counters after each run (`/v1/stats` moe_backend.prefill:
chunks per strategy, `auto`'s measured / predicted scales, bytes streamed), a rich table per run, a summary, and a
final JSON line.

    # on the GPU box: starts `ft serve` twice (with and without --no-prefix-cache) on a free port
    python benches/agent_trace.py --model qwen3-30b-a3b \\
        --serve-args "--device cuda --dummy-weights --replay-routing synthetic --gpu-memory-gb 24 --max-model-len 70000"
    # against a running server (one configuration); 3 concurrent sessions (subagents), about 20k tokens each
    python benches/agent_trace.py --server http://127.0.0.1:1919
    python benches/agent_trace.py --server URL --variants plain --sessions 3 --scale 0.33 --turns 13 \\
        --max-tokens 32 --time-limit-s 170
    # tiny, on the CPU demo model (seconds)
    python benches/agent_trace.py --model demo --serve-args "--device cpu --dummy-weights" --scale 0.01 --turns 4

The KV host tier (`ft serve --kv-host-gb`, `freetoken.engine.kv_host`): `--kv-host-gb 0 GB` starts one server per
size (0: none) and runs `--variants` x `--sessions` on each, instead of the prefix-cache comparison; under a small
GPU KV budget (`--kv-cache-tokens` in `--serve-args`) the summary's re-prefilled tokens and p99 TTFT show what the
tier saves, and each run prints the tier's counters (`/v1/stats` kv_host: host hits, bytes, the crossover).

    # on the GPU box: 3 concurrent sessions through 32k tokens of GPU KV, without and with an 8 GB host tier
    python benches/agent_trace.py --model qwen3-30b-a3b --kv-host-gb 0 8 --variants plain --sessions 3 \
        --turns 6 --scale 0.5 --max-tokens 16 --serve-args "--device cuda --dummy-weights --replay-routing synthetic \
        --gpu-memory-gb 24 --max-model-len 40000 --kv-cache-tokens 32768"
    # on the CPU, the demo model (a minute; 3 sessions of ~1k tokens through 2k tokens of KV: re-prefilled tokens
    # 11044 without the tier, 3700 with it, measured here)
    python benches/agent_trace.py --model demo --kv-host-gb 0 0.05 --variants plain --sessions 3 --turns 4 \
        --scale 0.01 --max-tokens 8 --serve-args "--device cpu --dummy-weights --kv-cache-tokens 2048"

Hybrid models (Qwen3.5) and their recurrent-state checkpoints (issue 22): `--state-checkpoints marks chunk off`
starts one server per mode (`ft serve --state-checkpoints MODE`; `off` runs only the `--compare-variants`, its
figures hardly depend on the variant) instead of the prefix-cache comparison, and prints per turn the re-prefilled
tokens and TTFT of each mode side by side, and each server's checkpoint counters (`/v1/stats`). Against a running
server (`--server`) the mode is the server's own. OpenCode's pruning thresholds scale with `--prune-protect-tokens`
and `--prune-minimum-tokens`, so a short session reaches them.

    # on the GPU box: Qwen3.5-35B-A3B, dummy weights, replayed routing, 24 GB, 13 turns to about 60k tokens
    python benches/agent_trace.py --model qwen3.5-35b-a3b --state-checkpoints marks chunk off \\
        --variants openclaw opencode --compare-variants openclaw --sessions 1 --turns 13 --tool-tokens 1000 5000 \\
        --prune-protect-tokens 12000 --prune-minimum-tokens 6000 --max-tokens 16 \\
        --serve-args "--device cuda --dummy-weights --replay-routing synthetic --gpu-memory-gb 24 \\
        --max-model-len 70000 --max-prefill-tokens 32768"
    # (one prefill chunk streams every layer once: an 18.9k-token first turn in 1.2 s on the H200, against 3.2 s in
    # 8192-token chunks; the 13-turn openclaw session's p99 TTFT with marks was 1.72 s, stop 30)
    # on the CPU, the Qwen3.5 demo checkpoint (built first: freetoken.models.demo_qwen3_5)
    python -c "from freetoken.models.demo_qwen3_5 import build_qwen3_5_demo_checkpoint as b; b('/tmp/q35demo')"
    python benches/agent_trace.py --model /tmp/q35demo --state-checkpoints marks chunk off --serve-args \\
        "--device cpu --max-model-len 4096" --scale 0.01 --turns 5 --sessions 1 --max-tokens 8
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
from rich.console import Console
from rich.table import Table

# Text sizes are set in characters from these (Qwen3's tokenizer on this generator's text); prompt tokens shown are
# what the server counted.
PROSE_CHARS_PER_TOKEN = 4.9
CODE_CHARS_PER_TOKEN = 2.4
USER_EVERY = 4  # every 4th turn brings a user message after the tool result (the others are tool turns)
THINKING_TOKENS = 300
# Issue 21's target for a turn: TTFT <= this + the time to prefill its re-prefilled tokens alone (`AloneCurve`).
BOUND_ALLOWANCE_S = 0.3
# Fresh-prompt sizes (tokens, times --scale) whose TTFT gives the time to prefill that many tokens alone; a session's
# first turn (`--system-tokens`) is added, so every turn's re-prefill lies within the measured range.
ALONE_SIZES = (32, 256, 1024, 4096, 16384)
# OpenCode's session compaction (packages/opencode/src/session/compaction.ts, PRUNE_PROTECT / PRUNE_MINIMUM).
PRUNE_PROTECT_TOKENS = 40_000
PRUNE_MINIMUM_TOKENS = 20_000
PRUNED = "[Old tool result content cleared]"
TOOLS = ("read_file", "edit_file", "bash", "grep", "glob", "web_fetch")
VARIANTS = ("plain", "openclaw", "opencode")
CHECKPOINT_MODES = ("marks", "chunk", "off")
STARTUP_TIMEOUT_S = 1800.0  # loading a 30B-class model with dummy weights and capturing graphs takes minutes
WORDS = (
    "the a an of to in for on with by from at as is are be was were this that these those it its file function "
    "test module server request token cache layer expert model prompt session turn tool result error value index "
    "return import class def self args kwargs config path line buffer stream batch step decode prefill block "
    "update check read write run build patch diff commit branch merge review change fix add remove keep move "
    "when then else if not and or but so because while after before each every all some none first last next"
).split()


def log(*parts: object) -> None:
    print(*parts, file=sys.stderr, flush=True)


class TextGen:
    """Seeded text of about a given number of tokens: prose, code and command output."""

    def __init__(self, seed: str) -> None:
        self.rng = random.Random(seed)

    def prose(self, tokens: int) -> str:
        out, size, n = [], 0, max(1, int(tokens * PROSE_CHARS_PER_TOKEN))
        while size < n:
            sentence = " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(6, 18)))
            sentence = sentence[0].upper() + sentence[1:] + "."
            out.append(sentence)
            size += len(sentence) + 1
        return " ".join(out)

    def code(self, tokens: int) -> str:
        lines, size, n = [], 0, max(1, int(tokens * CODE_CHARS_PER_TOKEN))
        while size < n:
            r = self.rng.randint(0, 999)
            name, arg = self.rng.choice(WORDS), self.rng.choice(WORDS)
            line = self.rng.choice(
                (
                    f"def {name}_{r}({arg}, value={r % 7}):",
                    f"    {arg}_{r} = {name}.{arg}({r}, {r * 3 % 101})",
                    f"    if {arg} is None or len({arg}) > {r}:",
                    f"        return {name}_{r} + {r % 13}",
                    f"# {self.rng.choice(WORDS)} {self.rng.choice(WORDS)} {self.rng.choice(WORDS)}: {r}",
                    f"src/{name}/{arg}_{r}.py:{r % 400 + 1}: {self.rng.choice(WORDS)} {name} {arg}",
                )
            )
            lines.append(line)
            size += len(line) + 1
        return "\n".join(lines)


@dataclass
class Entry:
    """One message of the conversation, API-neutral: role "user", "assistant" (text, thinking, one tool call) or
    "tool" (a call's result)."""

    role: str
    text: str
    thinking: str = ""
    call_id: str = ""
    tool: str = ""
    args: dict = field(default_factory=dict)
    tokens: int = 0  # the size it was generated at (tool results: for pruning)
    pruned: bool = False


@dataclass
class Session:
    """A conversation in progress: its system prompt, tool schemas, messages, and its seeded generator."""

    name: str
    variant: str
    scale: float
    gen: TextGen
    system: str
    tools: list[dict]
    entries: list[Entry]
    tool_tokens: tuple[int, int]


def new_session(
    name: str, variant: str, seed: int, system_tokens: int, tool_tokens: tuple[int, int], scale: float, tag: str = ""
) -> Session:
    """A session whose system prompt and tool schemas come to about `system_tokens` (a quarter of it the tools'
    descriptions), with the task as its first user message. Its text is seeded by (`seed`, `tag`, `name`), not by
    the variant: sessions of the same tag and name send the same conversation in every variant."""
    gen = TextGen(f"{seed}-{tag}-{name}")
    per_tool = system_tokens // 4 // len(TOOLS)
    tools = [
        {
            "name": tool,
            "description": gen.prose(per_tool),
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string", "description": gen.prose(8)},
                    "command": {"type": "string", "description": gen.prose(8)},
                },
                "required": ["path"],
            },
        }
        for tool in TOOLS
    ]
    system = "You are a coding agent working in a repository.\n" + gen.prose(system_tokens - len(TOOLS) * per_tool)
    task = Entry("user", "Task: " + gen.prose(max(8, int(120 * scale))))
    return Session(name, variant, scale, gen, system, tools, [task], tool_tokens)


def advance(session: Session, turn: int, reply: str) -> None:
    """After turn `turn`'s reply: append the assistant's message (the reply, seeded thinking, a tool call), the
    call's result, and on every `USER_EVERY`-th turn a user message."""
    gen, scale = session.gen, session.scale
    tool = TOOLS[turn % len(TOOLS)]
    call_id = f"call_{session.name}_{turn}"
    thinking = gen.prose(max(4, int(THINKING_TOKENS * scale)))
    args = {"path": f"src/{gen.rng.choice(WORDS)}/{gen.rng.choice(WORDS)}_{turn}.py"}
    session.entries.append(Entry("assistant", reply, thinking=thinking, call_id=call_id, tool=tool, args=args))
    size = gen.rng.randint(*session.tool_tokens)
    session.entries.append(Entry("tool", gen.code(size), call_id=call_id, tool=tool, tokens=size))
    if turn % USER_EVERY == USER_EVERY - 1:
        session.entries.append(Entry("user", gen.prose(max(4, int(60 * scale)))))


def harness_view(
    session: Session, protect_tokens: float = PRUNE_PROTECT_TOKENS, minimum_tokens: float = PRUNE_MINIMUM_TOKENS
) -> list[Entry]:
    """What the session's harness sends: `plain` all of it; `openclaw` thinking only on the latest assistant
    message; `opencode` after `prune` (old tool outputs as `PRUNED`)."""
    entries = session.entries
    if session.variant == "openclaw":
        last = max((i for i, e in enumerate(entries) if e.role == "assistant"), default=-1)
        return [
            e if i == last or e.role != "assistant" else Entry(**{**e.__dict__, "thinking": ""})
            for i, e in enumerate(entries)
        ]
    if session.variant == "opencode":
        prune(entries, protect_tokens * session.scale, minimum_tokens * session.scale)
        return [Entry(**{**e.__dict__, "text": PRUNED}) if e.pruned else e for e in entries]
    return entries


def prune(entries: list[Entry], protect_tokens: float, minimum_tokens: float) -> None:
    """OpenCode's pruning (compaction.ts `prune`): from the newest tool output back, skip the first
    `protect_tokens` of them, then collect outputs up to the first already pruned one; prune those when they add up
    to more than `minimum_tokens` (marks `Entry.pruned`, which stays)."""
    seen = 0.0
    candidates = []
    for entry in reversed(entries):
        if entry.role != "tool":
            continue
        if entry.pruned:
            break
        seen += entry.tokens
        if seen > protect_tokens:
            candidates.append(entry)
    if sum(e.tokens for e in candidates) > minimum_tokens:
        for entry in candidates:
            entry.pruned = True


def openai_messages(session: Session, view: list[Entry]) -> list[dict]:
    """The view as OpenAI chat messages (thinking as `reasoning_content`, calls as `tool_calls`)."""
    messages: list[dict] = [{"role": "system", "content": session.system}]
    for e in view:
        if e.role == "user":
            messages.append({"role": "user", "content": e.text})
        elif e.role == "tool":
            messages.append({"role": "tool", "tool_call_id": e.call_id, "content": e.text})
        else:
            message = {
                "role": "assistant",
                "content": e.text,
                "tool_calls": [
                    {"id": e.call_id, "type": "function", "function": {"name": e.tool, "arguments": json.dumps(e.args)}}
                ],
            }
            if e.thinking:
                message["reasoning_content"] = e.thinking
            messages.append(message)
    return messages


def anthropic_messages(view: list[Entry]) -> list[dict]:
    """The view as Anthropic messages (thinking blocks, tool_use, tool_result in the next user message)."""
    messages: list[dict] = []

    def user_blocks() -> list:
        if not messages or messages[-1]["role"] != "user":
            messages.append({"role": "user", "content": []})
        return messages[-1]["content"]

    for e in view:
        if e.role == "user":
            user_blocks().append({"type": "text", "text": e.text})
        elif e.role == "tool":
            user_blocks().append({"type": "tool_result", "tool_use_id": e.call_id, "content": e.text})
        else:
            blocks = [{"type": "thinking", "thinking": e.thinking, "signature": "bench"}] if e.thinking else []
            blocks += [
                {"type": "text", "text": e.text},
                {"type": "tool_use", "id": e.call_id, "name": e.tool, "input": e.args},
            ]
            messages.append({"role": "assistant", "content": blocks})
    return messages


@dataclass
class TurnResult:
    """What one turn measured (seconds, tokens)."""

    session: str
    turn: int
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    decode_tok_per_s: float | None
    max_gap_s: float  # the longest time the stream sent nothing (the first token included)
    reply: str
    alone_s: float | None = None  # the time to prefill `reprefilled_tokens` alone (`AloneCurve`), once measured
    # With the model's tokenizer (`PromptDiff`): prompt tokens from the first one that differs from the previous
    # turn's prompt (all of them on the first turn), and that plus the tokens back to the last mark before the
    # change (what a snapshot at every mark would re-prefill: the target of the marks mode); None without it.
    changed_tokens: int | None = None
    mark_bound_tokens: int | None = None

    @property
    def reprefilled_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    @property
    def bound_s(self) -> float | None:
        """Issue 21's bound on this turn's TTFT: `BOUND_ALLOWANCE_S` + the time to prefill its re-prefilled tokens
        alone; None without an `AloneCurve`."""
        return None if self.alone_s is None else BOUND_ALLOWANCE_S + self.alone_s


@dataclass
class AloneCurve:
    """The time to prefill n tokens alone through this server: the TTFT of fresh prompts (a random nonce first, so
    nothing of them is cached; the server's cached-token count is subtracted all the same) by the tokens the server
    prefilled, the minimum over repeats (a repeat may have paid a first-time cost the turns do not). It includes
    what every turn's TTFT includes (HTTP, chat template, tokenizer, scheduling, the first token's sampling), and it
    attends over no earlier context, which a turn's extend does (the allowance covers that). Piecewise linear
    between the measured points; below the first, the first point's time (a shorter prefill is not slower); past
    the last, the line from the last point back to the last one at no more than half its tokens (the first point
    when none is), never below the last point. A wide base, because two sizes measured close together (17,857 and
    17,858 tokens on the H200, 10 ms apart by noise) give a slope of 10 ms per token: a bound of 380 s for 58k.

    Attributes:
        tokens: prefilled tokens of each point, strictly ascending (two requested sizes that prefilled the same
            count are one point: `measure_alone` keeps the faster).
        seconds: TTFT of each point.

    Raises:
        ValueError: no points, lists of different lengths, or tokens not strictly ascending.
    """

    tokens: list[int]
    seconds: list[float]

    def __post_init__(self) -> None:
        if not self.tokens or len(self.tokens) != len(self.seconds):
            raise ValueError(f"AloneCurve needs as many seconds as tokens, at least one: {self.tokens}, {self.seconds}")
        if any(b <= a for a, b in itertools.pairwise(self.tokens)):
            raise ValueError(f"AloneCurve's tokens must be strictly ascending: {self.tokens}")

    def __call__(self, n: int) -> float:
        """Seconds to prefill `n` tokens alone."""
        xs, ys = self.tokens, self.seconds
        if n <= xs[-1] or len(xs) == 1:
            return float(np.interp(n, xs, ys))
        base = max((i for i, x in enumerate(xs[:-1]) if x <= xs[-1] / 2), default=0)
        slope = (ys[-1] - ys[base]) / (xs[-1] - xs[base])
        return ys[-1] + max(slope, 0.0) * (n - xs[-1])


def stream_openai(client, model: str, session: Session, view: list[Entry], max_tokens: int, seed: int):
    """Yields (text piece, usage dict or None) of one streamed chat completion."""
    tools = [{"type": "function", "function": t} for t in session.tools]
    stream = client.chat.completions.create(
        model=model,
        messages=openai_messages(session, view),
        **({"tools": tools} if tools else {}),
        stream=True,
        max_tokens=max_tokens,
        temperature=0.0,
        seed=seed,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    for chunk in stream:
        usage = None
        if chunk.usage is not None:
            details = getattr(chunk.usage, "prompt_tokens_details", None)
            usage = {
                "prompt": chunk.usage.prompt_tokens,
                "completion": chunk.usage.completion_tokens,
                "cached": (getattr(details, "cached_tokens", None) or 0) if details is not None else 0,
            }
        piece = ""
        for choice in chunk.choices:
            delta = choice.delta
            piece += (delta.content or "") + (getattr(delta, "reasoning_content", None) or "")
            piece += "".join((c.function.arguments or "") for c in (delta.tool_calls or []) if c.function)
        yield piece, usage


def stream_anthropic(client, model: str, session: Session, view: list[Entry], max_tokens: int, seed: int):
    """Yields (text piece, usage dict or None) of one streamed Anthropic message. Prompt tokens are
    input + cache_read + cache_creation input tokens (Anthropic's `input_tokens` leaves the cached ones out)."""
    tools = [
        {"name": t["name"], "description": t["description"], "input_schema": t["parameters"]} for t in session.tools
    ]
    prompt = cached = 0
    stream = client.messages.create(
        model=model,
        system=session.system,
        messages=anthropic_messages(view),
        **({"tools": tools} if tools else {}),
        max_tokens=max_tokens,
        stream=True,
        extra_body={"temperature": 0.0},
    )
    for event in stream:
        if event.type == "message_start":
            u = event.message.usage
            cached = getattr(u, "cache_read_input_tokens", None) or 0
            prompt = (u.input_tokens or 0) + cached + (getattr(u, "cache_creation_input_tokens", None) or 0)
        elif event.type == "content_block_delta":
            d = event.delta
            yield (
                (getattr(d, "text", None) or getattr(d, "thinking", None) or getattr(d, "partial_json", None) or ""),
                None,
            )
        elif event.type == "message_delta":
            yield "", {"prompt": prompt, "cached": cached, "completion": event.usage.output_tokens}


class PromptDiff:
    """Where each turn's prompt departs from the previous turn's, in the server's tokens: renders the messages as
    the server does (`Tokenizer.encode_chat`, the OpenAI API's request) and finds the marks of its state
    checkpoints (`MarkSet`, hybrid models) in them."""

    def __init__(self, model_dir: Path) -> None:
        from freetoken.engine.state_checkpoints import MarkSet
        from freetoken.tokenizer import Tokenizer

        self.tokenizer = Tokenizer.from_dir(model_dir)
        self.marks = MarkSet.from_tokenizer(self.tokenizer)
        self.last: dict[str, list[int]] = {}  # session name -> its previous prompt's ids

    def encode(self, session: Session, view: list[Entry]) -> list[int]:
        """The prompt's token ids as the server gets them from `openai_messages`: its own request parsing (tool-call
        arguments to objects ...), then its rendering."""
        from freetoken.server.openai import parse_chat_request

        tools = [{"type": "function", "function": t} for t in session.tools]
        request = parse_chat_request({"model": "bench", "messages": openai_messages(session, view), "tools": tools})
        return self.tokenizer.encode_chat(request.messages, tools=request.tools, **request.template_kwargs)[1]

    def measure(self, session: Session, view: list[Entry], prompt_tokens: int) -> tuple[int | None, int | None]:
        """(changed tokens, the mark bound) of this turn, as `TurnResult` names them; (None, None) when the
        rendering here does not count the server's `prompt_tokens` (another template or API: no figure beats a
        wrong one)."""
        ids = self.encode(session, view)
        previous = self.last.get(session.name, [])
        self.last[session.name] = ids
        if len(ids) != prompt_tokens:
            return None, None
        same = next((i for i, (a, b) in enumerate(zip(previous, ids, strict=False)) if a != b), len(previous))
        same = min(same, len(ids) - 1)  # the last token is always computed (its logits)
        marks = self.marks.positions(ids, 0, same)
        return len(ids) - same, len(ids) - (marks[-1] if marks else 0)


def run_turn(
    client,
    api: str,
    model: str,
    session: Session,
    turn: int,
    max_tokens: int,
    seed: int,
    prune_tokens: tuple[float, float] = (PRUNE_PROTECT_TOKENS, PRUNE_MINIMUM_TOKENS),
    diff: PromptDiff | None = None,
) -> TurnResult:
    """Send the session's conversation as its harness would, stream the reply, and append it for the next turn;
    with `diff`, also measure what changed since the previous turn (OpenAI API only)."""
    view = harness_view(session, *prune_tokens)
    stream = stream_openai if api == "openai" else stream_anthropic
    t0 = last = time.perf_counter()
    first = None
    max_gap = 0.0
    pieces, usage = [], None
    for piece, u in stream(client, model, session, view, max_tokens, seed):
        now = time.perf_counter()
        if u is not None:
            usage = u
        if piece:
            max_gap = max(max_gap, now - last)
            last = now
            first = first if first is not None else now
            pieces.append(piece)
    if first is None or usage is None:
        missing = "tokens" if first is None else "usage"
        raise RuntimeError(f"{session.name} turn {turn}: the stream ended without {missing}")
    n = usage["completion"] or 0
    reply = "".join(pieces)
    changed = diff.measure(session, view, usage["prompt"] or 0) if diff is not None and api == "openai" else None
    advance(session, turn, reply)
    return TurnResult(
        session.name,
        turn,
        first - t0,
        usage["prompt"] or 0,
        usage["cached"],
        n,
        (n - 1) / (last - first) if n > 1 and last > first else None,
        max_gap,
        reply,
        changed_tokens=changed[0] if changed else None,
        mark_bound_tokens=changed[1] if changed else None,
    )


def make_client(base_url: str, api: str, args):
    """The official SDK's client for `api` ("openai" or "anthropic"), no retries."""
    import anthropic
    import openai

    timeout = args.request_timeout_s  # a float: the two SDKs build their own (different) httpx Timeout from it
    if api == "openai":
        return openai.OpenAI(base_url=base_url + "/v1", api_key=args.api_key, max_retries=0, timeout=timeout)
    return anthropic.Anthropic(base_url=base_url, api_key=args.api_key, max_retries=0, timeout=timeout)


def time_fresh_prompt(client, api: str, model: str, tokens: int, max_tokens: int, seed: int) -> tuple[int, float]:
    """(tokens the server prefilled, TTFT s) of a fresh prompt of about `tokens` tokens: a system prompt that opens
    with a random nonce, and a one-word user turn."""
    gen = TextGen(f"alone-{os.urandom(8).hex()}")
    system = f"[{os.urandom(8).hex()}] " + gen.prose(max(1, tokens - 16))
    session = Session("alone", "plain", 1.0, gen, system, [], [], (0, 0))
    stream = stream_openai if api == "openai" else stream_anthropic
    t0 = time.perf_counter()
    first, usage = None, None
    for piece, u in stream(client, model, session, [Entry("user", "Reply.")], max_tokens, seed):
        usage = u if u is not None else usage
        if piece and first is None:
            first = time.perf_counter()
    if first is None or usage is None:
        raise RuntimeError("a fresh prompt's stream ended without tokens or usage")
    return (usage["prompt"] or 0) - usage["cached"], first - t0


def measure_alone(base_url: str, api: str, model: str, args) -> AloneCurve | None:
    """The `AloneCurve` of this server at `args.alone_sizes` and `args.system_tokens` (times `args.scale`, at least
    16 tokens), each size `args.alone_repeats` times; None when no size could be measured (each failure is
    logged)."""
    import anthropic
    import openai

    client = make_client(base_url, api, args)
    best: dict[int, float] = {}  # prefilled tokens -> fastest TTFT (two sizes may prefill the same count)
    for size in sorted({max(16, int(n * args.scale)) for n in (*args.alone_sizes, args.system_tokens)}):
        for _ in range(args.alone_repeats):
            try:
                prefilled, ttft = time_fresh_prompt(client, api, model, size, min(args.max_tokens, 8), args.seed)
            except (openai.APIError, anthropic.APIError, RuntimeError) as e:  # e.g. past the server's context
                log(f"  alone: {size} tokens failed: {e}")
                break
            best[prefilled] = min(ttft, best.get(prefilled, ttft))
    if not best:
        return None
    measured = sorted(best.items())
    log("  alone: " + ", ".join(f"{n} tokens {t:.3f} s" for n, t in measured))
    return AloneCurve([n for n, _ in measured], [t for _, t in measured])


def run_sessions(
    base_url: str, api: str, model: str, variant: str, num_sessions: int, args
) -> tuple[list[TurnResult], list[str], bool]:
    """`num_sessions` concurrent sessions of `args.turns` turns each (one thread per session): the turns measured,
    the errors that ended a session early (an API error: a prompt past the context, a server fault), and whether
    `args.time_limit_s` cut the run (no session starts a turn after its first once the run has taken that long)."""
    import anthropic
    import openai

    system = max(16, int(args.system_tokens * args.scale))
    tool_tokens = (max(4, int(args.tool_tokens[0] * args.scale)), max(8, int(args.tool_tokens[1] * args.scale)))
    client = make_client(base_url, api, args)
    diff = PromptDiff(args.model_dir) if getattr(args, "model_dir", None) is not None else None
    results: list[TurnResult] = []
    errors: list[str] = []
    cut: list[bool] = []
    lock = threading.Lock()
    t_start = time.perf_counter()

    def one(i: int) -> None:
        name = f"s{i}"
        # Each run its own text: a run must not find its prompts in the prefix cache of the runs before it.
        session = new_session(
            name, variant, args.seed, system, tool_tokens, args.scale, tag=f"{variant}-x{num_sessions}"
        )
        for turn in range(args.turns):
            if turn and args.time_limit_s is not None and time.perf_counter() - t_start > args.time_limit_s:
                log(
                    f"  {variant} x{num_sessions} {name}: stopped before turn {turn} (--time-limit-s "
                    f"{args.time_limit_s:g})"
                )
                with lock:
                    cut.append(True)
                return
            try:
                r = run_turn(
                    client,
                    api,
                    model,
                    session,
                    turn,
                    args.max_tokens,
                    args.seed,
                    (args.prune_protect_tokens, args.prune_minimum_tokens),
                    diff,
                )
            except (openai.APIError, anthropic.APIError, RuntimeError) as e:  # the session ends; the run goes on
                log(f"  {variant} x{num_sessions} {name} turn {turn} failed: {e}")
                with lock:
                    errors.append(f"{name} turn {turn}: {e}")
                return
            with lock:
                results.append(r)
            log(
                f"  {variant} x{num_sessions} {name} turn {turn}: prompt {r.prompt_tokens}, cached {r.cached_tokens}, "
                f"TTFT {r.ttft_s:.3f} s, decode {r.decode_tok_per_s or 0:.1f} tok/s"
            )

    with ThreadPoolExecutor(num_sessions) as pool:
        for future in [pool.submit(one, i) for i in range(num_sessions)]:
            future.result()
    return sorted(results, key=lambda r: (r.session, r.turn)), errors, bool(cut)


def summarize(results: list[TurnResult], watchdog_s: float) -> dict:
    """Per-run figures: TTFT p50/p99/max, turns over the watchdog, decode last/first turn (per session, mean)."""
    ttft = np.array([r.ttft_s for r in results])
    firsts = {r.session: r for r in results if r.turn == 0}
    lasts: dict[str, TurnResult] = {}
    for r in results:
        if r.turn >= lasts.get(r.session, r).turn:
            lasts[r.session] = r
    ratios = [
        lasts[s].decode_tok_per_s / firsts[s].decode_tok_per_s
        for s in firsts
        if lasts[s].decode_tok_per_s and firsts[s].decode_tok_per_s
    ]
    return {
        "turns": len(results),
        "ttft_p50_s": round(float(np.percentile(ttft, 50)), 4),
        "ttft_p99_s": round(float(np.percentile(ttft, 99)), 4),
        "ttft_max_s": round(float(ttft.max()), 4),
        "watchdog_violations": sum(r.max_gap_s > watchdog_s for r in results),
        "final_prompt_tokens": max(r.prompt_tokens for r in results),
        "reprefilled_tokens": sum(r.reprefilled_tokens for r in results),
        "cached_tokens": sum(r.cached_tokens for r in results),
        "decode_last_over_first": round(sum(ratios) / len(ratios), 3) if ratios else None,
        "over_bound": sum(r.bound_s is not None and r.ttft_s > r.bound_s for r in results),
    }


def turn_table(title: str, results: list[TurnResult], watchdog_s: float) -> Table:
    table = Table(title=title)
    columns = ("session", "turn", "prompt", "cached", "re-prefilled", "TTFT s", "alone s", "bound", "decode tok/s")
    for column in (*columns, "watchdog"):
        table.add_column(column, justify="right")
    for r in results:
        bound = r.bound_s
        table.add_row(
            r.session,
            str(r.turn),
            str(r.prompt_tokens),
            str(r.cached_tokens),
            str(r.reprefilled_tokens),
            f"{r.ttft_s:.3f}",
            f"{r.alone_s:.3f}" if r.alone_s is not None else "-",
            "-" if bound is None else f"{'OVER' if r.ttft_s > bound else 'ok'} {bound:.2f}",
            f"{r.decode_tok_per_s:.1f}" if r.decode_tok_per_s else "-",
            "OVER" if r.max_gap_s > watchdog_s else "",
        )
    return table


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """`ft serve --model MODEL SERVE_ARGS` on a free port (a subprocess, logging to a temp file), stopped on exit."""

    def __init__(self, model: str, serve_args: list[str]) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="agent-trace-serve-", suffix=".log", delete=False)
        cmd = [
            sys.executable,
            "-m",
            "freetoken.cli.main",
            "serve",
            "--model",
            model,
            "--port",
            str(self.port),
            *serve_args,
        ]
        log(f"starting: {shlex.join(cmd)} (log: {self.log.name})")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def wait_ready(self) -> None:
        t0 = time.monotonic()
        while time.monotonic() - t0 < STARTUP_TIMEOUT_S:
            if self.proc.poll() is not None:
                raise SystemExit(f"ft serve exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2.0).status_code == 200:
                    log(f"server ready in {time.monotonic() - t0:.0f} s")
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        self.stop()
        raise SystemExit(f"ft serve did not answer /health in {STARTUP_TIMEOUT_S:.0f} s:\n{self.tail()}")

    def tail(self) -> str:
        return Path(self.log.name).read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> Server:
        self.wait_ready()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def server_knows(flag: str) -> bool:
    """Whether this checkout's `ft serve` has `flag`."""
    out = subprocess.run(
        [sys.executable, "-m", "freetoken.cli.main", "serve", "--help"], capture_output=True, text=True, check=False
    )
    return flag in out.stdout


def server_stats(base_url: str, api_key: str) -> dict:
    """The server's /v1/stats ({} when it has none)."""
    try:
        return httpx.get(base_url + "/v1/stats", headers={"Authorization": f"Bearer {api_key}"}, timeout=30).json()
    except (httpx.HTTPError, ValueError):
        return {}


def server_info(base_url: str, api_key: str) -> tuple[str, dict]:
    """(the served model's name, the routing the server reports in /v1/stats, or why it is unknown)."""
    headers = {"Authorization": f"Bearer {api_key}"}
    model = httpx.get(base_url + "/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
    routing = server_stats(base_url, api_key).get("routing")
    return model, routing or {"source": "unknown (no routing in /v1/stats)"}


def warm_up(base_url: str, api_key: str, model: str) -> None:
    """One short request, so that no measured turn pays the server's first-request costs (kernel compiles)."""
    body = {"model": model, "messages": [{"role": "user", "content": "Warm up."}], "max_tokens": 4, "temperature": 0}
    httpx.post(
        base_url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {api_key}"}, timeout=600
    ).raise_for_status()


def run_all(base_url: str, label: str, variants: list[str], sessions: list[int], args, console: Console) -> list:
    """Every (variant, sessions) run against one server (after a warm-up request); tables printed, run records
    returned."""
    model, routing = server_info(base_url, args.api_key)
    warm_up(base_url, args.api_key, model)
    console.print(f"[bold]{label}[/bold]: model {model!r}, routing: {json.dumps(routing)}")
    # Before the sessions: the prefix cache evicts least-recently-used blocks first, so these fresh prompts' blocks
    # go before any session's.
    alone = measure_alone(base_url, args.api, model, args) if args.alone_sizes else None
    runs = []
    for variant in variants:
        for n in sessions:
            results, errors, cut = run_sessions(base_url, args.api, model, variant, n, args)
            for r in results:
                r.alone_s = alone(r.reprefilled_tokens) if alone is not None else None
            summary = summarize(results, args.watchdog_s) if results else {"turns": 0}
            summary["errors"] = errors
            summary["cut_at_time_limit"] = cut
            summary["alone"] = None if alone is None else {"tokens": alone.tokens, "seconds": alone.seconds}
            stats = server_stats(base_url, args.api_key)  # one snapshot for the counters below
            kv_host = stats.get("kv_host")
            if kv_host is not None:  # the KV host tier's counters so far (they add up over the server's runs)
                summary["kv_host"] = kv_host
                console.print(f"{label}: kv host tier {json.dumps(kv_host)}")
            prefill = (stats.get("moe_backend") or {}).get("prefill")
            if prefill is not None:  # which prefill strategy ran the chunks, and auto's measured / predicted scales
                summary["prefill"] = prefill
                console.print(f"{label}: prefill {json.dumps(prefill)}")
            checkpoints = stats.get("state_checkpoints")
            if checkpoints is not None:  # hybrid models: the counters so far (they add up over the server's runs)
                summary["state_checkpoints"] = checkpoints
                console.print(f"{label}: state checkpoints {json.dumps(checkpoints)}")
            console.print(turn_table(f"{label}: {variant}, {n} session(s)", results, args.watchdog_s))
            runs.append(
                {
                    "server": label,
                    "routing": routing,
                    "variant": variant,
                    "sessions": n,
                    **summary,
                    "per_turn": [
                        {k: v for k, v in r.__dict__.items() if k != "reply"}
                        | {"reprefilled_tokens": r.reprefilled_tokens, "bound_s": r.bound_s}
                        for r in results
                    ],
                }
            )
    return runs


def mode_table(runs: list[dict]) -> Table:
    """Single-session runs side by side per checkpoint mode: per (variant, turn) the prompt, what changed since the
    previous turn and the mark bound (`TurnResult`), and each mode's re-prefilled tokens and TTFT."""
    modes = list(dict.fromkeys(r["server"] for r in runs))
    table = Table(title="re-prefilled tokens and TTFT per turn, by checkpoint mode (1 session)")
    for column in (
        "variant",
        "turn",
        "prompt",
        "changed",
        "mark bound",
        *(f"re-prefilled {m.split()[-1]}" for m in modes),
        *(f"TTFT s {m.split()[-1]}" for m in modes),
    ):
        table.add_column(column, justify="right")
    for (variant, turn), by_mode in sorted(turns_by_mode(runs).items()):
        first = next(iter(by_mode.values()))
        table.add_row(
            variant,
            str(turn),
            str(first["prompt_tokens"]),
            str(first.get("changed_tokens", "-")),
            str(first.get("mark_bound_tokens", "-")),
            *(str(by_mode[m]["reprefilled_tokens"]) if m in by_mode else "-" for m in modes),
            *(f"{by_mode[m]['ttft_s']:.3f}" if m in by_mode else "-" for m in modes),
        )
    return table


def turns_by_mode(runs: list[dict]) -> dict[tuple[str, int], dict[str, dict]]:
    """Single-session runs' turns: (variant, turn) -> server label -> the turn's record."""
    turns: dict[tuple[str, int], dict[str, dict]] = {}
    for run in runs:
        if run["sessions"] == 1:
            for t in run["per_turn"]:
                turns.setdefault((run["variant"], t["turn"]), {})[run["server"]] = t
    return turns


def checkpoint_targets(runs: list[dict]) -> dict:
    """Issue 22's targets on the single-session runs of "checkpoints marks" and "checkpoints chunk", per variant:
    turns where marks re-prefilled more than the mark bound (changed tokens + the span back to the last mark
    before the change), turns where marks re-prefilled more than chunk, chunk's total over marks' (the
    OpenCode-style session's target: >= 3), and the tokens the harness changed or added (`TurnResult`), which
    every mode re-prefills: a session's ratio is at most chunk's total over that."""
    out: dict[str, dict] = {}
    for (variant, turn), by_mode in sorted(turns_by_mode(runs).items()):
        marks, chunk = by_mode.get("checkpoints marks"), by_mode.get("checkpoints chunk")
        if marks is None:
            continue
        v = out.setdefault(variant, {"over_bound": [], "marks_over_chunk": [], "marks": 0, "chunk": 0, "changed": 0})
        v["changed"] += marks.get("changed_tokens") or 0
        bound = marks.get("mark_bound_tokens")
        if bound is not None and marks["reprefilled_tokens"] > bound:
            v["over_bound"].append(turn)
        v["marks"] += marks["reprefilled_tokens"]
        if chunk is not None:
            v["chunk"] += chunk["reprefilled_tokens"]
            if marks["reprefilled_tokens"] > chunk["reprefilled_tokens"]:
                v["marks_over_chunk"].append(turn)
    for v in out.values():
        v["chunk_over_marks"] = round(v["chunk"] / v["marks"], 2) if v["marks"] else None
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--server", help="base URL of a running server (one configuration is measured)")
    where.add_argument("--model", help="start `ft serve --model MODEL` here (twice: with and without the cache)")
    ap.add_argument("--serve-args", default="", help="flags for the started `ft serve` (one string)")
    ap.add_argument("--api", choices=("openai", "anthropic"), default="openai")
    ap.add_argument("--api-key", default="unused")
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    ap.add_argument("--sessions", type=int, nargs="+", default=[1, 3], help="concurrent sessions per run")
    ap.add_argument(
        "--compare-variants",
        nargs="*",
        choices=VARIANTS,
        default=["plain"],
        help="variants run again (1 session) on a server started with --no-prefix-cache",
    )
    ap.add_argument("--turns", type=int, default=18)
    ap.add_argument("--system-tokens", type=int, default=18_000, help="system prompt + tool schemas")
    ap.add_argument("--tool-tokens", type=int, nargs=2, default=[500, 4000], help="tool result sizes (min max)")
    ap.add_argument("--scale", type=float, default=1.0, help="multiplies every text size (0.01 for the demo)")
    ap.add_argument("--max-tokens", type=int, default=64, help="reply tokens per turn")
    ap.add_argument("--watchdog-s", type=float, default=120.0)
    ap.add_argument("--request-timeout-s", type=float, default=900.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--alone-sizes",
        type=int,
        nargs="*",
        default=list(ALONE_SIZES),
        help="fresh-prompt sizes (tokens, times --scale) timed before the sessions: the time to prefill a turn's "
        f"re-prefilled tokens alone, for its bound TTFT <= {BOUND_ALLOWANCE_S} s + that (none: no bound)",
    )
    ap.add_argument("--alone-repeats", type=int, default=2, help="fresh prompts per size (the fastest counts)")
    ap.add_argument(
        "--time-limit-s",
        type=float,
        default=None,
        help="per run: no session starts a turn after its first once the run has taken this long (the run is "
        "reported as cut)",
    )
    ap.add_argument(
        "--state-checkpoints",
        nargs="*",
        choices=CHECKPOINT_MODES,
        default=[],
        help="hybrid models: one server per mode (ft serve --state-checkpoints MODE), instead of the "
        "prefix-cache comparison; 'off' runs the --compare-variants only",
    )
    ap.add_argument(
        "--prune-protect-tokens",
        type=float,
        default=PRUNE_PROTECT_TOKENS,
        help="opencode: newest tool-output tokens never pruned (OpenCode's PRUNE_PROTECT)",
    )
    ap.add_argument(
        "--prune-minimum-tokens",
        type=float,
        default=PRUNE_MINIMUM_TOKENS,
        help="opencode: prune only when at least this many tool-output tokens go (PRUNE_MINIMUM)",
    )
    ap.add_argument(
        "--kv-host-gb",
        type=float,
        nargs="*",
        default=[],
        help="one server per value (ft serve --kv-host-gb GB; 0: no host tier) running --variants x --sessions, "
        "instead of the prefix-cache comparison; give a small GPU KV budget in --serve-args (--kv-cache-tokens)",
    )
    args = ap.parse_args(argv)
    args.model_dir = None
    if args.model:  # the bench renders prompts as the server does, to see what changed between turns
        from freetoken.cli.serve import resolve_model_dir

        args.model_dir = resolve_model_dir(args.model, "--dummy-weights" in shlex.split(args.serve_args))
    console = Console(no_color="NO_COLOR" in os.environ, width=140)
    runs = []
    if args.server:
        runs += run_all(args.server.rstrip("/"), "as given", args.variants, args.sessions, args, console)
        console.print(
            "--server: the server's own configuration only (--model starts one with and one without --no-prefix-cache)"
        )
    elif args.state_checkpoints:
        serve_args = shlex.split(args.serve_args)
        for mode in args.state_checkpoints:
            variants = args.compare_variants if mode == "off" else args.variants
            sessions = [1] if mode == "off" else args.sessions
            with Server(args.model, [*serve_args, "--state-checkpoints", mode]) as server:
                runs += run_all(server.base_url, f"checkpoints {mode}", variants, sessions, args, console)
        console.print(mode_table(runs))
        targets = checkpoint_targets(runs)
        for variant, v in targets.items():
            console.print(
                f"{variant}: marks re-prefilled {v['marks']}, chunk {v['chunk']} (chunk/marks {v['chunk_over_marks']}; "
                f"the harness changed {v['changed']});"
                f" turns over the mark bound: {v['over_bound'] or 'none'}; turns where marks > chunk: "
                f"{v['marks_over_chunk'] or 'none'}"
            )
    elif args.kv_host_gb:
        serve_args = shlex.split(args.serve_args)
        for gb in args.kv_host_gb:
            with Server(args.model, [*serve_args, "--kv-host-gb", str(gb)]) as server:
                runs += run_all(server.base_url, f"kv host {gb:g} GB", args.variants, args.sessions, args, console)
    else:
        serve_args = shlex.split(args.serve_args)
        with Server(args.model, serve_args) as server:
            runs += run_all(server.base_url, "prefix cache", args.variants, args.sessions, args, console)
        if args.compare_variants and not server_knows("--no-prefix-cache"):
            console.print("this ft serve has no --no-prefix-cache flag: the run without the prefix cache is skipped")
        elif args.compare_variants:
            with Server(args.model, [*serve_args, "--no-prefix-cache"]) as server:
                runs += run_all(server.base_url, "no prefix cache", args.compare_variants, [1], args, console)
    summary = Table(title="agent-trace runs")
    columns = {
        "turns": "turns",
        "final_prompt_tokens": "last prompt",
        "cached_tokens": "cached",
        "reprefilled_tokens": "re-prefilled",
        "ttft_p50_s": "TTFT p50 s",
        "ttft_p99_s": "p99 s",
        "ttft_max_s": "max s",
        "watchdog_violations": "over watchdog",
        "over_bound": "over bound",
        "decode_last_over_first": "decode last/first",
        "cut_at_time_limit": "cut",
    }
    keys = tuple(columns)
    for column in ("server", "variant", "sessions", *columns.values()):
        summary.add_column(column, justify="right")
    for run in runs:
        summary.add_row(run["server"], run["variant"], str(run["sessions"]), *(str(run.get(k, "-")) for k in keys))
    console.print(summary)
    print(
        json.dumps(
            {
                "bench": "agent_trace",
                "api": args.api,
                "scale": args.scale,
                "turns": args.turns,
                "max_tokens": args.max_tokens,
                "watchdog_s": args.watchdog_s,
                "seed": args.seed,
                "routing": runs[0]["routing"] if runs else None,
                "checkpoint_targets": checkpoint_targets(runs) if args.state_checkpoints else None,
                "runs": runs,
            }
        ),
        flush=True,
    )
    return 1 if any(run["errors"] for run in runs) else 0


if __name__ == "__main__":
    sys.exit(main())

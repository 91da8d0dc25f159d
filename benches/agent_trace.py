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
re-prefilled tokens (prompt - cached), decode tok/s ((completion tokens - 1) over first to last token). Per run:
p50/p99/max TTFT, turns over the harness watchdog (`--watchdog-s`, 120 s: a request that streams nothing for that
long is killed), last-turn over first-turn decode tok/s. Prints the routing the server runs (`/v1/stats`), a rich
table per run, a summary, and a final JSON line.

    # on the GPU box: starts `ft serve` twice (with and without --no-prefix-cache) on a free port
    python benches/agent_trace.py --model qwen3-30b-a3b \\
        --serve-args "--device cuda --dummy-weights --replay-routing synthetic --gpu-memory-gb 24 --max-model-len 70000"
    # against a running server (one configuration)
    python benches/agent_trace.py --server http://127.0.0.1:1919
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
    # on the CPU, the demo model (a minute)
    python benches/agent_trace.py --model demo --kv-host-gb 0 0.05 --variants plain --sessions 3 --turns 4 \
        --scale 0.01 --max-tokens 8 --serve-args "--device cpu --dummy-weights --kv-cache-tokens 512"

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
        --serve-args "--device cuda --dummy-weights --replay-routing synthetic --gpu-memory-gb 24 --max-model-len 70000"
    # on the CPU, the Qwen3.5 demo checkpoint (built first: freetoken.models.demo_qwen3_5)
    python -c "from freetoken.models.demo_qwen3_5 import build_qwen3_5_demo_checkpoint as b; b('/tmp/q35demo')"
    python benches/agent_trace.py --model /tmp/q35demo --state-checkpoints marks chunk off --serve-args \\
        "--device cpu --max-model-len 4096" --scale 0.01 --turns 5 --sessions 1 --max-tokens 8
"""

from __future__ import annotations

import argparse
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

    @property
    def reprefilled_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


def stream_openai(client, model: str, session: Session, view: list[Entry], max_tokens: int, seed: int):
    """Yields (text piece, usage dict or None) of one streamed chat completion."""
    tools = [{"type": "function", "function": t} for t in session.tools]
    stream = client.chat.completions.create(
        model=model,
        messages=openai_messages(session, view),
        tools=tools,
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
        tools=tools,
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


def run_turn(
    client,
    api: str,
    model: str,
    session: Session,
    turn: int,
    max_tokens: int,
    seed: int,
    prune_tokens: tuple[float, float] = (PRUNE_PROTECT_TOKENS, PRUNE_MINIMUM_TOKENS),
) -> TurnResult:
    """Send the session's conversation as its harness would, stream the reply, and append it for the next turn."""
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
    )


def run_sessions(
    base_url: str, api: str, model: str, variant: str, num_sessions: int, args
) -> tuple[list[TurnResult], list[str]]:
    """`num_sessions` concurrent sessions of `args.turns` turns each (one thread per session): the turns measured,
    and the errors that ended a session early (an API error: a prompt past the context, a server fault)."""
    import anthropic
    import openai

    system = max(16, int(args.system_tokens * args.scale))
    tool_tokens = (max(4, int(args.tool_tokens[0] * args.scale)), max(8, int(args.tool_tokens[1] * args.scale)))
    timeout = args.request_timeout_s  # a float: the two SDKs build their own (different) httpx Timeout from it
    if api == "openai":
        client = openai.OpenAI(base_url=base_url + "/v1", api_key=args.api_key, max_retries=0, timeout=timeout)
    else:
        client = anthropic.Anthropic(base_url=base_url, api_key=args.api_key, max_retries=0, timeout=timeout)
    results: list[TurnResult] = []
    errors: list[str] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        name = f"s{i}"
        # Each run its own text: a run must not find its prompts in the prefix cache of the runs before it.
        session = new_session(
            name, variant, args.seed, system, tool_tokens, args.scale, tag=f"{variant}-x{num_sessions}"
        )
        for turn in range(args.turns):
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
    return sorted(results, key=lambda r: (r.session, r.turn)), errors


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
    }


def turn_table(title: str, results: list[TurnResult], watchdog_s: float) -> Table:
    table = Table(title=title)
    for column in ("session", "turn", "prompt", "cached", "re-prefilled", "TTFT s", "decode tok/s", "watchdog"):
        table.add_column(column, justify="right")
    for r in results:
        table.add_row(
            r.session,
            str(r.turn),
            str(r.prompt_tokens),
            str(r.cached_tokens),
            str(r.reprefilled_tokens),
            f"{r.ttft_s:.3f}",
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
    runs = []
    for variant in variants:
        for n in sessions:
            results, errors = run_sessions(base_url, args.api, model, variant, n, args)
            summary = summarize(results, args.watchdog_s) if results else {"turns": 0}
            summary["errors"] = errors
            kv_host = server_stats(base_url, args.api_key).get("kv_host")
            if kv_host is not None:  # the KV host tier's counters so far (they add up over the server's runs)
                summary["kv_host"] = kv_host
                console.print(f"{label}: kv host tier {json.dumps(kv_host)}")
            checkpoints = server_stats(base_url, args.api_key).get("state_checkpoints")
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
                        | {"reprefilled_tokens": r.reprefilled_tokens}
                        for r in results
                    ],
                }
            )
    return runs


def mode_table(runs: list[dict]) -> Table:
    """Single-session runs side by side per checkpoint mode: per (variant, turn) the prompt, and each mode's
    re-prefilled tokens and TTFT."""
    modes = list(dict.fromkeys(r["server"] for r in runs))
    table = Table(title="re-prefilled tokens and TTFT per turn, by checkpoint mode (1 session)")
    for column in (
        "variant",
        "turn",
        "prompt",
        *(f"re-prefilled {m.split()[-1]}" for m in modes),
        *(f"TTFT s {m.split()[-1]}" for m in modes),
    ):
        table.add_column(column, justify="right")
    turns: dict[tuple[str, int], dict[str, dict]] = {}
    for run in runs:
        if run["sessions"] == 1:
            for t in run["per_turn"]:
                turns.setdefault((run["variant"], t["turn"]), {})[run["server"]] = t
    for (variant, turn), by_mode in sorted(turns.items()):
        prompt = next(iter(by_mode.values()))["prompt_tokens"]
        table.add_row(
            variant,
            str(turn),
            str(prompt),
            *(str(by_mode[m]["reprefilled_tokens"]) if m in by_mode else "-" for m in modes),
            *(f"{by_mode[m]['ttft_s']:.3f}" if m in by_mode else "-" for m in modes),
        )
    return table


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
        "decode_last_over_first": "decode last/first",
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
                "runs": runs,
            }
        ),
        flush=True,
    )
    return 1 if any(run["errors"] for run in runs) else 0


if __name__ == "__main__":
    sys.exit(main())

"""Recurrent-state checkpoints of hybrid models: snapshots of the linear layers' state at special-token marks, so a
new request resumes from the deepest unchanged mark instead of prefilling from the start.

A hybrid model (Qwen3.5: Gated DeltaNet layers beside full attention) compresses a sequence's past into a fixed
state per linear layer (`freetoken.engine.state_pool`): the KV prefix cache (`freetoken.engine.prefix_cache`) alone
cannot resume it, since the state at a position is not recoverable from K/V. Harnesses also cut and edit history
exactly at special tokens (they strip thinking after `</think>`, replace tool outputs between `<tool_response>` and
`</tool_response>`, append turns after `<|im_end|>`), so a snapshot taken after such a boundary survives the edit,
and one taken at an arbitrary chunk end (upstream's scheme, mode "chunk") usually does not.

Marks. A mark is the position right after one of the boundary strings `MARK_STRINGS` (`MarkSet`): the strings the
model's chat template writes (rendered on a probe conversation with thinking, a tool call and a tool response),
each as the token ids the model's tokenizer gives it (a multi-token string is matched as its whole sequence).

A snapshot at position p holds the state after tokens [0, p) of every linear layer (conv window and delta-rule
state) and the K/V of the tokens of its last, partial KV block ([p - p % block_size, p)); the full blocks before
that are the prefix cache's. It is keyed by (the prefix-cache node of its last full block, the tail's token ids):
the node names the content of every earlier token exactly (`prefix_cache`), so a key equal to a prompt's is a
snapshot of that prompt's prefix. A snapshot dies with its node: when the prefix cache evicts that block, its
snapshots are dropped (`PrefixCache.on_evict`), so a snapshot is never used without its KV, and a hybrid prompt uses
cached KV blocks only up to the snapshot it resumes from.

Which marks are snapshotted (mode "marks"). Capturing a state mid-chunk costs one more launch per linear layer of
the prefill (the chunk is not split into steps: `GatedDeltaNet` hands the state out between sub-spans), and each
snapshot costs its bytes (63 MB on Qwen3.5-35B-A3B), so a prompt with hundreds of marks keeps:
  - its first mark (in a chat, within or at the end of the system prompt and tools, the prefix every session of
    a harness shares, and the one left when an early message is edited),
  - its last `TAIL_MARKS` marks (the ends of the latest messages, where the next turn appends),
  - its last `TAIL_TURNS` turn ends (`<|im_end|>`): the one before the latest reply is where a harness that strips
    that reply's thinking on the next turn (OpenClaw) changes the prompt,
  - every tool output's start (the `<tool_response>` mark), where OpenCode replaces old outputs deep in the
    history (measured by benches/agent_trace.py: with spacing alone such turns re-prefilled up to the spacing more),
  - every user query's end (the turn end of a user turn that is not a tool output): Qwen's chat templates render
    the thinking of the replies after the last query only, so when the next query arrives every reply since the
    previous one loses its thinking, and the prompt changes right after that query's end, however many tool turns
    (each with its turn ends) came between,
  - marks at least `spacing` tokens after the previous kept one, or after where the prompt resumed
    (`--state-checkpoint-spacing`; other deep history edits re-prefill at most about that),
  - the end of the prompt (the next turn usually starts with the whole of it),
and while decoding, every mark the output writes (`</think>`, a tool call's close ...). Mode "chunk" snapshots at
the end of every prefill chunk, as upstream does; mode "off" never (and hybrids then never reuse KV).

Lifetime: snapshots live in `SnapshotPool`, a byte budget (`--state-checkpoint-gb`, default `default_budget_bytes`)
with least-recently-used eviction; a snapshot being written by a running step is pinned (reference counted) and
cannot be evicted until the step commits or fails. On CUDA, a snapshot evicted from the device goes to a host-RAM
tier (`--state-checkpoint-host-gb`, pinned memory, LRU too) and is restored from there over PCIe (63 MB: a few ms,
against seconds of re-prefill): old snapshots, the ones OpenCode-style edits deep in the history need, survive.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from freetoken.config import EngineConfig, ModelConfig
from freetoken.engine.state_pool import RecurrentStatePool

log = logging.getLogger(__name__)

# Boundaries harnesses cut history at: end of thinking, tool call open/close, tool response open/close, turn end.
MARK_STRINGS = ("</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<|im_end|>")
TAIL_MARKS = 4
# Turn ends (`<|im_end|>` marks) kept at a prompt's end besides its last marks: a reply and its tool response hold
# more marks than `TAIL_MARKS`, and OpenClaw strips the previous reply's thinking on the next turn, so the turn end
# before that reply (the 3rd or 4th last: reply, tool response, maybe a user message) is where that turn resumes.
TAIL_TURNS = 4
TURN_END = "<|im_end|>"
# Tool outputs start right after this mark; OpenCode replaces old ones by a placeholder, deep in the history, so
# every such mark of a prompt is kept, whatever the spacing.
TOOL_OUTPUT_OPEN = "<tool_response>"
# A user turn opens with this; one whose text does not start with `TOOL_OUTPUT_OPEN` is a query (the templates'
# `last_query_index`), whose end is kept whatever the spacing.
QUERY_OPEN = "<|im_start|>user"
# Default snapshot budget: room for this many snapshots, capped at `DEFAULT_BUDGET_FRACTION` of the device budget.
DEFAULT_SNAPSHOTS = 64
DEFAULT_BUDGET_FRACTION = 0.1

# The probe conversation the chat template is rendered on to see which boundary strings it writes.
_PROBE_TOOLS = [{"type": "function", "function": {"name": "probe", "description": "d", "parameters": {}}}]
_PROBE_MESSAGES = [
    {"role": "system", "content": "s"},
    {"role": "user", "content": "u"},
    {
        "role": "assistant",
        "content": "a",
        "reasoning_content": "r",
        "tool_calls": [{"type": "function", "id": "c", "function": {"name": "probe", "arguments": "{}"}}],
    },
    {"role": "tool", "tool_call_id": "c", "content": "t"},
    {"role": "assistant", "content": "b", "reasoning_content": "r"},  # last: templates drop earlier turns' thinking
]


class MarkSet:
    """Token-id sequences whose end is a mark, and where they end in a token list.

    Args:
        sequences: the boundary strings as token ids (each non-empty).
        turn_end, tool_output, query_open: the ids of `TURN_END`, `TOOL_OUTPUT_OPEN` and `QUERY_OPEN` (empty when
            the template writes none).
    """

    def __init__(
        self,
        sequences: Sequence[Sequence[int]],
        turn_end: Sequence[int] = (),
        tool_output: Sequence[int] = (),
        query_open: Sequence[int] = (),
    ) -> None:
        self.sequences = sorted({tuple(s) for s in sequences if s}, key=len, reverse=True)
        self._by_last: dict[int, list[tuple[int, ...]]] = {}
        for seq in self.sequences:
            self._by_last.setdefault(seq[-1], []).append(seq)
        self.turn_end = tuple(turn_end)  # the turn end's ids (`TURN_END`), () when the template writes none
        self.tool_output = tuple(tool_output)  # the tool output opener's (`TOOL_OUTPUT_OPEN`), the same
        self.query_open = tuple(query_open)  # a user turn's opener (`QUERY_OPEN`), the same

    @classmethod
    def from_tokenizer(cls, tokenizer) -> MarkSet:
        """The marks of a model: the `MARK_STRINGS` that its chat template writes on a probe conversation (all of
        them when it has no template or the probe fails to render), as `tokenizer.encode` gives them."""
        strings = list(MARK_STRINGS)
        text = "".join(MARK_STRINGS) + QUERY_OPEN
        try:
            text = tokenizer.apply_chat_template(_PROBE_MESSAGES, tools=_PROBE_TOOLS)
            strings = [s for s in MARK_STRINGS if s in text] or strings
        except ValueError as e:
            log.info("state checkpoints: the chat template did not render a probe (%s); marks are %s", e, strings)
        turn_end = tokenizer.encode(TURN_END) if TURN_END in strings else []
        tool_output = tokenizer.encode(TOOL_OUTPUT_OPEN) if TOOL_OUTPUT_OPEN in strings else []
        query_open = tokenizer.encode(QUERY_OPEN) if turn_end and QUERY_OPEN in text else []
        return cls([tokenizer.encode(s) for s in strings], turn_end, tool_output, query_open)

    def ends_at(self, tokens: Sequence[int], end: int) -> bool:
        """Whether a mark sequence ends right before position `end` (tokens[end - len : end] is one)."""
        for seq in self._by_last.get(tokens[end - 1], ()) if end > 0 else ():
            if end >= len(seq) and tuple(tokens[end - len(seq) : end]) == seq:
                return True
        return False

    def turn_ends(self, tokens: Sequence[int], marks: Sequence[int]) -> list[int]:
        """Those of `marks` (positions, as `positions` gives them) that end a turn (right after `TURN_END`)."""
        return _after(tokens, marks, self.turn_end)

    def tool_outputs(self, tokens: Sequence[int], marks: Sequence[int]) -> list[int]:
        """Those of `marks` where a tool output starts (right after `TOOL_OUTPUT_OPEN`)."""
        return _after(tokens, marks, self.tool_output)

    def query_ends(self, tokens: Sequence[int], marks: Sequence[int]) -> list[int]:
        """Those of `marks` that end a user query: a turn end whose turn opened with `QUERY_OPEN` and whose text
        does not start with `TOOL_OUTPUT_OPEN` (Qwen's templates write tool outputs as user turns too). Reads each
        turn back to its opener once: linear in the turns' tokens."""
        n = len(self.query_open)
        if not n:
            return []
        opener, tool = self.query_open[0], self.tool_output
        ends = []
        for p in self.turn_ends(tokens, marks):
            i = p - len(self.turn_end) - 1
            while i >= 0 and tokens[i] != opener:
                i -= 1
            if i < 0 or tuple(tokens[i : i + n]) != self.query_open:
                continue
            # The text starts after the role's newline (one token, two for an odd tokenizer): a tool output there?
            head = tuple(tokens[i + n : i + n + len(tool) + 2])
            if not tool or not any(head[k : k + len(tool)] == tool for k in range(3)):
                ends.append(p)
        return ends

    def positions(self, tokens: Sequence[int], start: int, stop: int) -> list[int]:
        """Marks p with start < p <= stop (p: the position right after a mark sequence), ascending."""
        last = self._by_last
        return [p for p in range(start + 1, stop + 1) if tokens[p - 1] in last and self.ends_at(tokens, p)]


def _after(tokens: Sequence[int], marks: Sequence[int], seq: tuple[int, ...]) -> list[int]:
    """Those of `marks` right after `seq` in `tokens` (none for an empty `seq`)."""
    n = len(seq)
    return [p for p in marks if n and p >= n and tuple(tokens[p - n : p]) == seq]


def select_marks(
    marks: list[int],
    start: int,
    end: int,
    spacing: int,
    tail: int = TAIL_MARKS,
    turn_ends: Sequence[int] = (),
    tail_turns: int = TAIL_TURNS,
    always: Sequence[int] = (),
) -> list[int]:
    """Which of a prompt's `marks` (ascending, in (start, end]) to snapshot: the first, the last `tail`, the last
    `tail_turns` of `turn_ends` (those of the marks that end a turn), all of `always` (marks kept wherever they
    are), those at least `spacing` after the previous kept one, and `end` (the prompt's end) itself. Ascending,
    without repeats."""
    kept = set(marks[-tail:]) if tail else set()
    kept.update(turn_ends[-tail_turns:] if tail_turns else ())
    kept.update(always)
    kept.update(marks[:1])
    last = start
    for p in marks:
        if p - last >= spacing:
            kept.add(p)
        if p in kept:
            last = p
    kept.add(end)
    return sorted(kept)


@dataclass(eq=False)
class Snapshot:
    """One checkpoint: the linear layers' states after `position` tokens and the K/V of its partial last block.

    Attributes:
        position: tokens before the state (the prompt resumes at this position).
        states: per linear layer, (conv window [C, K - 1] model dtype, delta-rule state [Hv, Dk, Dv] float32).
        tail: per full-attention layer, (k, v) [block_size, Hkv, D]; rows [0, position % block_size) are used.
        node: the prefix-cache node of block position // block_size - 1 (`prefix_cache.ROOT` for the first),
            None until registered; tail_tokens: the token ids of the partial block.
        pins: running steps writing it (an unpinned, registered snapshot can be evicted).
    """

    position: int
    states: dict[int, tuple[torch.Tensor, torch.Tensor]]
    tail: list[tuple[torch.Tensor, torch.Tensor]]
    node: int | None = None
    tail_tokens: tuple[int, ...] = ()
    pins: int = 0

    @property
    def key(self) -> tuple[int | None, tuple[int, ...]]:
        """(the prefix-cache node of the last full block, the tail's token ids): equal keys, equal prefixes."""
        return self.node, self.tail_tokens


class SnapshotPool:
    """Snapshots within a byte budget, evicted least recently used; pinned ones stay. With a host tier, a snapshot
    evicted from the device moves to host memory (`demote`) and leaves only when the host tier evicts it in turn.

    Args:
        capacity: most snapshots on the compute device at once (its byte budget over `snapshot_nbytes`).
        make: allocates the tensors of one snapshot for a position: `make(position) -> Snapshot`.
        on_drop: called with each snapshot that leaves the pool (evicted or dropped), to unindex it.
        host_capacity: most snapshots in the host tier (0: none).
        demote: moves a snapshot's tensors to host memory, in place (needed with a host tier).
    """

    def __init__(
        self,
        capacity: int,
        make: Callable[[int], Snapshot],
        on_drop: Callable[[Snapshot], None],
        host_capacity: int = 0,
        demote: Callable[[Snapshot], None] | None = None,
    ) -> None:
        self.capacity = capacity
        self.host_capacity = host_capacity if demote is not None else 0
        self._make = make
        self._on_drop = on_drop
        self._demote = demote
        self._lru: OrderedDict[Snapshot, None] = OrderedDict()  # unpinned device snapshots, least recent first
        self._pinned: dict[Snapshot, None] = {}
        self._host: OrderedDict[Snapshot, None] = OrderedDict()  # the host tier, least recently used first
        self.num_evicted = 0
        self.num_demoted = 0

    def __len__(self) -> int:
        return self.num_device + len(self._host)

    @property
    def num_device(self) -> int:
        """Snapshots on the compute device (pinned ones included)."""
        return len(self._lru) + len(self._pinned)

    @property
    def num_host(self) -> int:
        """Snapshots in the host tier."""
        return len(self._host)

    def allocate(self, position: int) -> Snapshot | None:
        """A new snapshot on the device, pinned once. When the device tier is full its least recently used
        unpinned snapshot goes to the host tier (whose own least recently used one is evicted when it is full), or
        is evicted without one. None when every device snapshot is pinned (or the capacity is 0)."""
        if self.num_device >= self.capacity:
            if not self._lru:
                return None
            victim, _ = self._lru.popitem(last=False)
            if self.host_capacity:
                if len(self._host) >= self.host_capacity:
                    self._evict(self._host.popitem(last=False)[0])
                self._demote(victim)  # type: ignore[misc]  # host_capacity > 0 only with a demote
                self._host[victim] = None
                self.num_demoted += 1
            else:
                self._evict(victim)
        snap = self._make(position)
        snap.pins = 1
        self._pinned[snap] = None
        return snap

    def _evict(self, snap: Snapshot) -> None:
        self.num_evicted += 1
        self._on_drop(snap)

    def pin(self, snap: Snapshot) -> None:
        """One more reference: the snapshot cannot be evicted until `unpin`."""
        if snap.pins == 0:
            del self._lru[snap]
            self._pinned[snap] = None
        snap.pins += 1

    def unpin(self, snap: Snapshot) -> None:
        """Drop one reference; the last makes it the most recently used evictable snapshot.

        Raises:
            ValueError: it is not pinned.
        """
        if snap.pins < 1:
            raise ValueError("snapshot unpinned more often than pinned")
        snap.pins -= 1
        if snap.pins == 0:
            del self._pinned[snap]
            self._lru[snap] = None

    def touch(self, snap: Snapshot) -> None:
        """Mark an unpinned snapshot most recently used in its tier (a restore read it)."""
        for tier in (self._lru, self._host):
            if snap in tier:
                tier.move_to_end(snap)

    def drop(self, snap: Snapshot) -> None:
        """Remove a snapshot now, pinned or not (its KV was evicted, a step writing it failed, a duplicate)."""
        self._lru.pop(snap, None)
        self._pinned.pop(snap, None)
        self._host.pop(snap, None)
        snap.pins = 0
        self._on_drop(snap)


def snapshot_nbytes(model_cfg: ModelConfig, dtype: torch.dtype, block_size: int) -> int:
    """Bytes of one snapshot: every linear layer's state (`RecurrentStatePool.bytes_per_slot`) and a KV block of
    every full-attention layer (the partial tail block)."""
    size = torch.empty((), dtype=dtype).element_size()
    tail = 2 * model_cfg.num_kv_layers * block_size * model_cfg.num_key_value_heads * model_cfg.head_dim * size
    return RecurrentStatePool.bytes_per_slot(model_cfg, dtype) + tail


def host_budget_bytes(cfg: EngineConfig, model_cfg: ModelConfig, dtype: torch.dtype) -> int:
    """The host tier's budget: `--state-checkpoint-host-gb` on a CUDA device when checkpoints are on (0 on a CPU
    device, where the device tier already is host memory)."""
    if torch.device(cfg.device).type != "cuda" or not default_budget_bytes(cfg, model_cfg, dtype):
        return 0
    return int(cfg.state_checkpoint_host_gb * 1e9)


def default_budget_bytes(cfg: EngineConfig, model_cfg: ModelConfig, dtype: torch.dtype) -> int:
    """The snapshot budget: `--state-checkpoint-gb` when set, else `DEFAULT_SNAPSHOTS` snapshots capped at
    `DEFAULT_BUDGET_FRACTION` of the device budget (`--gpu-memory-gb`, or the CUDA device's total memory); 0 for
    models without linear layers or with checkpoints off (`--state-checkpoints off`, `--no-prefix-cache`)."""
    if not model_cfg.linear_layers or cfg.state_checkpoints == "off" or cfg.no_prefix_cache:
        return 0
    if cfg.state_checkpoint_gb > 0:
        return int(cfg.state_checkpoint_gb * 1e9)
    wanted = DEFAULT_SNAPSHOTS * snapshot_nbytes(model_cfg, dtype, cfg.kv_block_size)
    device = torch.device(cfg.device)
    if cfg.gpu_memory_gb:
        budget = cfg.gpu_memory_gb * 1e9
    elif device.type == "cuda":
        budget = torch.cuda.get_device_properties(device).total_memory
    else:
        return wanted
    return min(wanted, int(DEFAULT_BUDGET_FRACTION * budget))


@dataclass
class Capture:
    """A snapshot a step takes of one of its sequences: after `offset` of its `query_len` tokens."""

    seq_index: int
    offset: int
    snapshot: Snapshot


@dataclass
class StepCaptures:
    """The captures of one scheduled step; `splits[i]`: the interior offsets of sequence i of the step, where the
    linear layers hand their state out mid-span (`AttentionMetadata.state_splits`)."""

    captures: list[Capture] = field(default_factory=list)
    splits: list[list[int]] = field(default_factory=list)

    def write(self, layer: int, seq_index: int, offset: int, conv: torch.Tensor, ssm: torch.Tensor) -> None:
        """Copy one linear layer's state rows (conv [C, K - 1], ssm [Hv, Dk, Dv]) after `offset` tokens of
        sequence `seq_index` into its capture (`AttentionMetadata.state_capture`)."""
        for c in self.captures:
            if c.seq_index == seq_index and c.offset == offset:
                dst_conv, dst_ssm = c.snapshot.states[layer]
                dst_conv.copy_(conv)
                dst_ssm.copy_(ssm)
                return
        raise KeyError(f"no capture after {offset} tokens of sequence {seq_index} of the step")


class StateCheckpoints:
    """Snapshots of running hybrid sequences, their index by prefix, restores and counters.

    Args:
        mode: "marks" or "chunk" (see the module docstring).
        marks: the model's marks (mode "marks").
        state_pool: the running sequences' recurrent states (source of snapshots, target of restores).
        kv: the KV cache (tails copied out of and into its blocks).
        budget_bytes: the snapshot pool's byte budget.
        spacing: mode "marks": tokens between kept marks deep in a prompt.

    Raises:
        ValueError: an unknown mode.
    """

    def __init__(
        self,
        mode: str,
        marks: MarkSet,
        state_pool: RecurrentStatePool,
        kv,
        budget_bytes: int,
        spacing: int,
        model_cfg: ModelConfig,
        dtype: torch.dtype,
        host_budget_bytes: int = 0,
    ) -> None:
        if mode not in ("marks", "chunk"):
            raise ValueError(f"--state-checkpoints {mode!r}: checkpoints take 'marks' or 'chunk'")
        self.mode = mode
        self.marks = marks
        self.state_pool = state_pool
        self.kv = kv
        self.spacing = spacing
        self.block_size = kv.block_size
        self.nbytes_each = snapshot_nbytes(model_cfg, dtype, kv.block_size)
        self.budget_bytes = budget_bytes
        self.host_budget_bytes = host_budget_bytes
        self.pool = SnapshotPool(
            budget_bytes // self.nbytes_each,
            self._make,
            self._unindex,
            host_budget_bytes // self.nbytes_each,
            self._demote,
        )
        self._index: dict[int | None, dict[tuple[int, ...], Snapshot]] = {}  # node -> tail tokens -> snapshot
        self._plans: dict[object, list[int]] = {}  # prefilling sequence -> positions still to snapshot
        self.num_restores = 0
        self.num_restored_tokens = 0
        self.num_snapshots = 0
        self.num_invalidated = 0

    # Snapshot tensors and the index.

    def _make(self, position: int) -> Snapshot:
        states = {
            layer: (torch.empty_like(conv[0]), torch.empty_like(ssm[0]))
            for layer, (conv, ssm) in self.state_pool.layers.items()
        }
        bs = self.block_size
        tail = [(torch.empty_like(k[:bs]), torch.empty_like(v[:bs])) for k, v in self.kv.layers]
        return Snapshot(position, states, tail)

    @staticmethod
    def _demote(snap: Snapshot) -> None:
        """Move a snapshot's tensors into one pinned host buffer (the host tier; restores copy them back): one
        page-locked allocation per snapshot, not one per tensor (each costs a driver call the first time)."""
        tensors = [t for pair in snap.states.values() for t in pair] + [t for pair in snap.tail for t in pair]
        align = 64
        offsets, size = [], 0
        for t in tensors:
            offsets.append(size)
            size += -(-t.numel() * t.element_size() // align) * align
        buf = torch.empty(size, dtype=torch.uint8, pin_memory=torch.cuda.is_available())  # (the tier is CUDA's)
        views = iter(
            [
                buf[o : o + t.numel() * t.element_size()].view(t.dtype).view(t.shape).copy_(t)
                for o, t in zip(offsets, tensors, strict=True)
            ]
        )
        snap.states = {layer: (next(views), next(views)) for layer in snap.states}
        snap.tail = [(next(views), next(views)) for _ in snap.tail]

    def _unindex(self, snap: Snapshot) -> None:
        by_tail = self._index.get(snap.node)
        if by_tail is not None and by_tail.get(snap.tail_tokens) is snap:
            del by_tail[snap.tail_tokens]
            if not by_tail:
                del self._index[snap.node]

    def on_evict(self, node: int) -> None:
        """The prefix cache evicted the block of `node`: the snapshots that extend it lost their KV."""
        for snap in list(self._index.get(node, {}).values()):
            self.num_invalidated += 1
            self.pool.drop(snap)

    def find(self, tokens: Sequence[int], nodes: Sequence[int]) -> Snapshot | None:
        """The deepest snapshot of a prefix of `tokens` that leaves at least its last token to compute (its logits
        must come from this prompt), given `nodes`, the prefix cache's match of `tokens` (one node per cached full
        block). None when no snapshot survives. Read-only."""
        bs = self.block_size
        root = 0
        for b in range(len(nodes), -1, -1):
            by_tail = self._index.get(nodes[b - 1] if b else root)
            if not by_tail:
                continue
            best = None
            for tail, snap in list(by_tail.items()):
                end = b * bs + len(tail)
                if (
                    end < len(tokens)
                    and tuple(tokens[b * bs : end]) == tail
                    and (best is None or len(tail) > len(best.tail_tokens))
                ):
                    best = snap
            if best is not None:
                return best
        return None

    # Restores.

    def restore(self, snap: Snapshot, slot: int, tail_block: int | None) -> None:
        """Copy `snap`'s states into state-pool `slot` and its tail K/V into KV block `tail_block` (None when the
        snapshot sits on a block boundary), and count the restore."""
        for layer, (conv, ssm) in self.state_pool.layers.items():
            src_conv, src_ssm = snap.states[layer]
            conv[slot].copy_(src_conv)
            ssm[slot].copy_(src_ssm)
        rows = len(snap.tail_tokens)
        if tail_block is not None and rows:
            start = tail_block * self.block_size
            for (k, v), (tk, tv) in zip(self.kv.layers, snap.tail, strict=True):
                k[start : start + rows].copy_(tk[:rows])
                v[start : start + rows].copy_(tv[:rows])
        self.pool.touch(snap)
        self.num_restores += 1
        self.num_restored_tokens += snap.position

    # Planning and taking snapshots.

    def admitted(self, seq) -> None:
        """Plan a just-admitted sequence's prompt snapshots (mode "marks"), from where it resumes."""
        if self.mode == "marks":
            start, end = seq.num_computed, seq.prompt_len
            marks = self.marks.positions(seq.token_ids, start, end)
            tokens = seq.token_ids
            self._plans[seq] = select_marks(
                marks,
                start,
                end,
                self.spacing,
                turn_ends=self.marks.turn_ends(tokens, marks),
                always=self.marks.tool_outputs(tokens, marks) + self.marks.query_ends(tokens, marks),
            )

    def forget(self, seq) -> None:
        """A sequence left the running set (finished, aborted, preempted): drop its plan."""
        self._plans.pop(seq, None)

    def plan_step(self, seqs: Sequence, query_lens: Sequence[int]) -> StepCaptures | None:
        """The snapshots a step of `seqs` (each running `query_lens` tokens from its `num_computed`) takes in its
        prompts: planned marks inside each span (mode "marks") or each prefill chunk's end (mode "chunk"). Output
        marks are taken at `commit`. None when there is none (or no room: every snapshot is pinned)."""
        step = StepCaptures(splits=[[] for _ in seqs])
        for i, (seq, q) in enumerate(zip(seqs, query_lens, strict=True)):
            start, end = seq.num_computed, seq.num_computed + q
            if start >= seq.prompt_len:
                continue
            if self.mode == "chunk":
                positions = [end]
            else:
                plan = self._plans.get(seq, [])
                positions = [p for p in plan if start < p <= end]
                if positions:
                    self._plans[seq] = [p for p in plan if p > end]
            for p in positions:
                snap = self.pool.allocate(p)
                if snap is None:
                    break
                step.captures.append(Capture(i, p - start, snap))
                if p < end:
                    step.splits[i].append(p - start)
        return step if step.captures else None

    def commit(
        self,
        seqs: Sequence,
        query_lens: Sequence[int],
        captures: StepCaptures | None,
        nodes_at: Callable[[Any, int], int],
    ) -> None:
        """After a step finished: finish its captures (the span-end ones copied from the state slots now), take
        output marks of decoding sequences (mode "marks"), and index them all under `nodes_at(seq, b)`, the
        prefix-cache node of the sequence's first b blocks (its blocks are indexed by now)."""
        done = list(captures.captures) if captures is not None else []
        taken = {(c.seq_index, c.offset) for c in done}
        if self.mode == "marks":
            for i, (seq, q) in enumerate(zip(seqs, query_lens, strict=True)):
                n = seq.num_computed
                if n > seq.prompt_len and (i, q) not in taken and self.marks.ends_at(seq.token_ids, n):
                    snap = self.pool.allocate(n)
                    if snap is not None:
                        done.append(Capture(i, q, snap))
        for c in done:
            seq, q = seqs[c.seq_index], query_lens[c.seq_index]
            snap = c.snapshot
            if c.offset == q:  # the span's end: the state is the slot's now
                for layer, (conv, ssm) in self.state_pool.layers.items():
                    dst_conv, dst_ssm = snap.states[layer]
                    dst_conv.copy_(conv[seq.state_slot])
                    dst_ssm.copy_(ssm[seq.state_slot])
            b, rows = divmod(snap.position, self.block_size)
            if rows:
                start = seq.block_table[b] * self.block_size
                for (k, v), (tk, tv) in zip(self.kv.layers, snap.tail, strict=True):
                    tk[:rows].copy_(k[start : start + rows])
                    tv[:rows].copy_(v[start : start + rows])
            snap.node = nodes_at(seq, b)
            snap.tail_tokens = tuple(seq.token_ids[b * self.block_size : snap.position])
            by_tail = self._index.setdefault(snap.node, {})
            old = by_tail.get(snap.tail_tokens)
            if old is not None:  # the same prefix snapshotted before (n > 1 choices, a resent prompt)
                self.pool.unpin(snap)
                self.pool.drop(snap)
                self.pool.touch(old)
                continue
            by_tail[snap.tail_tokens] = snap
            self.num_snapshots += 1
            self.pool.unpin(snap)

    def discard(self, captures: StepCaptures | None) -> None:
        """A step failed: its captures hold nothing valid."""
        for c in captures.captures if captures is not None else ():
            self.pool.drop(c.snapshot)

    def stats(self) -> dict:
        """Counters (JSON-able): mode, restores and the tokens they saved, snapshots taken, live (on the device and
        in the host tier), moved to the host, evicted (LRU) and invalidated (their KV evicted), bytes live and the
        budgets."""
        live = len(self.pool)
        return {
            "mode": self.mode,
            "num_restores": self.num_restores,
            "num_restored_tokens": self.num_restored_tokens,
            "num_snapshots": self.num_snapshots,
            "num_live": live,
            "num_live_host": self.pool.num_host,
            "num_demoted": self.pool.num_demoted,
            "num_evicted": self.pool.num_evicted,
            "num_invalidated": self.num_invalidated,
            "bytes_live": live * self.nbytes_each,
            "bytes_budget": self.budget_bytes,
            "bytes_host_budget": self.host_budget_bytes,
            "capacity": self.pool.capacity,
            "host_capacity": self.pool.host_capacity,
        }

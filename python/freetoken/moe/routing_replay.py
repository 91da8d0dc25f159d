"""Routing replay, for benchmarks: every MoE router picks the experts a routing trace recorded, not its own.

Random (dummy) router weights route almost uniformly, and through a whole decode the same few experts win (the
hidden states barely move), so a benchmark on dummy weights sees an expert cache that nearly always hits. Replaying
a trace gives the expert cache, the prefill strategies and the decode driver the misses a real model causes.

The trace is a token stream: per MoE layer a table of `[T, k]` expert ids (`T` rows, one per token, in order; a
trace file of batch `B` is flattened step by step). A device clock counts the tokens routed so far; a step of
`M` tokens (a decode batch, a prefill chunk or both) takes rows `clock .. clock + M - 1` (mod `T`) at every MoE
layer, and the last MoE layer advances the clock by `M`. A decode step of batch `B` over a trace of batch `B`
therefore replays that trace step by step. The ids come from a device table indexed by a device counter, so
captured CUDA graphs replay the trace too. The routers' own softmax weights are kept (only the ids change).

What is routed depends on the order of the steps, not on the tokens: outputs are not those of the model, and a
prefix recomputed later sees other experts than the first time. That is why `ft serve` takes it only with
`--dummy-weights` (`EngineConfig.replay_routing`).

    ft serve --model qwen3-30b-a3b --dummy-weights --replay-routing synthetic   # or a .fttrace file

`synthetic` is `freetoken._core.synthetic_trace` at its defaults (Zipf skew 0.45 over a per-layer permutation,
reuse 0.35 of a pick made in the last 16 steps; calibrated to published statistics, see its docstring), batch 1,
`SYNTHETIC_TOKENS` rows, seeded by `--seed`. `benches/moe_backends.py` and `benches/prefill.py` replay it the same
way.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import numpy as np
import torch
from torch import nn

from freetoken._core import read_trace, synthetic_trace

log = logging.getLogger(__name__)

SYNTHETIC = "synthetic"
# Rows (tokens) of the synthetic trace the server replays: past the 16-step reuse window by far, so the wrap-around
# is not seen; 8192 x 48 layers x top-8 int64 ids is 25 MB of device memory for Qwen3-30B-A3B.
SYNTHETIC_TOKENS = 8192
# The synthetic trace's parameters, as `synthetic_trace` defaults them (printed with the routing in use).
SYNTHETIC_PARAMS = {"skew": 0.45, "reuse": 0.35, "window": 16}


class TraceRouter(nn.Module):
    """A MoE layer's router whose ids come from a trace: the router's own weights, the trace's expert ids.

    Args:
        router: the layer's router (`x [M, H] -> (ids [M, k] int64, weights [M, k])`).
        table: [T, k] int64 expert ids on the compute device, one row per token of the trace.
        clock: [1] int64 on the compute device, shared by every layer's `TraceRouter`: rows routed so far, mod T.
        tick: True on the last MoE layer, which advances the clock by the step's rows.
    """

    def __init__(self, router: nn.Module, table: torch.Tensor, clock: torch.Tensor, tick: bool) -> None:
        super().__init__()
        self.router, self.table, self.clock, self.tick = router, table, clock, tick

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [M, H] -> (the trace's ids [M, k] int64 for the next M rows, the router's weights [M, k])."""
        _, weights = self.router(x)
        rows = x.shape[0]
        index = (torch.arange(rows, device=x.device) + self.clock).remainder_(self.table.shape[0])  # [M]
        ids = self.table.index_select(0, index)
        if self.tick:  # the clock stays in range, so the other layers index with it as it is
            self.clock.add_(rows).remainder_(self.table.shape[0])
        return ids, weights


def trace_tables(path: str | Path) -> tuple[dict, list[np.ndarray]]:
    """A trace file as per-layer token tables: (its header {num_layers, num_experts, top_k},
    [num_layers x [T, k] int64]), rows in step order and, within a step, in batch order.

    Raises:
        MissingFileError, TraceFormatError: from `read_trace`.
        ValueError: a layer without records, or layers of different lengths.
    """
    trace = read_trace(path)
    per_layer: list[list[np.ndarray]] = [[] for _ in range(trace["num_layers"])]
    for _, layer, ids in sorted(trace["records"], key=lambda r: (r[0], r[1])):
        per_layer[layer].append(ids)
    if not all(per_layer) or len({sum(len(i) for i in rows) for rows in per_layer}) != 1:
        raise ValueError(f"{path}: every layer of a replayed trace needs the same number of token rows")
    header = {key: trace[key] for key in ("num_layers", "num_experts", "top_k")}
    return header, [np.concatenate(rows).astype(np.int64) for rows in per_layer]


def synthetic_tables(
    num_layers: int, num_experts: int, top_k: int, num_steps: int, batch: int = 1, seed: int = 0
) -> list[np.ndarray]:
    """`synthetic_trace` (defaults of `SYNTHETIC_PARAMS`) of `num_steps` steps of `batch` tokens, as per-layer
    token tables: num_layers x [num_steps * batch, top_k] int64."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "synthetic.fttrace"
        synthetic_trace(path, num_layers, num_experts, top_k, num_steps, batch=batch, seed=seed)
        return trace_tables(path)[1]


def install_trace(model: nn.Module, tables: list[np.ndarray], source: str) -> torch.Tensor:
    """Put a `TraceRouter` in front of every MoE layer's router of `model` (or swap the tables of those already
    there); returns the shared clock ([1] int64, zero; reset it to replay from the first row).

    Args:
        model: a `Qwen3MoeForCausalLM` (any module whose `model.layers[i].mlp.gate` is a MoE layer's router).
        tables: one [T, k] int64 table per MoE layer, in layer order (T equal across layers).
        source: what the tables are ("synthetic", a path), for `describe`.

    Raises:
        ValueError: the tables do not match the model (number of MoE layers, top-k, ids past its experts).
    """
    from freetoken.models.qwen3_moe import SparseMoeBlock

    blocks = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, SparseMoeBlock)]
    cfg = model.config
    if len(tables) != len(blocks):
        raise ValueError(f"routing trace {source}: {len(tables)} MoE layers, the model has {len(blocks)}")
    for table in tables:
        if table.ndim != 2 or table.shape[1] != cfg.num_experts_per_tok:
            raise ValueError(
                f"routing trace {source}: top-{table.shape[-1]}, the model routes top-{cfg.num_experts_per_tok}"
            )
        if table.size and not 0 <= table.min() <= table.max() < cfg.num_experts:
            raise ValueError(f"routing trace {source}: expert ids past the model's {cfg.num_experts} experts")
    device = next(model.parameters()).device
    clock = torch.zeros(1, dtype=torch.int64, device=device)
    for n, (block, table) in enumerate(zip(blocks, tables, strict=True)):
        router = block.gate.router if isinstance(block.gate, TraceRouter) else block.gate
        block.gate = TraceRouter(router, torch.from_numpy(table).to(device), clock, tick=n == len(blocks) - 1)
    model.routing_source = source
    return clock


def install_replay(model: nn.Module, replay: str, seed: int = 0) -> torch.Tensor:
    """`ft serve --replay-routing`: install `synthetic` (`SYNTHETIC_TOKENS` rows of batch 1, seeded by `seed`) or
    the trace file at path `replay` into `model` (`install_trace`), and log which. Returns the clock.

    Raises:
        FileNotFoundError: no such trace file. ValueError: a trace that does not fit the model (or malformed).
    """
    cfg = model.config
    num_layers = len(cfg.moe_layers)
    if replay == SYNTHETIC:
        tables = synthetic_tables(num_layers, cfg.num_experts, cfg.num_experts_per_tok, SYNTHETIC_TOKENS, seed=seed)
        source = f"synthetic ({', '.join(f'{k}={v}' for k, v in SYNTHETIC_PARAMS.items())}, seed={seed})"
    else:
        path = Path(replay).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"--replay-routing {replay}: no such trace file (or give {SYNTHETIC!r})")
        header, tables = trace_tables(path)
        if header["num_experts"] != cfg.num_experts:
            raise ValueError(
                f"--replay-routing {replay}: a trace of {header['num_experts']} experts per layer, the "
                f"model has {cfg.num_experts}"
            )
        source = str(path)
    clock = install_trace(model, tables, source)
    log.info(
        "routing: replayed from the %s trace (%d tokens, then it wraps); the routers' own ids are not used",
        source,
        tables[0].shape[0],
    )
    return clock


def describe(model: nn.Module) -> dict:
    """The routing `model` runs, JSON-able: {"source": "model"} (its routers), or the replayed trace's source and
    rows (`/v1/stats`'s `routing`)."""
    from freetoken.models.qwen3_moe import SparseMoeBlock

    for layer in model.model.layers:
        if isinstance(layer.mlp, SparseMoeBlock) and isinstance(layer.mlp.gate, TraceRouter):
            return {
                "source": "replay",
                "trace": getattr(model, "routing_source", "?"),
                "tokens": int(layer.mlp.gate.table.shape[0]),
            }
    return {"source": "model"}

"""Routing replay (`freetoken.moe.routing_replay`, `ft serve --replay-routing`): the experts the MoE layers get are
the trace's rows in token order, through chunked prefills and batched decode steps, on the CPU device; trace files
are flattened step by step; a trace that does not fit the model is refused.

The server half (`--replay-routing` without `--dummy-weights` refused; `/v1/stats` names the routing) is in
test_cli.py and test_agent_trace.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from freetoken._core import read_trace, synthetic_trace
from freetoken.config import EngineConfig
from freetoken.engine.llm_engine import LLMEngine
from freetoken.engine.types import SamplingParams
from freetoken.models.demo import build_demo_checkpoint
from freetoken.moe.routing_replay import (
    SYNTHETIC_TOKENS,
    describe,
    install_replay,
    install_trace,
    synthetic_tables,
    trace_tables,
)
from greedy import greedy_tokens


class Recorder:
    """An expert backend wrapper that records the ids each MoE layer is given."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.graph_safe, self.wants_weights = inner.graph_safe, inner.wants_weights
        self.ids: dict[int, list[np.ndarray]] = {}

    def begin_step(self, num_tokens, num_prefill_tokens, top_k):
        self.inner.begin_step(num_tokens, num_prefill_tokens, top_k)

    def stats(self):
        return self.inner.stats()

    def forward(self, layer, hidden, topk_ids, topk_weights):
        self.ids.setdefault(layer, []).append(topk_ids.cpu().numpy().copy())
        return self.inner.forward(layer, hidden, topk_ids, topk_weights)


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    return build_demo_checkpoint(tmp_path_factory.mktemp("replay"), seed=0)


def _engine(demo_dir, device_: str = "cpu", dtype: str = "float32", **kwargs) -> LLMEngine:
    cfg = EngineConfig(
        device=device_, dtype=dtype, dummy_weights=True, seed=3, max_model_len=128, kv_cache_gb=0.5, **kwargs
    )
    return LLMEngine.from_dir(demo_dir, cfg)


def test_layers_get_the_trace_rows_in_token_order(demo_dir):
    """Two requests with chunked prefills (5 tokens a step) and a shared decode batch: every MoE layer's ids,
    concatenated over the steps, are the first rows of that layer's synthetic table."""
    engine = _engine(demo_dir, replay_routing="synthetic", max_prefill_tokens=5, max_num_seqs=2)
    model = engine.runner.model
    recorder = Recorder(model.experts)
    model.attach_experts(recorder)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    engine.add_request("a", list(range(10, 22)), params)
    engine.add_request("b", list(range(40, 47)), params)
    while engine.has_work():
        engine.step()
    cfg = model.config
    tables = synthetic_tables(len(cfg.moe_layers), cfg.num_experts, cfg.num_experts_per_tok, SYNTHETIC_TOKENS, seed=3)
    steps = [len(ids) for ids in recorder.ids[cfg.moe_layers[0]]]
    assert max(steps) == 5 and 2 in steps, steps  # chunked prefill steps and batched decode steps both ran
    for n, layer in enumerate(cfg.moe_layers):
        got = np.concatenate(recorder.ids[layer])
        assert got.shape == (12 + 7 + 2 * 5, cfg.num_experts_per_tok)  # prompts, then 5 decodes each
        np.testing.assert_array_equal(got, tables[n][: len(got)])
    assert engine.stats()["routing"] == describe(model)
    assert engine.stats()["routing"]["source"] == "replay" and "synthetic" in engine.stats()["routing"]["trace"]


def test_off_by_default_routes_by_the_model(demo_dir):
    engine = _engine(demo_dir)
    assert engine.stats()["routing"] == {"source": "model"}


def test_replay_needs_dummy_weights():
    with pytest.raises(ValueError, match="--dummy-weights"):
        EngineConfig(replay_routing="synthetic").validate()


def test_trace_files_are_flattened_step_by_step(demo_dir, tmp_path):
    """A trace of batch 3: rows of step s are 3s .. 3s + 2; the clock wraps past the last row."""
    engine = _engine(demo_dir)
    model = engine.runner.model
    cfg = model.config
    layers = len(cfg.moe_layers)
    path = tmp_path / "b3.fttrace"
    synthetic_trace(path, layers, cfg.num_experts, cfg.num_experts_per_tok, 4, batch=3, seed=9)
    _, tables = trace_tables(path)
    for step, layer, ids in read_trace(path)["records"]:
        np.testing.assert_array_equal(tables[layer][3 * step : 3 * step + 3], ids)
    clock = install_replay(model, str(path))
    assert describe(model) == {"source": "replay", "trace": str(path), "tokens": 12}
    gate = model.model.layers[cfg.moe_layers[-1]].mlp.gate
    clock.fill_(10)
    ids, _ = gate(torch.zeros(4, cfg.hidden_size))  # rows 10, 11, 0, 1
    np.testing.assert_array_equal(ids.numpy(), tables[-1][[10, 11, 0, 1]])
    assert int(clock) == 2


def test_a_trace_that_does_not_fit_is_refused(demo_dir, tmp_path):
    engine = _engine(demo_dir)
    model = engine.runner.model
    cfg = model.config
    layers = len(cfg.moe_layers)
    tables = synthetic_tables(layers, cfg.num_experts, cfg.num_experts_per_tok, 8)
    with pytest.raises(ValueError, match="MoE layers"):
        install_trace(model, tables[:-1], "short")
    with pytest.raises(ValueError, match="experts"):
        install_trace(model, [t + cfg.num_experts for t in tables], "past")
    path = tmp_path / "wide.fttrace"
    synthetic_trace(path, layers, 2 * cfg.num_experts, cfg.num_experts_per_tok, 4, seed=1)
    with pytest.raises(ValueError, match="experts per layer"):
        install_replay(model, str(path))
    with pytest.raises(FileNotFoundError, match="no such trace"):
        install_replay(model, str(tmp_path / "missing.fttrace"))
    assert describe(model) == {"source": "model"}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("backend", "dtype"), [("fused", "float32"), ("offload", "bfloat16")])
def test_cuda_graphs_replay_the_trace(demo_dir, backend, dtype):
    """On CUDA, decode steps in CUDA graphs (the routers captured; offload's piecewise ones served by the decode
    driver) route as the eager path does: the clock counts every token routed (prompts, then one per sequence per
    decode step; a batch of 2 is a graph size, so no padding rows), and in float32 the greedy tokens are the eager
    path's."""
    prompts = [[3, 17, 100, 42, 7, 8, 9, 200, 13], [5, 6, 400, 401, 402, 1, 2, 3, 4, 5, 6, 7, 8]]
    max_tokens = 12

    def run(enforce_eager: bool) -> tuple[list[list[int]], int]:
        slots = {"expert_slots": 6} if backend == "offload" else {}
        engine = _engine(
            demo_dir,
            device_="cuda",
            dtype=dtype,
            replay_routing="synthetic",
            moe_backend=backend,
            enforce_eager=enforce_eager,
            **slots,
        )
        assert enforce_eager or engine.runner.decode is not None
        model = engine.runner.model
        clock = model.model.layers[model.config.moe_layers[0]].mlp.gate.clock
        clock.zero_()  # capturing the graphs ran the routers
        tokens = greedy_tokens(engine, prompts, max_tokens)
        return tokens, int(clock)

    graphs, eager = run(False), run(True)
    assert graphs[1] == eager[1] == sum(map(len, prompts)) + len(prompts) * (max_tokens - 1)
    if dtype == "float32":
        assert graphs[0] == eager[0]

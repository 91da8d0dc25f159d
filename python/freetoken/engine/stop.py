"""Output text of one request: incremental detokenization and stop strings.

Text is released only when it can no longer become part of a stop string, so a client never sees a prefix of a
stop string that later matches (the same hold-back rule as vLLM's and TGI's stop-sequence handling).

Stop strings apply to the answer, not to the model's reasoning: with `reasoning_tags`, text inside a reasoning
block is released as it comes and searched only for the block's end; stop strings are looked for after it.
"""

from __future__ import annotations

from freetoken.tokenizer import IncrementalDetokenizer, Tokenizer


class OutputText:
    """Turns generated token ids into released text, and finds stop strings."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: list[int],
        stop: list[str],
        reasoning_tags: tuple[str, str] | None = None,
    ) -> None:
        """Args:
        tokenizer: the model's tokenizer.
        prompt_ids: the prompt (the detokenizer starts from its end).
        stop: the stop strings.
        reasoning_tags: (open, close) of the model's reasoning block (see `SamplingParams.reasoning_tags`), or
            None when the output has no reasoning.
        """
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids=prompt_ids, skip_special_tokens=True)
        self._stop = [s for s in stop if s]
        self._pending = ""
        # "open?": the output may start with `open`; "inside": in the reasoning block; "answer": stops apply.
        self._phase = "answer"
        self._open, self._close = reasoning_tags or ("", "")
        if reasoning_tags is not None and self._stop:
            self._phase = "inside" if not self._open else "open?"

    def push(self, token_ids: list[int]) -> tuple[str, str | None]:
        """Add generated tokens. Returns (text to release now, the stop string matched or None).

        After a match, the released text ends right before the stop string and nothing more is released.
        """
        self._pending += self._detok.push(token_ids)
        return self._release()

    def flush(self) -> str:
        """At the end of the request: release whatever is still held back."""
        self._pending += self._detok.flush()
        text, _ = self._release()
        rest, self._pending = self._pending, ""
        return text + rest

    def _release(self) -> tuple[str, str | None]:
        reasoning = self._release_reasoning()
        text, stop = self._release_answer()
        return reasoning + text, stop

    def _release_reasoning(self) -> str:
        """While the output may still be (or is) in its reasoning block: the text that can go out unsearched."""
        if self._phase == "open?":
            head = self._pending.lstrip()
            if head.startswith(self._open):
                self._phase = "inside"
            elif self._open.startswith(head):
                return ""  # may still become the opening tag
            else:
                self._phase = "answer"
        if self._phase != "inside":
            return ""
        end = self._pending.find(self._close)
        if end >= 0:
            cut = end + len(self._close)
            self._phase = "answer"
        else:
            cut = len(self._pending)
            for n in range(min(len(self._close) - 1, cut), 0, -1):
                if self._pending.endswith(self._close[:n]):
                    cut -= n  # a partial closing tag: held back until decided
                    break
        text, self._pending = self._pending[:cut], self._pending[cut:]
        return text

    def _release_answer(self) -> tuple[str, str | None]:
        if self._phase != "answer":
            return "", None
        if not self._stop:
            text, self._pending = self._pending, ""
            return text, None
        hits = [(self._pending.find(s), s) for s in self._stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if hits:
            index, stop = min(hits)
            text, self._pending = self._pending[:index], ""
            return text, stop
        keep = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(self._pending)), keep, -1):
                if self._pending.endswith(s[:n]):
                    keep = n
                    break
        cut = len(self._pending) - keep
        text, self._pending = self._pending[:cut], self._pending[cut:]
        return text, None

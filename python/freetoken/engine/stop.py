"""Output text of one request: incremental detokenization and stop strings.

Text is released only when it can no longer become part of a stop string, so a client never sees a prefix of a
stop string that later matches (the same hold-back rule as vLLM's and TGI's stop-sequence handling).
"""

from __future__ import annotations

from freetoken.tokenizer import IncrementalDetokenizer, Tokenizer


class OutputText:
    """Turns generated token ids into released text, and finds stop strings."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], stop: list[str]) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids=prompt_ids, skip_special_tokens=True)
        self._stop = [s for s in stop if s]
        self._pending = ""

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

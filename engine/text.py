"""Incremental detokenization with stop strings, for streaming text deltas."""

from __future__ import annotations


class TextStream:
    """Turns a growing list of token ids into text deltas.

    A delta is held back while the text ends in an incomplete UTF-8 sequence (U+FFFD) or could be
    the start of a stop string, so no client ever sees half a character or part of a stop string.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""  # decoded text of token_ids, cut at a stop string once one appears
        self.emitted = 0  # characters of self.text already returned
        self.stopped = False

    def push(self, token_ids: list[int]) -> str:
        """Add tokens; return the new text that is safe to emit."""
        if self.stopped or not token_ids:
            return ""
        self.token_ids.extend(token_ids)
        self.text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        if self.stop:
            search_from = max(0, self.emitted - self.holdback - 1)
            hits = [i for i in (self.text.find(s, search_from) for s in self.stop) if i >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                self.stopped = True
                return self.flush()
        safe = len(self.text)
        if self.text.endswith("\ufffd"):
            safe = self.text.rfind("\ufffd")
            while safe > 0 and self.text[safe - 1] == "\ufffd":
                safe -= 1
        if self.stop:
            safe = min(safe, len(self.text) - self.holdback)
        if safe <= self.emitted:
            return ""
        delta = self.text[self.emitted : safe]
        self.emitted = safe
        return delta

    def flush(self) -> str:
        """The rest of the text (at the end of the sequence)."""
        delta = self.text[self.emitted :]
        self.emitted = len(self.text)
        return delta

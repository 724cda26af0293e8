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
        self.text = ""  # decoded text of token_ids up to read_offset, cut at a stop string once one appears
        self.emitted = 0  # characters of self.text already returned
        self.stopped = False
        # Incremental decoding: only the tokens from prefix_offset on are decoded at each push (not the
        # whole output, which made a long output quadratic); ids[prefix_offset:read_offset] is already
        # in `text` and is decoded again only as left context, so a tokenizer that drops a leading space
        # at the start of a decode drops it from both and the difference is exact.
        self.prefix_offset = 0
        self.read_offset = 0

    def _decode(self, start: int, end: int | None = None) -> str:
        return self.tokenizer.decode(self.token_ids[start:end], skip_special_tokens=True)

    def _advance(self, final: bool = False) -> None:
        """Append the text of the tokens past read_offset, unless it ends in an incomplete character."""
        prefix = self._decode(self.prefix_offset, self.read_offset)
        new = self._decode(self.prefix_offset)
        if len(new) > len(prefix) and (final or not new.endswith("\ufffd")):
            self.text += new[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)

    def push(self, token_ids: list[int]) -> str:
        """Add tokens; return the new text that is safe to emit."""
        if self.stopped or not token_ids:
            return ""
        self.token_ids.extend(token_ids)
        before = len(self.text)
        self._advance()
        if self.stop and len(self.text) > before:
            search_from = max(0, min(before, self.emitted) - self.holdback - 1)
            hits = [i for i in (self.text.find(s, search_from) for s in self.stop) if i >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                self.stopped = True
                return self.flush()
        safe = len(self.text)
        if self.stop:
            safe = min(safe, len(self.text) - self.holdback)
        if safe <= self.emitted:
            return ""
        delta = self.text[self.emitted : safe]
        self.emitted = safe
        return delta

    def flush(self) -> str:
        """The rest of the text (at the end of the sequence)."""
        if not self.stopped:
            self._advance(final=True)
        delta = self.text[self.emitted :]
        self.emitted = len(self.text)
        return delta

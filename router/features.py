"""Request rendering and conversation-shape features for the domain classifier.

A request (a completion prompt or a list of chat messages) is rendered to one bounded string:
a header line with the conversation's shape, then the (truncated) messages with role markers.
Everything downstream (TF-IDF, shape features) reads that string, so the whole pipeline takes
plain strings and persists as plain scikit-learn objects.

    [chat turns=3 user=2 assistant=1 system=0 fences=1]
    <user> hey, can you help me?
    <assistant> Sure!
    <user> why does this fail? ```python ...```
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence

import numpy as np
from sklearn.base import BaseEstimator, TransformerMixin
from sklearn.feature_extraction.text import TfidfVectorizer

from router.errors import InvalidRequest

# Bounds that keep classification time independent of the request size.
MAX_CHARS = 1000  # rendered body: the first 2/3 and the last 1/3 of the text
MAX_MESSAGE_CHARS = 600  # per chat message, the same way
MAX_MESSAGES = 12  # first 2 + last 10 messages are kept
ROLES = ("system", "developer", "user", "assistant", "tool")

_HEADER_RE = re.compile(
    r"^\[(chat|text) turns=(\d+) user=(\d+) assistant=(\d+) system=(\d+) fences=(\d+)\]"
)
_CODE_CHARS = frozenset("{}()[];=<>_#:.*/\\|&!+-%\"'`$@^~")
_CODE_LINE_RE = re.compile(
    r"^\s*(def |class |import |from \S+ import|return\b|if .*:$|for .*:$|while .*:$|#include|"
    r"function |const |let |var |public |private |SELECT |INSERT |fn |func |package |\}|\{|@)"
)


def _clip(text: str, limit: int) -> str:
    """Keep the head and the tail of a long text (bounded time)."""
    if len(text) <= limit:
        return text
    head = limit * 2 // 3
    return text[:head] + " … " + text[len(text) - (limit - head) :]


def _check_text(text: str, where: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequest(
            f"{where} is not valid UTF-8 text (undecodable character at position {exc.start}); "
            "send UTF-8 encoded text",
            param=where,
        ) from None
    return text


def _decode(value: object, where: str) -> str:
    if isinstance(value, (bytes, bytearray, memoryview)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidRequest(
                f"{where} is not valid UTF-8 (byte 0x{bytes(value)[exc.start]:02x} at position "
                f"{exc.start}); send UTF-8 encoded text",
                param=where,
            ) from None
    if isinstance(value, str):
        return value
    raise InvalidRequest(
        f"{where} must be a string, got {type(value).__name__}", param=where
    )


def _message_text(content: object, where: str) -> str:
    """OpenAI message content: a string or a list of parts ({"type": "text", "text": ...})."""
    if content is None:
        return ""
    if isinstance(content, (str, bytes, bytearray)):
        return _decode(content, where)
    if isinstance(content, Sequence):
        parts = []
        for part in content[:32]:
            if isinstance(part, Mapping) and part.get("type", "text") == "text":
                parts.append(_decode(part.get("text", ""), where))
        return "\n".join(parts)
    raise InvalidRequest(
        f"{where} must be a string or a list of text parts, got {type(content).__name__}",
        param=where,
    )


def render(request: object) -> str:
    """Render a completion prompt or chat messages into the bounded classifier input.

    Raises InvalidRequest (a ValueError) on empty, non-text or non-UTF-8 input.
    """
    if isinstance(request, (str, bytes, bytearray, memoryview)):
        text = _decode(request, "prompt")
        # Slice first, then check: the work stays bounded for a 100 MB prompt.
        body = _check_text(_clip(text, MAX_CHARS), "prompt")
        if not body.strip():
            raise InvalidRequest("prompt is empty; send some text to classify", param="prompt")
        fences = body.count("```")
        header = f"[text turns=1 user=0 assistant=0 system=0 fences={fences}]"
        return header + "\n" + body
    if isinstance(request, Sequence) and not isinstance(request, Mapping):
        return _render_messages(request)
    raise InvalidRequest(
        "request must be a prompt string or a list of chat messages "
        f'[{{"role": ..., "content": ...}}], got {type(request).__name__}',
        param="messages",
    )


def _render_messages(messages: Sequence) -> str:
    if len(messages) == 0:
        raise InvalidRequest("messages is empty; send at least one message", param="messages")
    n = len(messages)
    keep = list(range(n)) if n <= MAX_MESSAGES else [0, 1, *range(n - MAX_MESSAGES + 2, n)]
    counts = dict.fromkeys(ROLES, 0)
    lines = []
    fences = 0
    for i in keep:
        message = messages[i]
        if not isinstance(message, Mapping):
            raise InvalidRequest(
                f"messages[{i}] must be an object with 'role' and 'content', "
                f"got {type(message).__name__}",
                param=f"messages[{i}]",
            )
        role = message.get("role")
        if role not in ROLES:
            raise InvalidRequest(
                f"messages[{i}].role is {role!r}; expected one of {', '.join(ROLES)}",
                param=f"messages[{i}].role",
            )
        text = _message_text(message.get("content"), f"messages[{i}].content")
        text = _check_text(_clip(text, MAX_MESSAGE_CHARS), f"messages[{i}].content")
        counts[role] += 1
        fences += text.count("```")
        lines.append(f"<{role}> {text}")
    body = _clip("\n".join(lines), MAX_CHARS)
    if not any(line.split(" ", 1)[-1].strip() for line in lines if not line.startswith("<system>")):
        raise InvalidRequest("messages have no text to classify", param="messages")
    header = (
        f"[chat turns={n} user={counts['user']} assistant={counts['assistant']} "
        f"system={counts['system'] + counts['developer']} fences={fences}]"
    )
    return header + "\n" + body


def strip_header(rendered: str) -> str:
    """The rendered body without the shape header (for the text n-gram features)."""
    return rendered.split("\n", 1)[1] if rendered.startswith("[") and "\n" in rendered else rendered


def text_body(rendered: str) -> str:
    """Lower-cased body: the TF-IDF preprocessor (the header goes to ShapeFeatures instead)."""
    return strip_header(rendered).lower()


SHAPE_FEATURES = (
    "is_chat", "log_turns", "has_system", "user_share", "fences", "log_chars", "log_lines",
    "code_char_ratio", "code_line_ratio", "indent_ratio", "question", "upper_ratio",
    "digit_ratio", "mean_word_len", "newline_ratio",
)


def shape_vector(rendered: str) -> list[float]:
    """Numeric conversation-shape features, each scaled to about [0, 1]."""
    match = _HEADER_RE.match(rendered)
    if match:
        kind, turns, user, assistant, system, fences = match.groups()
        turns, user, assistant, system, fences = map(int, (turns, user, assistant, system, fences))
    else:
        kind, turns, user, assistant, system, fences = "text", 1, 0, 0, 0, rendered.count("```")
    body = strip_header(rendered)
    chars = max(len(body), 1)
    lines = body.split("\n")
    n_lines = max(len(lines), 1)
    words = body.split()
    code_chars = sum(body.count(c) for c in _CODE_CHARS)
    return [
        1.0 if kind == "chat" else 0.0,
        min(math.log1p(turns) / math.log(33), 1.0),
        1.0 if system else 0.0,
        user / max(user + assistant, 1),
        min(fences / 2, 1.0),
        min(math.log1p(chars) / math.log(MAX_CHARS + 1), 1.0),
        min(math.log1p(n_lines) / math.log(101), 1.0),
        min(code_chars / chars * 4, 1.0),
        sum(1 for line in lines if _CODE_LINE_RE.match(line)) / n_lines,
        sum(1 for line in lines if line.startswith(("    ", "\t"))) / n_lines,
        1.0 if "?" in body else 0.0,
        min(sum(map(str.isupper, body)) / chars * 5, 1.0),
        min(sum(map(str.isdigit, body)) / chars * 5, 1.0),
        min(sum(map(len, words)) / max(len(words), 1) / 12, 1.0),
        min(n_lines / chars * 20, 1.0),
    ]


class ShapeFeatures(TransformerMixin, BaseEstimator):
    """scikit-learn transformer: rendered strings -> (n, len(SHAPE_FEATURES)) float array."""

    def __init__(self, weight: float = 1.0):
        self.weight = weight

    def fit(self, X, y=None):
        self.n_features_out_ = len(SHAPE_FEATURES)
        return self

    def transform(self, X):
        # (n, F)
        return np.asarray([shape_vector(x) for x in X], dtype=np.float64) * self.weight

    def get_feature_names_out(self, input_features=None):
        return np.asarray([f"shape__{name}" for name in SHAPE_FEATURES], dtype=object)


class CompactTfidfVectorizer(TfidfVectorizer):
    """TfidfVectorizer whose saved state keeps the vocabulary as one newline-joined string.

    skops writes a dict entry by entry (about 800 bytes each); a 50k-term vocabulary would make a
    50 MB file. Terms never contain a newline (word tokens and char_wb n-grams have no newlines).
    """

    def __getstate__(self):
        state = dict(super().__getstate__())  # a copy: the base returns the live __dict__
        state.pop("stop_words_", None)
        vocabulary = state.pop("vocabulary_", None)
        if vocabulary is not None:
            terms = [""] * len(vocabulary)
            for term, index in vocabulary.items():
                terms[index] = term
            state["terms_"] = "\n".join(terms)
        return state

    def __setstate__(self, state):
        state = dict(state)
        terms = state.pop("terms_", None)
        super().__setstate__(state)
        if terms is not None:
            self.vocabulary_ = {term: index for index, term in enumerate(terms.split("\n"))}

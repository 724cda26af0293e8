"""TextStream: deltas add up to the text, stop strings cut it and never leak in part."""

from __future__ import annotations

import pytest

from engine.text import TextStream


class ByteTokenizer:
    """Token id = one byte; decoding an incomplete UTF-8 sequence gives U+FFFD, as real tokenizers do."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def _push_all(stream: TextStream, ids: list[int], chunk: int = 1) -> list[str]:
    return [stream.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk)] + [stream.flush()]


@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_deltas_add_up_and_hold_back_partial_characters(chunk):
    text = "héllo wörld ✓ done"
    ids = list(text.encode())
    stream = TextStream(ByteTokenizer())
    deltas = _push_all(stream, ids, chunk)
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


@pytest.mark.parametrize("chunk", [1, 3, 7])
@pytest.mark.parametrize(
    "text, stop, expected",
    [
        ("abc STOP def", ("STOP",), "abc "),
        ("abc STO STOP", ("STOP",), "abc STO "),  # a false start, released once it cannot match
        ("aXYb XYZ", ("XYZ", "b X"), "aXY"),  # the earliest of several stop strings wins
        ("no stop here", ("STOP",), "no stop here"),
        ("STOP at once", ("STOP",), ""),
        ("ends with ST", ("STOP",), "ends with ST"),  # a partial stop string at the end is real text
    ],
)
def test_stop_strings_cut_text_and_never_leak(text, stop, expected, chunk):
    stream = TextStream(ByteTokenizer(), stop)
    ids = list(text.encode())
    emitted = ""
    for i in range(0, len(ids), chunk):
        emitted += stream.push(ids[i : i + chunk])
        assert expected.startswith(emitted), f"leaked {emitted!r} (final text {expected!r})"
        if stream.stopped:
            break
    emitted += stream.flush()
    assert emitted == expected
    assert stream.stopped == (expected != text)
    assert stream.push(list(b"more")) == "" or not stream.stopped


def test_word_tokenizer_stream(tiny):
    tok = tiny.make_tokenizer(32)
    ids = [5, 6, 7, 5, 8, 9]
    stream = TextStream(tok, ("w5 w8",))
    deltas = _push_all(stream, ids)
    assert "".join(deltas) == "w5 w6 w7 "
    assert stream.stopped


class CountingTokenizer(ByteTokenizer):
    def __init__(self) -> None:
        self.longest = 0

    def decode(self, ids, skip_special_tokens=True):
        self.longest = max(self.longest, len(ids))
        return super().decode(ids, skip_special_tokens)


def test_each_push_decodes_a_short_window_not_the_whole_output():
    """A long output costs linear time: each push decodes the last few tokens, not everything so far."""
    tok = CountingTokenizer()
    stream = TextStream(tok, ("STOP",))
    text = "ü → x " * 400  # multi-byte characters throughout, 4,000 bytes
    deltas = _push_all(stream, list(text.encode()), 1)
    assert "".join(deltas) == text
    assert tok.longest <= 8


@pytest.mark.parametrize("chunk", [1, 3])
def test_real_tokenizer_deltas_add_up_to_its_decode(chunk):
    from transformers import AutoTokenizer

    from engine.loading import resolve_model_dir

    tok = AutoTokenizer.from_pretrained(resolve_model_dir("default"))
    text = "def f(x):\n    return x  # ünïcode 🙂 中文 テスト\n\n  spaced   out\tand Ω done."
    ids = tok(text, add_special_tokens=False).input_ids
    stream = TextStream(tok)
    deltas = _push_all(stream, ids, chunk)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True)
    assert all("\ufffd" not in d for d in deltas)

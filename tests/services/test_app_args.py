"""The app's arguments (serve config `args`): validated before anything loads."""

import pydantic
import pytest

from services.config import AppArgs


def test_torch_threads_is_optional_and_positive():
    assert AppArgs(torch_threads=2).torch_threads == 2 and AppArgs().torch_threads is None
    with pytest.raises(pydantic.ValidationError):
        AppArgs(torch_threads=0)


def test_draft_confidence_and_graph_warmup_are_validated():
    assert AppArgs().draft_confidence == 0.0 and AppArgs(draft_confidence=0.3).draft_confidence == 0.3
    assert AppArgs().graph_warmup_tokens == 256 and AppArgs(graph_warmup_tokens=0).graph_warmup_tokens == 0
    for bad in ({"draft_confidence": 1.0}, {"draft_confidence": -0.1}, {"graph_warmup_tokens": -1}):
        with pytest.raises(pydantic.ValidationError):
            AppArgs(**bad)

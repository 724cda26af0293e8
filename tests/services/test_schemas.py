"""Request bodies: what parse_body accepts, and the OpenAI fields the server does not implement."""

from __future__ import annotations

import json

import pytest

from services.schemas import UNSUPPORTED, APIError, ChatCompletionRequest, CompletionRequest, parse_body

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def _parse(body: dict, schema=ChatCompletionRequest):
    return parse_body(json.dumps(body).encode(), schema)


@pytest.mark.parametrize("field, value", [
    ("logprobs", True), ("top_logprobs", 3), ("presence_penalty", 0.5), ("frequency_penalty", -1.0),
    ("logit_bias", {"50256": -100}), ("tools", [{"type": "function", "function": {"name": "f"}}]),
    ("functions", [{"name": "f"}]), ("response_format", {"type": "json_object"}),
])
def test_a_chat_field_the_server_does_not_implement_is_refused_by_name(field, value):
    with pytest.raises(APIError) as caught:
        _parse({**CHAT, field: value})
    error = caught.value
    assert error.status == 400 and error.code == "unsupported_parameter" and error.param == field
    assert error.message.startswith(f"unsupported parameter {field}=") and "leave" in error.message  # and the fix


@pytest.mark.parametrize("field, value", [("best_of", 3), ("echo", True), ("suffix", "}\n"), ("logprobs", 2)])
def test_a_completion_field_the_server_does_not_implement_is_refused(field, value):
    with pytest.raises(APIError) as caught:
        _parse({"prompt": "def f(", field: value}, CompletionRequest)
    assert caught.value.status == 400 and caught.value.param == field


def test_those_fields_at_their_defaults_pass_as_clients_send_them():
    defaults = {"logprobs": False, "top_logprobs": None, "presence_penalty": 0, "frequency_penalty": 0.0,
                "logit_bias": {}, "tools": [], "functions": None, "response_format": {"type": "text"}, "n": 1,
                "best_of": 1, "echo": False, "suffix": "", "parallel_tool_calls": True, "metadata": {"a": "b"}}
    assert set(UNSUPPORTED) <= set(defaults)  # every refused field has a default that passes
    assert _parse({**CHAT, **defaults, "temperature": 0}).temperature == 0
    assert _parse({"prompt": "x", **defaults}, CompletionRequest).prompt == "x"


def test_a_refusal_comes_before_field_validation_and_names_the_first_field():
    with pytest.raises(APIError) as caught:  # also an invalid temperature: the unsupported field is named first
        _parse({**CHAT, "temperature": 9, "frequency_penalty": 1, "logprobs": True})
    assert caught.value.param == "logprobs"
    with pytest.raises(APIError) as caught:
        _parse({**CHAT, "temperature": 9})
    assert caught.value.status == 422 and caught.value.param == "temperature"

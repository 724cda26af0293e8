"""OpenAI request schemas (the fields this server reads) and the OpenAI error shape."""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

Role = Literal["system", "developer", "user", "assistant", "tool"]


class APIError(Exception):
    """An error answered as {"error": {"message", "type", "param", "code"}} with an HTTP status."""

    TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 403: "permission_error", 404: "not_found_error",
             422: "invalid_request_error", 429: "rate_limit_error", 500: "server_error", 503: "server_error"}

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None,
                 error_type: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.error_type = error_type or self.TYPES.get(status, "server_error")
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}


MAX_CHOICES = 16  # `n`: each choice is a request of its own in the Generator's batch


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Role = Field(description="Author of the message.")
    content: str | list[dict] | None = Field(None, description="Text, or a list of content parts ({type: text, text}).")


class SamplingFields(BaseModel):
    """Fields shared by chat and completion requests. OpenAI fields this server does not implement are refused
    when they ask for something (`UNSUPPORTED`, checked by `parse_body`); other unknown fields are ignored."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(None, description="Any value is accepted; the server has one target model.")
    max_tokens: int | None = Field(None, ge=1, description="Tokens to generate at most.")
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="0 = greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = Field(0, ge=0, description="Extra field: keep the k most likely tokens (0 = off).")
    n: int = Field(1, ge=1, le=MAX_CHOICES, description="Choices per request, generated side by side (with `seed`: "
                   "choice i samples with seed + i, so choice 0 is what n=1 gives).")
    stop: str | list[str] | None = Field(None, description="Up to 4 stop strings.")
    seed: int | None = Field(None, description="Seed for sampling; the same seed gives the same output.")
    stream: bool = Field(False, description="Server-sent events, ending with `data: [DONE]`.")
    stream_options: dict | None = Field(None, description="Accepted; usage is always in the last chunk.")
    user: str | None = Field(None, description="End-user id (logged only).")
    speculation: bool = Field(True, description="Extra field: false runs without a draft.")
    domain: str | None = Field(None, description="Extra field: choose the draft domain (if the tenant may).")

    @field_validator("stop")
    @classmethod
    def _stops(cls, value):
        items = [value] if isinstance(value, str) else value or []
        if len(items) > 4:
            raise ValueError("at most 4 stop strings")
        if any(not s for s in items):
            raise ValueError("stop strings must be non-empty")
        return value


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, description="The conversation so far.")
    max_completion_tokens: int | None = Field(None, ge=1, description="Alias of max_tokens (newer clients).")


class CompletionRequest(SamplingFields):
    prompt: str | list[str] = Field(description="The prompt (a string, or a list with one string).")

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value):
        if isinstance(value, list):
            if len(value) != 1:
                raise ValueError("give one prompt per request (a string or a list of one string)")
            value = value[0]
        if not value:
            raise ValueError("the prompt is empty")
        return value


class AdminDraftRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    domain: Literal["code", "general", "dialog"] = Field(description="The domain whose draft to switch.")
    version: str = Field(min_length=1, description="The draft version to activate ('latest' = newest in the store).")


def _off(value) -> bool:
    """A field left at a value that changes nothing: absent, null, false, 0, empty."""
    return value is None or value is False or value == 0 or value in ("", [], {})


# OpenAI fields this server does not implement, each with the values that would ask for something it does not do
# (anything but `_off`, unless a test of its own is given) and what to do instead. A request setting one is
# refused (400 `unsupported_parameter`) rather than answered as if the field were not there: ignoring
# `presence_penalty` or `logit_bias` would change what the caller asked for without a word. Fields left at their
# defaults (as some clients send them: `"logprobs": false, "presence_penalty": 0`) pass; other unknown fields are
# ignored.
UNSUPPORTED: dict[str, tuple[str, object]] = {
    "logprobs": ("token log-probabilities are not returned by this server; leave logprobs unset", None),
    "top_logprobs": ("token log-probabilities are not returned by this server; leave top_logprobs unset", None),
    "presence_penalty": ("repetition penalties are not applied by this server; leave presence_penalty at 0", None),
    "frequency_penalty": ("repetition penalties are not applied by this server; leave frequency_penalty at 0", None),
    "logit_bias": ("logit_bias is not applied by this server; leave it unset", None),
    "tools": ("tool calling is not supported; leave tools unset", None),
    "functions": ("function calling is not supported; leave functions unset", None),
    "response_format": ("only plain text responses are supported; leave response_format unset or {\"type\": \"text\"}",
                        lambda v: _off(v) or (isinstance(v, dict) and v.get("type") == "text")),
    "best_of": ("best_of is not supported; ask for n choices instead (leave best_of at 1)",
                lambda v: _off(v) or v == 1),
    "echo": ("echo is not supported; prepend the prompt yourself", None),
    "suffix": ("suffix (insertion) is not supported; leave it unset", None),
}


def check_supported(data: dict) -> None:
    """APIError 400 for the first field of `UNSUPPORTED` that asks for something this server does not do."""
    for name, (message, allowed) in UNSUPPORTED.items():
        if name in data and not (allowed or _off)(data[name]):
            raise APIError(400, f"unsupported parameter {name}={json.dumps(data[name])[:80]}: {message}",
                           "unsupported_parameter", name)


def parse_body(raw: bytes, schema: type[BaseModel]) -> BaseModel:
    """Bytes -> validated model, or APIError 400 (not UTF-8, not JSON, a field the server does not implement
    asking for something: `UNSUPPORTED`) / 422 (fields)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(400, f"the request body is not UTF-8 text (bad byte at offset {exc.start}); "
                            "send JSON encoded as UTF-8", "invalid_encoding") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}",
                       "invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}", "invalid_json")
    if issubclass(schema, SamplingFields):
        check_supported(data)
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or None
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg'].removeprefix('Value error, ')}"
                             for e in exc.errors()[:5])
        raise APIError(422, f"invalid request: {problems}", "validation_error", field) from None

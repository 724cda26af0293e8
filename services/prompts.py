"""Request text -> prompt token ids, the same way for the API and for offline comparison."""

from __future__ import annotations


def message_text(content) -> str:
    """OpenAI message content (a string or a list of parts) -> text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, dict) and part.get("type") == "text")


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Chat messages rendered by the model's chat template, with the assistant turn opened."""
    plain = [{"role": m["role"], "content": message_text(m.get("content"))} for m in messages]
    text = tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def completion_prompt_ids(tokenizer, prompt: str) -> list[int]:
    return list(tokenizer(prompt)["input_ids"])

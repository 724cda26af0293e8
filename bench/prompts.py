"""Held-out benchmark prompts per domain: the built corpora's test split, or a small built-in set."""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

# Used only when `flashspec data build` has not been run: a few requests per domain, so the
# benchmarks still run on a fresh machine. Figures recorded in RESULTS.md say which set they used.
BUILTIN = {
    "code": [
        "Write a Python function that parses an ISO 8601 date string and returns a datetime object.",
        "Complete this code:\n```python\ndef merge_sorted(a, b):\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n",
        "Explain what this function does:\n```python\ndef f(xs):\n    return {x: xs.count(x) for x in set(xs)}\n```",
        "Write a Python class implementing a least-recently-used cache with get and put methods.",
    ],
    "general": [
        "Explain how Python's garbage collector handles reference cycles.",
        "Summarize the main differences between threads and processes.",
        "What is a context manager, and when should I write one?",
        "Describe how the import system finds a module.",
    ],
    "dialog": [
        "hey! how was your weekend?",
        "I just got back from a trip to the mountains, it was amazing",
        "do you have any pets? I'm thinking about getting a dog",
        "what kind of music do you like to listen to when you study?",
    ],
}


def held_out_prompts(tokenizer, domain: str, n: int, split: str = "test") -> tuple[list[list[int]], str]:
    """(token ids of n chat-formatted prompts, description of their source)."""
    try:
        from training.corpora import load_domain

        ds = load_domain(domain, split)
        rows = sorted(ds.select(range(min(len(ds), 4 * n)))["prompt"], key=len)[:n]  # the shortest of 4n
        ids = [tokenizer(p, add_special_tokens=False).input_ids for p in rows]
        return ids, f"{domain} {split} split of the built corpora ({len(ids)} prompts)"
    except Exception as exc:  # noqa: BLE001 - data not built / datasets missing: fall back, say so
        log.info("using built-in prompts (%s)", exc)
    prompts = (BUILTIN[domain] * ((n // len(BUILTIN[domain])) + 1))[:n]
    ids = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
           for p in prompts]
    return [tokenizer(p, add_special_tokens=False).input_ids for p in ids], f"built-in {domain} prompts ({n})"

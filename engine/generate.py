"""Offline generation on top of the decode engine: whole results, or a stream of deltas."""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Iterator

from engine.requests import Request, RequestOutput, SpecStats
from engine.sampling import SamplingParams
from engine.scheduler import DecodeEngine

_ids = itertools.count()


@dataclasses.dataclass
class GenerationResult:
    token_ids: list[int]
    text: str
    finish_reason: str | None
    prompt_tokens: int
    prefill_ms: float  # admission + prefill + first token
    decode_tokens_per_s: float  # tokens after the first over the time after the first
    stats: SpecStats | None = None
    draft: str | None = None  # what its rounds ran: its draft, or "<draft>/<alternative>" (None: no round)

    def to_dict(self) -> dict:
        out = {
            "token_ids": self.token_ids,
            "text": self.text,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "prefill_ms": round(self.prefill_ms, 3),
            "decode_tokens_per_s": round(self.decode_tokens_per_s, 3),
        }
        if self.stats is not None:
            out["stats"] = self.stats.to_dict()
            out["draft"] = self.draft
        return out


def generate(engine: DecodeEngine, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None,
             draft: str | None | list[str | None] = None) -> list[GenerationResult]:
    """Generate for every prompt (batched up to the engine's batch size); results in prompt order."""
    n = len(prompts)
    params_list = params if isinstance(params, list) else [params or SamplingParams()] * n
    drafts = draft if isinstance(draft, list) else [draft] * n
    ids = [f"gen-{next(_ids)}" for _ in range(n)]
    for rid, prompt, p, d in zip(ids, prompts, params_list, drafts):
        engine.add_request(Request(rid, list(prompt), p, d))
    tokens = {rid: [] for rid in ids}
    texts = {rid: [] for rid in ids}
    finals: dict[str, RequestOutput] = {}
    started = time.perf_counter()
    first_at: dict[str, float] = {}
    end_at: dict[str, float] = {}
    while len(finals) < n:
        for out in engine.step():
            if out.request_id not in tokens:
                continue
            now = time.perf_counter()
            first_at.setdefault(out.request_id, now)
            tokens[out.request_id].extend(out.token_ids)
            texts[out.request_id].append(out.text)
            if out.finished:
                finals[out.request_id] = out
                end_at[out.request_id] = now
    engine.settle()  # an overlapped call launched for rows that have all stopped since: nothing of it is wanted
    results = []
    for rid in ids:
        out = finals[rid]
        end = end_at[rid]
        first = first_at[rid]
        rest = max(len(tokens[rid]) - 1, 0)
        rate = rest / (end - first) if end > first and rest else 0.0
        results.append(GenerationResult(tokens[rid], "".join(texts[rid]), out.finish_reason, out.prompt_tokens,
                                        (first - started) * 1000, rate, out.stats, out.draft))
    return results


def stream(engine: DecodeEngine, prompt_ids: list[int], params: SamplingParams | None = None,
           draft: str | None = None) -> Iterator[RequestOutput]:
    """Yield each step's output for one request until it finishes (other requests may share the engine)."""
    rid = f"stream-{next(_ids)}"
    engine.add_request(Request(rid, list(prompt_ids), params or SamplingParams(), draft))
    try:
        while True:
            for out in engine.step():
                if out.request_id == rid:
                    yield out
                    if out.finished:
                        return
    finally:
        engine.cancel(rid)
        engine.settle()

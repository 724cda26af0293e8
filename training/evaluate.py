"""Evaluate a draft with the real FlashSpec decoder on held-out prompts of a domain.

Greedy, gamma 5, block 2 and block gamma, batch size 1: mean accepted length, acceptance rate and
acceptance by draft position, tokens/s spec vs engine AR side by side, and the perplexity under the
target of what each produced (greedy speculative decoding is lossless, so spec and AR must match).
"""

from __future__ import annotations

import math
import random
import time
from typing import Sequence

import torch
import torch.nn.functional as F

from engine.generate import generate
from engine.model import Transformer
from engine.requests import SpecStats
from engine.sampling import SamplingParams
from engine.scheduler import DecodeEngine
from engine.speculative import SpecConfig


def held_out_prompts(domain: str, tokenizer, num_prompts: int, split: str = "validation", max_prompt_tokens: int = 512,
                     data_dir=None, seed: int = 0) -> list[list[int]]:
    """A seeded sample of a domain's held-out prompts (already chat-templated), as token ids.

    Prompts longer than max_prompt_tokens are left out (not cut: a cut prompt is another request).
    """
    from training.corpora import load_domain

    rows = load_domain(domain, split, data_dir)
    if "prompt" not in rows.column_names:
        raise ValueError(f"{domain}/{split} has no prompt column (columns: {', '.join(rows.column_names)}); rebuild the data")
    ids = tokenizer(list(rows["prompt"]), add_special_tokens=False)["input_ids"]
    fitting = [p for p in ids if 0 < len(p) <= max_prompt_tokens]
    if not fitting:
        raise ValueError(f"{domain}/{split} has no prompt of at most {max_prompt_tokens} tokens")
    random.Random(seed).shuffle(fitting)
    return fitting[:num_prompts]


@torch.no_grad()
def perplexity(model: Transformer, prompts: Sequence[list[int]], completions: Sequence[list[int]]) -> float:
    """exp(mean NLL) of the completions' tokens under the model, each given its prompt."""
    nll, count = 0.0, 0
    device = model.embed_tokens.weight.device
    for prompt, completion in zip(prompts, completions):
        if not completion:
            continue
        ids = torch.tensor([list(prompt) + list(completion)], device=device)  # (1, T)
        pos = torch.arange(ids.shape[1], device=device)[None]
        logits = model(ids, pos).logits[0, len(prompt) - 1 : -1].float()  # (n, V) predicting the completion
        nll += float(F.cross_entropy(logits, ids[0, len(prompt):], reduction="sum"))
        count += len(completion)
    return math.exp(nll / count) if count else float("nan")


def _merge(stats: Sequence[SpecStats | None]) -> SpecStats:
    total = SpecStats()
    for s in stats:
        if s is None:
            continue
        total.rounds += s.rounds
        total.verify_passes += s.verify_passes
        total.drafted += s.drafted
        total.accepted += s.accepted
        total.emitted += s.emitted
        for name, (r, t) in s.by_drafter.items():
            total.count_drafter(name, r, t)
        for i, (a, d) in enumerate(zip(s.accepted_by_position, s.drafted_by_position)):
            while len(total.drafted_by_position) <= i:
                total.drafted_by_position.append(0)
                total.accepted_by_position.append(0)
            total.accepted_by_position[i] += a
            total.drafted_by_position[i] += d
    return total


def _timed_run(engine: DecodeEngine, prompts, params, draft_name):
    generate(engine, [prompts[0]], SamplingParams(max_new_tokens=4), draft=draft_name)  # warm-up
    start = time.perf_counter()
    results = generate(engine, prompts, params, draft=draft_name)
    seconds = time.perf_counter() - start
    tokens = sum(len(r.token_ids) for r in results)
    return results, tokens / seconds if seconds > 0 else 0.0


def evaluate_draft(model: Transformer, tokenizer, draft, prompts: list[list[int]], max_new_tokens: int = 64,
                   gamma: int = 5, blocks: Sequence[int] = (2, 5), include_ar: bool = True,
                   quality: bool = True) -> dict:
    """Run AR and spec (one run per block size) at batch size 1 on the same prompts; a JSON-able report."""
    if not prompts:
        raise ValueError("no prompts to evaluate on")
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    max_seq_len = max(len(p) for p in prompts) + max_new_tokens + 8
    report: dict = {"num_prompts": len(prompts), "max_new_tokens": max_new_tokens, "gamma": gamma, "batch_size": 1,
                    "greedy": True, "draft": {"name": draft.name, "version": draft.version, "config": draft.config.to_dict()}}
    ar_results = None
    if include_ar:
        engine = DecodeEngine(model, tokenizer, max_batch_size=1, max_seq_len=max_seq_len)
        ar_results, ar_tps = _timed_run(engine, prompts, params, None)
        report["ar"] = {"tokens_per_s": round(ar_tps, 2), "tokens": sum(len(r.token_ids) for r in ar_results)}
        if quality:
            report["ar"]["perplexity"] = round(perplexity(model, prompts, [r.token_ids for r in ar_results]), 4)
        del engine
    report["spec"] = {}
    for block in blocks:
        engine = DecodeEngine(model, tokenizer, max_batch_size=1, max_seq_len=max_seq_len,
                              spec=SpecConfig(num_speculative_tokens=gamma, block_size=block))
        engine.add_draft("eval", draft)
        results, tps = _timed_run(engine, prompts, params, "eval")
        stats = _merge([r.stats for r in results]).to_dict()
        entry = {"block_size": block, "tokens_per_s": round(tps, 2), "mean_accepted_length": stats["mean_accepted_length"],
                 "acceptance_rate": stats["acceptance_rate"], "acceptance_by_position": stats["acceptance_by_position"],
                 "tokens_per_verify_pass": stats["tokens_per_verify_pass"], "rounds": stats["rounds"]}
        if ar_results is not None:
            entry["speedup_vs_ar"] = round(tps / report["ar"]["tokens_per_s"], 3) if report["ar"]["tokens_per_s"] else None
            entry["outputs_equal_ar"] = sum(r.token_ids == a.token_ids for r, a in zip(results, ar_results))
        if quality:
            entry["perplexity"] = round(perplexity(model, prompts, [r.token_ids for r in results]), 4)
        report["spec"][f"block{block}"] = entry
        del engine
    # Headline figures: one verify pass per round (block = gamma) when measured, else the first block size.
    head = report["spec"].get(f"block{gamma}") or next(iter(report["spec"].values()))
    report["mean_accepted_length"] = head["mean_accepted_length"]
    report["acceptance_rate"] = head["acceptance_rate"]
    report["acceptance_by_position"] = head["acceptance_by_position"]
    return report

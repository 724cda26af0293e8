"""Self-distillation data: the target's own replies to a domain's training prompts, cached on disk.

A draft is judged on what the target generates, so training on the target's replies (rather than
on raw documents) matches what it will face. Greedy replies are what greedy decoding meets; sampled
replies (`temperature` > 0, seeded per prompt) add more of the target's own text per prompt, which
matters when a domain has a few thousand prompts and training would otherwise repeat them many
times. Replies are generated in batches with the decode engine and cached under
`$FLASHSPEC_HOME/selfdistill/`, keyed by the target fingerprint and settings.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

from drafts.checkpoint import target_fingerprint
from engine.generate import generate
from engine.loading import flashspec_home
from engine.sampling import SamplingParams
from engine.scheduler import DecodeEngine


def cache_path(domain: str, fingerprint: str, num_prompts: int, max_new_tokens: int, max_prompt_tokens: int,
               seed: int, root: Path | None = None, temperature: float = 0.0) -> Path:
    root = root or flashspec_home() / "selfdistill"
    sampled = f"-t{temperature:g}" if temperature > 0 else ""
    return root / f"{domain}-{fingerprint[:12]}-n{num_prompts}-m{max_new_tokens}-p{max_prompt_tokens}-s{seed}{sampled}.json"


def self_distill(model, tokenizer, domain: str, rows, num_prompts: int, max_new_tokens: int = 128,
                 max_prompt_tokens: int = 384, batch_size: int = 8, seed: int = 0, cache_root: Path | None = None,
                 progress: bool = True, temperature: float = 0.0) -> dict[str, list[int]]:
    """{prompt text: the target's reply token ids} for a seeded sample of `rows` (cached).

    temperature 0: greedy replies; > 0: one sampled reply per prompt, seeded by (seed, prompt index),
    so the same call gives the same replies."""
    from tqdm.auto import tqdm

    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    path = cache_path(domain, target_fingerprint(model), num_prompts, max_new_tokens, max_prompt_tokens, seed, cache_root,
                      temperature)
    if path.is_file():
        return json.loads(path.read_text())
    prompts = list(dict.fromkeys(rows["prompt"]))
    random.Random(seed).shuffle(prompts)
    ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    chosen = [(p, i) for p, i in zip(prompts, ids) if 0 < len(i) <= max_prompt_tokens][:num_prompts]
    if not chosen:
        raise ValueError(f"no {domain} prompt has at most {max_prompt_tokens} tokens; raise max_prompt_tokens")
    # Rows finish a few at a time: admitting a quarter of the batch at once makes one prefill pass of many
    # prompts instead of one pass per step for one or two (offline work: no request waits on a user).
    # No tokenizer in the engine: replies are token ids, so no row pays for detokenizing text nobody reads.
    engine = DecodeEngine(model, None, max_batch_size=batch_size, max_seq_len=max_prompt_tokens + max_new_tokens + 8,
                          min_admit=max(1, batch_size // 4))
    def params(index: int) -> SamplingParams:
        if temperature == 0:
            return SamplingParams(max_new_tokens=max_new_tokens)
        return SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed * 1_000_003 + index)

    replies: dict[str, list[int]] = {}
    chunk = batch_size * 16  # prompts per generate call: the batch drains only at each chunk's end
    for start in tqdm(range(0, len(chosen), chunk), desc=f"self-distill {domain}", disable=not progress):
        part = chosen[start : start + chunk]
        part_params = [params(start + j) for j in range(len(part))]
        for (prompt, _), result in zip(part, generate(engine, [i for _, i in part], part_params)):
            replies[prompt] = result.token_ids
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(replies))
    os.replace(tmp, path)
    return replies


def greedy_and_sampled(model, tokenizer, domain: str, rows, num_prompts: int, sampled: int = 0,
                       temperature: float = 0.8, max_new_tokens: int = 128, batch_size: int = 8, seed: int = 0,
                       progress: bool = True, max_prompt_tokens: int = 384,
                       ) -> tuple[dict[str, list[int]], list[dict[str, list[int]]]]:
    """The greedy replies to `num_prompts` prompts, and `sampled` more sets of replies to the same prompts
    sampled at `temperature` (seeds seed + 1, seed + 2, ...): `domain_sequences(..., greedy, sampled)`."""
    if num_prompts <= 0:
        return {}, []  # raw text only
    kw = dict(max_new_tokens=max_new_tokens, batch_size=batch_size, progress=progress, max_prompt_tokens=max_prompt_tokens)
    greedy = self_distill(model, tokenizer, domain, rows, num_prompts, seed=seed, **kw)
    more = [self_distill(model, tokenizer, domain, rows, num_prompts, seed=seed + 1 + i, temperature=temperature, **kw)
            for i in range(sampled)]
    return greedy, more

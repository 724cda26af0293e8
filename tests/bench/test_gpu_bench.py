"""bench.gpu's fp32 check: every greedy token against the fp32 model's argmax given the same prefix."""

from __future__ import annotations

import torch

from bench.gpu import fp32_agreement
from engine.generate import generate
from engine.sampling import SamplingParams
from engine.scheduler import DecodeEngine


def test_greedy_outputs_agree_everywhere_and_a_changed_token_is_one_miss_with_its_gap(tiny_target):
    model = tiny_target.model
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    engine = DecodeEngine(model, None, max_batch_size=2, max_seq_len=64)
    outs = [r.token_ids for r in generate(engine, prompts, SamplingParams(max_new_tokens=12, eos_token_ids=()))]
    same = fp32_agreement(model, prompts, outs)
    assert same["fp32_agreement"] == 1.0 and same["fp32_misses"] == 0 and same["fp32_gap_max"] is None

    changed = [list(o) for o in outs]
    x = torch.tensor([prompts[1] + outs[1][:5]])
    logits = model(x, torch.arange(x.shape[1])[None]).logits[0, -1]
    changed[1][5] = int(logits.argsort()[-2])  # the runner-up at position 5, then the rest as before
    report = fp32_agreement(model, prompts, changed)
    gap = float(logits.max() - logits.sort().values[-2])
    assert report["fp32_misses"] >= 1 and report["fp32_agreement"] <= 1 - 1 / 24
    assert report["fp32_gap_max"] >= gap - 1e-5 > 0  # the changed token is one of the misses, with its gap

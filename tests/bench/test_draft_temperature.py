"""bench.draft_temperature: the first draft position's expected acceptance, sum_x min(p, q_tau)."""

from __future__ import annotations

import pytest
import torch

from bench.draft_temperature import expected_acceptance, first_position_stats
from drafts.config import DraftConfig
from drafts.model import DraftModel


def test_an_exact_draft_is_always_accepted_at_its_own_temperature_only(tiny):
    target = tiny.tiny_vocab_target(8, num_layers=3, seed=7)
    exact = DraftModel(target, DraftConfig(shared_layers=1, adapter_layers=2, head="mlp_tied"))
    exact.init_from_target()  # an early exit after all 3 layers: the target itself
    seqs = [torch.randint(0, 8, (12,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(3)]
    got = expected_acceptance(target, exact, seqs, [4, 6, 9], taus=(0.5, 1.0, 2.0))
    assert got[1.0] == pytest.approx(1.0, abs=1e-5)
    assert got[0.5] < 0.999 and got[2.0] < 0.999  # sharper or flatter than the target: rejected sometimes
    # A draft that scores 3 of the 8 tokens can only be accepted on those: at most their target mass.
    sub = DraftModel(target, DraftConfig(shared_layers=1, adapter_layers=2, head="mlp_tied", head_vocab=3))
    sub.init_from_target()
    sub.set_vocab(torch.tensor([5, 0, 2]))
    pos = torch.arange(12)[None]
    mass = [torch.softmax(target(torch.tensor([s]), pos).logits[0, st - 1:-1], -1)[:, [5, 0, 2]].sum(-1)
            for s, st in zip(seqs, [4, 6, 9])]
    bound = torch.cat(mass).mean().item()
    assert 0 < expected_acceptance(target, sub, seqs, [4, 6, 9], taus=(1.0,))[1.0] <= bound + 1e-6
    # ... which is what the ceiling reports: that mass, and all of it for a full-vocabulary head.
    assert first_position_stats(target, sub, seqs, [4, 6, 9], taus=(1.0,))[1] == pytest.approx(bound, abs=1e-6)
    assert first_position_stats(target, exact, seqs, [4, 6, 9], taus=(1.0,))[1] == pytest.approx(1.0, abs=1e-6)

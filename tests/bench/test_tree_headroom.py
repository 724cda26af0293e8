"""bench.tree_headroom: how often the target's greedy token is among the draft's top k at the first position."""

from __future__ import annotations

import pytest
import torch

from bench.tree_headroom import top_k_coverage
from drafts.config import DraftConfig
from drafts.model import DraftModel


def test_top_k_coverage_is_exact_for_the_target_itself_and_grows_with_k(tiny):
    target = tiny.tiny_vocab_target(8, num_layers=3, seed=7)
    seqs = [torch.randint(0, 8, (12,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(3)]
    starts = [4, 6, 9]
    exact = DraftModel(target, DraftConfig(shared_layers=1, adapter_layers=2, head="mlp_tied"))
    exact.init_from_target()  # an early exit after all 3 layers: the target itself
    assert top_k_coverage(target, exact, seqs, starts, (1, 2)) == {1: 1.0, 2: 1.0}
    # An untrained early exit after 1 layer: covered more often as k grows, always with all 8 tokens.
    rough = DraftModel(target, DraftConfig(shared_layers=1, adapter_layers=0, head="mlp_tied"))
    rough.init_from_target()
    got = top_k_coverage(target, rough, seqs, starts, (1, 2, 4, 8))
    assert got[1] < 1.0 and got[1] <= got[2] <= got[4] <= got[8] == 1.0
    # A sub-vocabulary never covers a token outside it: the target's argmaxes kept out, never found.
    pos = torch.arange(12)[None]
    wanted = {int(t) for s, st in zip(seqs, starts) for t in target(torch.tensor([s]), pos).logits[0, st - 1:-1].argmax(-1)}
    outside = [t for t in range(8) if t not in wanted]
    assert outside  # these seeds leave one token out
    sub = DraftModel(target, DraftConfig(shared_layers=1, adapter_layers=2, head="mlp_tied", head_vocab=2))
    sub.init_from_target()
    sub.set_vocab(torch.tensor([outside[0], outside[0]]))
    assert top_k_coverage(target, sub, seqs, starts, (1, 4)) == {1: 0.0, 4: 0.0}
    sub.set_vocab(torch.tensor([sorted(wanted)[0], outside[0]]))  # one token the target does want: covered sometimes
    assert 0.0 < top_k_coverage(target, sub, seqs, starts, (2,))[2] < 1.0
    with pytest.raises(SystemExit, match="--ks"):
        from bench.tree_headroom import main

        main(["--ks", "0"])


def test_a_simulated_chain_plays_the_engine_s_rounds_and_a_wider_tree_accepts_more(tiny):
    from bench.draft_temperature import target_replies
    from bench.tree_headroom import engine_chain_rounds, simulate_tree_rounds

    target = tiny.tiny_vocab_target(8, num_layers=3, seed=7)
    draft = DraftModel(target, DraftConfig(shared_layers=1, adapter_layers=1, head="mlp_tied", feature_input="deep"))
    draft.init_from_target()
    with torch.no_grad():  # the target's features matter: not an early exit any more
        draft.fuse.weight.add_(0.3 * torch.randn(draft.fuse.weight.shape, generator=torch.Generator().manual_seed(1)))
    prompts = [[1, 2, 3], [4, 0, 6, 2, 5], [7, 7, 1, 3]]
    seqs = target_replies(target, None, prompts, 30)
    starts = [len(p) for p in prompts]
    chain = simulate_tree_rounds(target, draft, seqs, starts, (1, 1, 1, 1, 1))
    assert chain["tokens"] == 3 * 29 and chain["nodes_per_round"] == 5
    assert chain["rounds"] == engine_chain_rounds(target, None, draft, prompts, 30, 5)  # the engine's own rounds
    assert 1.0 < chain["tokens_per_round"] < 6.0
    # Every token of the vocabulary at the first position: each round accepts at least one drafted token.
    wide = simulate_tree_rounds(target, draft, seqs, starts, (8, 1, 1, 1, 1))
    assert wide["nodes_per_round"] == 40 and wide["tokens_per_round"] > chain["tokens_per_round"]
    assert wide["rounds"] <= -(-29 // 2) * 3  # at least 2 tokens a round (a request's last round may be cut)
    assert wide["survival"][0] == 1.0 > chain["survival"][0]
    assert all(a >= b for a, b in zip(chain["survival"], chain["survival"][1:])) and len(chain["survival"]) == 5
    # The engine's draft trees (engine/tree.py) play the simulated rounds of "width,1,1,1,1" too.
    three = simulate_tree_rounds(target, draft, seqs, starts, (3, 1, 1, 1, 1))
    assert three["rounds"] == engine_chain_rounds(target, None, draft, prompts, 30, 5, width=3)
    # The exact draft (an early exit after all the target's layers) accepts whole chains.
    exact = DraftModel(target, DraftConfig(shared_layers=1, adapter_layers=2, head="mlp_tied"))
    exact.init_from_target()
    assert simulate_tree_rounds(target, exact, seqs, starts, (1, 1, 1))["rounds"] == 3 * -(-29 // 4)

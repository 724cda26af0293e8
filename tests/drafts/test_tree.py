"""Draft trees (engine/tree.py): the layout and mask, the branch choice, and greedy output equal to plain decoding."""

from __future__ import annotations

import pytest
import torch

from engine.cache import KVCache, visibility_mask
from engine.generate import generate
from engine.sampling import SamplingParams
from engine.scheduler import DecodeEngine
from engine.speculative import SpecConfig
from engine.tree import accept_tree, tree_layout, tree_mask
from tests.drafts.test_speculative import (LENGTHS, _sub_vocab, ar_greedy, layered, noisy, oracle, prompts_for,  # noqa: F401
                                           random_draft, small, spec_generate)


@pytest.fixture(scope="module")
def target(tiny_target):
    return tiny_target.model


def test_layout_and_mask_of_a_width_3_depth_2_tree():
    pos0 = torch.tensor([4])
    slots, positions = tree_layout(pos0, 3, 2)
    assert slots.tolist() == [[4, 5, 6, 7, 8, 9, 10]]
    assert positions.tolist() == [[4, 5, 5, 5, 6, 6, 6]]
    mask = tree_mask(pos0, 3, 2, 12)[0, 0].int()
    prefix = [1] * 5
    assert mask.tolist() == [
        prefix + [0, 0, 0, 0, 0, 0, 0],  # the root: the prefix and itself
        prefix + [1, 0, 0, 0, 0, 0, 0],  # branch 0, depth 1
        prefix + [0, 1, 0, 0, 0, 0, 0],
        prefix + [0, 0, 1, 0, 0, 0, 0],
        prefix + [1, 0, 0, 1, 0, 0, 0],  # branch 0, depth 2: its parent and itself
        prefix + [0, 1, 0, 0, 1, 0, 0],
        prefix + [0, 0, 1, 0, 0, 1, 0],
    ]


def test_a_width_1_tree_is_the_chain():
    pos0 = torch.tensor([3, 9])
    slots, positions = tree_layout(pos0, 1, 5)
    assert torch.equal(slots, positions)
    assert torch.equal(tree_mask(pos0, 1, 5, 20), visibility_mask(positions, 20))


def test_accept_tree_keeps_the_longest_branch_and_the_targets_next_token():
    # width 2, gamma 3; slot order: depth 1 (b0, b1), depth 2 (b0, b1), depth 3 (b0, b1)
    drafted = torch.tensor([[10, 20, 11, 21, 12, 22],
                            [10, 20, 11, 21, 12, 22],
                            [10, 20, 11, 21, 12, 22]])
    target = torch.tensor([
        [20, 99, 21, 99, 77, 99, 99],  # root -> 20 (b1); b1d1 -> 21; b1d2 -> 77: b1 accepts 2, next 77
        [10, 11, 99, 12, 99, 55, 99],  # b0 accepts all 3; next token = target at b0d3 = 55
        [30, 99, 99, 99, 99, 99, 99],  # nothing: next token is the root's 30
    ])
    num, branch, path, nxt = accept_tree(drafted, target, 2, 3)
    assert num.tolist() == [2, 3, 0]
    assert branch.tolist() == [1, 0, 0]
    assert path.tolist() == [[20, 21, 22], [10, 11, 12], [10, 11, 12]]
    assert nxt.tolist() == [77, 55, 30]


def test_cache_move_copies_every_layer_and_reads_before_writing():
    cache = KVCache(3, 2, 2, 10, 4)
    cache.storage.copy_(torch.randn(cache.storage.shape))
    before = cache.storage.clone()
    cache.move(torch.tensor([1]), torch.tensor([[3, 5, 7]]), torch.tensor([[2, 3, 4]]))  # slot 3 is read and written
    assert torch.equal(cache.storage[:, :, 1, :, [2, 3, 4]], before[:, :, 1, :, [3, 5, 7]])
    assert torch.equal(cache.storage[:, :, 0], before[:, :, 0])
    assert torch.equal(cache.k[2][1, :, 4], before[0, 2, 1, :, 7])  # the per-layer views see it


DRAFTS = {
    "partial": lambda t: noisy(oracle(t), 0.5),
    "random": lambda t: random_draft(t, adapter_layers=2),
    "deep-partial": lambda t: noisy(oracle(t, deep=True), 0.5),
    "feature-layers": lambda t: layered(t, (2,)),
    "head_vocab": lambda t: _sub_vocab(noisy(oracle(t, head_vocab=48), 0.3)),
}


@pytest.mark.parametrize("graphs", [False, "emulate"], ids=["eager", "graph-path"])
@pytest.mark.parametrize("kind", list(DRAFTS))
@pytest.mark.parametrize("width, gamma", [(2, 3), (4, 5)])
def test_greedy_tree_rounds_equal_plain_decoding(target, kind, width, gamma, graphs):
    spec = SpecConfig(gamma, gamma, tree_width=width, tree_max_batch=4)
    results = spec_generate(target, DRAFTS[kind](target), spec, cuda_graphs=graphs)
    assert [r.token_ids for r in results] == ar_greedy(target)
    for r in results:
        assert r.stats.verify_passes == r.stats.rounds  # one verify pass a round


def test_a_tree_accepts_more_a_round_than_the_chain(target):
    """With a draft that is often right but not always, the tree's second and further first tokens win rounds
    the chain loses: more accepted tokens per round, for the same output."""
    def per_round(spec):
        results = spec_generate(target, noisy(oracle(target), 0.8), spec, new=60)
        assert [r.token_ids for r in results] == ar_greedy(target, new=60)
        return sum(r.stats.accepted for r in results) / sum(r.stats.rounds for r in results)

    chain = per_round(SpecConfig(5, 5))
    tree = per_round(SpecConfig(5, 5, tree_width=4, tree_max_batch=4))
    assert tree > 1.1 * chain, (chain, tree)


def test_the_oracle_accepts_every_token_of_its_first_branch(target):
    results = spec_generate(target, oracle(target), SpecConfig(5, 2, tree_width=3), lengths=(17,))
    assert results[0].token_ids == ar_greedy(target, (17,))[0]
    assert results[0].stats.acceptance_rate == 1.0


def test_a_tree_without_moving_the_kept_branch_is_caught(target, monkeypatch):
    """The check above fails when the kept branch's KV stays at its tree slots (the next round would read the
    wrong keys): the tests can tell."""
    monkeypatch.setattr(KVCache, "move", lambda self, rows, src, dst: None)
    results = spec_generate(target, noisy(oracle(target), 0.5), SpecConfig(5, 5, tree_width=3, tree_max_batch=4))
    assert [r.token_ids for r in results] != ar_greedy(target)


def test_wider_batches_and_seeded_sampled_rows_keep_the_chain(target, monkeypatch):
    import engine.tree as tree

    calls = []
    real = tree.launch_tree_round
    monkeypatch.setattr(tree, "launch_tree_round", lambda *a, **k: calls.append(len(a[1])) or real(*a, **k))
    spec = SpecConfig(3, 3, tree_width=3, tree_max_batch=2)
    results = spec_generate(target, noisy(oracle(target), 0.5), spec, lengths=(5, 17, 2))
    assert [r.token_ids for r in results] == ar_greedy(target, (5, 17, 2))
    assert max(calls) == 2  # 3 rows take the chain; once a row finishes, the other two make trees
    calls.clear()
    sampled = SamplingParams(max_new_tokens=10, temperature=0.8, seed=1)
    spec_generate(target, noisy(oracle(target), 0.5), spec, lengths=(5,), params=sampled)
    assert calls == []
    spec_generate(target, noisy(oracle(target), 0.5), spec, lengths=(5,), new=10)
    assert calls and set(calls) == {1}


def test_overlapped_tree_rounds_give_the_same_tokens(target):
    eng = DecodeEngine(target, None, max_batch_size=1, max_seq_len=128, cuda_graphs="emulate", overlap=True,
                       spec=SpecConfig(4, 4, tree_width=3))
    eng.add_draft("d", noisy(oracle(target), 0.5))
    out = generate(eng, prompts_for(target.args.vocab_size, (17,)), SamplingParams(max_new_tokens=40, eos_token_ids=()),
                   draft=["d"])
    assert out[0].token_ids == ar_greedy(target, (17,), 40)[0]


def test_tree_config_is_checked(target):
    from engine.gamma import GammaController

    with pytest.raises(ValueError, match="exceed the engine's tree_width"):
        DecodeEngine(target, None, spec=SpecConfig(4, 4, tree_width=2), gamma=GammaController(4, widths=(1, 3)))
    with pytest.raises(ValueError, match="tree_width"):
        SpecConfig(tree_width=0)
    with pytest.raises(ValueError, match="tree_max_batch"):
        SpecConfig(tree_max_batch=0)


def test_the_adaptive_controller_picks_chain_or_tree_per_round(target, monkeypatch):
    """With the gamma controller each round takes a (gamma, width) arm: both widths run, output stays plain
    decoding's, and warm-up runs every arm a batch-1 greedy round may take."""
    from engine.gamma import GammaController
    import engine.tree as tree

    ctl = GammaController(4, min_rounds=1, explore_every=2)
    eng = DecodeEngine(target, None, max_batch_size=2, max_seq_len=128, cuda_graphs="emulate", gamma=ctl,
                       spec=SpecConfig(4, 4, tree_width=3))
    assert ctl.widths == (1, 3)
    eng.add_draft("d", noisy(oracle(target), 0.5))
    widths = []
    real = tree.launch_tree_round
    monkeypatch.setattr(tree, "launch_tree_round", lambda *a, **k: widths.append((a[3], a[4])) or real(*a, **k))
    eng.warmup(max_len=24, prompt_len=8, sampling=("greedy", "sampled"))
    assert set(widths) == {(g, 3) for g in range(1, 5)}  # batch 1, greedy: each gamma as a tree (batch 2: chains)
    out = generate(eng, prompts_for(target.args.vocab_size, (17,)), SamplingParams(max_new_tokens=60, eos_token_ids=()),
                   draft=["d"])
    assert out[0].token_ids == ar_greedy(target, (17,), 60)[0]
    assert set(ctl.chosen_widths) == {1, 3}


# ----- sampled trees -------------------------------------------------------------------------------


def test_sampled_tree_acceptance_keeps_the_target_distribution():
    """accept_tree_sampled alone, one position (gamma 1), every candidate count: over many draws the emitted
    token's frequencies are the target's, whatever the draft's distribution."""
    from engine.tree import accept_tree_sampled

    gen = torch.Generator().manual_seed(0)
    vocab, n = 6, 200_000
    p = torch.softmax(torch.randn(vocab, generator=gen) * 1.5, -1)
    q = torch.softmax(torch.randn(vocab, generator=gen) * 1.5, -1)
    for width in (1, 2, 3):
        cand = torch.multinomial(q, n * width, replacement=True, generator=gen).view(n, width)
        target = torch.cat([p[None].expand(1 + width, vocab)])[None].expand(n, -1, -1)
        draws = torch.rand(n, width + 1, generator=gen)
        num, branch, path, nxt = accept_tree_sampled(cand, q[None, None].expand(n, 1, vocab), target, width, 1, draws)
        emitted = torch.where(num > 0, path[:, 0], nxt)
        freq = torch.bincount(emitted, minlength=vocab).float() / n
        assert (freq - p).abs().sum() / 2 < 0.006, (width, freq, p)
        accept = (num > 0).float().mean().item()
        if width == 1:
            single = accept
        else:
            assert accept > single + 0.03  # more candidates, more first tokens accepted


def tree_sampled_tokens(model, draft, temperature, top_p, n, width, spec_kw=None, batch=500, **engine_kw):
    """The first K tokens of n unseeded sampled requests (torch's global seed fixes their streams), every round
    a tree of `width` (tree_max_batch covers the batch)."""
    from tests.drafts.test_speculative import K, PROMPT

    torch.manual_seed(1234)
    spec = SpecConfig(3, 3, tree_width=width, tree_max_batch=batch, **(spec_kw or {}))
    eng = DecodeEngine(model, None, max_batch_size=batch, max_seq_len=32, spec=spec, **engine_kw)
    eng.add_draft("d", draft)
    params = SamplingParams(max_new_tokens=K, temperature=temperature, top_p=top_p, eos_token_ids=())
    results = generate(eng, [PROMPT] * n, params, draft="d")
    assert all(r.stats is not None and r.stats.rounds >= 1 for r in results)
    return torch.tensor([r.token_ids for r in results]), results


@pytest.mark.parametrize("temperature, top_p, width, graphs", [
    (1.0, 1.0, 2, None), (1.0, 1.0, 3, "emulate"), (0.7, 0.9, 3, None)])
def test_sampled_tree_rounds_are_lossless(small, temperature, top_p, width, graphs, monkeypatch):
    """Whole generations through the engine (the first 3 tokens after a prompt, 20k requests): their joint
    distribution is the target's; and the trees really ran and beat the chain's first-token acceptance."""
    import engine.tree as tree
    from tests.drafts.test_speculative import distances, exact_joint, thresholds

    model, draft = small
    ran = []
    real = tree.launch_tree_round
    monkeypatch.setattr(tree, "launch_tree_round", lambda *a, **k: ran.append(a[4]) or real(*a, **k))
    n = 20000
    tokens, results = tree_sampled_tokens(model, draft, temperature, top_p, n, width, cuda_graphs=graphs)
    assert ran and set(ran) == {width}
    per_position, joint = distances(tokens, exact_joint(model, temperature, top_p))
    position_max, joint_max = thresholds(n)
    assert max(per_position) < position_max, per_position
    assert joint < joint_max, joint


def test_sampled_tree_with_a_sub_vocabulary_draft_is_lossless(tiny):
    from tests.drafts.test_speculative import V, distances, exact_joint, noisy as noisy_, thresholds

    model = tiny.tiny_vocab_target(V, num_layers=3, seed=7)
    from drafts.config import DraftConfig
    from drafts.model import DraftModel

    draft = DraftModel(model, DraftConfig(shared_layers=1, adapter_layers=2, head="mlp_tied", head_vocab=5))
    draft.init_from_target()
    draft.set_vocab(torch.tensor([6, 1, 3, 0, 7]))
    draft = noisy_(draft, 1.0)
    n = 20000
    for whole in (False, True):
        tokens, _ = tree_sampled_tokens(model, draft, 1.0, 1.0, n, 3, spec_kw={"sub_vocab_draws": not whole},
                                        batch=256)
        per_position, joint = distances(tokens, exact_joint(model, 1.0, 1.0))
        position_max, joint_max = thresholds(n)
        assert max(per_position) < position_max, (whole, per_position)
        assert joint < joint_max, (whole, joint)


def test_sampled_trees_accept_more_first_tokens_than_the_chain(small):
    model, draft = small
    n = 4000

    def first_accepted(width):
        _, results = tree_sampled_tokens(model, draft, 1.0, 1.0, n, width)
        return sum(r.stats.accepted for r in results) / sum(r.stats.rounds for r in results)

    chain, tree = first_accepted(1), first_accepted(3)
    assert tree > chain + 0.1, (chain, tree)


def test_a_broken_residual_between_candidates_is_caught(small, monkeypatch):
    """Trying every candidate against the target itself, not against what the rejected ones leave, over-weights
    the draft's tokens: the distribution check above catches it."""
    import engine.tree as tree
    from tests.drafts.test_speculative import distances, exact_joint, thresholds

    monkeypatch.setattr(tree, "residual", lambda p, q: p)
    model, draft = small
    n = 5000
    tokens, _ = tree_sampled_tokens(model, draft, 1.0, 1.0, n, 3)
    per_position, joint = distances(tokens, exact_joint(model, 1.0, 1.0))
    assert max(per_position) > thresholds(n)[0] or joint > thresholds(n)[1], (per_position, joint)


@pytest.mark.parametrize("graphs", [False, "emulate"], ids=["eager", "graph-path"])
def test_tree_rounds_keep_the_limits(target, graphs):
    """A tree writes width * gamma nodes past a row's length: the context limit, max_new_tokens and an EOS
    inside the kept branch end the output exactly where plain decoding does."""
    spec = SpecConfig(5, 5, tree_width=3, tree_max_batch=4)
    draft = noisy(oracle(target), 0.3)
    for length in (10, 12):  # prompt + output may not pass the 16-token context
        expected = ar_greedy(target, (length,), 50, max_seq_len=16)[0]
        got = spec_generate(target, draft, spec, lengths=(length,), new=50, max_seq_len=16, cuda_graphs=graphs)[0]
        assert got.token_ids == expected and got.finish_reason == "length"
    for new in (1, 4, 7):
        results = spec_generate(target, draft, spec, new=new, cuda_graphs=graphs)
        assert [r.token_ids for r in results] == ar_greedy(target, LENGTHS, new)
    expected = ar_greedy(target, (7,), 20)[0]
    cut = next(i for i in range(2, 6) if expected[i] not in expected[:i])
    params = SamplingParams(max_new_tokens=20, eos_token_ids=(expected[cut],))
    got = spec_generate(target, oracle(target), spec, lengths=(7,), params=params, cuda_graphs=graphs)[0]
    assert got.token_ids == expected[:cut] and got.finish_reason == "stop"

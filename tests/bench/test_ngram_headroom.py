"""bench.ngram_headroom: n-gram lookup drafting played over known replies, alone and beside a draft."""

from __future__ import annotations

import pytest
import torch

from bench.ngram_headroom import (candidate_rounds, expected_lookup_tokens, lookup_rounds, main, ngram_candidates,
                                  ngram_lookup, play_lookup, projected)
from drafts.config import DraftConfig
from drafts.model import DraftModel


def test_lookup_takes_the_longest_suffix_that_occurred_before_at_its_most_recent_place():
    assert ngram_lookup([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 2) == [7, 1]  # "1 2 3" last seen before 7
    assert ngram_lookup([5, 2, 3, 8, 6, 2, 3], 4) == [8, 6, 2, 3]  # "2 3" (no earlier "6 2 3")
    assert ngram_lookup([4, 5, 6, 5], 3, min_n=2) == []  # only "5" recurs: shorter than min_n 2
    assert ngram_lookup([4, 5, 6, 5], 3) == [6, 5, 6]  # min_n 1 by default; "6 5" then repeats with its period
    assert ngram_lookup([1, 2, 1, 2], 5) == [1, 2, 1, 2, 1]  # what follows the match reaches the end: repeated
    assert ngram_lookup([3, 3, 3], 2) == [3, 3]  # the suffix itself never counts as its own earlier occurrence
    assert ngram_lookup([7], 3) == [] and ngram_lookup([], 3) == []


def test_lookup_rounds_over_a_repeating_reply_and_plain_steps_where_nothing_recurs():
    seq = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4, 1]  # prompt [1, 2, 3, 4], reply from index 4 on
    got = play_lookup([seq], [4], lambda toks: ngram_lookup(toks, 3, min_n=2))
    # t=4 (context 1 2 3 4 1): neither "3 4 1" nor "4 1" occurred before, a plain step; t=5: "1 2" at 0 ->
    # [3, 4, 1], all kept, +4 (t=9); t=9: "4 1 2" at 3 -> [3, 4, 1], the last 3 tokens of the reply (t=12)
    assert got == {"lookup_rounds": 2, "lookup_tokens": 7, "plain_steps": 1, "tokens": 8}
    # min_n 1: at t=4 "1" occurred at 0 -> [2, 3, 4], all kept (t=8); t=8: "3 4 1" at 2 -> [2, 3, 4] (t=12)
    got = play_lookup([seq], [4], lambda toks: ngram_lookup(toks, 3))
    assert got == {"lookup_rounds": 2, "lookup_tokens": 8, "plain_steps": 0, "tokens": 8}
    fresh = play_lookup([[9, 8, 7, 6, 5, 4, 3]], [2], lambda toks: ngram_lookup(toks, 3))
    assert fresh == {"lookup_rounds": 0, "lookup_tokens": 0, "plain_steps": 4, "tokens": 4}
    wrong = play_lookup([[1, 2, 3, 1, 2, 5, 6]], [3], lambda toks: ngram_lookup(toks, 2))  # [3, 1] proposed, 5 comes
    assert wrong["lookup_rounds"] >= 1 and wrong["tokens"] == 3
    assert projected(8, 1.0, lookup_rounds=2, verify_ms=1.0) == 4.0 and projected(4, 1.0, plain_steps=4) == 1.0


def test_a_draft_s_simulated_rounds_give_way_to_lookup_rounds_where_lookup_proposes(tiny):
    from bench.draft_temperature import target_replies
    from bench.tree_headroom import simulate_tree_rounds

    target = tiny.tiny_vocab_target(8, num_layers=3, seed=7)
    draft = DraftModel(target, DraftConfig(shared_layers=1, adapter_layers=1, head="mlp_tied"))
    prompts = [[1, 2, 3], [4, 0, 6, 2, 5]]
    seqs = target_replies(target, None, prompts, 20)
    starts = [len(p) for p in prompts]
    with torch.no_grad():
        alone = simulate_tree_rounds(target, draft, seqs, starts, (1, 1, 1))
        never = simulate_tree_rounds(target, draft, seqs, starts, (1, 1, 1), lookup=lambda toks: [])
        assert {k: never[k] for k in alone} == alone and never["lookup_rounds"] == 0

        def oracle(toks):  # proposes the reply's next 3 tokens: every round a lookup round, 4 tokens each
            seq = next(s for s in seqs if s[: len(toks)] == toks)
            return seq[len(toks): len(toks) + 3]

        known = simulate_tree_rounds(target, draft, seqs, starts, (1, 1, 1), lookup=oracle)
    assert known["rounds"] == 0 and known["lookup_tokens"] == 2 * 19
    assert known["lookup_rounds"] == 2 * -(-19 // 4)


def test_expected_tokens_of_a_lookup_round_are_the_products_of_the_target_s_probabilities(tiny):
    target = tiny.tiny_vocab_target(8, num_layers=2, seed=3)
    seqs, starts = [[1, 2, 3, 1, 2, 5, 1, 2]], [4]
    lookup = lambda toks: ngram_lookup(toks, 2, min_n=2)  # noqa: E731
    got = expected_lookup_tokens(target, seqs, starts, lookup, temperature=1.0, batch=2)
    # positions t = 4..6: "3 1 2"? no; t=4 context 1 2 3 1 2 -> "1 2" at 0 -> [3, 1]; t=5 (... 2 5): none;
    # t=6 (... 5 1): "5 1"? no, "1"? below min_n 2 -> none
    assert got["positions"] == 3 and got["proposed"] == 1
    with torch.no_grad():
        ctx = torch.tensor([[1, 2, 3, 1, 2, 3, 1]])
        probs = torch.softmax(target(ctx, torch.arange(7)[None]).logits[0].float(), dim=-1)
    want = 1 + probs[4, 3] + probs[4, 3] * probs[5, 1]  # after "1 2 3 1 2": 3, then 1
    assert abs(got["expected_tokens"] - float(want)) < 1e-5
    assert 1.0 < got["expected_tokens"] < 3.0


def test_bad_options_are_refused_with_the_fix():
    with pytest.raises(SystemExit, match="--gamma 0"):
        main(["--gamma", "0"])
    with pytest.raises(SystemExit, match="min-n <= max-n"):
        main(["--min-n", "3", "--max-n", "2"])
    with pytest.raises(SystemExit, match="--rules-max-n 3,0: give n >= 1"):
        main(["--rules", "5", "--rules-max-n", "3,0"])
    with pytest.raises(SystemExit, match="--candidates 0: give K >= 1 with --rules"):
        main(["--rules", "5", "--candidates", "0"])
    with pytest.raises(SystemExit, match="--candidates 2: give K >= 1 with --rules"):
        main(["--candidates", "2"])


def test_lookup_rounds_count_a_round_that_proposes_nothing_as_one_token():
    seq = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4, 1]
    # min_n 2: t=4 nothing (1 token), t=5 [3, 4, 1] kept (4), t=9 [3, 4, 1] kept to the reply's end (3): 8 in 3 rounds
    assert lookup_rounds([seq], [4], lambda toks: ngram_lookup(toks, 3, min_n=2)) == 8 / 3
    assert lookup_rounds([seq], [4], lambda toks: ngram_lookup(toks, 3)) == 4.0  # n to 1: 8 tokens in 2 rounds
    assert lookup_rounds([[9, 8, 7, 6]], [1], lambda toks: []) == 1.0


def test_streak_rounds_propose_the_longer_gamma_after_a_full_round_and_price_it():
    from bench.ngram_headroom import streak_pairs, streak_rounds

    seq = [1, 2, 3] * 12  # prompt [1, 2, 3, 1, 2, 3], then a reply that repeats its period to the end
    base = streak_rounds([seq], [6], 2, None)
    assert base["streak_rounds"] == 0 and base["tokens_per_round"] == 3.0  # every round accepts its 2, and one more
    fast = streak_rounds([seq], [6], 2, 5, lag=1, cost=1.5)
    # Lag 1: the first round proposes 2 (all kept), every later one 5 (all kept): rounds of 3, then 6 tokens.
    assert fast["streak_rounds"] == fast["rounds"] - 1 and fast["tokens_per_round"] > 4.5
    assert fast["tokens_per_cost"] == pytest.approx(fast["tokens_per_round"] * fast["rounds"]
                                                    / (1 + 1.5 * (fast["rounds"] - 1)))
    dear = streak_rounds([seq], [6], 5, None, gamma_cost=1.5)  # every round at the longer gamma, each 1.5
    assert dear["tokens_per_cost"] == pytest.approx(dear["tokens_per_round"] / 1.5)
    lagged = streak_rounds([seq], [6], 2, 5, lag=2)  # the first two rounds propose 2
    assert lagged["streak_rounds"] == lagged["rounds"] - 2
    assert streak_rounds([[5, 1, 2, 3, 4, 6, 7, 8, 9]], [2], 2, 5)["streak_rounds"] == 0  # nothing repeats
    assert streak_pairs("8:15,5:12") == ((8, 15), (5, 12))
    for bad in ("8", "15:8", "0:3", "a:b"):
        with pytest.raises(Exception, match="GAMMA:STREAK"):
            streak_pairs(bad)


def test_candidates_are_the_distinct_proposals_of_earlier_matches_and_a_round_keeps_the_best():
    seq = [1, 2, 7, 1, 2, 8, 9, 1, 2]
    # "1 2" followed by 8 (most recent) then 7; then "2" alone adds nothing new (the same places)
    assert ngram_candidates(seq, 2, 1) == [ngram_lookup(seq, 2)] == [[8, 9]]
    assert ngram_candidates(seq, 2, 3) == [[8, 9], [7, 1]]
    assert ngram_candidates([5, 6, 7], 2, 2) == []
    # The reply goes on 7 1 5: one proposal, [8, 9], misses (1 token), then [1, 2] keeps 1 (2 tokens); with two,
    # [7, 1] is kept whole: the 3 tokens in one round
    reply = seq + [7, 1, 5]
    one, two = (candidate_rounds([reply], [len(seq) - 1], 2, k) for k in (1, 2))
    assert one == lookup_rounds([reply], [len(seq) - 1], lambda toks: ngram_lookup(toks, 2)) == 1.5
    assert two == 3.0

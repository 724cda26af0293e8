"""engine.lookup.propose: batched n-gram lookup on the device, the reference rule's proposals for every row."""

from __future__ import annotations

import random

import pytest
import torch

from bench.ngram_headroom import ngram_lookup
from engine.lookup import LookupShadow, propose


def _rows(seed: int, count: int, width: int) -> list[list[int]]:
    """Histories with repeats planted in them (copied spans), of every length up to width, over a small vocab."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        length = rng.randint(0, width)
        toks = [rng.randrange(6) for _ in range(length)]
        for _ in range(rng.randint(0, 3)):  # copy a span to a later place
            if length >= 6:
                a, c = rng.randrange(length - 3), rng.randrange(2, 5)
                d = rng.randrange(length - c + 1)
                toks[d:d + c] = toks[a:a + c][: length - d]
        rows.append(toks)
    return rows


def test_a_continuation_that_reaches_the_end_repeats_with_its_period():
    """The match is p < gamma tokens back: the tokens after it are the last p, and the proposal repeats them
    (what lookup would propose again after accepting them), here and in the reference."""
    toks = [9, 3, 1, 2, 3, 1, 2, 3]  # "1 2 3" last occurred 3 tokens back: period 3
    history = torch.tensor([toks + [0] * 4])
    proposals, counts = propose(history, torch.tensor([len(toks)]), 7)
    assert counts.tolist() == [7] and proposals[0].tolist() == [1, 2, 3, 1, 2, 3, 1] == ngram_lookup(toks, 7)
    assert LookupShadow(toks, 7).propose(len(toks)) == [1, 2, 3, 1, 2, 3, 1]
    proposals, counts = propose(history, torch.tensor([len(toks)]), 7, repeat=False)  # the rule before the repeat
    assert counts.tolist() == [3] and proposals[0, :3].tolist() == [1, 2, 3] == ngram_lookup(toks, 7, repeat=False)
    assert LookupShadow(toks, 7, repeat=False).propose(len(toks)) == [1, 2, 3]


@pytest.mark.parametrize("repeat", [True, False])
@pytest.mark.parametrize("gamma,max_n,min_n", [(5, 3, 2), (3, 3, 1), (4, 2, 2), (1, 4, 1), (8, 3, 1)])
def test_every_row_gets_the_reference_rule_s_proposal(gamma, max_n, min_n, repeat):
    width = 40
    rows = _rows(gamma * 10 + max_n + min_n, 64, width)
    history = torch.full((len(rows), width + 8), 99)  # past each row's length: tokens that must not count
    for i, toks in enumerate(rows):
        history[i, :len(toks)] = torch.tensor(toks, dtype=torch.long)
    lengths = torch.tensor([len(t) for t in rows])
    proposals, counts = propose(history, lengths, gamma, max_n, min_n, repeat)
    for i, toks in enumerate(rows):
        want = ngram_lookup(toks, gamma, max_n, min_n, repeat)
        assert proposals[i, :counts[i]].tolist() == want, (toks, want)
    assert (counts > 0).any() and (counts == 0).any()  # both kinds of rows are in the sample


def test_it_runs_inside_a_graph_shaped_call_and_refuses_bad_settings():
    history = torch.tensor([[1, 2, 3, 1, 2, 0, 0], [4, 4, 4, 4, 0, 0, 0], [7, 1, 8, 2, 1, 0, 0], [5, 6, 0, 0, 0, 0, 0]])
    proposals, counts = propose(history, torch.tensor([5, 4, 5, 2]), 3)
    assert proposals.shape == (4, 3) and counts.tolist() == [3, 3, 3, 0]
    assert proposals[0].tolist() == [3, 1, 2]  # "1 2" occurred: what followed it
    assert proposals[1].tolist() == [4, 4, 4]  # a run: its one token, repeated, not just the one seen after "4 4 4"
    assert proposals[2].tolist() == [8, 2, 1]  # no 3- or 2-gram occurred; the last token alone did
    _, _, matched = propose(history, torch.tensor([5, 4, 5, 2]), 3, with_match=True)
    assert matched.tolist() == [2, 3, 1, 0]  # the n each row's match has ("4 4 4": the 3-gram, max_n 3)
    with pytest.raises(ValueError, match="gamma"):
        propose(history, torch.tensor([5, 4]), 0)
    with pytest.raises(ValueError, match="min_n"):
        propose(history, torch.tensor([5, 4]), 2, max_n=1, min_n=2)


def _replayed(seq: list[int], start: int, gamma: int, max_n: int, min_n: int, repeat: bool = True,
              streak: int | None = None, lag: int = 2) -> list[int]:
    """The reference: lookup rounds over a known greedy reply seq[start:] (seq[start] the prefill's token), each
    `ngram_lookup` over the history up to the pending token, then the reply's matching prefix and its next token;
    a round whose outcome the reply does not settle yet (it matches to its end) is not counted. A round proposes
    `streak` tokens (not None) where the round `lag` rounds before it accepted all the `gamma`s it proposed."""
    made, full, t = [], [], start
    while True:
        g = streak if streak is not None and len(full) >= lag and full[-lag] else gamma
        proposal = ngram_lookup(seq[:t + 1], g, max_n, min_n, repeat)
        accepted = 0
        while accepted < len(proposal) and t + 1 + accepted < len(seq) and seq[t + 1 + accepted] == proposal[accepted]:
            accepted += 1
        if t + 1 + accepted >= len(seq):
            return made
        made.append(accepted + 1)
        full.append(accepted == g)
        t += accepted + 1


@pytest.mark.parametrize("gamma,max_n,min_n,repeat,streak,lag", [
    (5, 3, 2, True, None, 2), (3, 3, 1, True, None, 2), (8, 2, 2, True, None, 2), (8, 3, 1, True, None, 2),
    (5, 3, 2, False, None, 2), (8, 3, 1, False, None, 2), (3, 3, 1, True, 7, 2), (2, 3, 1, True, 5, 1),
    (3, 2, 1, True, 6, 1)])
def test_the_shadow_replays_the_rounds_lookup_would_run_whatever_the_tokens_come_in(gamma, max_n, min_n, repeat,
                                                                                   streak, lag):
    """LookupShadow over a request's tokens as they come (a prefill's token, then rounds' and steps' of any length)
    makes the rounds the reference rule makes over the whole reply, each as soon as the tokens settle it; with a
    streak gamma, each round at the gamma the rounds before it set."""
    rng = random.Random(gamma)
    streaks = 0
    runs = [[1, 2, 3] * 30, [4] * 50, [0, 5] * 40 + [1, 2] * 20]  # replies that repeat: streaks
    for row in _rows(gamma, 40, 90) + runs:
        if len(row) < 4:
            continue
        prompt_len = rng.randint(1, len(row) // 3)
        shadow = LookupShadow(row[:prompt_len], gamma, max_n, min_n, repeat=repeat, streak_gamma=streak, lag=lag)
        got, at = [], prompt_len
        while at < len(row):
            chunk = rng.randint(1, gamma + 1)
            got += shadow.extend(row[at:at + chunk])
            at += chunk
            assert got == _replayed(row[:at], prompt_len, gamma, max_n, min_n, repeat, streak, lag)
        assert shadow.rounds == len(got) and shadow.tokens == sum(got) and list(shadow.recent) == got[-32:]
        streaks += sum(1 for n in got if n > gamma + 1)
    assert (streaks > 0) == (streak is not None)  # the streak cases do run rounds past the gamma
    with pytest.raises(ValueError, match="gamma"):
        LookupShadow([1, 2], 0)
    with pytest.raises(ValueError, match="lag"):
        LookupShadow([1, 2], 3, streak_gamma=5, lag=0)


def test_an_allotted_round_gives_its_budget_to_the_rows_likeliest_to_keep_their_tokens():
    """`allot`: the budget's tokens less one a row, to the (row, depth) pairs the table rates likeliest, a row's
    deeper tokens only after its shallower ones; each row at most max_gamma."""
    from engine.lookup import ALLOT_TABLE, allot

    matched = torch.tensor([6, 1, 0, 3, 6, 2, 4, 1])
    gammas = allot(matched, 8 * 6, 12)  # the verify tokens of a gamma-5 round of 8 rows
    assert gammas.sum().item() == 8 * 5 and gammas.max().item() <= 12
    by_n = {n: g for n, g in zip(matched.tolist(), gammas.tolist())}
    assert by_n[6] >= by_n[4] >= by_n[3] >= by_n[2] >= by_n[1] >= by_n[0], by_n  # the table's order of n
    assert by_n[6] > 5 > by_n[1]  # a long match proposes more than the uniform round's 5, a one-token one less
    # Every token allotted is rated at least as likely kept as every token left out.
    table = torch.tensor(ALLOT_TABLE).cummin(dim=1).values
    kept = [table[n, g - 1].item() for n, g in zip(matched.tolist(), gammas.tolist()) if g]
    left = [table[n, g].item() for n, g in zip(matched.tolist(), gammas.tolist()) if g < 12]
    assert min(kept) >= max(left)
    # A table rating every depth alike: every row the same gamma, the uniform round.
    assert allot(matched, 8 * 6, 12, table=[[0.5] * 12] * 7).tolist() == [5] * 8
    assert allot(torch.tensor([6, 6]), 2 * 6, 3).tolist() == [3, 3]  # at most max_gamma a row, however large the budget
    with pytest.raises(ValueError, match="budget"):
        allot(matched, 7, 5)

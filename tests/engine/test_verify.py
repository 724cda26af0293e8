"""Verification on hand-built distributions: accepted, recovered and bonus tokens.

Distribution checks use n draws and total variation distance (TV). For n draws from a distribution
over V outcomes, E[TV(empirical, true)] <= 0.5 * sqrt(V / n) (Cauchy-Schwarz on the per-outcome
standard errors); the thresholds below are 2x that bound: about 0.016 for V = 4, n = 40k.
"""

from __future__ import annotations

import pytest
import torch

from engine.sampling import RandomStream
from engine.verify import verify_greedy, verify_sampled

N = 40000


def tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * (a - b).abs().sum().item()


def threshold(v: int, n: int = N) -> float:
    return 2 * 0.5 * (v / n) ** 0.5


def freq(tokens: torch.Tensor, v: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=v).float() / tokens.numel()


def one_hot_logits(tokens: list[int], v: int = 6) -> torch.Tensor:
    out = torch.zeros(1, len(tokens), v)
    out[0, torch.arange(len(tokens)), torch.tensor(tokens)] = 5.0
    return out


def test_greedy_all_accepted_gives_the_bonus():
    res = verify_greedy(torch.tensor([[1, 2, 3]]), one_hot_logits([1, 2, 3, 4]))
    assert res.num_accepted.tolist() == [3] and res.next_token.tolist() == [4]


def test_greedy_first_rejected_gives_the_target_token():
    res = verify_greedy(torch.tensor([[5, 2, 3]]), one_hot_logits([1, 2, 3, 4]))
    assert res.num_accepted.tolist() == [0] and res.next_token.tolist() == [1]


def test_greedy_stops_at_the_first_mismatch_per_row():
    drafts = torch.tensor([[1, 2, 0], [1, 0, 3], [1, 2, 3]])
    logits = one_hot_logits([1, 2, 3, 4]).expand(3, -1, -1)
    res = verify_greedy(drafts, logits)
    assert res.num_accepted.tolist() == [2, 1, 3]
    assert res.next_token.tolist() == [3, 2, 4]


def streams(n: int, seed: int) -> list[RandomStream]:
    """One random stream per row, as the engine gives each request its own."""
    return [RandomStream(seed * 1_000_003 + r) for r in range(n)]


def _rows(dist: torch.Tensor, n: int) -> torch.Tensor:
    return dist.expand(n, *dist.shape).clone()


def test_sampled_all_accepted_when_target_covers_the_draft():
    """target_prob >= draft_prob for every drafted token: always accepted; the bonus comes from t[k]."""
    draft = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.2, 0.8, 0.0, 0.0]])  # (k=2, V)
    target = torch.tensor([[0.6, 0.4, 0.0, 0.0], [0.1, 0.9, 0.0, 0.0], [0.1, 0.2, 0.3, 0.4]])  # (k+1, V)
    tokens = torch.tensor([0, 1])
    seed = 0
    res = verify_sampled(_rows(tokens, N), _rows(draft, N), _rows(target, N), streams(N, seed))
    assert (res.num_accepted == 2).all()
    assert tv(freq(res.next_token, 4), target[2]) < threshold(4)


def test_sampled_first_rejected_when_the_target_excludes_the_token():
    draft = torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.25] * 4])
    target = torch.tensor([[0.5, 0.0, 0.5, 0.0], [0.25] * 4, [0.25] * 4])
    seed = 1
    res = verify_sampled(_rows(torch.tensor([1, 0]), N), _rows(draft, N), _rows(target, N), streams(N, seed))
    assert (res.num_accepted == 0).all()
    # recovered ~ normalize(max(0, target - draft)) = target here (the draft's only token has target mass 0)
    assert tv(freq(res.next_token, 4), target[0]) < threshold(4)


def test_sampled_acceptance_rate_and_recovered_distribution():
    """Draft a token from `draft`: accepted with probability min(1, t/d); on rejection the recovered token
    follows normalize(max(0, t - d)); overall the emitted token follows the target exactly."""
    target = torch.tensor([0.1, 0.4, 0.2, 0.3])
    draft = torch.tensor([0.4, 0.1, 0.3, 0.2])
    seed = 2
    gen = torch.Generator().manual_seed(seed)
    drafted = torch.multinomial(draft, N, replacement=True, generator=gen)  # (N,)
    res = verify_sampled(drafted[:, None], _rows(draft[None], N), _rows(torch.stack([target, target]), N), streams(N, seed))
    accepted = res.num_accepted == 1
    for tok in range(4):
        rate = accepted[drafted == tok].float().mean().item()
        expected = min(1.0, (target[tok] / draft[tok]).item())
        assert abs(rate - expected) < 0.03, (tok, rate, expected)
    residual = (target - draft).clamp_min(0)
    residual /= residual.sum()
    recovered = res.next_token[~accepted]
    assert tv(freq(recovered, 4), residual) < threshold(4, recovered.numel())
    emitted = torch.where(accepted, drafted, res.next_token)
    assert tv(freq(emitted, 4), target) < threshold(4)
    # Power: the draft itself, or the target, as the recovered distribution would fail this check.
    assert tv(draft, target) > 10 * threshold(4) and tv(target, residual) > 10 * threshold(4)


def test_sampled_second_position_rejected_recovers_from_that_position():
    draft = torch.tensor([[0.0, 1.0, 0.0], [0.5, 0.5, 0.0]])  # d0 = 1 (certain), d1 = 0
    target = torch.tensor([[0.0, 1.0, 0.0], [0.25, 0.25, 0.5], [1.0, 0.0, 0.0]])
    seed = 3
    res = verify_sampled(_rows(torch.tensor([1, 0]), N), _rows(draft, N), _rows(target, N), streams(N, seed))
    # d1 = 0 is accepted with probability 0.25 / 0.5; on acceptance the bonus comes from t[2] = token 0.
    assert set(res.num_accepted.unique().tolist()) == {1, 2}
    assert abs((res.num_accepted == 2).float().mean().item() - 0.5) < 0.02
    assert (res.next_token[res.num_accepted == 2] == 0).all()
    # On rejection: normalize(max(0, [0.25, 0.25, 0.5] - [0.5, 0.5, 0])) = token 2.
    assert (res.next_token[res.num_accepted == 1] == 2).all()


def test_identical_distributions_always_accept():
    dist = torch.tensor([[0.3, 0.7], [0.6, 0.4], [0.5, 0.5]])
    seed = 4
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.multinomial(dist[:2], 2000, replacement=True, generator=gen).T  # (2000, 2)
    res = verify_sampled(tokens, _rows(dist[:2], 2000), _rows(dist, 2000), streams(2000, seed))
    assert (res.num_accepted == 2).all()


@pytest.mark.parametrize("seed", [0, 1])
def test_sampled_is_reproducible_per_row_stream(seed):
    draft = torch.softmax(torch.randn(8, 3, 5, generator=torch.Generator().manual_seed(9)), -1)
    target = torch.softmax(torch.randn(8, 4, 5, generator=torch.Generator().manual_seed(10)), -1)
    tokens = torch.randint(0, 5, (8, 3), generator=torch.Generator().manual_seed(11))

    def run():
        res = verify_sampled(tokens, draft, target, streams(8, seed * 100))
        return res.num_accepted.tolist(), res.next_token.tolist()

    assert run() == run()


def test_a_sub_vocabulary_draft_verifies_as_its_whole_vocabulary_form():
    """A draft that drew over its K-token sub-vocabulary (probabilities (B, k, K), each row's token ids, the
    drafted tokens' places in them) gets exactly what the same draft spread over the whole vocabulary (zeros
    elsewhere) gets from the same draws: same accepted counts, same next tokens, rejections included."""
    gen = torch.Generator().manual_seed(11)
    b, k, v, sub = 64, 3, 12, 5
    ids = torch.stack([torch.randperm(v, generator=gen)[:sub] for _ in range(b)])  # (B, K), out of id order
    draft_sub = torch.rand(b, k, sub, generator=gen).pow(3)
    draft_sub /= draft_sub.sum(-1, keepdim=True)
    index = torch.multinomial(draft_sub.view(-1, sub), 1, generator=gen).view(b, k)
    tokens = ids.gather(1, index)
    draft_full = torch.zeros(b, k, v).scatter_(-1, ids[:, None].expand(-1, k, -1), draft_sub)
    target = torch.rand(b, k + 1, v, generator=gen).pow(3)
    target /= target.sum(-1, keepdim=True)
    draws = torch.rand(b, k + 1, generator=gen)
    whole = verify_sampled(tokens, draft_full, target, draws=draws)
    part = verify_sampled(tokens, draft_sub, target, draws=draws, draft_vocab=ids, draft_index=index)
    assert torch.equal(part.num_accepted, whole.num_accepted) and torch.equal(part.next_token, whole.next_token)
    assert 0 < int((whole.num_accepted < k).sum()) < b  # rejections (the residual) and full acceptances both ran

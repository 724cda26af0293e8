"""processed_probs semantics on hand-made logits, sampling from them, and parameter validation."""

from __future__ import annotations

import math

import pytest
import torch

from engine.sampling import RandomStream, SamplingParams, needs_filters, processed_probs, sample, uniform

BASE = torch.tensor([0.5, 0.3, 0.2])  # target probabilities at temperature 1
LOGITS = BASE.log()[None]  # (1, 3)


def probs(logits=LOGITS, temperature=1.0, top_k=0, top_p=1.0):
    b = logits.shape[0]
    return processed_probs(logits, torch.full((b,), float(temperature)), torch.full((b,), top_k),
                           torch.full((b,), float(top_p)))


def close(a, b):
    return torch.allclose(a, torch.tensor(b, dtype=torch.float32).expand_as(a), atol=1e-6)


def test_temperature():
    assert close(probs(), [[0.5, 0.3, 0.2]])
    sq = BASE**2 / (BASE**2).sum()  # temperature 0.5 squares the probabilities
    assert close(probs(temperature=0.5), [sq.tolist()])
    cube_root = BASE ** (1 / 3) / (BASE ** (1 / 3)).sum()
    assert close(probs(temperature=3.0), [cube_root.tolist()])
    assert close(probs(temperature=0.0), [[1.0, 0.0, 0.0]])  # greedy: one-hot argmax


def test_top_k():
    assert close(probs(top_k=1), [[1.0, 0.0, 0.0]])
    assert close(probs(top_k=2), [[0.625, 0.375, 0.0]])
    assert close(probs(top_k=3), [[0.5, 0.3, 0.2]])
    assert close(probs(top_k=50), [[0.5, 0.3, 0.2]])  # larger than the vocabulary: off


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    assert close(probs(top_p=0.4), [[1.0, 0.0, 0.0]])  # the top token always stays
    assert close(probs(top_p=0.5), [[1.0, 0.0, 0.0]])  # 0.5 reached by the first token
    assert close(probs(top_p=0.6), [[0.625, 0.375, 0.0]])
    assert close(probs(top_p=0.81), [[0.5, 0.3, 0.2]])
    assert close(probs(top_p=1.0), [[0.5, 0.3, 0.2]])


def test_order_temperature_then_top_k_then_top_p():
    # Temperature 0.5 gives [0.658, 0.237, 0.105]: top-p 0.6 keeps only the first token
    # (applying top-p before temperature would keep two).
    assert close(probs(temperature=0.5, top_p=0.6), [[1.0, 0.0, 0.0]])
    # top-k 2 first renormalizes to [0.625, 0.375]: top-p 0.6 then drops the second.
    assert close(probs(top_k=2, top_p=0.6), [[1.0, 0.0, 0.0]])
    assert close(probs(top_k=2, top_p=0.7), [[0.625, 0.375, 0.0]])


def test_rows_and_extra_dims_use_their_own_parameters():
    logits = torch.stack([LOGITS[0], LOGITS[0].flip(0)])  # (2, 3)
    out = processed_probs(logits, torch.tensor([1.0, 0.0]), torch.tensor([2, 0]), torch.tensor([1.0, 1.0]))
    assert close(out[0], [0.625, 0.375, 0.0]) and close(out[1], [0.0, 0.0, 1.0])
    # (B, k, V): each row's parameters apply to all of its positions.
    logits3 = logits[:, None].expand(2, 4, 3)
    out3 = processed_probs(logits3, torch.tensor([1.0, 0.0]), torch.tensor([2, 0]), torch.tensor([1.0, 1.0]))
    assert out3.shape == (2, 4, 3)
    assert torch.allclose(out3, out[:, None].expand(2, 4, 3))


def test_sample_follows_the_distribution_and_its_seed():
    dist = torch.tensor([0.5, 0.3, 0.2, 0.0])
    n = 20000
    draws = sample(dist.expand(n, 4).clone(), [RandomStream(seed) for seed in range(n)])  # a draw per seed
    stream = RandomStream(7)
    draws_of_one = torch.cat([sample(dist[None].clone(), [stream]) for _ in range(2000)])  # draws of one stream
    for got, count in ((draws, n), (draws_of_one, 2000)):
        freq = torch.bincount(got, minlength=4).float() / count
        assert freq[3] == 0
        assert (freq - dist).abs().max() < 4.5 * (0.25 / count) ** 0.5, freq
    a = sample(dist.expand(8, 4).clone(), [RandomStream(s) for s in range(8)])
    b = sample(dist.expand(8, 4).clone(), [RandomStream(s) for s in range(8)])
    assert torch.equal(a, b)


def test_sample_never_picks_a_token_without_mass():
    probs = torch.zeros(4096, 6)
    probs[:, 1] = 1e-30  # a tiny share, then nothing up to the end of the vocabulary
    probs[::2, 0] = 1.0
    got = sample(probs, [RandomStream(s) for s in range(4096)])
    assert set(got.tolist()) <= {0, 1}
    assert (got[1::2] == 1).all()


def test_streams_are_uniform_independent_of_the_batch_and_advance():
    streams = [RandomStream(s) for s in range(64)]
    u = uniform((64, 500), streams, torch.device("cpu"))
    assert 0 <= u.min() and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.005  # sd of the mean of 32k uniforms: 0.0016
    assert abs(u.var().item() - 1 / 12) < 0.003
    # Neighbouring seeds and neighbouring draws are not correlated.
    assert abs(torch.corrcoef(torch.stack([u[:-1].flatten(), u[1:].flatten()]))[0, 1]) < 0.03
    assert abs(torch.corrcoef(torch.stack([u[:, :-1].flatten(), u[:, 1:].flatten()]))[0, 1]) < 0.03
    # A row's draws depend on its own seed and count only: alone, or after others drew more.
    alone = RandomStream(5)
    first = uniform((1, 500), [alone], torch.device("cpu"))
    assert torch.equal(first[0], u[5])
    assert all(s.drawn == 500 for s in streams)
    nxt = uniform((2, 3), [streams[5], RandomStream(99)], torch.device("cpu"))
    assert torch.equal(nxt[0], uniform((1, 3), [alone], torch.device("cpu"))[0])


def test_unseeded_streams_follow_torch_manual_seed():
    torch.manual_seed(3)
    a = [RandomStream().key for _ in range(4)]
    torch.manual_seed(3)
    assert a == [RandomStream().key for _ in range(4)]
    assert len(set(a)) == 4


def test_unfiltered_probs_skip_the_sort_but_match():
    logits = torch.randn(5, 50)
    temp, top_k, top_p = torch.tensor([0.0, 0.5, 1.0, 1.5, 0.0]), torch.zeros(5, dtype=torch.long), torch.ones(5)
    assert torch.allclose(processed_probs(logits, temp, top_k, top_p, filtered=False),
                          processed_probs(logits, temp, top_k, top_p), atol=1e-6)
    assert needs_filters([SamplingParams(top_p=0.9)]) and needs_filters([SamplingParams(), SamplingParams(top_k=3)])
    assert not needs_filters([SamplingParams(temperature=1.0)])


@pytest.mark.parametrize(
    "kwargs, names",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=math.nan), "temperature"),
        (dict(temperature=math.inf), "temperature"),
        (dict(draft_temperature=-1.0), "draft_temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_p=-0.2), "top_p"),
        (dict(top_p=math.nan), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(stop=("",)), "stop"),
    ],
)
def test_invalid_sampling_params_name_the_problem(kwargs, names):
    with pytest.raises(ValueError, match=names):
        SamplingParams(**kwargs)


def test_valid_sampling_params():
    assert SamplingParams().greedy
    assert not SamplingParams(temperature=0.7, top_p=0.9, top_k=5).greedy
    assert SamplingParams(stop="END").stop == ("END",)


def test_param_tensors_are_per_row_and_the_draft_temperature_falls_back_to_the_request_s():
    from engine.sampling import param_tensors

    params = [SamplingParams(temperature=0.7, top_k=5, top_p=0.9), SamplingParams(temperature=1.2, draft_temperature=0.8)]
    t = param_tensors(params, torch.device("cpu"))
    assert t["temperature"].tolist() == pytest.approx([0.7, 1.2]) and t["draft_temperature"].tolist() == pytest.approx([0.7, 0.8])
    assert t["top_p"].tolist() == pytest.approx([0.9, 1.0]) and t["top_k"].tolist() == [5, 0]
    assert t["temperature"].dtype == torch.float32 and t["top_k"].dtype == torch.long

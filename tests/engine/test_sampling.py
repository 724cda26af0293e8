"""processed_probs semantics on hand-made logits, sampling from them, and parameter validation."""

from __future__ import annotations

import math

import pytest
import torch

from engine.sampling import SamplingParams, processed_probs, sample

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


def test_sample_follows_the_distribution_and_its_generator():
    dist = torch.tensor([0.5, 0.3, 0.2, 0.0])
    n = 20000
    gen = torch.Generator().manual_seed(0)
    draws = torch.cat([sample(dist.expand(1000, 4).clone(), [gen] * 1000) for _ in range(n // 1000)])
    freq = torch.bincount(draws, minlength=4).float() / n
    assert freq[3] == 0
    assert (freq - dist).abs().max() < 0.02  # ~4.5 standard errors at n = 20k
    a = sample(dist.expand(8, 4).clone(), [torch.Generator().manual_seed(s) for s in range(8)])
    b = sample(dist.expand(8, 4).clone(), [torch.Generator().manual_seed(s) for s in range(8)])
    assert torch.equal(a, b)


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

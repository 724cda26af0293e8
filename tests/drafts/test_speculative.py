"""FlashSpec decoding is lossless: greedy token for token, sampling in distribution.

Drafts used (target: 4 layers, every draft shares layer 0):
  oracle  - adapters = target layers [1, 4), tied head, initialised from the target: proposes exactly
            the target's next token, so every drafted token is accepted;
  partial - the oracle with noise on its adapter weights: some tokens accepted, some not;
  random  - untrained, random weights: almost nothing accepted.
"""

from __future__ import annotations

import ast
import functools

import pytest
import torch

import engine.speculative as speculative
from drafts.config import DraftConfig
from drafts.model import DraftModel
from engine.attention import SdpaBackend
from engine.gamma import GammaController
from engine.generate import generate
from engine.lookup import MAX_GAMMA, LookupDraft
from engine.requests import Request
from engine.sampling import SamplingParams, processed_probs, sample
from engine.scheduler import DecodeEngine
from engine.speculative import SpecConfig
from engine.verify import VerifyResult
from tests.conftest import drive

GRID = [(1, 1), (3, 1), (3, 2), (3, 3), (5, 1), (5, 2), (5, 5)]  # (gamma, block_size): block in {1, 2, gamma}
LENGTHS = (5, 17, 2, 30)  # a ragged batch of prompts
NEW = 30


def oracle(target, deep=False, **kwargs) -> DraftModel:
    config = DraftConfig(shared_layers=1, adapter_layers=target.args.num_layers - 1, head="mlp_tied",
                         feature_input="deep" if deep else "none", **kwargs)
    draft = DraftModel(target, config, name="oracle")
    draft.init_from_target()
    return draft


def noisy(draft: DraftModel, scale: float, seed: int = 5) -> DraftModel:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.adapters.parameters():
            if p.dim() == 2:
                p.add_(scale * torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    return draft


def random_draft(target, seed=3, **kwargs) -> DraftModel:
    torch.manual_seed(seed)
    return DraftModel(target, DraftConfig(shared_layers=1, init_from_target=False, **kwargs), name="random")


def prompts_for(vocab: int, lengths=LENGTHS) -> list[list[int]]:
    return [torch.randint(2, vocab, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in lengths]


@functools.lru_cache(maxsize=None)
def _ar_cached(target_id, lengths, new, max_seq_len):
    target = _TARGETS[target_id]
    eng = DecodeEngine(target, None, max_batch_size=len(lengths), max_seq_len=max_seq_len)
    params = SamplingParams(max_new_tokens=new, eos_token_ids=())
    return tuple(tuple(r.token_ids) for r in generate(eng, prompts_for(target.args.vocab_size, lengths), params))


_TARGETS: dict[int, object] = {}


def ar_greedy(target, lengths=LENGTHS, new=NEW, max_seq_len=128) -> list[list[int]]:
    _TARGETS[id(target)] = target
    return [list(t) for t in _ar_cached(id(target), tuple(lengths), new, max_seq_len)]


def spec_generate(target, drafts, spec: SpecConfig, lengths=LENGTHS, new=NEW, params=None, tokenizer=None,
                  max_seq_len=128, **engine_kwargs):
    """Generate with one draft per row (a list) or the same draft for all rows."""
    engine_kwargs.setdefault("max_batch_size", len(lengths))
    eng = DecodeEngine(target, tokenizer, max_seq_len=max_seq_len, spec=spec, **engine_kwargs)
    per_row = drafts if isinstance(drafts, list) else [drafts] * len(lengths)
    names = []
    for d in per_row:
        if d is None:
            names.append(None)
            continue
        name = f"d{id(d)}"
        if name not in eng.drafts:
            eng.add_draft(name, d)
        names.append(name)
    params = params or SamplingParams(max_new_tokens=new, eos_token_ids=())
    return generate(eng, prompts_for(target.args.vocab_size, lengths), params, draft=names)


@pytest.fixture(scope="module")
def target(tiny_target):
    return tiny_target.model


# ----- greedy losslessness ---------------------------------------------------------------------


@pytest.mark.parametrize("lengths", [(17,), LENGTHS], ids=["bs1", "bs4-ragged"])
@pytest.mark.parametrize("gamma, block", GRID)
def test_greedy_oracle_draft_is_lossless_and_fully_accepted(target, gamma, block, lengths):
    results = spec_generate(target, oracle(target), SpecConfig(gamma, block), lengths=lengths)
    assert [r.token_ids for r in results] == ar_greedy(target, lengths)
    for r in results:
        assert r.stats.acceptance_rate == 1.0
        assert r.stats.mean_accepted_length == gamma + 1 > gamma
        assert r.stats.verify_passes == r.stats.rounds * len(SpecConfig(gamma, block).blocks())


@pytest.mark.parametrize("lengths", [(17,), LENGTHS], ids=["bs1", "bs4-ragged"])
@pytest.mark.parametrize("gamma, block", GRID)
def test_greedy_random_draft_is_lossless(target, gamma, block, lengths):
    results = spec_generate(target, random_draft(target), SpecConfig(gamma, block), lengths=lengths)
    assert [r.token_ids for r in results] == ar_greedy(target, lengths)
    drafted = sum(r.stats.drafted for r in results)
    assert sum(r.stats.accepted for r in results) <= 0.1 * drafted
    for r in results:
        assert r.stats.verify_passes == r.stats.rounds  # every round ends at its first block


@pytest.mark.parametrize("gamma, block", [(3, 1), (5, 2), (5, 5)])
def test_greedy_partially_trained_draft_is_lossless(target, gamma, block):
    results = spec_generate(target, noisy(oracle(target), 0.5), SpecConfig(gamma, block))
    assert [r.token_ids for r in results] == ar_greedy(target)
    accepted, drafted = sum(r.stats.accepted for r in results), sum(r.stats.drafted for r in results)
    assert 0 < accepted < drafted


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda t: DraftModel(t, DraftConfig()), id="default-mlp-head"),
        pytest.param(lambda t: _init(DraftModel(t, DraftConfig())), id="default-mlp-head-init"),
        pytest.param(lambda t: _init(DraftModel(t, DraftConfig(head="mlp_tied"))), id="mlp_tied"),
        pytest.param(lambda t: _init(DraftModel(t, DraftConfig(feature_input="deep"))), id="deep"),
        pytest.param(lambda t: oracle(t, deep=True), id="deep-oracle"),
        pytest.param(lambda t: noisy(oracle(t, deep=True), 0.5), id="deep-partial"),
        pytest.param(lambda t: _sub_vocab(oracle(t, head_vocab=48)), id="head_vocab"),
        pytest.param(lambda t: layered(t, (2, 3), scale=0.0), id="feature-layers-oracle"),
        pytest.param(lambda t: layered(t, (2,)), id="feature-layers-partial"),
    ],
)
@pytest.mark.parametrize("gamma, block", [(5, 2), (3, 3)])
def test_greedy_draft_configs_are_lossless(target, make, gamma, block):
    draft = make(target)
    results = spec_generate(target, draft, SpecConfig(gamma, block))
    assert [r.token_ids for r in results] == ar_greedy(target)


def layered(target, layers, scale=0.5, seed=7) -> DraftModel:
    """A deep draft fusing the target's states after `layers` too: the oracle with noise on its adapters
    and on the feature projection (scale 0: the oracle itself, whose projection picks the final state)."""
    draft = noisy(oracle(target, deep=True, feature_layers=layers), scale, seed)
    return with_features(draft, scale, seed) if scale else draft


def with_features(draft: DraftModel, scale: float, seed: int = 7) -> DraftModel:
    """Noise on the fusion's feature half (zero after init_from_target) and on the feature projection,
    so the draft's predictions depend on the features it is given."""
    gen = torch.Generator().manual_seed(seed)
    h = draft.target.args.hidden_size
    with torch.no_grad():
        draft.fuse.weight[:, h:].add_(2 * scale * torch.randn(h, h, generator=gen) / h ** 0.5)
        if draft.feat_proj is not None:
            w = draft.feat_proj.weight
            w.add_(2 * scale * torch.randn(w.shape, generator=gen) / h ** 0.5)
    return draft


def _init(draft):
    draft.init_from_target()
    return draft


def _sub_vocab(draft):
    """Sub-vocabulary = the tokens the target emits most in the reference outputs, then the rest by id."""
    target = draft.target
    counts = torch.zeros(target.args.vocab_size)
    for row in ar_greedy(target):
        counts += torch.bincount(torch.tensor(row), minlength=target.args.vocab_size)
    draft.set_vocab(counts.argsort(descending=True, stable=True)[: len(draft.vocab_ids)])
    return draft


def test_deep_oracle_accepts_everything(target):
    for gamma, block in [(5, 2), (3, 3), (1, 1)]:
        results = spec_generate(target, oracle(target, deep=True), SpecConfig(gamma, block))
        assert all(r.stats.acceptance_rate == 1.0 for r in results)


def test_head_vocab_draft_accepts_only_its_tokens(target):
    draft = _sub_vocab(oracle(target, head_vocab=48))
    results = spec_generate(target, draft, SpecConfig(5, 2))
    assert 0 < sum(r.stats.accepted for r in results) < sum(r.stats.drafted for r in results)


@pytest.mark.parametrize("deep", [False, True])
@pytest.mark.parametrize("window", [4, 8, 64])
def test_greedy_with_a_windowed_draft_cache_is_lossless(target, deep, window):
    draft = oracle(target, deep=deep)
    results = spec_generate(target, draft, SpecConfig(5, 2, draft_kv_window=window))
    assert [r.token_ids for r in results] == ar_greedy(target)
    if window == 64:  # the window covers every sequence: the oracle stays exact
        assert all(r.stats.acceptance_rate == 1.0 for r in results)


def test_windowed_draft_cache_keeps_short_rows_context_in_a_ragged_batch(target):
    """A short prompt prefilled beside a long one keeps its own context in the draft's ring buffer:
    with a window covering the short row's whole sequence, the oracle accepts everything there."""
    lengths, new = (3, 40), 10
    results = spec_generate(target, oracle(target), SpecConfig(3, 3, draft_kv_window=16), lengths=lengths, new=new)
    assert [r.token_ids for r in results] == ar_greedy(target, lengths, new)
    alone = spec_generate(target, oracle(target), SpecConfig(3, 3, draft_kv_window=16), lengths=(3,), new=new)
    assert alone[0].stats.acceptance_rate == 1.0
    assert results[0].stats.acceptance_rate == 1.0


@pytest.mark.parametrize("gamma, block", [(5, 2), (3, 1), (3, 3)])
def test_greedy_ragged_batch_with_mixed_drafts(target, gamma, block):
    """One draft per row (different adapters, heads, feature inputs; same trunk depth), plus a plain row."""
    drafts = [
        oracle(target),
        random_draft(target, adapter_layers=2),
        noisy(oracle(target), 0.5),
        oracle(target, deep=True),
        None,
    ]
    lengths = LENGTHS + (9,)
    results = spec_generate(target, drafts, SpecConfig(gamma, block), lengths=lengths)
    assert [r.token_ids for r in results] == ar_greedy(target, lengths)
    assert results[0].stats.acceptance_rate == 1.0 and results[3].stats.acceptance_rate == 1.0
    assert results[1].stats.acceptance_rate <= 0.1
    assert results[4].stats is None
    if (gamma, block) != (5, 2):
        return
    # Each row gives what it gives alone with its draft.
    for i in (0, 1, 2, 3):
        alone = spec_generate(target, drafts[i], SpecConfig(gamma, block), lengths=(lengths[i],))[0]
        assert alone.token_ids == results[i].token_ids
        assert alone.stats.accepted == results[i].stats.accepted


def test_greedy_and_sampled_rows_in_one_batch(target):
    """Greedy rows sharing a round with sampled rows still decode exactly greedily."""
    n = len(LENGTHS)
    params = [SamplingParams(max_new_tokens=NEW, eos_token_ids=()) if i % 2 == 0 else
              SamplingParams(max_new_tokens=NEW, eos_token_ids=(), temperature=1.0, seed=i) for i in range(n)]
    results = spec_generate(target, noisy(oracle(target), 0.5), SpecConfig(5, 2), params=params)
    expected = ar_greedy(target)
    for i in range(0, n, 2):
        assert results[i].token_ids == expected[i]
    assert all(len(r.token_ids) == NEW for r in results)


def test_memory_report_counts_the_draft_cache_and_weights(target):
    args = target.args
    draft = oracle(target)
    for window in (None, 8):
        eng = DecodeEngine(target, None, max_batch_size=2, max_seq_len=64, spec=SpecConfig(5, 2, draft_kv_window=window))
        eng.add_draft("o", draft)
        report = eng.memory_report()
        slots = (window if window else 64) + eng.margin
        per_slot = 2 * draft.adapter_layers * args.num_kv_heads * args.head_dim * 4  # K and V, fp32
        assert report["draft_cache"] == 2 * slots * per_slot
        assert report["draft_weights"]["o"] == sum(p.numel() * 4 for p in draft.trainable_parameters())
        assert report["draft_weights"]["o"] < report["target_weights"]


def test_draft_with_another_trunk_depth_is_refused(target):
    eng = DecodeEngine(target, None, max_batch_size=2, max_seq_len=64)
    eng.add_draft("a", oracle(target))
    with pytest.raises(ValueError, match="trunk depth"):
        eng.add_draft("b", DraftModel(target, DraftConfig(shared_layers=2)))


def test_speculative_requests_are_reproducible_with_a_seed(target):
    params = [SamplingParams(max_new_tokens=20, temperature=0.8, top_k=20, seed=s) for s in (1, 1, 2, 3)]
    a = [r.token_ids for r in spec_generate(target, noisy(oracle(target), 0.5), SpecConfig(5, 2), params=params)]
    b = [r.token_ids for r in spec_generate(target, noisy(oracle(target), 0.5), SpecConfig(5, 2), params=params)]
    assert a == b
    assert a[2] != a[3]


@pytest.mark.parametrize("spec", [SpecConfig(5, 5, draft_confidence=0.2), SpecConfig(4, 2, draft_confidence=0.2),
                                  SpecConfig(4, 2)], ids=["early stop", "blocks, early stop", "blocks"])
def test_a_seeded_request_repeats_its_tokens_whatever_shares_its_batch(target, spec):
    """Drafting stops early only when no row of the batch trusts its draft, and rows finished in an earlier block
    still draw while the batch goes on: a seeded sampled request drafts the full gamma and its stream moves a
    fixed budget a round, so its tokens are the same alone, beside other requests and under a governor."""
    seeded = SamplingParams(max_new_tokens=40, temperature=0.9, seed=11, eos_token_ids=())
    others = [SamplingParams(max_new_tokens=40, eos_token_ids=()),
              SamplingParams(max_new_tokens=40, temperature=1.0, eos_token_ids=())]
    drafts = [noisy(oracle(target), 0.8), noisy(oracle(target), 0.2, seed=6), noisy(oracle(target), 0.5, seed=7)]
    alone = spec_generate(target, drafts[:1], spec, lengths=(5,), new=40, params=[seeded])[0]
    batched = spec_generate(target, drafts, spec, lengths=(5, 9, 7), new=40, params=[seeded, *others])
    assert alone.stats.rounds > 0 and batched[0].stats.rounds > 0
    assert batched[0].token_ids == alone.token_ids
    assert batched[0].stats.drafted == alone.stats.drafted  # the same rounds, not only the same tokens


# ----- stop conditions -------------------------------------------------------------------------


def test_eos_inside_accepted_tokens_ends_the_sequence_there(target):
    expected = ar_greedy(target, (7,), 20)[0]
    # Tokens 1..6 come from the first round (token 0 from the prefill): pick one first seen in 2..5.
    cut = next(i for i in range(2, 6) if expected[i] not in expected[:i])
    params = SamplingParams(max_new_tokens=20, eos_token_ids=(expected[cut],))
    result = spec_generate(target, oracle(target), SpecConfig(5, 5), lengths=(7,), params=params)[0]
    assert result.token_ids == expected[:cut]
    assert result.finish_reason == "stop"
    assert result.stats.rounds == 1


@pytest.mark.parametrize("new", [1, 2, 4, 6, 7, 13])
def test_max_new_tokens_is_exact(target, new):
    results = spec_generate(target, oracle(target), SpecConfig(5, 2), new=new)
    expected = ar_greedy(target, LENGTHS, new)
    assert [r.token_ids for r in results] == expected
    assert all(len(r.token_ids) == new and r.finish_reason == "length" for r in results)


def test_context_limit_is_the_same_as_autoregressive(target):
    """The engine's context (prompt + output <= max_seq_len) holds when a round could overshoot it."""
    for length in (10, 12):
        expected = ar_greedy(target, (length,), 50, max_seq_len=16)[0]
        assert length + len(expected) == 16
        result = spec_generate(target, oracle(target), SpecConfig(5, 2), lengths=(length,), new=50, max_seq_len=16)[0]
        assert result.token_ids == expected
        assert result.finish_reason == "length"


def test_stop_string_inside_accepted_tokens(tiny_target):
    target, tok = tiny_target.model, tiny_target.tokenizer
    plain = DecodeEngine(target, tok, max_batch_size=1, max_seq_len=128)
    prompt = prompts_for(target.args.vocab_size, (7,))
    full = generate(plain, prompt, SamplingParams(max_new_tokens=20, eos_token_ids=()))[0]
    stop = full.text.split(" ")[3]  # the 4th word: inside the first round of 6 tokens
    params = SamplingParams(max_new_tokens=20, eos_token_ids=(), stop=(stop,))
    ar = generate(plain, prompt, params)[0]
    spec = spec_generate(target, oracle(target), SpecConfig(5, 2), lengths=(7,), params=params, tokenizer=tok)[0]
    assert ar.text == full.text[: full.text.find(stop)]
    assert spec.text == ar.text and spec.finish_reason == ar.finish_reason == "stop"
    assert spec.token_ids == ar.token_ids  # no tokens past the stop string reach the caller


def test_stream_deltas_never_show_a_stop_string(tiny_target):
    from engine.generate import stream

    target, tok = tiny_target.model, tiny_target.tokenizer
    eng = DecodeEngine(target, tok, max_batch_size=1, max_seq_len=128, spec=SpecConfig(5, 2))
    eng.add_draft("o", oracle(target))
    prompt = prompts_for(target.args.vocab_size, (7,))[0]
    full = "".join(o.text for o in stream(eng, prompt, SamplingParams(max_new_tokens=24, eos_token_ids=()), "o"))
    words = full.split(" ")
    stop = " ".join(words[8:10])
    seen = ""
    for out in stream(eng, prompt, SamplingParams(max_new_tokens=24, eos_token_ids=(), stop=(stop,)), "o"):
        seen += out.text
        assert full[: full.find(stop)].startswith(seen)
    assert seen == full[: full.find(stop)]


# ----- sampling losslessness -------------------------------------------------------------------
#
# Test: a tiny target (vocabulary V = 8) and a partially trained draft (acceptance ~0.6). From one
# prompt, n requests with seeds 0..n-1 generate K = 3 tokens each: token 1 from the prefill, tokens
# 2-3 from the first speculative round(s). The exact target distribution of the 3 tokens is computed
# by enumeration (V^2 = 64 prefixes). Statistic: total variation (TV) distance between the empirical
# and the exact distribution, per position (V cells) and for the joint (V^3 cells). Under exact
# sampling E[TV] <= 0.5 * sqrt(cells / n); the threshold is twice that bound: 0.02 per position and
# 0.16 for the joint at n = 20k. A verifier that accepts every drafted token, or one that draws the
# recovered token from the target instead of the residual, lands at 0.1-0.4 (checked below at n = 5k).

V, K, PROMPT = 8, 3, [1, 5, 2, 7]


@pytest.fixture(scope="module")
def small(tiny):
    model = tiny.tiny_vocab_target(V, num_layers=3, seed=7)
    draft = DraftModel(model, DraftConfig(shared_layers=1, adapter_layers=2, head="mlp_tied"))
    draft.init_from_target()
    return model, noisy(draft, 1.0)


def exact_joint(model, temperature: float, top_p: float, prompt=PROMPT) -> torch.Tensor:
    """(V, V, V) probabilities of the first K = 3 tokens after `prompt`, by enumeration."""
    seqs = torch.tensor([prompt])
    joint = torch.ones(1)
    for _ in range(K):
        n = seqs.shape[0]
        with torch.no_grad():
            logits = model(seqs, torch.arange(seqs.shape[1])[None].expand(n, -1)).logits[:, -1]
        probs = processed_probs(logits, torch.full((n,), temperature), torch.zeros(n, dtype=torch.long),
                                torch.full((n,), top_p))  # (n, V)
        joint = (joint[:, None] * probs).reshape(-1)
        seqs = torch.cat([seqs.repeat_interleave(V, 0), torch.arange(V).repeat(n)[:, None]], dim=1)
    return joint.view(V, V, V)


def sampled_tokens(model, draft, temperature, top_p, n, spec=SpecConfig(3, 2), batch=500, gamma=None,
                   cuda_graphs=None) -> torch.Tensor:
    eng = DecodeEngine(model, None, max_batch_size=batch, max_seq_len=32, spec=spec, gamma=gamma,
                       cuda_graphs=cuda_graphs)
    eng.add_draft("d", draft)
    params = [SamplingParams(max_new_tokens=K, temperature=temperature, top_p=top_p, seed=i, eos_token_ids=())
              for i in range(n)]
    results = generate(eng, [PROMPT] * n, params, draft="d")
    assert all(r.stats is not None and r.stats.rounds >= 1 for r in results)
    return torch.tensor([r.token_ids for r in results])  # (n, K)


def distances(tokens: torch.Tensor, exact: torch.Tensor) -> tuple[list[float], float]:
    n = tokens.shape[0]
    empirical = torch.zeros(V, V, V)
    empirical.index_put_((tokens[:, 0], tokens[:, 1], tokens[:, 2]), torch.ones(n), accumulate=True)
    empirical /= n
    per_position = []
    for pos in range(K):
        others = tuple(d for d in range(K) if d != pos)
        per_position.append(0.5 * (empirical.sum(others) - exact.sum(others)).abs().sum().item())
    return per_position, 0.5 * (empirical - exact).abs().sum().item()


def thresholds(n: int) -> tuple[float, float]:
    return 2 * 0.5 * (V / n) ** 0.5, 2 * 0.5 * (V**K / n) ** 0.5


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_sampling_is_lossless(small, temperature, top_p):
    model, draft = small
    n = 20000
    tokens = sampled_tokens(model, draft, temperature, top_p, n)
    exact = exact_joint(model, temperature, top_p)
    per_position, joint = distances(tokens, exact)
    position_max, joint_max = thresholds(n)
    assert max(per_position) < position_max, per_position
    assert joint < joint_max, joint
    # The draft really disagrees with the target (else the check would be vacuous).
    assert _draft_target_tv(model, draft, temperature, top_p) > 0.1


@pytest.mark.parametrize("path", ["general loop", "one-graph round", "whole vocabulary"])
def test_sampling_is_lossless_with_a_sub_vocabulary_draft(tiny, path, monkeypatch):
    """A draft scoring 5 of the 8 tokens (listed out of id order) draws its tokens over those 5 and the
    verifier spreads its distribution over the vocabulary only where it needs it: the output still has
    the target's distribution, in the general loop (blocks of 2) and in the captured round (emulated);
    and so it has with `sub_vocab_draws=False`, which draws over the whole vocabulary."""
    model = tiny.tiny_vocab_target(V, num_layers=3, seed=7)
    draft = DraftModel(model, DraftConfig(shared_layers=1, adapter_layers=2, head="mlp_tied", head_vocab=5))
    draft.init_from_target()
    draft.set_vocab(torch.tensor([6, 1, 3, 0, 7]))
    draft = noisy(draft, 1.0)
    subs = []
    real = speculative.verify_sampled
    monkeypatch.setattr(speculative, "verify_sampled",
                        lambda *a, **kw: subs.append(kw.get("draft_vocab") is not None) or real(*a, **kw))
    n = 20000
    one_graph = path == "one-graph round"
    whole = path == "whole vocabulary"
    tokens = sampled_tokens(model, draft, 1.0, 1.0, n, spec=SpecConfig(3, 3 if one_graph else 2, sub_vocab_draws=not whole),
                            batch=256, cuda_graphs="emulate" if one_graph else None)
    assert subs and all(s != whole for s in subs)  # every round drew over the sub-vocabulary (or over the whole)
    per_position, joint = distances(tokens, exact_joint(model, 1.0, 1.0))
    position_max, joint_max = thresholds(n)
    assert max(per_position) < position_max, per_position
    assert joint < joint_max, joint


def test_sampling_is_lossless_with_adaptive_gamma(small):
    """Rounds of different gammas (the controller cycles through 1-3 and then picks by measured rates)."""
    from engine.gamma import GammaController

    model, draft = small
    n = 20000
    ctl = GammaController(3, min_rounds=4, explore_every=2, pin_seeded=False)  # the seeds here only fix the draws
    tokens = sampled_tokens(model, draft, 1.0, 1.0, n, gamma=ctl)
    assert len(ctl.chosen) == 3, ctl.chosen
    per_position, joint = distances(tokens, exact_joint(model, 1.0, 1.0))
    position_max, joint_max = thresholds(n)
    assert max(per_position) < position_max, per_position
    assert joint < joint_max, joint


def _draft_target_tv(model, draft, temperature, top_p) -> float:
    pos = torch.arange(len(PROMPT))[None]
    tokens = torch.tensor([PROMPT])
    with torch.no_grad():
        target_logits = model(tokens, pos).logits[:, -1]
        trunk = model(tokens, pos, layers=range(0, 1)).hidden
        draft_logits = draft.forward_train(trunk, None, pos)[0][:, -1]
    args = (torch.tensor([temperature]), torch.tensor([0]), torch.tensor([top_p]))
    return 0.5 * (processed_probs(target_logits, *args) - processed_probs(draft_logits, *args)).abs().sum().item()


def _accept_all(draft_tokens, draft_probs, target_probs, streams, **_):
    batch, k = draft_tokens.shape
    return VerifyResult(torch.full((batch,), k), sample(target_probs[:, k], streams))


def _recover_from_target(draft_tokens, draft_probs, target_probs, streams, **kw):
    result = _REAL_VERIFY(draft_tokens, draft_probs, target_probs, streams, **kw)
    rows = torch.arange(draft_tokens.shape[0])
    wrong = sample(target_probs[rows, result.num_accepted], streams)
    rejected = result.num_accepted < draft_tokens.shape[1]
    return VerifyResult(result.num_accepted, torch.where(rejected, wrong, result.next_token))


_REAL_VERIFY = speculative.verify_sampled


@pytest.mark.parametrize("broken", [_accept_all, _recover_from_target], ids=["accept-all", "recover-from-target"])
def test_sampling_check_detects_a_broken_verifier(small, monkeypatch, broken):
    model, draft = small
    monkeypatch.setattr(speculative, "verify_sampled", broken)
    n = 5000
    tokens = sampled_tokens(model, draft, 1.0, 1.0, n)
    per_position, joint = distances(tokens, exact_joint(model, 1.0, 1.0))
    position_max, joint_max = thresholds(n)
    assert max(per_position) > position_max or joint > joint_max, (per_position, joint)


# ----- the CUDA-graph path's shapes (emulated on CPU: same keys, padding and static buffers) -----------


def _mixed_drafts(target):
    return [oracle(target), random_draft(target, adapter_layers=2), noisy(oracle(target), 0.5),
            oracle(target, deep=True), None]


@pytest.mark.parametrize("gamma, block", [(5, 5), (3, 3), (5, 2)])
@pytest.mark.parametrize("window", [None, 8])
def test_graph_path_with_mixed_drafts_is_lossless(target, gamma, block, window):
    """Several drafts in one captured drafting loop (rows grouped by draft), a batch padded to its bucket
    (5 rows run as 8 with the scratch row), greedy: every row equals plain decoding."""
    lengths = LENGTHS + (9,)
    results = spec_generate(target, _mixed_drafts(target), SpecConfig(gamma, block, draft_kv_window=window),
                            lengths=lengths, max_batch_size=8, cuda_graphs="emulate", mixed_round_graph=True)
    assert [r.token_ids for r in results] == ar_greedy(target, lengths)
    if window is None:
        assert results[0].stats.acceptance_rate == 1.0 and results[3].stats.acceptance_rate == 1.0


@pytest.mark.parametrize("mixed", [False, True], ids=["per-piece", "one-graph"])
def test_graph_path_with_scattered_rows_equals_plain_decoding(target, mixed):
    """Requests finishing at different times leave gaps between the running rows and new requests fill
    them: every step then runs on scattered rows, padded, with the rows as a graph input."""
    drafts = _mixed_drafts(target)
    vocab = target.args.vocab_size
    eng = DecodeEngine(target, None, max_batch_size=6, max_seq_len=128, spec=SpecConfig(5, 5), cuda_graphs="emulate",
                       mixed_round_graph=mixed)
    names = []
    for i, d in enumerate(drafts):
        if d is not None:
            eng.add_draft(f"d{i}", d)
        names.append(f"d{i}" if d is not None else None)
    lengths = (5, 17, 2, 30, 9, 12, 7, 21, 3, 14)
    news = (4, 30, 9, 25, 3, 18, 22, 6, 15, 11)
    prompts = prompts_for(vocab, lengths)
    requests = [Request(f"r{i}", prompts[i], SamplingParams(max_new_tokens=news[i], eos_token_ids=()), names[i % 5])
                for i in range(len(lengths))]
    got = {r.request_id: [] for r in requests}
    pending = list(requests)
    for r in pending[:6]:
        eng.add_request(r)
    pending = pending[6:]
    scattered = 0
    while eng.has_work():
        running = [i for i, s in enumerate(eng.slots) if s is not None]
        scattered += bool(running) and running != list(range(running[0], running[0] + len(running)))
        for out in eng.step():
            got[out.request_id].extend(out.token_ids)
            if out.finished and pending:
                eng.add_request(pending.pop(0))
    assert scattered > 0
    assert any("bucket" in k for k in eng.graphs.graphs)
    for i, r in enumerate(requests):
        expected = ar_greedy(target, (lengths[i],), news[i])[0]
        assert got[r.request_id] == expected, f"request {i} (draft {names[i % 5]})"


@pytest.mark.parametrize("head_vocab", [None, 48], ids=["whole vocabulary", "sub-vocabulary"])
@pytest.mark.parametrize("top_p", [1.0, 0.9], ids=["unfiltered", "top-p"])
def test_sampled_rows_in_the_one_graph_round_match_the_general_loop(target, top_p, head_vocab, monkeypatch):
    """Block == gamma: sampled rows (and a greedy one among them) run the whole round as one graph, with
    the random streams' state as a graph input. The draws come in the general loop's order, so the seeded
    tokens are the same, and the graph path really ran; so too when the draft draws over a sub-vocabulary."""
    params = [SamplingParams(max_new_tokens=NEW, eos_token_ids=(), temperature=t, top_p=top_p, seed=i)
              for i, t in enumerate((0.8, 1.0, 0.0, 1.3))]
    draft = oracle(target, head_vocab=head_vocab) if head_vocab else oracle(target)
    draft = noisy(_sub_vocab(draft) if head_vocab else draft, 0.5)  # one draft: every batch takes the one-graph round
    plain = spec_generate(target, draft, SpecConfig(5, 5), params=params)
    captured = []
    real = speculative._captured_round

    def spy(eng, slots, drafts, gamma, kv_len, greedy, *rest):
        captured.append(greedy)
        return real(eng, slots, drafts, gamma, kv_len, greedy, *rest)

    monkeypatch.setattr(speculative, "_captured_round", spy)
    hashed = []  # one hash of the counters a round: each small op of it is a kernel in the graph
    monkeypatch.setattr(speculative, "uniform_at", lambda *a, real=speculative.uniform_at: hashed.append(a[2]) or real(*a))
    emulated = spec_generate(target, draft, SpecConfig(5, 5), params=params, max_batch_size=8, cuda_graphs="emulate")
    assert [r.token_ids for r in emulated] == [r.token_ids for r in plain]
    assert False in captured  # sampled rounds went through the graph path
    assert len(hashed) == captured.count(False) and {shape[1] for shape in hashed} == {11}  # 2 * gamma + 1 draws
    assert 0 < sum(r.stats.accepted for r in emulated) < sum(r.stats.drafted for r in emulated)  # both outcomes


def test_sampled_plain_decoding_in_multi_step_graphs_matches_one_step_decoding(target, monkeypatch):
    """Plain sampled rows decode 4 steps per graph with the streams' state as an input; rows cut short
    (another row of the batch reaches its limit mid-graph) draw the same numbers again next call, so the
    seeded tokens equal one-step decoding's."""
    params = [SamplingParams(max_new_tokens=n, eos_token_ids=(), temperature=1.0, top_k=k, seed=7 + n)
              for n, k in ((5, 0), (9, 20), (14, 0), (22, 0))]
    plain = spec_generate(target, None, SpecConfig(5, 5), params=params)
    graphs = spec_generate(target, None, SpecConfig(5, 5), params=params, cuda_graphs="emulate", ar_steps_per_sync=4)
    assert [r.token_ids for r in graphs] == [r.token_ids for r in plain]
    import engine.scheduler as scheduler

    hashed = []  # a 4-step call hashes its counters once, not once a step
    monkeypatch.setattr(scheduler, "uniform_at", lambda *a, real=scheduler.uniform_at: hashed.append(a[2]) or real(*a))
    spec_generate(target, None, SpecConfig(5, 5), params=params, cuda_graphs="emulate", ar_steps_per_sync=4)
    assert hashed and {shape[1] for shape in hashed} == {4}
    assert [len(r.token_ids) for r in graphs] == [5, 9, 14, 22]


@pytest.mark.parametrize("block", [2, 5], ids=["per-piece", "one-graph"])
def test_graph_path_sampled_rows_match_the_plain_path(target, block):
    """Sampled rows of three drafts and a plain one: block 2 takes the per-step graphs (padded when
    scattered), block 5 runs each round of the mixed batch as one graph with every draft over all rows.
    Same seeded tokens as without graphs."""
    params = [SamplingParams(max_new_tokens=NEW, eos_token_ids=(), temperature=0.8, top_p=0.9, seed=i)
              for i in range(len(LENGTHS))]
    drafts = [noisy(oracle(target), 0.5), oracle(target, deep=True), None, noisy(oracle(target), 0.3)]
    plain = spec_generate(target, drafts, SpecConfig(5, block), params=params)
    emulated = spec_generate(target, drafts, SpecConfig(5, block), params=params, max_batch_size=8,
                             cuda_graphs="emulate")
    assert [r.token_ids for r in emulated] == [r.token_ids for r in plain]


def test_a_mixed_round_graph_depends_on_the_set_of_drafts_not_their_rows(target):
    """Batches of the same two drafts in any proportion and order replay one round graph; a batch of one
    draft has its own. (Oracle drafts: every row keeps all its rows' pace, so the batch stays 4 rows.)"""
    eng = DecodeEngine(target, None, max_batch_size=4, max_seq_len=128, spec=SpecConfig(5, 5), cuda_graphs="emulate")
    eng.add_draft("a", oracle(target))
    eng.add_draft("b", oracle(target, deep=True))
    prompts = prompts_for(target.args.vocab_size, (6, 9, 4, 7))
    params = SamplingParams(max_new_tokens=12, eos_token_ids=())
    expected = ar_greedy(target, (6, 9, 4, 7), 12)

    def rounds():
        return {k for k in eng.graphs.graphs if k[0] == "greedy-round"}

    assert [r.token_ids for r in generate(eng, prompts, params, draft=["a", "b", "b", "b"])] == expected
    first = rounds()
    assert len(first) == 1 and next(iter(first))[1] == 2  # one graph, of two drafts
    for mix in (["b", "a", "a", "b"], ["a", "a", "b", "a"], ["b", "b", "a", "a"]):
        assert [r.token_ids for r in generate(eng, prompts, params, draft=mix)] == expected
    assert rounds() == first
    assert [r.token_ids for r in generate(eng, prompts, params, draft=["b"] * 4)] == expected
    assert {k[1] for k in rounds() - first} == {1}


def test_warmup_captures_the_bucket_shapes_ahead_of_traffic(target):
    eng = DecodeEngine(target, None, max_batch_size=4, max_seq_len=128, spec=SpecConfig(5, 5), cuda_graphs="emulate")
    eng.add_draft("code", oracle(target))
    eng.add_draft("chat", noisy(oracle(target, deep=True), 0.3))
    assert eng.warmup(max_len=40, prompt_len=8) > 0
    assert not eng.has_work() and eng.num_running == 0
    captured = len(eng.graphs)
    # Three rows (padded to the 4-row bucket), plain and speculative, inside the warmed-up lengths.
    prompts = prompts_for(target.args.vocab_size, (6, 9, 4))
    params = SamplingParams(max_new_tokens=20, eos_token_ids=())
    plain = generate(eng, prompts, params)
    spec = generate(eng, prompts, params, draft=["code", "code", "code"])
    assert len(eng.graphs) == captured
    expected = ar_greedy(target, (6, 9, 4), 20)
    assert [r.token_ids for r in plain] == expected and [r.token_ids for r in spec] == expected


class BoundedSdpa(SdpaBackend):
    """SDPA standing in for a backend that reads no cache slot past a row's position (the Triton kernel on
    CUDA; the mask hides those slots, so the tokens are the same): the engine then keys no graph by length."""

    bounds_by_position = True


def _traffic(eng, vocab: int) -> list:
    """Greedy, sampled and top-p requests, plain, one draft, two of three drafts and plain rows mixed, more of
    them than rows (later ones land in scattered rows as others finish), longer than warm-up generates."""
    lengths, news = (6, 9, 4, 7, 12, 5), (50, 23, 61, 8, 40, 33)
    prompts = prompts_for(vocab, lengths)
    outs = []
    for kind in ({}, {"temperature": 1.0}, {"temperature": 0.8, "top_p": 0.9}):
        params = [SamplingParams(max_new_tokens=n, eos_token_ids=(), seed=i, **kind) for i, n in enumerate(news)]
        for mix in ([None] * 6, ["a"] * 6, ["a", "b", "a", "b", "b", "a"], [None, "a", "c", None, "b", "c"]):
            outs.append(generate(eng, prompts, params, draft=mix))
    return outs


@pytest.mark.slow  # about 95 s on 2 cores: `make test-slow` (the default suite keeps under 15 minutes)
def test_warmup_with_a_position_bounded_backend_captures_every_graph_serving_runs(target, monkeypatch):
    """With attention bounded by position, graphs do not depend on the sequence length: warm-up captures every
    graph, and traffic of any length, sampling kind, row layout and mix of drafts captures none (a mix runs
    all three drafts). Greedy tokens stay exact; replacing a draft and `warm_draft` restore the state."""
    model = target
    monkeypatch.setattr(model, "backend", BoundedSdpa())
    eng = DecodeEngine(model, None, max_batch_size=4, max_seq_len=128, spec=SpecConfig(3, 3), cuda_graphs="emulate",
                       gamma=GammaController(3))
    eng.add_draft("a", noisy(oracle(model), 0.3))
    eng.add_draft("b", oracle(model, deep=True))
    eng.add_draft("c", noisy(oracle(model), 0.6, seed=9))
    assert eng.kv_bucket(5) == eng.kv_bucket(100) == eng.cache.max_seq_len
    assert eng.warmup(max_len=16, prompt_len=4) > 0
    warmed = eng.graphs.captures
    outs = _traffic(eng, model.args.vocab_size)
    assert eng.graphs.captures == warmed
    expected = ar_greedy(target, (6, 9, 4, 7, 12, 5), 61)
    for out in outs[:4]:  # greedy: the target's own tokens
        assert [r.token_ids for r in out] == [e[:len(r.token_ids)] for e, r in zip(expected, out)]
        assert [len(r.token_ids) for r in out] == [50, 23, 61, 8, 40, 33]
    assert {k[1] for k in eng.graphs.graphs if k[0] == "greedy-round"} == {1, 3}  # one draft, or all three
    # The gamma controller prices a round by the graph it runs: a pair of drafts as the three-draft graph.
    assert {ast.literal_eval(k)[1] for k in eng.gamma.snapshot()["round_ms"]} == {1, 3}
    eng.add_draft("b", noisy(oracle(model), 0.2, seed=4))  # a new version: its graphs and the mixes' go
    assert eng.warm_draft("b", max_len=16, prompt_len=4) > 0
    warmed = eng.graphs.captures
    _traffic(eng, model.args.vocab_size)
    assert eng.graphs.captures == warmed
    with pytest.raises(ValueError, match="unknown warm-up sampling"):
        eng.warmup(sampling=("beam",))
    # A request arriving ends a draft's warm-up early (asked before each warm-up generation); the engine is
    # left idle and whole.
    eng.add_draft("c", noisy(oracle(model), 0.5, seed=11))
    asked = []
    assert eng.warm_draft("c", stop=lambda: asked.append(1) or len(asked) > 2) > 0
    assert len(asked) == 3 and not eng.has_work() and eng.gamma.forced is None
    assert eng.warm_draft("c", stop=lambda: True) == 0
    with pytest.raises(KeyError, match="no draft named 'd'"):
        eng.warm_draft("d")


def test_warmup_captures_every_prefill_graph_admissions_run(target, monkeypatch):
    """With prefill graphs, warm-up also captures the prefill pass of every padded prompt length, batch bucket,
    row layout and set of drafts: admissions of any prompt length then capture nothing, with exact greedy tokens."""
    monkeypatch.setattr(target, "backend", BoundedSdpa())
    eng = DecodeEngine(target, None, max_batch_size=2, max_seq_len=128, spec=SpecConfig(3, 3), cuda_graphs="emulate",
                       prefill_graphs=True)
    eng.add_draft("a", noisy(oracle(target), 0.3))
    eng.add_draft("b", layered(target, (2,)))
    assert eng.warmup(max_len=16, prompt_len=4, sampling=("greedy",)) > 0
    assert {k[1] for k in eng.graphs.graphs if k[0] == "prefill"} == {16, 32, 64, 128}
    warmed = eng.graphs.captures
    lengths, new = (3, 20, 40, 70), 12
    params = SamplingParams(max_new_tokens=new, eos_token_ids=())
    for mix in ([None] * 4, ["a"] * 4, ["b", None, "a", "b"]):
        out = generate(eng, prompts_for(target.args.vocab_size, lengths), params, draft=mix)
        assert [r.token_ids for r in out] == ar_greedy(target, lengths, new)
    assert eng.graphs.captures == warmed


def test_prefill_graphs_are_on_by_default_wherever_graphs_are(target, monkeypatch):
    """An engine that captures graphs runs its prefills as graphs too unless FLASHSPEC_PREFILL_GRAPHS=0; one
    that captures none (the CPU default) runs them eagerly whatever the environment says."""
    monkeypatch.delenv("FLASHSPEC_PREFILL_GRAPHS", raising=False)
    assert DecodeEngine(target, None, max_batch_size=1, max_seq_len=32, cuda_graphs="emulate").prefill_graphs
    assert not DecodeEngine(target, None, max_batch_size=1, max_seq_len=32).prefill_graphs  # no graphs on the CPU
    assert not DecodeEngine(target, None, max_batch_size=1, max_seq_len=32, cuda_graphs="emulate",
                            prefill_graphs=False).prefill_graphs
    monkeypatch.setenv("FLASHSPEC_PREFILL_GRAPHS", "0")
    assert not DecodeEngine(target, None, max_batch_size=1, max_seq_len=32, cuda_graphs="emulate").prefill_graphs


# ----- admissions beside the running rows (DecodeEngine(side_prefill=True)) -----------------------------------


def _slow_prefills(monkeypatch, polls: int = 2) -> None:
    """Each admission's prefill reads as still running the first `polls` times it is asked (on the CPU a launched
    prefill is done at once): the running rows then keep decoding beside it, as on a GPU's second stream."""
    from engine import scheduler

    real = scheduler._Admission.done

    def done(self):
        self.polled = getattr(self, "polled", 0) + 1
        return self.polled > polls and real(self)

    monkeypatch.setattr(scheduler._Admission, "done", done)


def _admission_traffic(target, eng, names):
    """12 requests of different lengths and draft names (a seeded sampled one among them) on a smaller batch: most
    are admitted while other rows run. -> (tokens by request, steps at which an admission was pending while rows
    ran, chained calls launched while one was pending)."""
    vocab = target.args.vocab_size
    lengths = (5, 17, 2, 30, 9, 12, 7, 21, 3, 14, 6, 11)
    news = (4, 30, 9, 25, 3, 18, 22, 6, 15, 11, 1, 20)
    prompts = prompts_for(vocab, lengths)
    requests = [Request(f"r{i}", prompts[i], SamplingParams(max_new_tokens=news[i], eos_token_ids=(),
                                                            temperature=0.9 if i == 5 else 0.0, seed=i),
                        names[i % len(names)]) for i in range(len(lengths))]
    for r in requests:
        eng.add_request(r)
    got = {r.request_id: [] for r in requests}
    beside, chained = 0, []
    real = eng._launch_next_round
    eng._launch_next_round = lambda *a: chained.append(bool(eng._admitting)) or real(*a)
    while eng.has_work():
        beside += bool(eng._admitting) and eng.num_running > 0
        for out in eng.step():
            got[out.request_id].extend(out.token_ids)
    eng.settle()
    assert not eng.has_work() and eng.num_admitting == 0 and len(eng._free_rows()) == len(eng.slots)
    return got, beside, sum(chained), requests, news


@pytest.mark.parametrize("overlap", [False, True], ids=["one call at a time", "overlapped"])
def test_admissions_beside_running_rows_give_the_same_tokens(target, monkeypatch, overlap):
    """With side_prefill, an admission's prefill runs while the other rows keep decoding and its rows join once it
    has run: lookup, draft (deep features, a windowed draft cache) and plain rows, greedy and seeded sampled, give
    the same tokens as with every admission stopping the batch, and the greedy ones plain decoding's."""
    _slow_prefills(monkeypatch)
    names = ["lookup", "deep", None, "lookup", "win"]

    def run(side):
        eng = _lookup_engine(target, "emulate", overlap, extra={"deep": oracle(target, deep=True),
                                                                "win": noisy(oracle(target), 0.4)},
                             side_prefill=side)
        return _admission_traffic(target, eng, names)

    stopped, stopped_beside, _, requests, news = run(False)
    got, beside, chained, _, _ = run(True)
    assert got == stopped
    assert stopped_beside == 0 and beside > 5  # without it no row runs while an admission is pending
    assert (chained > 0) == overlap  # chained calls ran while a prefill did
    for i, r in enumerate(requests):
        assert len(got[r.request_id]) == news[i]
        if not r.params.temperature:
            assert got[r.request_id] == ar_greedy(target, (len(r.prompt_ids),), news[i])[0], f"request {i}"


def test_a_request_cancelled_while_its_prefill_runs_leaves_its_row_free(target, monkeypatch):
    """An admitting request (its prefill launched, its row reserved) is listed, can be cancelled, never produces a
    token, and its row takes the next request; the others are unaffected."""
    _slow_prefills(monkeypatch, polls=3)
    eng = _lookup_engine(target, "emulate", overlap=True, side_prefill=True)
    vocab = target.args.vocab_size
    prompts = prompts_for(vocab, (9, 4, 14, 6))
    params = SamplingParams(max_new_tokens=20, eos_token_ids=())
    for i in range(2):
        eng.add_request(Request(f"r{i}", prompts[i], params, "lookup"))
    seen = {}

    def arrive(e):
        e.add_request(Request("r2", prompts[2], params, "lookup"))
        e.add_request(Request("r3", prompts[3], params))

    def cancel(e):
        assert e.num_admitting == 0 or "r2" in e.request_ids()
        seen["admitting"] = e.num_admitting
        assert e.cancel("r2")

    got, _ = drive(eng, {2: arrive, 3: cancel})
    assert seen["admitting"] >= 1  # r2 was admitting when cancelled
    assert "r2" not in got and not eng.cancel("r2")
    for i in (0, 1, 3):
        assert got[f"r{i}"] == ar_greedy(target, (len(prompts[i]),), 20)[0]
    assert not eng.has_work() and len(eng._free_rows()) == 4


# ----- admissions prefilled ahead of a free running row (DecodeEngine(prefill_ahead=k)) ------------------------


@pytest.mark.parametrize("graphs,overlap,side", [(None, False, False), ("emulate", True, False),
                                                 ("emulate", True, True)],
                         ids=["eager", "overlapped", "overlapped, prefills beside"])
def test_prefill_ahead_gives_the_same_tokens_in_fewer_prefill_passes(target, monkeypatch, graphs, overlap, side):
    """With prefill_ahead, a row that frees with no prefilled request to take it prefills a group into the rows
    ahead too; the others take the next rows that free without a pass of their own. Lookup, draft and plain rows,
    greedy and seeded sampled: the same tokens as admitting one free row at a time, never more rows running than
    max_batch_size, fewer prefill passes, and every row free at the end."""
    if side:
        _slow_prefills(monkeypatch)
    names = ["lookup", "deep", None, "lookup", "win"]

    def run(ahead):
        eng = _lookup_engine(target, graphs, overlap, extra={"deep": oracle(target, deep=True),
                                                             "win": noisy(oracle(target), 0.4)},
                             side_prefill=side, prefill_ahead=ahead)
        sizes, peak = [], []
        real_prefill, real_step = eng._prefill, eng.step
        monkeypatch.setattr(eng, "_prefill", lambda batch: (sizes.append(len(batch)), real_prefill(batch))[1])
        monkeypatch.setattr(eng, "step", lambda: (real_step(), peak.append(eng.num_running))[0])
        got, *_, requests, news = _admission_traffic(target, eng, names)
        return got, sizes, max(peak), requests, news, eng

    base, base_sizes, base_peak, requests, news = run(0)[:5]
    got, sizes, peak, _, _, eng = run(3)
    assert got == base
    assert len(eng.slots) == eng.max_batch_size + 3 and eng.cache_rows == len(eng.slots) + (graphs is not None)
    assert peak == base_peak == eng.max_batch_size  # rows ahead never run beside a full batch
    assert sum(sizes) == sum(base_sizes) == len(requests)
    assert max(sizes) <= eng.max_batch_size and len(sizes) < len(base_sizes), (sizes, base_sizes)
    for i, r in enumerate(requests):
        assert len(got[r.request_id]) == news[i]
        if not r.params.temperature:
            assert got[r.request_id] == ar_greedy(target, (len(r.prompt_ids),), news[i])[0], f"request {i}"


def test_a_request_cancelled_while_prefilled_ahead_frees_its_row_and_the_others_run(target):
    """Requests prefilled ahead wait in their rows (admitting, listed) while the batch is full; one cancelled there
    never produces a token and its row is free again; the others join as rows free and give plain decoding's
    tokens."""
    eng = DecodeEngine(target, None, max_batch_size=2, max_seq_len=128, spec=SpecConfig(5, 5), prefill_ahead=3)
    eng.add_draft("lookup", LookupDraft())
    vocab = target.args.vocab_size
    prompts = prompts_for(vocab, (9, 4, 14, 6, 11))
    news = (3, 20, 12, 12, 12)
    for i, p in enumerate(prompts):
        eng.add_request(Request(f"r{i}", p, SamplingParams(max_new_tokens=news[i], eos_token_ids=()),
                                "lookup" if i % 2 else None))
    seen = {}

    def cancel(e):
        seen["ids"], seen["admitting"], seen["running"] = e.request_ids(), e.num_admitting, e.num_running
        seen["waiting"] = [r.request_id for r in e.waiting]
        assert e.cancel("r3")

    got, first = drive(eng, {3: cancel})
    # r0 frees its row first (step 1): r2 takes it at step 2, prefilled with r3 (at most max_batch_size a pass),
    # which waits ahead; r4 waits for a prefill pass
    assert seen["running"] == 2 and seen["admitting"] == 1 and seen["waiting"] == ["r4"]
    assert sorted(seen["ids"]) == ["r1", "r2", "r3", "r4"]
    assert "r3" not in got and not eng.cancel("r3")
    for i in (0, 1, 2, 4):
        assert got[f"r{i}"] == ar_greedy(target, (len(prompts[i]),), news[i])[0], f"request {i}"
    assert first["r4"] > first["r2"]  # r4 joined only once a running row freed
    assert not eng.has_work() and len(eng._free_rows()) == len(eng.slots) == 5


def test_a_draft_needing_a_larger_cache_is_refused_while_a_request_waits_prefilled_on_a_draft(target):
    """A draft with more adapter layers than the draft cache holds replaces that cache, so it is refused while a
    speculative request holds it: running, or prefilled ahead and waiting for a row (its draft's KV is in the cache)."""
    eng = DecodeEngine(target, None, max_batch_size=2, max_seq_len=128, spec=SpecConfig(3, 3), prefill_ahead=2)
    eng.add_draft("a", random_draft(target, adapter_layers=1))
    prompts = prompts_for(target.args.vocab_size, (5, 7, 6, 9))
    for i, (news, draft) in enumerate(((2, None), (30, None), (30, None), (5, "a"))):
        eng.add_request(Request(f"r{i}", prompts[i], SamplingParams(max_new_tokens=news, eos_token_ids=()), draft))
    while not eng._admitting:  # r0 finishes; r2 takes its row, r3 (on draft "a") waits prefilled
        eng.step()
    assert [s.request.request_id for a in eng._admitting for s in a.states] == ["r3"]
    assert all(s is None or s.draft is None for s in eng.slots)  # the running rows decode plainly
    with pytest.raises(ValueError, match="no speculative request runs"):
        eng.add_draft("b", random_draft(target, adapter_layers=2))
    while eng.has_work():
        eng.step()
    eng.add_draft("b", random_draft(target, adapter_layers=2))
    assert eng.draft_cache.num_layers == 2


def test_prefill_ahead_must_be_a_count(target):
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="prefill_ahead"):
            DecodeEngine(target, None, max_batch_size=2, max_seq_len=32, prefill_ahead=bad)


def test_side_prefill_is_off_unless_asked_for_and_needs_captured_graphs(target, monkeypatch):
    """Side prefill is off by default (it did not pay on the H200); FLASHSPEC_SIDE_PREFILL=1 turns it on for an
    engine capturing graphs on CUDA, never for one on the CPU (eager or emulated graphs), which takes it only when
    asked for (the bookkeeping alone, for tests)."""
    from engine.scheduler import side_prefill_default

    monkeypatch.delenv("FLASHSPEC_SIDE_PREFILL", raising=False)
    assert not side_prefill_default()
    monkeypatch.setenv("FLASHSPEC_SIDE_PREFILL", "1")
    assert side_prefill_default()
    assert not DecodeEngine(target, None, max_batch_size=1, max_seq_len=32).side_prefill
    assert not DecodeEngine(target, None, max_batch_size=1, max_seq_len=32, cuda_graphs="emulate").side_prefill
    eng = DecodeEngine(target, None, max_batch_size=1, max_seq_len=32, cuda_graphs="emulate", side_prefill=True)
    assert eng.side_prefill and eng._side_stream is None and eng._main_stream is None


def test_replacing_a_draft_drops_its_graphs(target):
    eng = DecodeEngine(target, None, max_batch_size=2, max_seq_len=64, spec=SpecConfig(3, 3), cuda_graphs="emulate")
    first = oracle(target)
    eng.add_draft("code", first)
    generate(eng, prompts_for(target.args.vocab_size, (5,)), SamplingParams(max_new_tokens=8, eos_token_ids=()),
             draft="code")
    assert any(str(id(first)) in str(k) for k in eng.graphs.graphs)
    eng.add_draft("code", noisy(oracle(target), 0.2))
    assert not any(str(id(first)) in str(k) for k in eng.graphs.graphs)
    eng.remove_draft("code")
    assert not any("greedy-round" in k for k in eng.graphs.graphs)


def test_graph_path_multi_step_plain_decoding_is_exact(target):
    """Plain greedy rows decode 4 steps per graph; rows needing fewer tokens (or hitting max_new_tokens,
    EOS or the context mid-graph) still end exactly where one-step decoding ends, and the graph count
    does not grow with the number of tokens left."""
    vocab = target.args.vocab_size
    lengths, news = (5, 17, 2, 30), (7, 13, 2, 30)
    prompts = prompts_for(vocab, lengths)
    eng = DecodeEngine(target, None, max_batch_size=4, max_seq_len=60, ar_steps_per_sync=4, cuda_graphs="emulate")
    got = [r.token_ids for r in generate(eng, prompts, [SamplingParams(max_new_tokens=n, eos_token_ids=()) for n in news])]
    expected = [ar_greedy(target, (n,), new)[0] for n, new in zip(lengths, news)]
    assert got == expected
    assert {k[1] for k in eng.graphs.graphs if k[0] == "ar-greedy"} == {4}
    # The context limit: a 50-token prompt in a 60-token engine stops at 9 new tokens, as without graphs.
    long = prompts_for(vocab, (50,))
    plain = DecodeEngine(target, None, max_batch_size=1, max_seq_len=60)
    params = SamplingParams(max_new_tokens=40, eos_token_ids=())
    assert generate(eng, long, params)[0].token_ids == generate(plain, long, params)[0].token_ids
    # EOS inside a graph's 4 steps: the row ends at the EOS, like one-step decoding.
    eos = expected[1][5]
    with_eos = SamplingParams(max_new_tokens=30, eos_token_ids=(eos,))
    assert generate(eng, [prompts[1]], with_eos)[0].token_ids == generate(plain, [prompts[1]], with_eos)[0].token_ids


@pytest.mark.parametrize("gamma, block", [(5, 5), (5, 2), (3, 1)])
def test_early_stop_on_low_draft_confidence_is_lossless_and_drafts_less(target, gamma, block):
    """draft_confidence ends a round's drafting once no row trusts its next token: same output, fewer drafts."""
    drafts = [noisy(oracle(target), 0.5), random_draft(target), oracle(target, deep=True), noisy(oracle(target), 0.3)]
    full = spec_generate(target, drafts, SpecConfig(gamma, block))
    early = spec_generate(target, drafts, SpecConfig(gamma, block, draft_confidence=0.5))
    expected = ar_greedy(target)
    assert [r.token_ids for r in full] == expected and [r.token_ids for r in early] == expected
    assert sum(r.stats.drafted for r in early) < sum(r.stats.drafted for r in full)
    # Sampled rows stay reproducible with the same seed and keep their length.
    params = [SamplingParams(max_new_tokens=NEW, eos_token_ids=(), temperature=0.9, seed=i) for i in range(len(LENGTHS))]
    a = spec_generate(target, drafts, SpecConfig(gamma, block, draft_confidence=0.5), params=params)
    b = spec_generate(target, drafts, SpecConfig(gamma, block, draft_confidence=0.5), params=params)
    assert [r.token_ids for r in a] == [r.token_ids for r in b] and all(len(r.token_ids) == NEW for r in a)


def test_draft_confidence_is_validated():
    with pytest.raises(ValueError, match="draft_confidence"):
        SpecConfig(5, 5, draft_confidence=1.0)


@pytest.mark.parametrize("block", [1, 2], ids=["stop-between-blocks", "stop-inside-a-block"])
def test_sampling_with_early_stop_is_lossless(small, block):
    """draft_confidence 0.99 stops every round after its first drafted token: between blocks (block 1:
    the bonus token comes from the carried target distribution) or inside one (block 2: a truncated
    block is verified as the round's last). The output distribution stays the target's."""
    model, draft = small
    n = 20000
    tokens = sampled_tokens(model, draft, 1.0, 1.0, n, spec=SpecConfig(3, block, draft_confidence=0.99))
    per_position, joint = distances(tokens, exact_joint(model, 1.0, 1.0))
    position_max, joint_max = thresholds(n)
    assert max(per_position) < position_max, per_position
    assert joint < joint_max, joint


# ----- deep features in the engine are the ones training uses -----------------------------------------


@pytest.mark.parametrize("layers", [(), (2,), (2, 3)], ids=["final", "final+2", "final+2+3"])
@pytest.mark.parametrize("path", ["loop", "one-graph", "windowed"])
def test_engine_feeds_deep_drafts_the_features_training_uses(target, monkeypatch, layers, path):
    """A round's first drafted token is the draft's prediction from the verified prefix alone, so it must
    equal the teacher-forced prediction (training's `forward_train` on the target's states, as
    `distill_loss` feeds it) at the pending position: accepted exactly where that prediction is the
    target's token. A wrong layer, shift or projection in prefill, verify or the round graph breaks it."""
    from training.distill import _shift, target_states

    draft = layered(target, layers) if layers else with_features(noisy(oracle(target, deep=True), 0.5), 0.5)
    rounds = []
    real = speculative.spec_round

    def spy(eng, slots, drafts, cfg):
        pos0 = slots[0].length
        result = real(eng, slots, drafts, cfg)
        rounds.append((pos0, result.num_accepted[0]))
        return result

    monkeypatch.setattr("engine.scheduler.spec_round", spy)
    spec = SpecConfig(5, 2 if path == "loop" else 5, draft_kv_window=96 if path == "windowed" else None)  # 96: covers the sequence
    kwargs = {"cuda_graphs": "emulate"} if path == "one-graph" else {}
    result = spec_generate(target, draft, spec, lengths=(17,), new=60, **kwargs)[0]
    assert result.token_ids == ar_greedy(target, (17,), 60)[0]
    seq = torch.tensor(prompts_for(target.args.vocab_size, (17,))[0] + result.token_ids)[None]
    with torch.no_grad():
        trunk, final, captured = target_states(target, seq, draft.shared_layers, draft.feature_layers)
        feats = _shift(draft.target_features(final, captured))
        predicted = draft.forward_train(trunk, feats, torch.arange(seq.shape[1])[None])[0].argmax(-1)[0]
    checked = [(p, acc) for p, acc in rounds if p + 1 < seq.shape[1]]
    hits = [bool(predicted[p] == seq[0, p + 1]) for p, _ in checked]
    assert [acc >= 1 for _, acc in checked] == hits
    assert 0 < sum(hits) < len(hits)  # both outcomes occur: the check has teeth


@pytest.mark.parametrize("graphs", [False, True], ids=["loop", "one-graph"])
def test_drafts_fusing_different_layers_share_a_batch(target, graphs):
    """Rows of drafts with different feature layers (none, final only, final + 2, final + 2 + 3) in one
    ragged batch: each gets its own features (oracles accept everything), output equals plain decoding."""
    drafts = [layered(target, (2,), scale=0.0), noisy(oracle(target), 0.5), oracle(target, deep=True),
              layered(target, (2, 3)), layered(target, (2, 3), scale=0.0)]
    lengths = LENGTHS + (9,)
    kwargs = dict(max_batch_size=8, cuda_graphs="emulate", mixed_round_graph=True) if graphs else {}
    results = spec_generate(target, drafts, SpecConfig(5, 5 if graphs else 2), lengths=lengths, **kwargs)
    assert [r.token_ids for r in results] == ar_greedy(target, lengths)
    assert [r.stats.acceptance_rate == 1.0 for r in (results[0], results[2], results[4])] == [True] * 3
    assert results[3].stats.acceptance_rate < 1.0


def test_a_draft_fusing_layers_outside_the_verify_pass_is_refused_before_anything_changes(target):
    """The engine checks a draft's feature layers against its own target (a draft built for another target
    would otherwise capture nothing or the wrong states) before it allocates anything for the draft."""
    import types

    eng = DecodeEngine(target, None, max_batch_size=2, max_seq_len=64)
    stranger = types.SimpleNamespace(shared_layers=1, adapter_layers=2, feature_input="deep",
                                     feature_layers=(target.args.num_layers,))
    with pytest.raises(ValueError, match="strictly between"):
        eng.add_draft("d", stranger)
    assert eng.drafts == {} and eng.draft_cache is None


# ----- overlapped rounds (DecodeEngine(overlap=True)): the next round launched before the host reads one --------


def _overlap_engine(target, drafts, overlap, gamma=None, **kw):
    eng = DecodeEngine(target, None, max_batch_size=4, max_seq_len=128, spec=SpecConfig(5, 5), cuda_graphs="emulate",
                       overlap=overlap, gamma=gamma, **kw)
    names = []
    for i, d in enumerate(drafts):
        if d is not None and f"d{i}" not in eng.drafts:
            eng.add_draft(f"d{i}", d)
        names.append(f"d{i}" if d is not None else None)
    eng.chained = 0
    real = eng._launch_next_round  # chained from a round in flight

    def counted(*args):
        eng.chained += 1
        return real(*args)

    eng._launch_next_round = counted
    return eng, names


@pytest.mark.parametrize("case", ["one draft", "three drafts", "sampled", "adaptive gamma"])
def test_overlapped_rounds_give_the_same_tokens_and_stops(target, case):
    """Rounds launched from the last round's outcome on the device, before the host reads it: the same tokens
    as one round at a time (greedy: plain decoding's), for one draft, three drafts mixed in the batch (deep and
    not), seeded sampling, and gamma picked by the controller; a row meeting its EOS mid-chain has the round
    in flight for it dropped; nothing is left running."""
    from engine.gamma import GammaController

    mixed = case == "three drafts"
    first = noisy(oracle(target), 0.5)
    drafts = ([first, oracle(target, deep=True), noisy(oracle(target, deep=True), 0.4), first]
              if mixed else [noisy(oracle(target), 0.4)] * 4)
    sampled = case == "sampled"
    base = [SamplingParams(max_new_tokens=n, eos_token_ids=(), temperature=0.9 if sampled else 0.0, seed=i)
            for i, n in enumerate((40, 31, 52, 45))]
    vocab = target.args.vocab_size
    prompts = prompts_for(vocab)
    eng, names = _overlap_engine(target, drafts, False)
    eos = generate(eng, prompts, base, names)[1].token_ids[19]
    params = list(base)
    params[1] = SamplingParams(max_new_tokens=31, eos_token_ids=(eos,), temperature=base[1].temperature, seed=1)
    runs = {}
    for overlap in (False, True):
        controller = GammaController(5, pin_seeded=True) if case == "adaptive gamma" else None
        eng, names = _overlap_engine(target, drafts, overlap, gamma=controller)
        runs[overlap] = [r.token_ids for r in generate(eng, prompts, params, names)]
        assert not eng.has_work()
        if overlap:
            assert eng.chained >= 3
    assert runs[True] == runs[False]
    assert len(runs[True][1]) < 31  # the EOS stopped row 1
    if not sampled:
        assert runs[True] == [r[: len(t)] for r, t in zip(ar_greedy(target, new=52), runs[True])]


def test_an_overlapped_round_chain_makes_way_for_a_request_and_survives_a_cancel_and_a_draft_swap(target):
    """A request arriving mid-chain is admitted at the next step; a row cancelled with a round in flight
    loses that round's tokens, the others keep theirs; replacing a draft waits for the round in flight."""
    draft = noisy(oracle(target), 0.4)
    eng, _ = _overlap_engine(target, [draft], True)
    prompts = prompts_for(target.args.vocab_size, (5, 9, 7))
    params = SamplingParams(max_new_tokens=40, eos_token_ids=())
    alone = ar_greedy(target, (5, 9, 7), 40)
    eng.add_request(Request("a", prompts[0], params, "d0"))
    eng.add_request(Request("b", prompts[1], params, "d0"))

    def arrive(e):
        assert e._ahead is not None and e._ahead.kind == "round"
        e.add_request(Request("c", prompts[2], params, "d0"))

    def swap_and_cancel(e):
        e.add_draft("d0", noisy(oracle(target), 0.4, seed=9))  # running rows keep theirs
        assert e.cancel("b")

    got, first = drive(eng, {3: arrive, 6: swap_and_cancel})
    assert first["c"] <= 4
    assert got["a"] == alone[0] and got["c"] == alone[2]
    assert got["b"] == alone[1][: len(got["b"])] and len(got["b"]) < 40
    assert eng.chained > 0 and not eng.has_work()


def test_an_overlapped_lone_request_its_draft_fits_badly_drops_to_plain_decoding(target):
    """The governor's per-request rule with a round in flight: an untrained draft (about 1 token a round) whose
    measured average pays; alone, the request drops to plain decoding after a full window of its own rounds
    (plus the one already launched), with plain decoding's tokens."""
    from engine.governor import REQUEST_WINDOW, SpeculationGovernor

    bad = DraftModel(target, DraftConfig(shared_layers=1, adapter_layers=1, head="mlp", init_from_target=False))
    gov = SpeculationGovernor(min_samples=2)
    for _ in range(16):  # the draft pays on average: 15 ms rounds of 3 tokens against 10 ms a plain token
        gov.observe_ar(1, 0.010, 1)
        gov.observe_spec("d0", 1, 0.015, 3)
    gov.observe_ar = gov.observe_spec = lambda *args: None  # ... and this CPU's timings do not change that
    eng, names = _overlap_engine(target, [bad], True, governor=gov)
    out = generate(eng, prompts_for(target.args.vocab_size, (5,)), SamplingParams(max_new_tokens=80, eos_token_ids=()),
                   names)[0]
    assert out.token_ids == ar_greedy(target, (5,), 80)[0]
    assert REQUEST_WINDOW <= out.stats.rounds <= REQUEST_WINDOW + 1 and gov.decisions["dropped"] == 1
    assert eng.chained > 0 and not eng.has_work()


def test_a_round_settles_each_stream_a_fixed_budget_past_its_start_and_never_back():
    from engine.sampling import RandomStream
    from engine.speculative import round_draws, settle_draws

    assert round_draws(SpecConfig(5, 5)) == 11  # one verify a round: what the captured round advances
    assert round_draws(SpecConfig(4, 2)) == 2 * 4 + 2 + 1  # two blocks, and a bonus draw between them
    streams = [RandomStream(1), RandomStream(2), RandomStream(3)]
    starts = [5, 0xFFFFFFFE, 40]
    for stream, start, used in zip(streams, starts, (3, 4, 20)):
        stream.drawn = (start + used) & 0xFFFFFFFF
    settle_draws(streams, starts, 11)
    assert [s.drawn for s in streams] == [16, (0xFFFFFFFE + 11) & 0xFFFFFFFF, 60]  # the counter wraps; 20 > 11 kept


@pytest.mark.parametrize("sampled,window,rows", [(False, None, 4), (True, None, 4), (False, 16, 4), (True, None, 1)],
                         ids=["greedy", "sampled", "windowed-draft-cache", "one-row-at-a-time"])
def test_prefill_graphs_give_the_eager_prefill_s_tokens(target, monkeypatch, sampled, window, rows):
    """prefill_graphs: each admission's prefill runs padded to a power-of-two length through the graph path
    (emulated on the CPU): the same tokens as without graphs, for a batch of plain rows, a trunk draft and a
    deep draft fusing a middle layer's states, and the prefill graphs keyed by their padded length."""
    import engine.scheduler as scheduler

    drafts = [None, noisy(oracle(target), 0.5), layered(target, (2,)), None]
    params = [SamplingParams(max_new_tokens=NEW, eos_token_ids=(), seed=i, **({"temperature": 0.9} if sampled else {}))
              for i in range(len(LENGTHS))]
    spec = SpecConfig(5, 5, draft_kv_window=window)
    want = [r.token_ids for r in spec_generate(target, drafts, spec, params=params, max_batch_size=rows)]
    keys = []
    real = scheduler.DecodeEngine.run_graph
    monkeypatch.setattr(scheduler.DecodeEngine, "run_graph",
                        lambda self, key, *a, **kw: keys.append(key) or real(self, key, *a, **kw))
    stats = []
    for prefill_graphs in (False, True):
        keys.clear()
        got = spec_generate(target, drafts, spec, params=params, cuda_graphs="emulate", prefill_graphs=prefill_graphs,
                            max_batch_size=rows)
        assert [r.token_ids for r in got] == want, prefill_graphs
        prefills = {key[1] for key in keys if key[0] == "prefill"}
        # LENGTHS (5, 17, 2, 30) pad to 32 tokens in one admission; one at a time, to 16, 32, 16, 32
        assert prefills == (({32} if rows == 4 else {16, 32}) if prefill_graphs else set())
        stats.append([(r.stats.accepted, r.stats.drafted) if r.stats else None for r in got])
    # The drafts prefilled from the same states: the same acceptance (tokens alone would not show it: lossless).
    assert stats[0] == stats[1] and sum(s[1] for s in stats[1] if s) > 0, stats


# ----- lookup rounds (engine.lookup.LookupDraft): proposals from each request's own tokens, verified greedily ----


def _lookup_engine(target, graphs, overlap=False, extra=None, **kw):
    from engine.lookup import LookupDraft

    kw.setdefault("max_seq_len", 128)
    eng = DecodeEngine(target, None, max_batch_size=4, spec=SpecConfig(5, 5), cuda_graphs=graphs, overlap=overlap, **kw)
    eng.add_draft("lookup", LookupDraft())
    for name, draft in (extra or {}).items():
        eng.add_draft(name, draft)
    return eng


@pytest.mark.parametrize("graphs,overlap", [(None, False), ("emulate", False), ("emulate", True)])
def test_lookup_rounds_give_plain_decoding_s_tokens_and_take_repeats_in_few_rounds(target, tiny, graphs, overlap):
    """Greedy rows naming a LookupDraft: plain decoding's tokens, eagerly, as graphs and chained (overlap). A target
    of 8 tokens soon repeats itself greedily, and there lookup rounds make several tokens each."""
    eng = _lookup_engine(target, graphs, overlap)
    outs = generate(eng, prompts_for(target.args.vocab_size), SamplingParams(max_new_tokens=NEW, eos_token_ids=()),
                    "lookup")
    assert [o.token_ids for o in outs] == ar_greedy(target)
    assert all(o.stats.rounds for o in outs) and not eng.has_work()
    small = tiny.tiny_vocab_target(8, num_layers=3, seed=7)
    prompts = [[1, 2, 3, 4], [5, 0, 6], [7, 7, 1]]
    params = SamplingParams(max_new_tokens=60, eos_token_ids=())
    want = [o.token_ids for o in generate(DecodeEngine(small, None, max_batch_size=3, max_seq_len=128), prompts, params)]
    eng = _lookup_engine(small, graphs, overlap)
    chained, real = [], eng._launch_next_round
    eng._launch_next_round = lambda *args: chained.append(1) or real(*args)  # rounds launched from one in flight
    outs = generate(eng, prompts, params, "lookup")
    assert [o.token_ids for o in outs] == want
    assert sum(o.stats.emitted for o in outs) / sum(o.stats.rounds for o in outs) > 2.0
    assert (len(chained) > 3) == overlap


def test_a_batch_of_lookup_rows_draft_rows_and_plain_rows_gives_each_plain_decoding_s_tokens(target):
    for graphs in (None, "emulate"):
        eng = _lookup_engine(target, graphs, extra={"d": noisy(oracle(target), 0.4)})
        outs = generate(eng, prompts_for(target.args.vocab_size), SamplingParams(max_new_tokens=NEW, eos_token_ids=()),
                        ["lookup", "d", None, "lookup"])
        assert [o.token_ids for o in outs] == ar_greedy(target), graphs
        assert outs[0].stats.rounds and outs[1].stats.rounds and not (outs[2].stats and outs[2].stats.rounds)
        if graphs:  # the lookup rows beside the draft's rows: one captured round, one verify pass for both kinds
            keys = list(eng.graphs.graphs)
            assert any(k[0] == "greedy-round" and ("lookup", *LookupDraft().rule) in k for k in keys), keys
            both = [k for k in keys if k[0] == "greedy-round" and ("lookup", *LookupDraft().rule) in k]
            assert both and all(k[1] == 1 for k in both)  # one draft in the graph; the lookup drafter is none


@pytest.mark.slow  # about a minute on a 2-core machine; keeps the default suite under its 15-minute limit
def test_mixed_rounds_of_lookup_and_draft_rows_chain_with_overlap_and_warm_up_covers_them(target):
    """Two drafts and the lookup drafter: warm-up captures the drafts' mix and the mix with lookup rows (a batch
    of two included), so greedy traffic of any mix captures nothing more; overlapped, such rounds chain on the
    device (the history written in the graph), and every request gets plain decoding's tokens."""
    extra = {"d": noisy(oracle(target), 0.4), "e": noisy(oracle(target), 0.6)}
    eng = _lookup_engine(target, "emulate", overlap=True, extra=extra)
    assert eng._mixes() == [["d", "e"], ["lookup", "d", "e"]]
    assert eng.warmup(max_len=64, prompt_len=4, sampling=("greedy",)) > 0
    captured = eng.graphs.captures
    chained, real = [], eng._launch_next_round
    eng._launch_next_round = lambda *args: chained.append(1) or real(*args)
    for mix in (["lookup", "d"], ["e", "lookup", "d", "lookup"], ["d", "e"], ["lookup", "e", None, "d"]):
        n = len(mix)
        outs = generate(eng, prompts_for(target.args.vocab_size)[:n], SamplingParams(max_new_tokens=20, eos_token_ids=()),
                        mix)
        assert [o.token_ids for o in outs] == [t[:20] for t in ar_greedy(target)[:n]], mix
    assert eng.graphs.captures == captured  # nothing left to capture in traffic
    assert chained  # mixed rounds chained on the device
    # Sampled, lookup rows and draft rows run a draft round, then a lookup round: seeded, the tokens eager ones.
    params = SamplingParams(max_new_tokens=12, eos_token_ids=(), temperature=0.9, seed=3)
    got = [generate(_lookup_engine(target, g, extra=extra), prompts_for(target.args.vocab_size)[:3], params,
                    ["lookup", "d", "lookup"]) for g in (None, "emulate")]
    assert [o.token_ids for o in got[0]] == [o.token_ids for o in got[1]]
    assert all(o.stats.rounds for o in got[1])


@pytest.mark.parametrize("graphs,overlap", [(None, False), ("emulate", True)])
def test_requests_the_governor_splits_between_a_draft_and_its_lookup_alternative_keep_plain_tokens(target, graphs,
                                                                                                    overlap):
    """Requests naming "d", whose alternative is the lookup drafter: the governor sends some to each (untried first,
    then probes every other admission; a draft row that does not pay may move to lookup), so batches mix draft
    rows and lookup rows; every request gets plain decoding's tokens, reported under what it ran last."""
    from engine.governor import SpeculationGovernor

    gov = SpeculationGovernor(min_samples=2, probe_every=2)
    eng = _lookup_engine(target, graphs, overlap, extra={"d": noisy(oracle(target), 0.4)}, governor=gov)
    eng.set_alternatives("d", ["lookup"])
    eng.calibrate(prompt_tokens=4)  # plain decoding's cost, as the service seeds it
    lengths = (5, 17, 2, 30, 9, 11, 3, 7, 4, 13)  # more requests than rows: admissions after the first rounds
    outs = generate(eng, prompts_for(target.args.vocab_size, lengths), SamplingParams(max_new_tokens=NEW,
                                                                                      eos_token_ids=()), "d")
    assert [o.token_ids for o in outs] == ar_greedy(target, lengths)
    assert {o.draft for o in outs} <= {"d", "d/lookup", None}  # what each ran last (moved to lookup, or plain)
    ran = {k.split("@")[0] for k in gov.snapshot()["spec_samples"]}
    assert ran - {"lookup"} == {"d", "d/lookup"}  # both ran rounds ("lookup": calibrate's lookup rounds, with graphs)
    assert ("lookup" in ran) == (graphs is not None)
    if graphs:  # calibrate seeded the lookup pool's row round at every batch size
        assert all(gov.pool_samples("lookup", rows) >= gov.min_samples for rows in (1, 2, 4))


@pytest.mark.parametrize("graphs,overlap", [(None, False), ("emulate", True)])
def test_a_greedy_request_whose_draft_stops_paying_moves_to_its_lookup_alternative(target, graphs, overlap):
    """The governor drops a lone request whose draft fits badly (an untrained one, about 1 token a round, against a
    draft whose measured average pays); with the lookup drafter as that draft's alternative, not known not to pay,
    the greedy request goes on with lookup rounds instead of plain decoding (its history written from the host,
    also with a round in flight), with plain decoding's tokens, reported under what it ran last. A sampled one
    drops to plain decoding."""
    from engine.governor import SpeculationGovernor
    from engine.lookup import LOOKUP_POOL
    from engine.scheduler import SAMPLED

    def engine():
        bad = DraftModel(target, DraftConfig(shared_layers=1, adapter_layers=1, head="mlp", init_from_target=False))
        gov = SpeculationGovernor(min_samples=2)
        # Both pay on average at batch 1 and the draft is the cheaper a token, so requests start on it; its round
        # (15 ms greedy, 55 ms sampled) then needs 1.5 and 5.5 tokens a round of a request to pay for it.
        for suffix, seconds, tokens in (("", 0.015, 3), (SAMPLED, 0.055, 11)):
            for _ in range(16):
                gov.observe_ar(1, 0.010, 1)
                gov.observe_spec("d" + suffix, 1, seconds, tokens)
                gov.observe_spec("d/lookup" + suffix, 1, 0.018, 2)
                gov.observe_pool(LOOKUP_POOL, 1, 0.018, 1)  # a lookup round at batch 1, as its pool prices it
        # ... and this CPU's timings do not change that (a loaded machine's lookup rounds priced above 10 ms a
        # token dropped the greedy request from lookup too, and its history then stops at the drop)
        gov.observe_ar = gov.observe_spec = gov.observe_pool = lambda *args: None
        eng = _lookup_engine(target, graphs, overlap, extra={"d": bad}, governor=gov)
        eng.set_alternatives("d", ["lookup"])
        return eng, gov

    eng, gov = engine()
    prompts = prompts_for(target.args.vocab_size, (5,))
    out = generate(eng, prompts, SamplingParams(max_new_tokens=80, eos_token_ids=()), "d")[0]
    assert out.token_ids == ar_greedy(target, (5,), 80)[0]
    assert gov.decisions["switched"] == 1 and out.draft == "d/lookup"
    assert not eng.has_work()
    whole = list(prompts[0]) + out.token_ids  # its history holds every token, the draft's rounds' included
    assert eng.history[0, : len(whole)].tolist() == whole
    eng, gov = engine()
    generate(eng, prompts, SamplingParams(max_new_tokens=80, eos_token_ids=(), temperature=1.0), "d")
    assert gov.decisions["dropped"] == 1 and gov.decisions["switched"] == 0


@pytest.mark.parametrize("graphs,overlap", [(None, False), ("emulate", False), ("emulate", True)])
def test_a_lone_request_dropped_from_lookup_comes_back_once_its_replayed_rounds_pay(tiny, graphs, overlap):
    """A lone greedy lookup request the governor drops to plain decoding keeps lookup's rounds replayed over its
    tokens (`_watch_lookup`); once they price lookup below plain decoding (`SpeculationGovernor.returns_to`: the
    pool's round at batch 1 over the replayed tokens a round) it goes back on lookup, its history rewritten from
    the host (with a plain call in flight too), and its tokens stay plain decoding's."""
    from engine.governor import REQUEST_WINDOW, SpeculationGovernor
    from engine.lookup import LOOKUP_POOL, LookupDraft

    small = tiny.tiny_vocab_target(8, num_layers=3, seed=7)
    prompt, new = [1, 2, 3, 4], 400  # a run of one token: lookup rounds make gamma + 1 tokens from the second on
    want = generate(DecodeEngine(small, None, max_batch_size=2, max_seq_len=420), [prompt],
                    SamplingParams(max_new_tokens=new, eos_token_ids=()))[0].token_ids
    gov = SpeculationGovernor(min_samples=2)
    for _ in range(16):  # plain decoding 10 ms a token, a lookup round 12 ms, at batch 1
        gov.observe_ar(1, 0.010, 1)
        gov.observe_pool(LOOKUP_POOL, 1, 0.012, 1)
    gov.observe_ar = gov.observe_spec = gov.observe_pool = lambda *args: None  # this CPU's timings change nothing
    asked = []
    gov.keep_speculating = lambda *args: asked.append(1) or len(asked) > 1  # dropped the first time
    eng = DecodeEngine(small, None, max_batch_size=2, max_seq_len=420, spec=SpecConfig(5, 5), cuda_graphs=graphs,
                       overlap=overlap, governor=gov)
    eng.add_draft("lookup", LookupDraft())
    out = generate(eng, [prompt], SamplingParams(max_new_tokens=new, eos_token_ids=()), "lookup")[0]
    assert out.token_ids == want
    assert gov.decisions["returned"] == 1 and gov.decisions["switched"] == 1 and out.draft == "lookup"
    # Dropped after min_samples rounds, back after REQUEST_WINDOW replayed rounds, then on lookup to the end.
    assert out.stats.rounds > gov.min_samples + 5 and len(asked) > 1
    assert sum(out.stats.recent) > REQUEST_WINDOW  # lookup's rounds after the return made tokens
    whole = prompt + out.token_ids
    assert eng.history[0, : len(whole)].tolist() == whole


@pytest.mark.parametrize("graphs,overlap", [(None, False), ("emulate", True)])
def test_a_lone_greedy_request_moves_to_lookup_once_the_replay_of_its_own_tokens_shows_lookup_cheaper(tiny, graphs,
                                                                                                   overlap):
    """With `lookup_replay` (by default for a request admitted to run alone), a greedy request on its draft, whose
    draft has the lookup drafter as alternative, has lookup's rounds replayed over its tokens (`LookupShadow`),
    reported to the governor for its domain. Running alone, it moves to lookup
    once the replay over its last rounds prices lookup's round below its draft's a token (a target of 8 tokens
    repeats itself: lookup makes several tokens a round), with plain decoding's tokens; where lookup's round is
    dear it stays on its draft. Sampled requests replay nothing."""
    from engine.governor import SpeculationGovernor

    small = tiny.tiny_vocab_target(8, num_layers=3, seed=7)
    prompts = [[2, 6, 1, 7]]  # greedily: a reply that ends in a run of one token
    params = SamplingParams(max_new_tokens=300, eos_token_ids=())
    want = generate(DecodeEngine(small, None, max_batch_size=1, max_seq_len=320), prompts, params)[0].token_ids

    def run(lookup_round: float, params=params, replay=None):
        gov = SpeculationGovernor(min_samples=2)
        for _ in range(16):  # the draft pays (4 ms a token against 10) and starts; lookup's domain price is poor
            gov.observe_ar(1, 0.010, 1)
            gov.observe_spec("d", 1, 0.012, 3)
            gov.observe_spec("d/lookup", 1, 0.027, 3)
            gov.observe_pool("lookup", 1, lookup_round, 1)
        gov.observe_ar = gov.observe_spec = gov.observe_pool = lambda *args: None  # this CPU's timings aside
        eng = _lookup_engine(small, graphs, overlap, extra={"d": noisy(oracle(small), 0.5)}, governor=gov,
                             max_seq_len=320, **({} if replay is None else {"lookup_replay": replay}))
        eng.set_alternatives("d", ["lookup"])
        return generate(eng, prompts, params, "d")[0], gov

    out, gov = run(0.002)  # 1 ms a token over the replay, against the draft's 12 ms round over 2.6: 4.6 ms
    assert out.token_ids == want
    assert out.draft == "d/lookup" and gov.decisions["switched"] == 1
    replayed = gov.snapshot()["pooled_rounds"]["d/lookup"]
    # The replay covered the whole reply (rounds of at most MAX_GAMMA + 1 tokens) and saw it repeat.
    assert replayed >= params.max_new_tokens // (MAX_GAMMA + 1)
    assert gov.snapshot()["pooled_tokens_per_round"]["d/lookup"] > 1.5
    out, gov = run(0.002, replay=False)  # no replay, no move
    assert out.token_ids == want and out.draft == "d" and gov.snapshot()["pooled_rounds"] == {}
    out, gov = run(0.002, replay=True)  # every request replayed: this lone one alike
    assert out.token_ids == want and out.draft == "d/lookup" and gov.decisions["switched"] == 1
    out, gov = run(0.120)  # lookup's round 120 ms (7.5 ms a token at 16 tokens a round): the replay does not move it
    assert out.token_ids == want and out.draft == "d" and gov.decisions["switched"] == 0
    out, gov = run(0.002, SamplingParams(max_new_tokens=40, eos_token_ids=(), temperature=0.8, seed=1))
    assert "d/lookup" not in gov.snapshot()["pooled_rounds"]


def test_by_default_only_requests_admitted_to_run_alone_replay_lookup(tiny):
    """`lookup_replay="alone"` (the default): a greedy request admitted with no other row replays lookup over its
    tokens; requests admitted into a batch do not (the replay's host time, about 10 us a round a row, bought nothing
    at bs 8 on the H200); True replays them too, False none; anything else is refused."""
    from engine.governor import SpeculationGovernor

    small = tiny.tiny_vocab_target(8, num_layers=3, seed=7)
    params = SamplingParams(max_new_tokens=8, eos_token_ids=())

    def shadows(prompts, **kw):
        eng = _lookup_engine(small, None, extra={"d": noisy(oracle(small), 0.5)}, governor=SpeculationGovernor(), **kw)
        eng.set_alternatives("d", ["lookup"])
        for i, prompt in enumerate(prompts):
            eng.add_request(Request(f"r{i}", prompt, params, "d"))
        eng.step()  # admits them all
        return [s.shadow is not None for s in eng.slots if s is not None]

    assert shadows([[2, 6, 1, 7]]) == [True]
    assert shadows([[2, 6, 1, 7], [1, 2, 3]]) == [False, False]
    assert shadows([[2, 6, 1, 7], [1, 2, 3]], lookup_replay=True) == [True, True]
    assert shadows([[2, 6, 1, 7]], lookup_replay=False) == [False]
    with pytest.raises(ValueError, match="lookup_replay"):
        _lookup_engine(small, None, lookup_replay="always")
    with pytest.raises(ValueError, match="lookup_replay"):
        _lookup_engine(small, None, lookup_replay=1)


@pytest.mark.parametrize("graphs,overlap", [(None, False), ("emulate", True)])
def test_a_batch_whose_rows_can_all_run_lookup_moves_to_it_together_where_the_governor_prices_it_cheaper(tiny, graphs,
                                                                                                      overlap):
    """Three greedy requests whose draft has the lookup alternative start on plain decoding (neither drafter pays at
    their batch size, each priced by its own rounds); once lookup's rows make 4 tokens a round for a 1.5 ms row's
    round (a batch of them 0.375 ms a token against plain decoding's 1), the whole batch moves to lookup at the next
    step and stays there (its rows are not judged one by one, where their own past rounds price lookup at 3 ms a
    token), with plain decoding's tokens. One sampled row among them (it cannot move) keeps the batch as it is."""
    from engine.governor import SpeculationGovernor

    small = tiny.tiny_vocab_target(8, num_layers=3, seed=7)
    prompts = [[2, 6, 1, 7], [1, 2, 3, 4, 5], [3, 3, 5, 0, 1, 4]]
    greedy = SamplingParams(max_new_tokens=40, eos_token_ids=())
    want = generate(DecodeEngine(small, None, max_batch_size=4, max_seq_len=128), prompts, greedy)

    def run(params):
        gov = SpeculationGovernor(min_samples=2, probe_every=1000)
        for _ in range(16):
            gov.observe_ar(4, 0.004, 4)  # plain decoding at 3-4 rows: 1 ms a token
            gov.observe_spec("d", 4, 0.012, 4)  # the draft: 3 ms a token
            gov.observe_spec("d/lookup", 4, 0.012, 4)  # lookup's own rounds so far: 3 ms a token
            gov.observe_pool("lookup", 4, 0.006, 4)  # a lookup row's round in a batch of them: 1.5 ms
        gov.observe_tokens("d/lookup", None, [1] * 16)  # 1 token a round so far: a batch of them 1.5 ms a token
        eng = _lookup_engine(small, graphs, overlap, extra={"d": noisy(oracle(small), 0.5)}, governor=gov)
        eng.set_alternatives("d", ["lookup"])
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            eng.add_request(Request(f"r{i}", prompt, p, "d"))

        def cheaper(eng):
            assert all(s.draft is None for s in eng.slots if s is not None and s.request.params.greedy)  # plain
            gov.observe_tokens("d/lookup", None, [4] * 400)
            gov.observe_ar = gov.observe_spec = gov.observe_pool = gov.observe_tokens = lambda *args: None

        got, _ = drive(eng, {2: cheaper})
        return got, gov, eng

    got, gov, eng = run([greedy] * 3)
    assert [got[f"r{i}"] for i in range(3)] == [o.token_ids for o in want]
    assert gov.decisions["switched"] == 3 and gov.decisions["plain"] == 3
    sampled = SamplingParams(max_new_tokens=40, eos_token_ids=(), temperature=0.8)
    got, gov, eng = run([greedy, sampled, greedy])
    assert got["r0"] == want[0].token_ids and got["r2"] == want[2].token_ids
    assert gov.decisions["switched"] == 0


@pytest.mark.parametrize("graphs,overlap", [(None, False), ("emulate", True)])
def test_plain_rows_replays_price_lookup_so_a_batch_moves_once_its_text_repeats(tiny, graphs, overlap):
    """A batch of greedy requests decoding plainly (lookup priced at 1 token a round from its first rounds, the draft
    dear): each plain row replays lookup over its tokens to watch for its way back, and those replays price lookup
    for the domain too (`DecodeEngine.comeback_prices`), so once the replies repeat the batch moves to lookup, with
    plain decoding's tokens. Without it (or with `lookup_replay=False`: no replay prices lookup) nothing prices
    lookup again and the batch stays plain to the end."""
    from engine.governor import SpeculationGovernor

    small = tiny.tiny_vocab_target(8, num_layers=3, seed=7)
    prompts = [[2, 6, 1, 7], [1, 2, 3, 4, 5], [3, 3, 5, 0, 1, 4]]
    greedy = SamplingParams(max_new_tokens=60, eos_token_ids=())
    want = [o.token_ids for o in generate(DecodeEngine(small, None, max_batch_size=4, max_seq_len=128), prompts, greedy)]

    def run(prices: bool, **kw):
        gov = SpeculationGovernor(min_samples=2, probe_every=1000)
        for _ in range(16):
            gov.observe_ar(4, 0.004, 4)  # plain decoding at 3-4 rows: 1 ms a token
            gov.observe_spec("d", 4, 0.012, 4)  # the draft: 3 ms a token
            gov.observe_spec("d/lookup", 4, 0.012, 4)  # lookup's own first rounds: 3 ms a token
            gov.observe_pool("lookup", 4, 0.006, 4)  # a lookup row's round in a batch of them: 1.5 ms
        gov.observe_tokens("d/lookup", None, [1] * 16)  # its first rounds made 1 token each: 1.5 ms a token
        gov.observe_ar = gov.observe_spec = gov.observe_pool = lambda *args: None  # this CPU's timings aside
        eng = _lookup_engine(small, graphs, overlap, extra={"d": noisy(oracle(small), 0.5)}, governor=gov, **kw)
        eng.comeback_prices = prices
        eng.set_alternatives("d", ["lookup"])
        outs = generate(eng, prompts, greedy, "d")
        assert [o.token_ids for o in outs] == want
        return gov, outs

    gov, outs = run(True)
    assert gov.decisions["plain"] == 3 and gov.decisions["switched"] == 3  # admitted plain, moved together
    assert all(o.draft == "d/lookup" for o in outs)
    assert gov.snapshot()["pooled_tokens_per_round"]["d/lookup"] > 2.0  # the replays priced it
    for gov, outs in (run(False), run(True, lookup_replay=False)):  # no replay prices lookup with lookup_replay=False
        assert gov.decisions["plain"] == 3 and gov.decisions["switched"] == 0 and all(o.draft is None for o in outs)


@pytest.mark.parametrize("graphs,overlap", [(None, False), ("emulate", True)])
def test_a_batch_held_plain_by_a_stale_lookup_price_probes_lookup_and_stays_on_the_fresh_price(tiny, graphs, overlap):
    """A batch of greedy requests decoding plainly, lookup's rounds at 3-4 rows priced dear (6 ms a row's round, say
    from one slow calibration) while its replays say it makes several tokens a round: only all-lookup rounds would
    measure the price, so nothing corrects it. Once it is `probe_seconds` old, the batch moves to lookup to measure
    it; the probe's rounds (0.4 ms a row's round here) restart the estimate and the batch stays on lookup, with plain
    decoding's tokens. With probes out of reach the batch stays plain to the end."""
    from engine.governor import SpeculationGovernor

    small = tiny.tiny_vocab_target(8, num_layers=3, seed=7)
    prompts = [[2, 6, 1, 7], [1, 2, 3, 4, 5], [3, 3, 5, 0, 1, 4]]
    greedy = SamplingParams(max_new_tokens=60, eos_token_ids=())
    want = [o.token_ids for o in generate(DecodeEngine(small, None, max_batch_size=4, max_seq_len=128), prompts, greedy)]

    def run(probe_seconds: float):
        now = [0.0]
        gov = SpeculationGovernor(min_samples=2, probe_every=1000, probe_seconds=probe_seconds, clock=lambda: now[0])
        for _ in range(16):
            gov.observe_ar(4, 0.004, 4)  # plain decoding at 3-4 rows: 1 ms a token
            gov.observe_spec("d", 4, 0.012, 4)  # the draft: 3 ms a token
            gov.observe_spec("d/lookup", 4, 0.012, 4)  # lookup's own first rounds: 3 ms a token
            gov.observe_pool("lookup", 4, 0.024, 4)  # a lookup row's round priced at 6 ms
        gov.observe_tokens("d/lookup", None, [1] * 16)  # its first rounds made 1 token each; the replays tell more
        gov.observe_ar = gov.observe_spec = lambda *args: None  # this CPU's timings aside
        pool, moves = gov.observe_pool, gov.batch_moves
        gov.observe_pool = lambda name, rows, seconds, n: pool(name, rows, 0.0004 * n, n)  # what a round costs
        # A second passes each time a batch is judged.
        gov.batch_moves = lambda *args: (now.__setitem__(0, now[0] + 1.0), moves(*args))[1]

        eng = _lookup_engine(small, graphs, overlap, extra={"d": noisy(oracle(small), 0.5)}, governor=gov)
        eng.set_alternatives("d", ["lookup"])
        outs = generate(eng, prompts, greedy, "d")
        assert [o.token_ids for o in outs] == want
        return gov, outs

    gov, outs = run(30.0)
    assert gov.decisions["plain"] == 3 and gov.decisions["batch_probes"] == 1 and gov.decisions["switched"] == 3
    assert all(o.draft == "d/lookup" for o in outs) and all(o.stats.rounds for o in outs)
    assert gov.snapshot()["pool_seconds_per_row_round"]["lookup@4"] == pytest.approx(0.0004)  # restarted
    gov, outs = run(1e9)
    assert gov.decisions["batch_probes"] == 0 and gov.decisions["switched"] == 0 and all(o.draft is None for o in outs)


def test_warm_up_covers_lookup_rounds_and_a_seeded_sampled_request_repeats_its_tokens(target):
    params = SamplingParams(max_new_tokens=12, eos_token_ids=(), temperature=0.8, seed=4)
    got = [generate(_lookup_engine(target, g), prompts_for(target.args.vocab_size, (9,)), params, "lookup")[0]
           for g in (None, None, "emulate")]
    assert got[0].stats.rounds and got[0].token_ids == got[1].token_ids == got[2].token_ids  # eager and graph alike
    warm = _lookup_engine(target, "emulate", extra={"d": noisy(oracle(target), 0.4)})
    assert warm.warmup(max_len=64, prompt_len=4, sampling=("greedy",)) > 0
    assert any(k[0] == "lookup-round" for k in warm.graphs.graphs)
    captured = warm.graphs.captures
    outs = generate(warm, prompts_for(target.args.vocab_size, (5, 17, 2, 30)),
                    SamplingParams(max_new_tokens=20, eos_token_ids=()), ["lookup", "d", "lookup", None])
    assert [o.token_ids for o in outs] == [t[:20] for t in ar_greedy(target)]
    assert warm.graphs.captures == captured  # nothing left to capture in traffic
    # A lone lookup row over a reply that repeats: rounds at 8 and at the streak gamma 15, both captured already.
    lone = generate(warm, [[3, 1, 4, 1, 5, 3, 1, 4, 1, 5, 3, 1, 4, 1, 5]], SamplingParams(max_new_tokens=40,
                                                                                          eos_token_ids=()), "lookup")[0]
    assert lone.token_ids == generate(DecodeEngine(target, None, max_batch_size=1, max_seq_len=128),
                                      [[3, 1, 4, 1, 5, 3, 1, 4, 1, 5, 3, 1, 4, 1, 5]],
                                      SamplingParams(max_new_tokens=40, eos_token_ids=()))[0].token_ids
    assert lone.stats.drafted > 8 * lone.stats.rounds  # some of its rounds proposed 15
    assert warm.graphs.captures == captured


def test_lookup_draft_settings_are_checked():
    from engine.lookup import LookupDraft

    with pytest.raises(ValueError, match="min_n"):
        LookupDraft(max_n=1, min_n=2)
    for bad in ({3: 8}, {1: 0}, {0: 4}, {1: 16}):
        with pytest.raises(ValueError, match="lookup gammas .*batch-size bucket"):
            LookupDraft(gammas=bad)
        with pytest.raises(ValueError, match="lookup streak gammas .*batch-size bucket"):
            LookupDraft(streak_gammas=bad)
    assert LookupDraft().trainable_parameters() == []
    assert LookupDraft().gamma_at(1, 5) == 8 and LookupDraft().gamma_at(8, 5) == 5
    assert LookupDraft(gammas={}).gamma_at(1, 5) == 5
    # After a round that accepted every token it proposed: the streak gamma where the bucket has one.
    assert LookupDraft().gamma_at(1, 5, streak=True) == 15 and LookupDraft().gamma_at(8, 5, streak=True) == 5
    assert LookupDraft(streak_gammas={}).gamma_at(1, 5, streak=True) == 8
    assert LookupDraft(gammas={}, streak_gammas={2: 9}).gamma_at(2, 5, streak=True) == 9


def test_a_lone_greedy_lookup_row_proposes_its_batch_size_s_gamma(tiny):
    """A greedy lookup round's gamma comes from its drafter by batch-size bucket (`LookupDraft.gammas`): two rows
    run the engine's 5, the one left when the other stops runs 8, and 15 after a round that accepted every token it
    proposed (`LookupDraft.streak_gammas`; the cache margin holds up to MAX_GAMMA); sampled rounds run the engine's
    gamma. Tokens are plain decoding's throughout."""
    from engine.lookup import MAX_GAMMA, LookupDraft

    small = tiny.tiny_vocab_target(8, num_layers=3, seed=7)
    prompts = [[1, 2, 3, 4], [5, 0, 6]]
    params = [SamplingParams(max_new_tokens=n, eos_token_ids=()) for n in (20, 60)]
    want = [o.token_ids for o in generate(DecodeEngine(small, None, max_batch_size=2, max_seq_len=128), prompts, params)]
    eng = DecodeEngine(small, None, max_batch_size=2, max_seq_len=128, spec=SpecConfig(5, 5), cuda_graphs="emulate")
    eng.add_draft("lookup", LookupDraft())
    assert [o.token_ids for o in generate(eng, prompts, params, "lookup")] == want
    gammas = {(k[-2][1][0], k[3]) for k in eng.graphs.graphs if k[0] == "lookup-round"}  # (rows, gamma)
    assert gammas == {(2, 5), (1, 8), (1, 15)}, gammas  # the lone row's reply repeats itself: a streak
    lookup = eng.drafts["lookup"]
    assert eng.lookup_gamma(lookup, 1) == 8 and eng.lookup_gamma(lookup, 1, greedy=False) == 5
    assert eng.lookup_gamma(lookup, 1, streak=True) == 15 and eng.lookup_gamma(lookup, 2, streak=True) == 5
    assert eng.lookup_gamma(lookup, 1, greedy=False, streak=True) == 5
    plain = DecodeEngine(small, None, max_batch_size=2, max_seq_len=128, spec=SpecConfig(5, 5), cuda_graphs="emulate")
    plain.add_draft("lookup", LookupDraft(streak_gammas={}))  # no streak gamma: 8 throughout
    assert [o.token_ids for o in generate(plain, prompts, params, "lookup")] == want
    assert {(k[-2][1][0], k[3]) for k in plain.graphs.graphs if k[0] == "lookup-round"} == {(2, 5), (1, 8)}
    # The cache margin holds a lookup round's own gamma whatever the engine's (up to MAX_GAMMA), not a draft's 2.
    narrow = DecodeEngine(small, None, max_batch_size=2, max_seq_len=128, spec=SpecConfig(2, 2))
    assert narrow.margin == MAX_GAMMA + 4 and narrow.lookup_gamma(LookupDraft(), 1) == 8
    assert narrow.lookup_gamma(LookupDraft(gammas={1: MAX_GAMMA}), 1) == MAX_GAMMA
    assert narrow.lookup_gamma(LookupDraft(gammas={1: MAX_GAMMA}), 2) == 2
    with pytest.raises(ValueError, match="gamma 1..15"):
        LookupDraft(gammas={1: MAX_GAMMA + 1})


@pytest.mark.parametrize("allot,regroup", [(False, False), (True, False), (False, True), (True, True)])
def test_a_batch_of_lookup_rows_keeps_chaining_until_a_row_wants_no_more_than_the_round_in_flight(tiny, allot, regroup):
    """Overlapped lookup rounds chain while every row wants more tokens than the round in flight can make, not
    both rounds' in full: near a row's end the next round's surplus is cut at its commit, as any round's is. A
    greedy batch that regroups (`regroup_chains`, the default) chains while its rows run at all, the round in
    flight possibly ending a row. Plain decoding's tokens."""
    from engine.lookup import LookupDraft

    small = tiny.tiny_vocab_target(8, num_layers=3, seed=7)
    prompts = [[1, 2, 3, 4], [5, 0, 6], [7, 7, 1], [2, 2, 5, 1, 3]]
    params = [SamplingParams(max_new_tokens=n, eos_token_ids=()) for n in (21, 33, 46, 27)]
    want = [o.token_ids for o in generate(DecodeEngine(small, None, max_batch_size=4, max_seq_len=128), prompts, params)]
    eng = DecodeEngine(small, None, max_batch_size=4, max_seq_len=128, spec=SpecConfig(5, 5), cuda_graphs="emulate",
                       overlap=True)
    eng.regroup_chains = regroup
    eng.add_draft("lookup", LookupDraft(allot=allot))
    left, real = [], eng._launch_next_round

    def launch(batch, packed, pos0, gamma, greedy):  # the fewest tokens a row still wants when a round is chained
        left.append((min(s.request.params.max_new_tokens - len(s.output_ids) for s in batch), gamma))
        return real(batch, packed, pos0, gamma, greedy)

    eng._launch_next_round = launch
    assert [o.token_ids for o in generate(eng, prompts, params, "lookup")] == want
    # Chained with a row wanting fewer than both rounds' tokens (2 x (gamma + 1)); without regrouping never with
    # one the round in flight could finish, regrouping with such rows too, and on past the rows' ends.
    assert any(n < 2 * (g + 1) for n, g in left), left
    if regroup:
        assert any(n < g + 2 for n, g in left) and eng.regrouped > 0, (left, eng.regrouped)
    else:
        assert all(n >= g + 2 for n, g in left) and eng.regrouped == 0, left


@pytest.mark.parametrize("allot", [False, True])
def test_a_lookup_batch_regroups_its_chain_as_rows_end_and_prefilled_requests_join(tiny, allot):
    """An overlapped batch of greedy lookup rows keeps its chain through its rows' ends: a row that stopped leaves the
    next round and a request prefilled ahead joins it, launched before the round in flight is read (`_regroup_round`),
    down to the last row. Plain decoding's tokens (stop tokens, a stop by length mid-round, a cancel), with fewer
    rounds launched unchained than without regrouping."""
    from engine.lookup import LookupDraft

    small = tiny.tiny_vocab_target(8, num_layers=3, seed=7)
    prompts = [[1, 2, 3, 4], [5, 0, 6], [7, 7, 1], [2, 2, 5, 1, 3], [4, 6], [3, 1, 4, 1], [6, 6], [0, 5, 2]]
    params = [SamplingParams(max_new_tokens=n, eos_token_ids=eos)
              for n, eos in zip((21, 33, 46, 27, 15, 38, 9, 30), ((), (), (7,), (), (), (3,), (), ()))]
    want = [o.token_ids for o in generate(DecodeEngine(small, None, max_batch_size=3, max_seq_len=128), prompts, params)]

    def run(regroup: bool):
        eng = DecodeEngine(small, None, max_batch_size=3, max_seq_len=128, spec=SpecConfig(5, 5), cuda_graphs="emulate",
                           overlap=True, prefill_ahead=2)
        eng.regroup_chains = regroup
        eng.add_draft("lookup", LookupDraft(allot=allot))
        unchained, real = [], eng._lookup_round
        eng._lookup_round = lambda rows: unchained.append(len(rows)) or real(rows)
        outs = generate(eng, prompts, params, "lookup")
        return [o.token_ids for o in outs], len(unchained), eng.regrouped

    got, unchained, regrouped = run(True)
    assert got == want
    before, unchained_before, none = run(False)
    assert before == want and none == 0
    assert regrouped >= 5 and unchained < unchained_before, (regrouped, unchained, unchained_before)


def test_a_regrouped_chain_drops_a_cancelled_row_and_keeps_the_others_tokens(tiny):
    """A request cancelled while its batch's rounds run chained leaves the regrouped chain; the others give plain
    decoding's tokens."""
    small = tiny.tiny_vocab_target(8, num_layers=3, seed=7)
    prompts = [[1, 2, 3, 4], [5, 0, 6], [7, 7, 1], [2, 2, 5, 1, 3], [4, 6]]
    params = [SamplingParams(max_new_tokens=n, eos_token_ids=()) for n in (40, 35, 50, 30, 25)]
    want = [o.token_ids for o in generate(DecodeEngine(small, None, max_batch_size=3, max_seq_len=128), prompts, params)]
    eng = DecodeEngine(small, None, max_batch_size=3, max_seq_len=128, spec=SpecConfig(5, 5), cuda_graphs="emulate",
                       overlap=True, prefill_ahead=2)
    eng.add_draft("lookup", LookupDraft())
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(Request(f"r{i}", p, sp, draft="lookup"))
    got = {f"r{i}": [] for i in range(len(prompts))}
    finished, steps = set(), 0
    while eng.has_work():
        for o in eng.step():
            got[o.request_id] += o.token_ids
            if o.finished:
                finished.add(o.request_id)
        steps += 1
        if steps == 6:
            assert eng.cancel("r1")
    assert finished == {f"r{i}" for i in range(len(prompts))} - {"r1"}
    for i, w in enumerate(want):
        if i != 1:
            assert got[f"r{i}"] == w, i
    assert want[1][: len(got["r1"])] == got["r1"] and eng.regrouped > 0


@pytest.mark.parametrize("graphs,overlap", [(None, False), ("emulate", False), ("emulate", True)])
def test_allotted_lookup_rounds_give_each_row_its_own_gamma_within_the_batch_s_tokens_and_plain_tokens(tiny, monkeypatch,
                                                                                                     graphs, overlap):
    """`LookupDraft(allot=True)`: a greedy batch's round gives each row its own gamma (up to ALLOT_MAX_GAMMA) by its
    match's n, the rows' gammas summing to the bucket's gamma-5 round's tokens less a pending token a row; the rows'
    chains run as one packed pass. Plain decoding's tokens, eagerly, as graphs and chained; a lone row runs its
    usual round."""
    from engine import lookup as lookup_mod
    from engine.lookup import ALLOT_MAX_GAMMA, LookupDraft

    small = tiny.tiny_vocab_target(8, num_layers=3, seed=7)
    prompts = [[1, 2, 3, 4], [5, 0, 6], [7, 7, 1], [2, 2, 5, 1, 3], [4, 6]]
    params = [SamplingParams(max_new_tokens=n, eos_token_ids=()) for n in (40, 60, 30, 50, 45)]
    want = [o.token_ids for o in generate(DecodeEngine(small, None, max_batch_size=4, max_seq_len=128), prompts, params)]
    eng = DecodeEngine(small, None, max_batch_size=4, max_seq_len=128, spec=SpecConfig(5, 5), cuda_graphs=graphs,
                       overlap=overlap)
    eng.add_draft("lookup", LookupDraft(allot=True))
    rounds, real = [], lookup_mod.allotted_result
    monkeypatch.setattr("engine.scheduler.allotted_result", lambda packed: rounds.append(packed) or real(packed))
    outs = generate(eng, prompts, params, "lookup")
    assert [o.token_ids for o in outs] == want
    assert rounds and all(len(p) == ALLOT_MAX_GAMMA + 3 for packed in rounds for p in packed)
    gammas = [p[-1] for packed in rounds for p in packed]
    assert len(set(gammas)) > 2 and max(gammas) > 5  # rows' own gammas, some past the uniform round's
    # A full batch of 4 rows: its gammas sum to the verify tokens of a round of 5 (4 x 6) less its 4 pending tokens.
    full = [packed for packed in rounds if len(packed) == 4]
    assert full and all(sum(p[-1] for p in packed) == 4 * 5 for packed in full)
    assert all(p[0] <= p[-1] for packed in rounds for p in packed)  # never more accepted than allotted
    assert sum(o.stats.emitted for o in outs) / sum(o.stats.rounds for o in outs) > 2.0
    if graphs:
        kinds = {k[1] for k in eng.graphs.graphs if k[0] == "lookup-round"}
        assert ("allotted", 5) in kinds and "greedy" in kinds, kinds  # a lone row at the end: its usual round
        warm = DecodeEngine(small, None, max_batch_size=4, max_seq_len=128, spec=SpecConfig(5, 5), cuda_graphs=graphs,
                            overlap=overlap)
        warm.add_draft("lookup", LookupDraft(allot=True))
        assert warm.warmup(sampling=("greedy",)) > 0
        captured = warm.graphs.captures
        assert [o.token_ids for o in generate(warm, prompts, params, "lookup")] == want
        assert warm.graphs.captures == captured  # warm-up captured the allotted rounds traffic runs
    with pytest.raises(ValueError, match="greedy rows only"):
        lookup_mod.launch_lookup_round(eng, [], 12, 64, greedy=False, allotted=5)


@pytest.mark.parametrize("graphs,overlap", [(None, False), ("emulate", False), ("emulate", True)])
def test_a_lone_lookup_row_proposes_its_streak_gamma_after_a_round_that_accepted_everything(tiny, monkeypatch, graphs,
                                                                                           overlap):
    """A lone greedy lookup row's round proposes the streak gamma (15) where its last committed round accepted every
    token it proposed, else 8: read before the next launch, the round just before; chained (overlap), the round
    before the one in flight. Tokens are plain decoding's, and the governor's replay of the row's tokens runs the
    same rounds (`LookupShadow` with the engine's lag)."""
    import engine.scheduler as scheduler
    from engine.lookup import LookupDraft, LookupShadow

    small = tiny.tiny_vocab_target(8, num_layers=3, seed=7)
    prompts = [[2, 6, 1, 7]]  # greedily: a reply that ends in a run of one token
    params = SamplingParams(max_new_tokens=120, eos_token_ids=())
    want = generate(DecodeEngine(small, None, max_batch_size=1, max_seq_len=256), prompts, params)[0].token_ids
    launched, real = [], scheduler.launch_lookup_round

    def record(eng, slots, gamma, kv_len, greedy=True, pending=None, pos0=None, allotted=None):
        packed, p0 = real(eng, slots, gamma, kv_len, greedy, pending=pending, pos0=pos0, allotted=allotted)
        launched.append((gamma, packed, pending is not None))  # chained: launched before the round before was read
        return packed, p0

    monkeypatch.setattr(scheduler, "launch_lookup_round", record)
    eng = DecodeEngine(small, None, max_batch_size=1, max_seq_len=256, spec=SpecConfig(5, 5), cuda_graphs=graphs,
                       overlap=overlap)
    eng.add_draft("lookup", LookupDraft())
    out = generate(eng, prompts, params, "lookup")[0]
    assert out.token_ids == want
    rounds = [(g, int(packed[0, 0]), chained) for g, packed, chained in launched]
    full = [accepted == g for g, accepted, _ in rounds]
    for i, (g, _, chained) in enumerate(rounds):
        lag = 2 if chained else 1
        assert g == (15 if i >= lag and full[i - lag] else 8), (i, rounds)
    assert any(chained for *_, chained in rounds) == overlap
    assert sum(g == 15 for g, *_ in rounds) >= 3 and sum(g == 8 for g, *_ in rounds) >= 2
    # Every round but a chained one past the row's end was committed: the replay over the reply runs the same rounds.
    shadow = LookupShadow(prompts[0], 8, streak_gamma=15, lag=2 if overlap else 1)
    made = shadow.extend(want)
    assert made == [accepted + 1 for _, accepted, _ in rounds[:len(made)]]


@pytest.mark.parametrize("graphs", [None, "emulate"])
def test_sampled_lookup_rounds_are_lossless(small, graphs):
    """Sampled rows naming a LookupDraft: a proposed token is kept with the target's probability of it, else the
    next token comes from the target's distribution without it. From a prompt that repeats itself (so the first
    round proposes), the first 3 tokens of 20k seeded requests have the target's exact joint distribution."""
    from engine.lookup import LookupDraft

    model, _ = small
    prompt, n = [1, 5, 2, 7, 1, 5, 2], 20000
    eng = DecodeEngine(model, None, max_batch_size=500, max_seq_len=32, spec=SpecConfig(3, 3), cuda_graphs=graphs)
    eng.add_draft("lookup", LookupDraft())
    params = [SamplingParams(max_new_tokens=K, temperature=1.0, seed=i, eos_token_ids=()) for i in range(n)]
    results = generate(eng, [prompt] * n, params, draft="lookup")
    assert all(r.stats is not None and r.stats.rounds >= 1 for r in results)
    assert sum(r.stats.accepted > 0 for r in results) > n // 10  # proposals were kept: not a vacuous check
    per_position, joint = distances(torch.tensor([r.token_ids for r in results]), exact_joint(model, 1.0, 1.0, prompt))
    position_max, joint_max = thresholds(n)
    assert max(per_position) < position_max, per_position
    assert joint < joint_max, joint

"""The adaptive gamma controller: its estimates, its choices on simulated rounds, and the engine with it."""

from __future__ import annotations

import random

import pytest

from engine.gamma import GammaController

KEY = (1, 1, True)


def simulate(ctl: GammaController, accept: list[float], cost, rounds: int, seed: int = 0, rows: int = 1,
             noise: float = 0.0) -> tuple[float, dict[int, int]]:
    """Rounds of `rows` rows of one draft whose token k is accepted with probability accept[k - 1] given the
    ones before, a round at gamma costing cost(gamma) seconds (times 1 +- noise). Returns the tokens per second
    of the second half and the gammas it ran."""
    rng = random.Random(seed)
    tokens = seconds = 0.0
    ran: dict[int, int] = {}
    for i in range(rounds):
        gamma = ctl.choose(["d"] * rows, KEY)
        results = []
        for _ in range(rows):
            a = 0
            while a < gamma and rng.random() < accept[a]:
                a += 1
            results.append(("d", a, gamma))
        took = cost(gamma) * (1 + noise * (2 * rng.random() - 1))
        ctl.observe(KEY, gamma, took, results)
        if i >= rounds // 2:
            tokens += sum(a + 1 for _, a, _ in results)
            seconds += took
            ran[gamma] = ran.get(gamma, 0) + 1
    return tokens / seconds, ran


def best_fixed(accept: list[float], cost) -> tuple[int, float]:
    """The oracle: the fixed gamma with the most expected tokens per second, and that rate."""
    rates = {}
    for gamma in range(1, len(accept) + 1):
        s, total = 1.0, 1.0
        for k in range(gamma):
            s *= accept[k]
            total += s
        rates[gamma] = total / cost(gamma)
    gamma = max(rates, key=rates.get)
    return gamma, rates[gamma]


def test_survival_from_rounds_at_the_largest_gamma():
    ctl = GammaController(5)
    accept = [0.8, 0.7, 0.6, 0.5, 0.4]
    simulate(ctl, accept, lambda g: 1.0, 4000, rows=1)
    expected, s = [], 1.0
    for p in accept:
        s *= p
        expected.append(s)
    assert ctl.survival("d") == pytest.approx(expected, abs=0.08)


def test_positions_never_reached_lean_on_the_last_measured_one():
    ctl = GammaController(5)
    for _ in range(300):  # rounds of gamma 2 only: positions 3-5 are never drafted
        ctl.observe(KEY, 2, 1.0, [("d", 2, 2), ("d", 2, 2), ("d", 1, 2), ("d", 0, 2)])
    s = ctl.survival("d")
    p1, p2 = s[0], s[1] / s[0]
    assert p1 == pytest.approx(0.75, abs=0.02) and p2 == pytest.approx(2 / 3, abs=0.03)
    assert s[2] / s[1] == pytest.approx(p2, abs=1e-9) and s[4] / s[3] == pytest.approx(p2, abs=1e-9)
    assert ctl.survival("unseen") == pytest.approx([0.5 ** k for k in range(1, 6)])


def test_cost_is_the_line_through_the_measured_gammas():
    ctl = GammaController(5)
    assert ctl.cost(KEY, 3) is None
    for _ in range(5):
        ctl.observe(KEY, 5, 2.0e-3, [])
    assert ctl.cost(KEY, 1) == pytest.approx(2.0e-3)  # one gamma measured: its own average
    for _ in range(5):
        ctl.observe(KEY, 1, 1.2e-3, [])
    assert ctl.cost(KEY, 3) == pytest.approx(1.6e-3)
    assert ctl.cost(KEY, 4) == pytest.approx(1.8e-3)
    assert ctl.cost((8, 1, True), 3) is None  # another batch bucket has costs of its own


@pytest.mark.parametrize("name, accept, cost", [
    # The H200 profile: a drafted token costs ~0.19 of a 1 ms decode step, verify ~1.0 ms.
    ("dear drafting", [0.72, 0.75, 0.67, 0.70, 0.65], lambda g: 0.95e-3 + 0.23e-3 * g),
    ("cheap drafting", [0.9, 0.9, 0.9, 0.9, 0.9], lambda g: 1.0e-3 + 0.05e-3 * g),
    ("poor draft", [0.3, 0.3, 0.3, 0.3, 0.3], lambda g: 0.9e-3 + 0.25e-3 * g),
])
def test_it_finds_the_best_gamma(name, accept, cost):
    best, oracle_rate = best_fixed(accept, cost)
    rate, ran = simulate(GammaController(5), accept, cost, 3000, noise=0.2)
    assert max(ran, key=ran.get) == best, (name, ran)
    assert rate >= 0.95 * oracle_rate, (name, rate, oracle_rate)
    if best != 5:  # and it beats always drafting gamma = 5 where 5 is not best
        s, tokens = 1.0, 1.0
        for p in accept:
            s *= p
            tokens += s
        assert rate > 1.03 * tokens / cost(5), (name, rate, tokens / cost(5))
    else:
        assert rate >= 0.97 * oracle_rate


def test_it_follows_a_draft_that_gets_worse():
    ctl = GammaController(5)
    cost = lambda g: 1.0e-3 + 0.1e-3 * g  # noqa: E731
    _, ran = simulate(ctl, [0.9] * 5, cost, 1000)
    assert max(ran, key=ran.get) == 5
    _, ran = simulate(ctl, [0.25] * 5, cost, 1000, seed=1)
    assert max(ran, key=ran.get) == best_fixed([0.25] * 5, cost)[0] == 1


def test_disabled_or_forced():
    off = GammaController(4, enabled=False)
    assert {off.choose(["d"], KEY) for _ in range(20)} == {4}
    ctl = GammaController(4)
    ctl.forced = 2
    assert {ctl.choose(["d"], KEY) for _ in range(20)} == {2}
    ctl.observe(KEY, 2, 1.0, [("d", 0, 2)])
    assert ctl.cost(KEY, 2) is None and ctl.survival("d")[0] == 0.5  # forced rounds teach it nothing
    with pytest.raises(ValueError, match="min_gamma"):
        GammaController(3, min_gamma=4)


# ----- the engine with it --------------------------------------------------------------------------


def test_engine_greedy_output_is_unchanged_whatever_gamma_it_takes(tiny_target):
    from engine.generate import generate
    from engine.sampling import SamplingParams
    from engine.scheduler import DecodeEngine
    from engine.speculative import SpecConfig
    from tests.drafts.test_speculative import ar_greedy, noisy, oracle, prompts_for, LENGTHS

    target = tiny_target.model
    ctl = GammaController(4, min_rounds=1, explore_every=2)
    eng = DecodeEngine(target, None, max_batch_size=len(LENGTHS), max_seq_len=128, spec=SpecConfig(4, 2), gamma=ctl)
    eng.add_draft("d", noisy(oracle(target), 0.5))
    out = generate(eng, prompts_for(target.args.vocab_size), SamplingParams(max_new_tokens=30, eos_token_ids=()),
                   draft="d")
    assert [r.token_ids for r in out] == ar_greedy(target)
    assert len(ctl.chosen) == 4, ctl.chosen  # every gamma ran
    assert 0 < ctl.survival("d")[0] < 1
    with pytest.raises(ValueError, match="max_gamma"):
        DecodeEngine(target, None, spec=SpecConfig(5, 5), gamma=GammaController(4))
    eng.add_draft("d", oracle(target))  # a new version under the same name: its acceptance starts afresh
    assert ctl.survival("d") == GammaController(4).survival("d")


def test_engine_warmup_captures_every_gamma(tiny_target):
    from engine.scheduler import DecodeEngine
    from engine.speculative import SpecConfig
    from tests.drafts.test_speculative import oracle

    target = tiny_target.model
    counts = {}
    for gamma in (None, GammaController(3)):
        eng = DecodeEngine(target, None, max_batch_size=1, max_seq_len=64, spec=SpecConfig(3, 3), cuda_graphs="emulate",
                           gamma=gamma)
        eng.add_draft("d", oracle(target))
        eng.warmup(max_len=24, prompt_len=4)
        counts[gamma is None] = {k[3] for k in eng.graphs.graphs if k[0] == "greedy-round"}
    assert counts[True] == {3} and counts[False] == {1, 2, 3}


def test_engine_keeps_the_full_gamma_for_seeded_sampled_requests(tiny_target):
    from engine.generate import generate
    from engine.sampling import SamplingParams
    from engine.scheduler import DecodeEngine
    from engine.speculative import SpecConfig
    from tests.drafts.test_speculative import noisy, oracle, prompts_for

    target = tiny_target.model
    draft = noisy(oracle(target), 0.5)
    outs = {}
    for seed in (11, None, 11):
        ctl = GammaController(4, min_rounds=1, explore_every=2)
        eng = DecodeEngine(target, None, max_batch_size=2, max_seq_len=128, spec=SpecConfig(4, 4), gamma=ctl)
        eng.add_draft("d", draft)
        params = SamplingParams(max_new_tokens=30, temperature=1.0, seed=seed, eos_token_ids=())
        out = generate(eng, prompts_for(target.args.vocab_size, (5, 17)), params, draft="d")
        assert all(r.stats.rounds > 0 for r in out)
        if seed is None:
            assert len(ctl.chosen) > 1  # unseeded: the controller picks
        else:
            assert ctl.chosen == {}  # seeded: every round at the full gamma
            outs.setdefault(seed, []).append([r.token_ids for r in out])
    assert outs[11][0] == outs[11][1]
    ctl = GammaController(4, min_rounds=1, explore_every=2, pin_seeded=False)
    eng = DecodeEngine(target, None, max_batch_size=2, max_seq_len=128, spec=SpecConfig(4, 4), gamma=ctl)
    eng.add_draft("d", draft)
    generate(eng, prompts_for(target.args.vocab_size, (5, 17)), params, draft="d")
    assert len(ctl.chosen) > 1  # not pinned: seeded rounds adapt too


def test_a_choice_is_the_best_ratio_of_the_public_estimates():
    """`choose` (which fits the cost line and each draft's survival once per choice) picks the gamma with the
    most `expected_tokens` per predicted `cost`, on many random states of two drafts."""
    rng = random.Random(3)
    for trial in range(40):
        ctl = GammaController(5, explore_every=10**6)
        names = ["a", "b"]
        for _ in range(rng.randint(12, 60)):  # past the cycle through every gamma: rounds pick by the ratio
            gamma = ctl.choose(names, KEY)
            rows = [(n, rng.randint(0, gamma), gamma) for n in names]
            ctl.observe(KEY, gamma, 1e-3 * (1 + gamma * rng.uniform(0.05, 0.4)), rows)
        batch = [rng.choice(names) for _ in range(rng.randint(1, 4))]
        want = max(ctl.gammas, key=lambda g: ctl.expected_tokens(batch, g) / ctl.cost(KEY, g))
        assert ctl.choose(batch, KEY) == want, trial


def simulate_arms(ctl: GammaController, accept: dict[int, list[float]], cost, rounds: int, seed: int = 0):
    """As `simulate` with trees: accept[width][k - 1] and cost(gamma, width) per tree width. Returns the second
    half's tokens per second and the (gamma, width) arms it ran."""
    rng = random.Random(seed)
    tokens = seconds = 0.0
    ran: dict[tuple[int, int], int] = {}
    for i in range(rounds):
        gamma, width = ctl.choose_arm(["d"], KEY, trees=True)
        a = 0
        while a < gamma and rng.random() < accept[width][a]:
            a += 1
        took = cost(gamma, width) * (1 + 0.1 * (2 * rng.random() - 1))
        ctl.observe(KEY, gamma, took, [("d", a, gamma)], width)
        if i >= rounds // 2:
            tokens += a + 1
            seconds += took
            ran[(gamma, width)] = ran.get((gamma, width), 0) + 1
    return tokens / seconds, ran


@pytest.mark.parametrize("tree_gain, best", [(0.25, 3), (0.02, 1)], ids=["tree pays", "tree does not pay"])
def test_it_takes_the_tree_only_where_it_pays(tree_gain, best):
    """A tree raises the first position's acceptance (by tree_gain) for 6 % more cost a round: the controller
    runs trees where that is worth it and chains where it is not, and knows each width's survival apart."""
    chain = [0.6, 0.7, 0.7, 0.7, 0.7]
    accept = {1: chain, 3: [chain[0] + tree_gain, *chain[1:]]}
    cost = lambda g, w: (0.95e-3 + 0.2e-3 * g) * (1.06 if w > 1 else 1.0)  # noqa: E731
    ctl = GammaController(5, widths=(1, 3))
    rate, ran = simulate_arms(ctl, accept, cost, 4000)
    width = max((1, 3), key=lambda w: sum(n for (g, x), n in ran.items() if x == w))
    assert width == best, ran
    assert ctl.survival("d", best)[0] == pytest.approx(accept[best][0], abs=0.1)  # the arm it runs, measured apart
    oracle = max(best_fixed(accept[w], lambda g, w=w: cost(g, w))[1] for w in (1, 3))
    assert rate >= 0.93 * oracle, (rate, oracle)
    assert set(ctl.snapshot()["widths"]) == {1, 3}


def test_batches_that_may_not_take_a_tree_run_chains():
    ctl = GammaController(4, widths=(1, 2), min_rounds=1)
    assert {ctl.choose_arm(["d"], KEY, trees=False)[1] for _ in range(40)} == {1}
    assert {ctl.choose_arm(["d"], KEY, trees=True)[1] for _ in range(40)} == {1, 2}
    with pytest.raises(ValueError, match="include 1"):
        GammaController(4, widths=(2, 3))

"""bench.lookup_policy: the governor's per-request rules for a lone lookup request, replayed over replies."""

import pytest

from bench.lookup_policy import compare, play, seeded_governor

ROUND, PLAIN = 0.872e-3, 0.722e-3


def _late_repeater() -> tuple[list[int], list[int]]:
    """A reply of 120 tokens that never repeat, then a 5-token phrase over and over."""
    prompt = list(range(1000, 1010))
    return prompt, list(range(2000, 2120)) + [7, 8, 9, 10, 11] * 40


def test_a_reply_that_repeats_only_late_drops_then_comes_back_sooner_with_a_short_window():
    prompt, reply = _late_repeater()
    got = {w: play(prompt, reply, seeded_governor(ROUND, PLAIN, w), 8, ROUND, PLAIN) for w in (32, 8)}
    for w in (32, 8):
        assert got[w]["drops"] == 1 and got[w]["returns"] == 1, got  # dropped in the stretch without repeats
    assert got[8]["lookup_tokens"] > got[32]["lookup_tokens"]  # back on lookup sooner: more of the repeats
    assert got[8]["seconds"] < got[32]["seconds"]
    throughout = play(prompt, reply, seeded_governor(ROUND, PLAIN, 8), 8, ROUND, PLAIN, drop=False)
    assert throughout["drops"] == 0 and throughout["lookup_tokens"] == len(reply) - 1


def test_compare_prices_rules_against_plain_decoding_over_the_same_replies():
    prompt, reply = _late_repeater()
    never = (list(range(10)), list(range(100, 400)))  # no token ever recurs: lookup proposes nothing
    rules = compare([(prompt, reply), never], (32, 8), 8, ROUND, PLAIN)
    assert list(rules) == ["lookup throughout", "return window 32", "return window 8"]
    assert rules["return window 8"]["speedup"] > rules["return window 32"]["speedup"] > 1.0
    alone = compare([never], (8,), 8, ROUND, PLAIN)
    # Without a single repeat every lookup round makes one token: throughout it costs round / plain; the rule
    # drops it after its window and it does not come back.
    assert alone["lookup throughout"]["speedup"] == pytest.approx(PLAIN / ROUND, rel=0.01)
    assert alone["return window 8"]["drops"] == 1 and alone["return window 8"]["returns"] == 0
    assert alone["return window 8"]["speedup"] > alone["lookup throughout"]["speedup"]


def test_a_short_memory_of_a_domain_s_lookup_tokens_starts_the_request_after_one_that_did_not_repeat_on_its_draft():
    """Three replies that repeat a phrase, then one that never does, in turn: priced from about the last 100 replayed
    rounds (alpha 0.01) the request after the one that did not repeat starts on its draft, though its own reply
    repeats (a choice against its own reply, each pass); from about the last 1,000 (0.001) every request starts on
    lookup, and only the one that does not repeat is chosen against its reply."""
    from bench.lookup_policy import admissions

    repeater = lambda k: (list(range(10 * k, 10 * k + 10)), [7, 8, 9, 10, 11, 12] * 40)  # noqa: E731
    never = (list(range(500, 510)), list(range(600, 840)))  # no token recurs: one token a round
    got = admissions([repeater(1), repeater(2), never, repeater(3)], (0.01, 0.001), 8, ROUND, 0.45e-3)
    assert got[0.001] == {"draft_starts": 0, "against_own_reply": 3, "admissions": 12}
    assert got[0.01]["draft_starts"] >= 3 and got[0.01]["against_own_reply"] > got[0.001]["against_own_reply"]


def test_a_closed_batch_plays_rows_in_waves_and_costs_each_step_by_its_bucket():
    from bench.lookup_policy import batch_play

    never = [(list(range(100 * k, 100 * k + 5)), list(range(1000 * (k + 1), 1000 * (k + 1) + 10))) for k in range(3)]
    plain = batch_play(never, 2, None, 1.0, 0.1)
    # two rows for 9 steps (the prefill made each reply's first token), then the third request alone for 9
    # Plain steps of 1 token: an overlapped engine stops chaining when a row wants fewer than 2 (both calls) or 2
    # (this call's 1, and one more): the last step of each wave.
    assert plain == {"steps": {1: 9, 2: 9}, "fill": 0.75, "tokens_per_row_round": 1.0, "ms": round(9 * 1.2 + 9 * 1.1, 1),
                     "chain_stops": {"both rounds": round(2 / 18, 3), "this round": round(2 / 18, 3)},
                     "ms_with_host": round(9 * 1.2 + 9 * 1.1, 1)}
    assert batch_play(never, 2, None, 1.0, 0.1, host_ms=0.5)["ms_with_host"] == round(9 * 1.2 + 9 * 1.1 + 2 * 0.5, 1)
    from bench.lookup_policy import gamma_policy

    looked = batch_play(never, 2, gamma_policy("5"), 1.0, 0.1)  # nothing recurs: a round makes one token, dearer
    assert looked["steps"] == plain["steps"] and looked["ms"] > plain["ms"]
    phrase = [(list(range(10 * k, 10 * k + 6)), [7, 8, 9, 1, 2, 3] * 10) for k in range(4)]
    repeats = batch_play(phrase, 2, gamma_policy("5"), 1.0, 0.1)
    assert repeats["tokens_per_row_round"] > 4 and repeats["ms"] < batch_play(phrase, 2, None, 1.0, 0.1)["ms"] / 2
    stops = repeats["chain_stops"]  # a row within 12 tokens of its end stops the full rule, within 7 lookup's
    assert 0 < stops["this round"] < stops["both rounds"] < 1


def test_an_allotted_batch_spends_its_tokens_on_the_rows_that_repeat():
    """The policy 'allot': a batch's verify tokens go to its rows by their matches' n (engine.lookup.allot): beside a
    row that never repeats, a repeating row proposes past the uniform gamma, and the batch makes more tokens a round
    at the same cost a step as gamma 5."""
    from bench.lookup_policy import Allotted, batch_play, gamma_policy

    never = [(list(range(100 * k, 100 * k + 5)), list(range(1000 * (k + 1), 1000 * (k + 1) + 60))) for k in range(2)]
    phrase = [(list(range(10 * k, 10 * k + 6)), [7, 8, 9, 1, 2, 3, 4, 5] * 8) for k in range(2)]
    mixed = [never[0], phrase[0], never[1], phrase[1]]
    policy = gamma_policy("allot")
    assert isinstance(policy, Allotted) and (policy.gamma, policy.max_gamma) == (5, 12)
    assert gamma_policy("allot:8").max_gamma == 8
    assert policy.gammas(2, [6, 0]) == [10, 0]  # 2 x 6 verify tokens: the repeating row all but its pending one
    uniform, allotted = batch_play(mixed, 2, gamma_policy("5"), 1.0, 0.1), batch_play(mixed, 2, policy, 1.0, 0.1)
    assert allotted["tokens_per_row_round"] > uniform["tokens_per_row_round"] and allotted["ms"] < uniform["ms"]
    for bad in ("allot:0", "allot:16", "allot:x"):
        with pytest.raises(SystemExit, match="policy"):
            gamma_policy(bad)


def test_gamma_policies_from_their_text():
    from bench.lookup_policy import gamma_policy

    assert gamma_policy("5")(8, []) == 5 and gamma_policy("5")(1, []) == 8  # a lone row: LookupDraft's 8
    table = gamma_policy("8:5,4:8")
    assert (table(8, []), table(4, []), table(2, []), table(1, [])) == (5, 8, 5, 8)
    adaptive = gamma_policy("5/8@0.5")
    assert adaptive(8, [(5, 5), (1, 5), None]) == 8  # one of the two known rounds kept everything
    assert adaptive(8, [(5, 5), (1, 5), (0, 5)]) == 5 and adaptive(8, [None, None]) == 5
    for bad in ("five", "8:x", "5/8", "0", "8:16"):
        with pytest.raises(SystemExit, match="policy"):
            gamma_policy(bad)

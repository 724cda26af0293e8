"""`flashspec bench spec`: interleaved AR / FlashSpec passes, each ratio against the AR passes around it."""

from __future__ import annotations

import pytest

import bench.spec as spec_bench


def fake_measures(monkeypatch, tiny_target, ar_tps, spec_tps):
    monkeypatch.setattr("engine.loading.load_model", lambda name, device="cpu": tiny_target)
    monkeypatch.setattr("bench.prompts.held_out_prompts", lambda tok, domain, n, split: ([[5, 6, 7, 8]] * n, "test prompts"))
    calls, ar_it, spec_it = [], iter(ar_tps), iter(spec_tps)

    def measure(engine, prompts, params, draft_name):
        calls.append(draft_name)
        tps = next(ar_it) if draft_name is None else next(spec_it)
        return {"tps": tps, "mal": 2.5, "acc": 0.3, "outs": [[1, 2]] * len(prompts)}

    monkeypatch.setattr(spec_bench, "measure", measure)
    return calls


def test_passes_interleave_and_the_speedup_is_the_median_of_paired_ratios(monkeypatch, tiny_target, capsys):
    # warm-up, then AR 10, spec 15, AR 20, spec 30, AR 10: the ratios are 15/15 and 30/15
    calls = fake_measures(monkeypatch, tiny_target, [99.0, 10.0, 20.0, 10.0], [15.0, 30.0])
    rows = spec_bench.run(drafts=["untrained:1,1,mlp_tied,deep"], n_prompts=2, max_new_tokens=4, blocks=(5,),
                          repeats=2)
    assert calls == [None, None, "d", None, "d", None]
    assert rows[1]["speedup"] == pytest.approx(1.5) and rows[1]["range"] == pytest.approx((1.0, 2.0))
    assert rows[0]["tps"] == pytest.approx(40 / 3) and rows[1]["same"] == 2
    out = capsys.readouterr().out
    assert "2 interleaved passes" in out and "1.50x [1.00-2.00]" in out


def test_one_pass_compares_with_ar_first_and_last(monkeypatch, tiny_target, capsys):
    fake_measures(monkeypatch, tiny_target, [99.0, 10.0, 30.0], [40.0, 10.0])
    rows = spec_bench.run(drafts=["untrained:1,1,mlp_tied,deep"], n_prompts=1, max_new_tokens=4, blocks=(5,),
                          confidences=(0.0, 0.4))
    assert [r["speedup"] for r in rows] == pytest.approx([1.0, 2.0, 0.5]) and rows[1]["range"] is None
    assert "measured first and last (10.00 / 30.00 tok/s)" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="repeats"):
        spec_bench.run(repeats=0)


def test_several_gammas_each_a_row_and_a_long_block_is_one_verify(monkeypatch, tiny_target):
    fake_measures(monkeypatch, tiny_target, [99.0, 10.0, 10.0], [11.0, 12.0])
    rows = spec_bench.run(drafts=["untrained:1,1,mlp_tied,deep"], n_prompts=1, max_new_tokens=4, gamma=(5, 7),
                          blocks=(7,))
    assert [r["name"].split(") ")[1] for r in rows[1:]] == ["gamma 5 block 5", "gamma 7 block 7"]


def test_a_temperature_samples_every_path_and_does_not_compare_outputs(monkeypatch, tiny_target, capsys):
    seen = []
    fake_measures(monkeypatch, tiny_target, [99.0, 10.0, 10.0], [12.0])
    real = spec_bench.measure

    def measure(engine, prompts, params, draft_name):
        seen.append(params.temperature)
        return real(engine, prompts, params, draft_name)

    monkeypatch.setattr(spec_bench, "measure", measure)
    spec_bench.run(drafts=["untrained:1,1,mlp_tied,deep"], n_prompts=1, max_new_tokens=4, blocks=(5,), temperature=1.0)
    assert seen[1:] == [1.0, 1.0, 1.0]  # every measured pass (the warm-up aside) samples at T=1
    out = capsys.readouterr().out
    assert "T=1, batch 1" in out and "- (sampled)" in out and "1/1" not in out


def test_draft_temperatures_are_rows_of_a_sampled_run_and_refused_for_greedy(monkeypatch, tiny_target):
    seen = []
    fake_measures(monkeypatch, tiny_target, [99.0, 10.0, 10.0], [12.0, 13.0])
    real = spec_bench.measure

    def measure(engine, prompts, params, draft_name):
        seen.append((draft_name, params.temperature, params.draft_temperature))
        return real(engine, prompts, params, draft_name)

    monkeypatch.setattr(spec_bench, "measure", measure)
    rows = spec_bench.run(drafts=["untrained:1,1,mlp_tied,deep"], n_prompts=1, max_new_tokens=4, blocks=(5,),
                          temperature=1.0, draft_temperatures=(None, 0.8))
    assert [r["name"].split(") ")[1] for r in rows[1:]] == ["gamma 5 block 5", "gamma 5 block 5 draft T=0.8"]
    assert ("d", 1.0, None) in seen and ("d", 1.0, 0.8) in seen
    assert all(dt is None for name, _, dt in seen if name is None)  # plain decoding has no draft
    with pytest.raises(SystemExit, match="--temperature"):
        spec_bench.run(draft_temperatures=(0.8,))


def test_full_vocab_draws_add_a_row_per_sampled_row_and_are_refused_for_greedy(monkeypatch, tiny_target):
    seen = []
    fake_measures(monkeypatch, tiny_target, [99.0, 10.0, 10.0], [12.0, 13.0])
    real = spec_bench.measure

    def measure(engine, prompts, params, draft_name):
        if draft_name is not None:
            seen.append(engine.spec.sub_vocab_draws)
        return real(engine, prompts, params, draft_name)

    monkeypatch.setattr(spec_bench, "measure", measure)
    rows = spec_bench.run(drafts=["untrained:1,1,mlp_tied,deep,8"], n_prompts=1, max_new_tokens=4, blocks=(5,),
                          temperature=1.0, full_vocab_draws=True)
    assert seen == [True, False]
    assert [r["name"].endswith("draws over the whole vocabulary") for r in rows[1:]] == [False, True]
    with pytest.raises(SystemExit, match="--temperature"):
        spec_bench.run(full_vocab_draws=True)


def test_the_lookup_drafter_is_a_row_with_its_own_name(monkeypatch, tiny_target):
    """--draft lookup: the n-gram lookup drafter (no weights) measured like a draft, named as such."""
    from engine.lookup import LookupDraft

    assert isinstance(spec_bench.load_bench_draft("lookup", tiny_target.model), LookupDraft)
    fake_measures(monkeypatch, tiny_target, [99.0, 10.0, 10.0], [20.0])
    rows = spec_bench.run(drafts=["lookup"], n_prompts=1, max_new_tokens=4, blocks=(5,))
    assert rows[1]["name"] == "FlashSpec lookup (n-gram lookup) gamma 5 block 5"
    assert rows[1]["speedup"] == pytest.approx(2.0)


def test_a_draft_with_the_lookup_alternative_is_a_governed_row(monkeypatch, tiny_target):
    """--draft D+lookup: draft D with the lookup drafter as its alternative and the governor choosing (the service's
    way); the engine is set up so, and calibrated; other alternatives are refused."""
    engines = []
    fake_measures(monkeypatch, tiny_target, [99.0, 10.0, 10.0], [20.0])
    real_run = spec_bench.measure

    def measure(engine, prompts, params, draft_name):
        engines.append(engine)
        return real_run(engine, prompts, params, draft_name)

    monkeypatch.setattr(spec_bench, "measure", measure)
    rows = spec_bench.run(drafts=["untrained:1,1,mlp_tied,deep+lookup"], n_prompts=1, max_new_tokens=4, blocks=(5,))
    assert rows[1]["name"].startswith("FlashSpec untrained:1,1,mlp_tied,deep (N=1") and "or lookup (governor)" in rows[1]["name"]
    eng = engines[2]  # warm-up and the first AR pass come first
    assert eng.alternatives == {"d": ("lookup",)} and eng.governor.enabled and eng.governor.plain_samples(1) > 0
    with pytest.raises(SystemExit, match="only alternative is lookup"):
        spec_bench.run(drafts=["code+other"], n_prompts=1, max_new_tokens=4)


def test_the_long_shape_takes_the_gpu_benchmark_s_prompts(monkeypatch, tiny_target, capsys):
    fake_measures(monkeypatch, tiny_target, [99.0, 10.0, 10.0], [20.0])
    monkeypatch.setattr("bench.ngram_headroom.prompts_of", lambda shape, domain, tok, n, split: [[5, 6, 7, 8, 9]] * n)
    spec_bench.run(drafts=["lookup"], n_prompts=2, max_new_tokens=4, blocks=(5,), shape="long")
    assert "code test split in the GPU benchmark's long shape (2 prompts" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--shape"):
        spec_bench.run(drafts=["lookup"], n_prompts=1, max_new_tokens=4, shape="wide")

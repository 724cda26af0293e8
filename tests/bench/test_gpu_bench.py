"""bench.gpu's fp32 check: every greedy token against the fp32 model's argmax given the same prefix."""

from __future__ import annotations

import pytest
import torch

from bench.gpu import fp32_agreement
from engine.generate import generate
from engine.sampling import SamplingParams
from engine.scheduler import DecodeEngine


def bench_on(tiny_target, **args):
    """A Bench over the tiny target without loading a model: one timed pass a row, no fp32 check, `args` more flags."""
    import argparse

    from bench.gpu import Bench

    bench = Bench.__new__(Bench)
    bench.args = argparse.Namespace(passes=1, short_passes=None, fp32_check=False, **args)
    bench.loaded, bench.tok, bench.rows, bench._cell_base = tiny_target, None, [], None
    return bench


def tiny_draft(tiny_target):
    """A one-trunk-layer, one-adapter draft over the tiny target (the rows' best draft)."""
    from drafts.config import DraftConfig
    from drafts.model import DraftModel

    return DraftModel(tiny_target.model, DraftConfig(shared_layers=1, adapter_layers=1, head="mlp_tied"))


def test_greedy_outputs_agree_everywhere_and_a_changed_token_is_one_miss_with_its_gap(tiny_target):
    model = tiny_target.model
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    engine = DecodeEngine(model, None, max_batch_size=2, max_seq_len=64)
    outs = [r.token_ids for r in generate(engine, prompts, SamplingParams(max_new_tokens=12, eos_token_ids=()))]
    same = fp32_agreement(model, prompts, outs)
    assert same["fp32_agreement"] == 1.0 and same["fp32_misses"] == 0 and same["fp32_gap_max"] is None

    changed = [list(o) for o in outs]
    x = torch.tensor([prompts[1] + outs[1][:5]])
    logits = model(x, torch.arange(x.shape[1])[None]).logits[0, -1]
    changed[1][5] = int(logits.argsort()[-2])  # the runner-up at position 5, then the rest as before
    report = fp32_agreement(model, prompts, changed)
    gap = float(logits.max() - logits.sort().values[-2])
    assert report["fp32_misses"] >= 1 and report["fp32_agreement"] <= 1 - 1 / 24
    assert report["fp32_gap_max"] >= gap - 1e-5 > 0  # the changed token is one of the misses, with its gap


def test_a_failing_row_is_kept_with_its_error_and_the_table_goes_on():
    from bench.gpu import Bench, table_rows

    bench = Bench.__new__(Bench)  # no model: only the row bookkeeping
    bench.rows = []
    ar = bench.measure("bs 1", "engine AR", lambda: {"tps": 100.0, "outs": [[1, 2]]})
    assert ar["outs"] == [[1, 2]] and "outs" not in bench.rows[0]  # the caller keeps the outputs, the table not

    def broken():
        raise RuntimeError("CUDA error: operation failed due to a previous error during capture\nmore lines")

    failed = bench.measure("bs 1", "FlashSpec, governor", broken)
    assert failed["tps"] is None and failed["error"].startswith("RuntimeError: CUDA error: operation failed")
    bench.measure("bs 1", "FlashSpec, block 5", lambda: {"tps": 150.0, "mal": 2.5, "tps_passes": [149.6, 150.0, 163.2],
                                                         "graphs_in_passes": 2, "passes_rerun": 3})
    assert bench.measure("bs 1", "transformers lookup", lambda: None) is None  # a row that does not apply
    lines = table_rows(bench.rows)
    assert len(lines) == 3
    assert "failed: RuntimeError: CUDA error" in lines[1] and "more lines" not in lines[1]
    assert "| 150.0 | 1.50x | -x |" in lines[2] and lines[2].endswith("| 150-163 (2 captured, 3 passes rerun) |")  # spread, captures
    assert lines[0].endswith("| - |")
    # Rows of the fused path also get their ratio to fused plain decoding, the figure their speed-up is quoted by.
    bench.measure("bs 1", "engine AR (fused)", lambda: {"tps": 250.0})
    bench.measure("bs 1", "FlashSpec, block 5 (fused)", lambda: {"tps": 300.0})
    lines = table_rows(bench.rows)
    assert "| 250.0 | 2.50x | 1.00x |" in lines[3] and "| 300.0 | 3.00x | 1.20x |" in lines[4]
    assert all(line.count("|") == lines[2].count("|") for line in lines)  # the failed row keeps the columns


@pytest.mark.parametrize("module", ["bench.round_profile", "bench.flashinfer_probe", "bench.side_prefill_probe"])
def test_gpu_scripts_without_a_gpu_say_so_and_where_to_run_them(module):
    import subprocess
    import sys
    from pathlib import Path

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the script would run")
    done = subprocess.run([sys.executable, "-m", module], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 1 and "needs a CUDA GPU" in done.stderr and "GPU machine" in done.stderr


def test_fused_and_attention_rows_run_in_the_same_settings():
    import argparse

    from bench.gpu import fused_settings

    settings = [(1, "long", 256, True), (1, "long", 256, False), (8, "long", 256, True)]
    args = argparse.Namespace(fused_batch_sizes="1", fused_greedy_only=True)
    assert fused_settings(args, settings) == [(1, "long", 256, True)]
    args = argparse.Namespace(fused_batch_sizes=None, fused_greedy_only=False)
    assert fused_settings(args, settings) == settings


def test_short_cells_run_more_requests_than_long_ones():
    from bench.gpu import pick_prompts

    data = {d: {"long": [[n, i, 1] for i in range(16)], "short": [[n, i, 2] for i in range(16)]}
            for n, d in enumerate(("code", "general", "dialog"))}
    long1, domains = pick_prompts(data, "long", 1)
    assert len(long1) == 6 and domains == ["code", "general", "dialog"] * 2
    assert len(pick_prompts(data, "long", 8)[0]) == 8 and len(pick_prompts(data, "long", 1, long_prompts=3)[0]) == 3
    short, domains = pick_prompts(data, "short", 1, short_prompts=24)
    assert len(short) == 24 and domains.count("code") == 8 and len({tuple(p) for p in short}) == 24
    with pytest.raises(SystemExit, match="16 per domain"):
        pick_prompts(data, "short", 1, short_prompts=60)


def test_a_cells_engine_rows_take_their_passes_in_turn_and_a_broken_one_is_kept(tiny_target, monkeypatch):
    """bench.gpu's interleaved cell, on the CPU with a tiny model: every row built and warmed up first, then
    pass p runs every row starting at row p; a row failing in a pass keeps its error, the others go on."""
    import argparse

    from bench.gpu import Bench, EngineRow

    bench = Bench.__new__(Bench)
    bench.args = argparse.Namespace(passes=3, short_passes=None, fp32_check=False, gammas=(), adaptive_gamma=False)
    bench.loaded = tiny_target
    bench.tok = None
    bench.rows, bench._cell_base = [], None
    order = []
    real = EngineRow.timed_pass

    def spy(self):
        order.append(self.label)
        if self.label == "broken" and len([o for o in order if o == "broken"]) == 2:
            raise RuntimeError("lost the device\ndetails")
        return real(self)

    monkeypatch.setattr(EngineRow, "timed_pass", spy)
    prompts, domains = [[5, 6, 7], [8, 9, 10, 11]], ["code", "code"]

    def build(label, **kw):
        row = bench.engine_row(prompts, domains, 6, True, 2, None, **kw)
        row.label = label
        return row

    def unbuildable():
        raise ValueError("no such draft")

    bench.measure_engines("bs 2", [("a", lambda: build("a")), ("b", lambda: build("b", block=5)),
                                   ("unbuildable", unbuildable), ("broken", lambda: build("broken"))])
    # Pass 0 from row 0, pass 1 from row 1 (where "broken" fails), pass 2 from row 2 (skipped: failed).
    assert order == ["a", "b", "broken", "b", "broken", "a", "a", "b"]
    rows = {r["name"]: r for r in bench.rows}
    assert [r["name"] for r in bench.rows] == ["a", "b", "unbuildable", "broken"]
    assert len(rows["a"]["tps_passes"]) == 3 and rows["a"]["tps"] > 0 and rows["b"]["tps"] > 0
    split = rows["a"]["host_split"]  # the last pass: time in the engine's steps, and outside them
    assert split["steps"] > 0 and split["rounds"] == 0 and 0 < split["step_ms"] <= split["pass_ms"]
    assert split["outside_steps_ms"] == pytest.approx(split["pass_ms"] - split["step_ms"], abs=0.2)
    assert rows["unbuildable"]["error"] == "ValueError: no such draft"
    assert rows["broken"]["tps"] is None and rows["broken"]["error"] == "RuntimeError: lost the device"
    bench.args.short_passes = 7  # short cells (20 new tokens or fewer) take their own pass count
    assert (bench.passes(6), bench.passes(20), bench.passes(256)) == (7, 7, 3)


def test_the_host_split_counts_rounds_and_restores_the_engine(tiny_target):
    """`HostSplit` times the engine's steps and speculative rounds for one pass, then leaves the engine's own
    methods in place."""
    from bench.gpu import HostSplit
    from drafts.config import DraftConfig
    from drafts.model import DraftModel
    from engine.generate import generate
    from engine.sampling import SamplingParams
    from engine.scheduler import DecodeEngine
    from engine.speculative import SpecConfig

    model = tiny_target.model
    draft = DraftModel(model, DraftConfig(shared_layers=1, adapter_layers=1, head="mlp_tied"))
    draft.init_from_target()
    eng = DecodeEngine(model, None, max_batch_size=2, max_seq_len=64, spec=SpecConfig(3, 3))
    eng.add_draft("d", draft)
    params = SamplingParams(max_new_tokens=12, eos_token_ids=())
    with HostSplit(eng) as split:
        outs = generate(eng, [[5, 6, 7], [8, 9]], params, "d")
    report = split.report(wall=10.0)
    per_request = [o.stats.rounds for o in outs]  # a batched round counts once for the engine, once per row here
    assert 0 < max(per_request) <= report["rounds"] <= sum(per_request) <= 2 * report["steps"]
    assert 0 < report["round_ms"] <= report["step_ms"] <= report["pass_ms"] == 10000.0
    assert "step" not in vars(eng) and "_spec_round" not in vars(eng)


def test_a_timed_pass_that_captured_a_graph_runs_again(tiny_target):
    """A pass during which the engine captured a CUDA graph is no steady-state sample: it runs again (at most
    twice), and the row counts the reruns; the rate is the last try's."""
    from bench.gpu import RERUNS

    bench = bench_on(tiny_target, gammas=(), adaptive_gamma=False)
    row = bench.engine_row([[5, 6, 7], [8, 9, 10, 11]], ["code", "code"], 6, True, 2, None)
    tries, real = [], row.once

    def once(captures):
        tries.append(1)
        if captures:
            row.eng.graphs.captures += 1  # as a capture inside the pass would
        return real()

    row.once = lambda: once(len(tries) < 1)  # the first try captures, the second does not
    row.timed_pass()
    assert len(tries) == 2 and row.reruns == 1 and len(row.rates) == 1
    tries.clear()
    row.once = lambda: once(True)  # every try captures: it gives up after RERUNS more
    row.timed_pass()
    assert len(tries) == RERUNS + 1 and row.reruns == 1 + RERUNS and len(row.rates) == 2
    assert row.result()["passes_rerun"] == 1 + RERUNS


def test_shaped_prompts_are_exactly_the_benchmark_lengths(tiny):
    """bench.export_prompts.shaped_prompts (the GPU benchmark's prompts, and bench.domains --shapes): long =
    the request with later rows' documents appended, cut to exactly long_len tokens; short = the request cut."""
    from bench.export_prompts import shaped_prompts

    tok = tiny.make_tokenizer(200)
    tok.chat_template = "{% for m in messages %}w2 {{ m['content'] }} w3 {% endfor %}{% if add_generation_prompt %}w4{% endif %}"
    words = lambda start, n: " ".join(f"w{5 + (start + i) % 190}" for i in range(n))  # noqa: E731
    rows = [{"messages": [{"role": "user", "content": words(7 * i, 20)}], "text": words(11 * i, 60)} for i in range(6)]
    longs, shorts = shaped_prompts(tok, rows, 4, long_len=64, short_len=12)
    assert len(longs) == 4 and all(len(p) == 64 for p in longs)
    assert len(shorts) == 4 and all(len(p) == 12 for p in shorts)
    first = tok(rows[0]["messages"][0]["content"]).input_ids
    assert longs[0][1:21] == first and shorts[0][:2] == [2, first[0]]  # the request leads, then the appended text
    assert longs[0][21:25] == tok(rows[1]["text"]).input_ids[:4]


def test_fixed_gamma_rows_also_run_overlapped_on_request(tiny_target):
    """--gammas 3 --gammas-overlapped: the fixed-gamma row, and its twin with overlapped graph calls."""
    from bench.gpu import best_rows

    bench = bench_on(tiny_target, gammas=(3,), gammas_overlapped=True, adaptive_gamma=False)
    draft = tiny_draft(tiny_target)
    draft.init_from_target()
    rows = dict(best_rows(bench, ([[5, 6, 7]], ["code"], 4, True, 1), {"code": draft}, None, blocks=(5,)))
    assert list(rows) == ["FlashSpec best drafts, block 5", "FlashSpec best drafts, gamma 3",
                          "FlashSpec best drafts, gamma 3, overlapped", "FlashSpec best drafts, block 5, governor"]
    plain, overlapped = rows["FlashSpec best drafts, gamma 3"](), rows["FlashSpec best drafts, gamma 3, overlapped"]()
    assert not plain.eng.overlap and overlapped.eng.overlap
    assert overlapped.eng.spec.num_speculative_tokens == 3 == overlapped.eng.spec.block_size


def test_kernel_diff_keeps_what_differs_and_signs_it(capsys):
    from bench.round_profile import kernel_diff, print_kernel_diff

    chain = {"gemm": [10, 60.0], "attention": [4, 20.0], "argmax": [5, 10.0]}
    tree = {"gemm": [10, 66.0], "attention": [4, 20.0], "mask_and": [3, 9.0], "argmax": [1, 2.0]}
    diff = kernel_diff(tree, chain)
    assert diff == {"gemm": [0, 6.0], "mask_and": [3, 9.0], "argmax": [-4, -8.0]}  # same count and time: left out
    print_kernel_diff(tree, chain, top=2, indent="")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "-1 kernels, +0.007 ms of kernel time in all"
    assert len(lines) == 3 and "mask_and" in lines[1] and "argmax" in lines[2]  # the two largest by time


def test_a_swept_setting_without_a_time_says_why():
    """bench.round_profile's sweeps (--vocab-calls, --proj-calls): a declined call or a failing setting is said, not
    timed (a declined call launches nothing: its time would be the host's check alone)."""
    from bench.round_profile import setting_us

    def fails():
        raise RuntimeError("out of shared memory")

    assert setting_us(lambda: None, torch.zeros(1)) == "declined"
    assert setting_us(fails, torch.zeros(1)) == "RuntimeError"


def test_overridden_sets_module_switches_for_a_block_and_restores_them_after_an_error():
    import types

    from bench.round_profile import overridden

    module = types.SimpleNamespace(PROJ=False, INLINE_MERGE=True)
    with overridden(module, PROJ=True, INLINE_MERGE=False):
        assert module.PROJ is True and module.INLINE_MERGE is False
    assert module.PROJ is False and module.INLINE_MERGE is True
    try:
        with overridden(module, PROJ=True):
            raise RuntimeError("a setting that does not compile")
    except RuntimeError:
        pass
    assert module.PROJ is False


def test_lookup_rows_run_the_requests_on_a_lookup_drafter(tiny_target):
    """--lookup 3,5: rows whose requests name an n-gram lookup drafter, at each gamma alone and overlapped, and at
    the largest with the governor."""
    from bench.gpu import lookup_rows

    bench = bench_on(tiny_target, lookup=(3, 5))
    workload = ([[5, 6, 7, 5, 6]], ["code"], 6, True, 1)
    rows = dict(lookup_rows(bench, workload, None, " (fused)"))
    assert list(rows) == ["FlashSpec lookup, gamma 3 (fused)", "FlashSpec lookup, gamma 3, overlapped (fused)",
                          "FlashSpec lookup, gamma 5 (fused)", "FlashSpec lookup, gamma 5, overlapped (fused)",
                          "FlashSpec lookup, gamma 5, governor, overlapped (fused)"]
    row = rows["FlashSpec lookup, gamma 3 (fused)"]()
    assert row.eng.spec.num_speculative_tokens == 3 and row.outs == [] and row.names == ["code"]
    row.timed_pass()
    assert row.outs[0].stats.rounds > 0  # its request ran lookup rounds
    bench.args.lookup = ()
    assert lookup_rows(bench, workload, None) == []


def test_the_lookup_alternative_row_lets_the_governor_pick_a_draft_or_lookup(tiny_target):
    """With the best drafts, --lookup adds the service's setting where each draft has the lookup drafter as an
    alternative (`DecodeEngine.set_alternatives`): the governor tries both, then runs the cheaper; every request's
    tokens are plain decoding's; the row says where its pass's tokens came from and what the governor decided."""
    from bench.gpu import lookup_rows, paths
    from engine.generate import generate
    from engine.sampling import SamplingParams
    from engine.scheduler import DecodeEngine

    bench = bench_on(tiny_target, lookup=(3,))
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 8, 9, 8, 9, 8], [4, 4, 5, 4, 4, 5], [7, 3, 7, 3, 7, 3]]
    workload = (prompts, ["code"] * 4, 12, True, 1)
    best = {"code": tiny_draft(tiny_target)}
    rows = dict(lookup_rows(bench, workload, None, "", best))
    name = "FlashSpec best drafts or lookup (governor's choice), adaptive gamma, governor, overlapped"
    assert list(rows)[-1] == name
    row = rows[name]()
    assert row.eng.alternatives == {"code": ("lookup",)} and row.gov is not None
    row.timed_pass()
    ran = row.gov.snapshot()["spec_samples"]
    assert ran.get("code@1", 0) > 0 and ran.get("code/lookup@1", 0) > 0  # both were tried
    made = paths(row.outs, row.eng.drafts)  # where the (last) pass's tokens came from, by the drafter each round ran
    by = [o.stats.by_drafter for o in row.outs if o.stats is not None]
    assert made["draft_rounds"] == sum(b.get("code", [0, 0])[0] for b in by)
    assert made["lookup_rounds"] == sum(b.get("code/lookup", [0, 0])[0] for b in by)
    assert made["draft_tokens"] + made["lookup_tokens"] + made["plain_tokens"] >= sum(len(o.token_ids) for o in row.outs)
    assert row.pass_decisions["speculate"] + row.pass_decisions["plain"] == len(prompts)  # this pass's admissions
    params = SamplingParams(max_new_tokens=12, eos_token_ids=())
    plain = generate(DecodeEngine(tiny_target.model, None, max_batch_size=1, max_seq_len=64), prompts, [params] * 4)
    assert [o.token_ids for o in row.outs] == [o.token_ids for o in plain]
    assert row.eng.lookup_replay == "alone"  # the engine's default: each request here runs alone, so each is replayed
    replayed = row.gov.snapshot()["pooled_rounds"]["code/lookup"]
    bench.args.lookup_replay = True  # --lookup-replay: the same row replayed at every batch size, and not at all
    rows = dict(lookup_rows(bench, workload, None, "", best))
    every, none = (name.replace("choice), ", f"choice), {label}, ")
                   for label in ("replayed at every batch size", "not replayed"))
    assert list(rows)[-3:] == [name, every, none]
    row = rows[none]()
    row.timed_pass()
    assert row.eng.lookup_replay is False
    assert row.gov.snapshot()["pooled_rounds"]["code/lookup"] < replayed  # only the rounds that ran lookup
    assert [o.token_ids for o in row.outs] == [o.token_ids for o in plain]
    assert rows[every]().eng.lookup_replay is True


def test_lookup_before_repeat_rows_run_the_earlier_rule_side_by_side(tiny_target):
    """--lookup-before-repeat: the largest gamma's lookup rows, alone and in the service's setting, again with the
    rule before the repeat (n 3 else 2, only the tokens that followed), with plain decoding's tokens."""
    from bench.gpu import lookup_rows

    bench = bench_on(tiny_target, lookup=(3, 4), lookup_before_repeat=True)
    workload = ([[5, 6, 7, 5, 6, 7, 5, 6], [9, 8, 9, 8, 9, 8]], ["code", "code"], 10, True, 1)
    best = {"code": tiny_draft(tiny_target)}
    rows = dict(lookup_rows(bench, workload, None, "", best))
    old = [name for name in rows if "rule before the repeat" in name]
    assert old == ["FlashSpec lookup, gamma 4, overlapped, rule before the repeat",
                   "FlashSpec lookup, gamma 4, governor, overlapped, rule before the repeat",
                   "FlashSpec best drafts or lookup (governor's choice), adaptive gamma, governor, overlapped, "
                   "rule before the repeat"]
    alone, new = rows[old[0]](), rows["FlashSpec lookup, gamma 4, overlapped"]()
    assert alone.eng.drafts["code"].rule == (3, 2, False) and new.eng.drafts["code"].rule == (6, 1, True)
    service = rows[old[2]]()
    assert service.eng.drafts["lookup"].rule == (3, 2, False)
    for row in (alone, new, service):
        row.timed_pass()
    assert [o.token_ids for o in alone.outs] == [o.token_ids for o in new.outs] == [o.token_ids for o in service.outs]
    assert sum(o.stats.rounds for o in alone.outs) > sum(o.stats.rounds for o in new.outs)  # the repeat: fewer rounds


def test_lookup_max_n_rows_look_up_longer_ngrams_side_by_side(tiny_target):
    """--lookup-max-n N: lookup alone at the largest gamma (overlapped) and the service's setting again with the
    longest n-gram looked up at N (here 3, shorter than the default 6), with plain decoding's tokens; a longer n picks
    the place whose longer context matches over the most recent place of the short one."""
    from bench.gpu import lookup_rows

    bench = bench_on(tiny_target, lookup=(3, 4), lookup_max_n=(3,))
    # "1 2 3" recurs with different continuations; only its 5-token context "8 9 1 2 3" picks the one that repeats
    prompts = [[8, 9, 1, 2, 3, 4, 5, 7, 1, 2, 3, 6, 6, 8, 9, 1, 2, 3]]
    workload = (prompts, ["code"], 10, True, 1)
    best = {"code": tiny_draft(tiny_target)}
    rows = dict(lookup_rows(bench, workload, None, "", best))
    shorter = [name for name in rows if "n up to 3" in name]
    assert shorter == ["FlashSpec lookup, gamma 4, overlapped, n up to 3",
                       "FlashSpec best drafts or lookup (governor's choice), adaptive gamma, governor, overlapped, "
                       "n up to 3"]
    alone, default = rows[shorter[0]](), rows["FlashSpec lookup, gamma 4, overlapped"]()
    assert alone.eng.drafts["code"].rule == (3, 1, True) and default.eng.drafts["code"].rule == (6, 1, True)
    service = rows[shorter[1]]()
    assert service.eng.drafts["lookup"].rule == (3, 1, True)
    for row in (alone, default, service):
        row.timed_pass()
    assert [o.token_ids for o in alone.outs] == [o.token_ids for o in default.outs] == [o.token_ids for o in service.outs]
    from engine.lookup import propose

    history, length = torch.tensor(prompts), torch.tensor([len(prompts[0])])
    assert propose(history, length, 2, max_n=3)[0].tolist() == [[6, 6]]  # after "7 1 2 3", the most recent
    assert propose(history, length, 2, max_n=6)[0].tolist() == [[4, 5]]  # after "8 9 1 2 3", the longest
    assert propose(history, length, 2)[0].tolist() == [[4, 5]]  # the default looks up to 6
    bench.args.lookup_max_n = ()
    assert not [name for name in dict(lookup_rows(bench, workload, None, "", best)) if "n up to" in name]


def test_lookup_allot_rows_run_allotted_rounds_side_by_side_with_plain_tokens(tiny_target):
    """--lookup-allot: lookup alone at the largest gamma (overlapped) and the service's setting again with allotted
    rounds (LookupDraft(allot=True)), plain decoding's tokens; without it, no such rows."""
    from bench.gpu import lookup_rows

    bench = bench_on(tiny_target, lookup=(3, 5), lookup_allot=True)
    prompts = [[1, 2, 3, 1, 2, 3, 1], [5, 6, 7, 8], [4, 4, 2, 4, 4], [9, 3, 9, 3]]
    workload = (prompts, ["code"] * 4, 12, True, 4)
    best = {"code": tiny_draft(tiny_target)}
    rows = dict(lookup_rows(bench, workload, None, "", best))
    allotted = [name for name in rows if ", allotted" in name]
    assert allotted == ["FlashSpec lookup, gamma 5, overlapped, allotted",
                        "FlashSpec best drafts or lookup (governor's choice), adaptive gamma, governor, overlapped, "
                        "allotted"]
    alone, default = rows[allotted[0]](), rows["FlashSpec lookup, gamma 5, overlapped"]()
    assert alone.eng.drafts["code"].allot and not default.eng.drafts["code"].allot
    assert rows[allotted[1]]().eng.drafts["lookup"].allot
    for row in (alone, default):
        row.timed_pass()
    assert [o.token_ids for o in alone.outs] == [o.token_ids for o in default.outs]
    bench.args.lookup_allot = False
    assert not [name for name in dict(lookup_rows(bench, workload, None, "", best)) if ", allotted" in name]


def test_vocab_config_rows_run_under_their_launch_setting_and_restore_it(tiny_target):
    """--vocab-config t=0: lookup alone at the largest gamma (overlapped) and the service's setting again, every model
    call of theirs (warm-up and timed passes) under the vocabulary launch setting, the other rows' under the default;
    plain decoding's tokens; a bad setting is an argparse error naming it."""
    import argparse

    import pytest

    from bench.gpu import lookup_rows, vocab_setting
    from engine import triton_kernels

    bench = bench_on(tiny_target, lookup=(3, 4), vocab_config=vocab_setting("t=0"))
    workload = ([[5, 6, 7, 5, 6, 7, 5, 6], [9, 8, 9, 8, 9, 8]], ["code", "code"], 12, True, 2)
    best = {"code": tiny_draft(tiny_target)}
    rows = dict(lookup_rows(bench, workload, None, "", best))
    named = [name for name in rows if "vocabulary" in name]
    assert named == ["FlashSpec lookup, gamma 4, overlapped, vocabulary t=0",
                     "FlashSpec best drafts or lookup (governor's choice), adaptive gamma, governor, overlapped, "
                     "vocabulary t=0"]
    seen: list[int] = []
    hook = tiny_target.model.lm_head.register_forward_hook(lambda *_: seen.append(triton_kernels.VOCAB_CONFIG["t"]))
    try:
        default = rows["FlashSpec lookup, gamma 4, overlapped"]()
        default.timed_pass()
        assert seen and set(seen) == {1}  # the default
        seen.clear()
        tiled = [rows[name]() for name in named]
        for row in tiled:
            row.timed_pass()
        assert seen and set(seen) == {0}
    finally:
        hook.remove()
    assert triton_kernels.VOCAB_CONFIG["t"] == 1  # restored after each row's block
    assert [o.token_ids for o in default.outs] == [o.token_ids for o in tiled[0].outs] == [o.token_ids for o in tiled[1].outs]
    for bad in ("t=2", "q=1", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="--vocab-config"):
            vocab_setting(bad)


def test_lookup_lone_rows_run_the_service_at_another_lone_lookup_gamma(tiny_target):
    """--lookup-lone G: the service's setting again with a lone greedy row's lookup gamma G
    (LookupDraft(gammas={1: G})), side by side; its lone lookup rounds run at G, with plain decoding's tokens."""
    from bench.gpu import lookup_rows

    bench = bench_on(tiny_target, lookup=(3,), lookup_lone=(6, 12))
    workload = ([[5, 6, 7, 5, 6, 7, 5, 6], [9, 8, 9, 8, 9, 8]], ["code", "code"], 14, True, 1)
    best = {"code": tiny_draft(tiny_target)}
    rows = dict(lookup_rows(bench, workload, None, "", best))
    base = "FlashSpec best drafts or lookup (governor's choice), adaptive gamma, governor, overlapped"
    assert list(rows)[-3:] == [base, base + ", lone lookup gamma 6", base + ", lone lookup gamma 12"]
    default, lone = rows[base](), rows[base + ", lone lookup gamma 12"]()
    assert lone.eng.drafts["lookup"].gamma_at(1, 5) == 12 and default.eng.drafts["lookup"].gamma_at(1, 5) == 8
    for row in (default, lone):
        row.timed_pass()
    assert [o.token_ids for o in default.outs] == [o.token_ids for o in lone.outs]
    assert lone.eng.lookup_gamma(lone.eng.drafts["lookup"], 1) == 12  # not capped by the engine's gamma 5
    assert lone.gov.snapshot()["spec_samples"].get("code/lookup@1", 0) > 0  # lookup rounds ran
    bench.args.lookup_lone = ()
    assert all("lone lookup gamma" not in name for name in dict(lookup_rows(bench, workload, None, "", best)))


def test_lookup_streak_rows_run_lookup_with_and_without_a_streak_gamma(tiny_target):
    """--lookup-streaks S: lookup alone at the largest gamma again with a lone row's rounds at S after a full round
    (the alone rows propose their gamma every round), and the service's setting again without a streak gamma (and
    at S where S is not its default); the same tokens."""
    from bench.gpu import lookup_rows

    bench = bench_on(tiny_target, lookup=(3,), lookup_streaks=(9, 15))
    workload = ([[5, 6, 7, 5, 6, 7, 5, 6]], ["code"], 40, True, 1)
    best = {"code": tiny_draft(tiny_target)}
    rows = dict(lookup_rows(bench, workload, None, "", best))
    base = "FlashSpec best drafts or lookup (governor's choice), adaptive gamma, governor, overlapped"
    alone = "FlashSpec lookup, gamma 3, overlapped"
    assert list(rows)[-4:] == [alone + ", 9 after a full round", base + ", lone lookup, 9 after a full round",
                               alone + ", 15 after a full round", base + ", no streak gamma"]
    plain, streaky = rows[alone](), rows[alone + ", 9 after a full round"]()
    service, none = rows[base](), rows[base + ", no streak gamma"]()
    assert plain.eng.drafts["code"].streak_gammas == {} and streaky.eng.drafts["code"].streak_gammas == {1: 9}
    assert service.eng.drafts["lookup"].streak_gammas == {1: 15} and none.eng.drafts["lookup"].streak_gammas == {}
    for row in (plain, streaky):
        row.timed_pass()
    assert [o.token_ids for o in plain.outs] == [o.token_ids for o in streaky.outs]
    drafted = lambda row: [(o.stats.drafted, o.stats.rounds) for o in row.outs]  # noqa: E731
    assert all(n == 3 * r for n, r in drafted(plain))  # every round proposes 3
    assert all(3 * r < n < 9 * r for n, r in drafted(streaky))  # the repeating reply: rounds of 9 after full ones
    bench.args.lookup_streaks = ()
    assert all("full round" not in name and "streak" not in name
               for name in dict(lookup_rows(bench, workload, None, "", best)))


def test_return_window_rows_run_the_service_with_another_governor_window(tiny_target):
    """--return-window W / --governor-rows / --plain-timing step: the service's setting again with the governor's
    return window W, with other governor settings, or plain calls priced as before, side by side."""
    import argparse

    from bench.gpu import governor_settings, lookup_rows
    from engine.governor import RETURN_WINDOW

    bench = bench_on(tiny_target, lookup=(3,), return_window=(32,))
    workload = ([[5, 6, 7, 5, 6, 7, 5, 6]], ["code"], 8, True, 1)
    best = {"code": tiny_draft(tiny_target)}
    rows = dict(lookup_rows(bench, workload, None, "", best))
    base = "FlashSpec best drafts or lookup (governor's choice), adaptive gamma, governor, overlapped"
    assert list(rows)[-2:] == [base, base + ", return window 32"]
    assert rows[base]().gov.return_window == RETURN_WINDOW and rows[base + ", return window 32"]().gov.return_window == 32
    bench.args.governor_rows = governor_settings("tokens_alpha=0.01, return_window=4;return_window=16")
    assert bench.args.governor_rows == ({"tokens_alpha": 0.01, "return_window": 4}, {"return_window": 16})
    rows = dict(lookup_rows(bench, workload, None, "", best))
    assert list(rows)[-2:] == [base + ", governor tokens_alpha=0.01, return_window=4", base + ", governor return_window=16"]
    row = rows[base + ", governor tokens_alpha=0.01, return_window=4"]()
    assert (row.gov.tokens_alpha, row.gov.return_window) == (0.01, 4) and rows[base]().gov.tokens_alpha == 0.001
    for bad in ("clock=1", "return_window", "nonsense=2"):
        with pytest.raises(argparse.ArgumentTypeError):
            governor_settings(bad)
    bench.args.plain_timing = "step"  # --plain-timing step: lookup under the governor and the service, plain calls
    rows = dict(lookup_rows(bench, workload, None, "", best))  # priced from the step's start (as before)
    before = [name for name in rows if name.endswith("plain calls timed from the step")]
    assert before == ["FlashSpec lookup, gamma 3, governor, overlapped, plain calls timed from the step",
                      base + ", plain calls timed from the step"]
    assert [rows[name]().eng.plain_timed_from_read for name in before] == [False, False]
    assert rows[base]().eng.plain_timed_from_read is True


def test_side_prefill_rows_run_lookup_and_the_service_with_prefills_beside_the_running_rows(tiny_target):
    """--side-prefill: lookup at the largest gamma overlapped and the service's setting again with each admission's
    prefill beside the running rows (DecodeEngine(side_prefill=True)); the other rows keep the default (off)."""
    from bench.gpu import lookup_rows

    bench = bench_on(tiny_target, lookup=(3,), side_prefill=True)
    workload = ([[5, 6, 7, 5, 6, 7, 5, 6]], ["code"], 8, True, 1)
    best = {"code": tiny_draft(tiny_target)}
    rows = dict(lookup_rows(bench, workload, None, "", best))
    base = "FlashSpec best drafts or lookup (governor's choice), adaptive gamma, governor, overlapped"
    beside = [name for name in rows if name.endswith("prefills beside the running rows")]
    assert beside == ["FlashSpec lookup, gamma 3, overlapped, prefills beside the running rows",
                      base + ", prefills beside the running rows"]
    built = [rows[name]() for name in beside]
    assert [(r.eng.side_prefill, r.eng.overlap) for r in built] == [(True, True), (True, True)]
    assert not rows[base]().eng.side_prefill
    bench.args.side_prefill = False
    assert not any("beside" in name for name in lookup_rows(bench, workload, None, "", best))


def test_prefill_ahead_rows_run_lookup_and_the_service_with_rows_prefilled_ahead(tiny_target):
    """--prefill-ahead 0,7: lookup at the largest gamma overlapped and the service's setting again at each count of
    rows prefilled ahead (DecodeEngine(prefill_ahead=k)). The service's setting holds the service's default on CUDA
    (AppArgs.engine_prefill_ahead: bs - 1 here); lookup alone keeps the engine's default (none)."""
    from bench.gpu import lookup_rows
    from services.config import AppArgs

    bench = bench_on(tiny_target, lookup=(3,), prefill_ahead=(0, 7))
    workload = ([[5, 6, 7, 5, 6, 7, 5, 6]], ["code"], 8, True, 4)
    best = {"code": tiny_draft(tiny_target)}
    rows = dict(lookup_rows(bench, workload, None, "", best))
    base = "FlashSpec best drafts or lookup (governor's choice), adaptive gamma, governor, overlapped"
    ahead = [name for name in rows if "prefilled ahead" in name]
    assert ahead == [f"{row}, {k} rows prefilled ahead" for k in (0, 7)
                     for row in ("FlashSpec lookup, gamma 3, overlapped", base)]
    built = [rows[name]() for name in ahead]
    assert [(r.eng.prefill_ahead, len(r.eng.slots), r.eng.overlap) for r in built] == [
        (0, 4, True), (0, 4, True), (7, 11, True), (7, 11, True)]
    assert rows[base]().eng.prefill_ahead == 3 == AppArgs(device="cuda", max_batch_size=4).engine_prefill_ahead()
    assert rows["FlashSpec lookup, gamma 3, overlapped"]().eng.prefill_ahead == 0
    bench.args.prefill_ahead = ()
    assert not any("ahead" in name for name in lookup_rows(bench, workload, None, "", best))


def test_paths_sum_a_pass_s_tokens_by_the_drafter_each_round_ran():
    """Draft rounds and lookup rounds by the drafter each ran (an alternative's name is "<draft>/<its name>"), plain
    decoding's tokens as the rest of each request's (its prefill's first token included), and requests that moved."""
    from types import SimpleNamespace

    from bench.gpu import paths
    from engine.lookup import LookupDraft
    from engine.requests import SpecStats

    def out(tokens: int, by: dict | None):
        stats = None
        if by is not None:
            stats = SpecStats()
            stats.by_drafter = {name: list(counts) for name, counts in by.items()}
        return SimpleNamespace(token_ids=list(range(tokens)), stats=stats)

    drafts = {"code": object(), "lookup": LookupDraft()}
    outs = [out(20, {"code/lookup": (6, 19)}),  # lookup throughout: its prefill's token is the only plain one
            out(20, {"code": (4, 9), "code/lookup": (2, 6)}),  # its draft, then lookup, then plain decoding
            out(10, None),  # plain decoding throughout
            out(12, {"code/lookup": (3, 5)})]  # dropped to plain decoding after 3 rounds
    assert paths(outs, drafts) == {"draft_rounds": 4, "draft_tokens": 9, "lookup_rounds": 11, "lookup_tokens": 30,
                                   "plain_tokens": 1 + 5 + 10 + 7, "requests_moved": 2}
    # A row whose requests name the lookup drafter under their domain (bench.gpu's lookup rows): lookup rounds.
    assert paths([out(20, {"code": (6, 19)})], {"code": LookupDraft()})["lookup_rounds"] == 6

"""Distillation: a tiny target's draft learns (loss falls, real acceptance rises), resume, data and bad input."""

from __future__ import annotations

import datasets
import numpy as np
import pytest
import torch
import typer
from typer.testing import CliRunner

from drafts.checkpoint import version_folder
from engine.config import ModelArgs
from engine.generate import generate
from engine.model import Transformer
from engine.sampling import SamplingParams
from engine.scheduler import DecodeEngine
from engine.speculative import SpecConfig
import training.distill as distill
from training.distill import (TeacherCache, TokenData, TrainConfig, TrainError, build_draft, domain_sequences,
                              frequent_vocab, target_states, train)
from training.evaluate import evaluate_draft

ARGS = ModelArgs(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4,
                 num_kv_heads=2, head_dim=16, eos_token_ids=(1,), bos_token_id=0, max_position_embeddings=256)


def tiny_target(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(ARGS, max_seq_len=256).eval().requires_grad_(False)
    with torch.no_grad():  # make the deep layers matter, so an early exit is a poor draft
        for layer in model.layers:
            layer.self_attn.o_proj.weight.mul_(4)
            layer.mlp.down_proj.weight.mul_(4)
    return model


@pytest.fixture(scope="module")
def setup():
    """The target and its own greedy continuations of 16 random prompts (self-distillation data)."""
    torch.set_num_threads(1)
    target = tiny_target()
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 256, (8,), generator=gen).tolist() for _ in range(16)]
    engine = DecodeEngine(target, None, max_batch_size=8, max_seq_len=96)
    replies = generate(engine, prompts, SamplingParams(max_new_tokens=40))
    seqs = [p + r.token_ids for p, r in zip(prompts, replies)]
    return target, prompts, TokenData(seqs, [[1.0] * len(s) for s in seqs])


def config(tmp_path, **kw) -> TrainConfig:
    base = dict(domain="code", shared_layers=1, adapter_layers=1, head_vocab=64, steps=40, batch_size=8, seq_len=64,
                lr_adapters=3e-3, lr_head=3e-3, warmup_steps=2, eval_every=20, save_every=20, out_dir=str(tmp_path))
    return TrainConfig(**{**base, **kw})


def acceptance(target, draft, prompts) -> float:
    report = evaluate_draft(target, None, draft.eval(), prompts, max_new_tokens=24, blocks=(5,), include_ar=False,
                            quality=False)
    return report["mean_accepted_length"]


@pytest.mark.parametrize("feature_input, feature_layers", [("deep", []), ("none", []), ("deep", [2])],
                         ids=["deep", "none", "deep-layer2"])
def test_training_lowers_the_loss_and_raises_real_acceptance(tmp_path, setup, feature_input, feature_layers):
    target, prompts, data = setup
    cfg = config(tmp_path, feature_input=feature_input, head_vocab=None, feature_layers=feature_layers)
    before = acceptance(target, build_draft(target, cfg, None), prompts[:4])
    result = train(cfg, target, data, data, progress=False)
    after = acceptance(target, result.draft, prompts[:4])
    first, last = result.history[0], result.history[-1]
    assert last["loss"] < 0.5 * first["loss"]
    assert last["eval"]["top1_by_step"][0] > first["top1_by_step"][0]
    assert len(last["top1_by_step"]) == (2 if feature_input == "deep" else 1)  # rollout only where features exist
    assert last["eval"]["accept_by_step"][0] > first["accept_by_step"][0]  # a sampled token is kept more often
    assert after > before + 0.3, (before, after)
    assert (tmp_path / "ckpt" / "state.pt").is_file() and (tmp_path / "train_log.jsonl").is_file()


def test_the_loss_reports_expected_acceptance_and_the_tv_term_adds_its_complement(setup):
    """accept = weighted mean of sum_x min(p, q) over the head's vocabulary (1 for an exact draft, the
    probability that a token the draft samples is kept); tv_weight adds tv_weight * (1 - accept) per pass."""
    target, _, data = setup
    tokens, weights = distill._batch(data, list(range(4)), torch.device("cpu"))
    base = dict(domain="code", shared_layers=1, adapter_layers=3, head_vocab=None, feature_input="none",
                out_dir="unused", rollout_steps=1)
    exact = build_draft(target, TrainConfig(**base), None)  # adapters = target layers 1..3: the target itself
    _, parts = distill.distill_loss(target, exact, tokens, weights, TrainConfig(**base))
    assert parts["accept"].tolist() == pytest.approx([1.0], abs=1e-4) and parts["kl"].item() < 1e-4

    cfg = TrainConfig(**{**base, "adapter_layers": 1})
    draft = build_draft(target, cfg, None)  # an early exit: a poor draft
    loss, parts = distill.distill_loss(target, draft, tokens, weights, cfg)
    accept = parts["accept"].item()
    assert 0.05 < accept < 0.95
    loss_tv, parts_tv = distill.distill_loss(target, draft, tokens, weights, TrainConfig(**{**base, "adapter_layers": 1,
                                                                                             "tv_weight": 2.0}))
    assert parts_tv["accept"].item() == pytest.approx(accept, abs=1e-6)
    assert loss_tv.item() == pytest.approx(loss.item() + 2.0 * (1 - accept), abs=1e-5)
    loss_tv.backward()  # the term is differentiable through the draft's distribution
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in draft.parameters())


def test_a_draft_without_shared_layers_trains_and_stays_lossless(tmp_path, setup):
    """N = 0: the draft sees the token embeddings (and the target's features), not target layers;
    verification then runs every target layer. Cheapest drafting where GEMMs are flat in the rows."""
    target, prompts, data = setup
    cfg = config(tmp_path, shared_layers=0, adapter_layers=1, feature_input="deep", head_vocab=None, steps=30)
    before = acceptance(target, build_draft(target, cfg, None), prompts[:4])
    result = train(cfg, target, data, data, progress=False)
    assert result.history[-1]["loss"] < 0.5 * result.history[0]["loss"]
    draft = result.draft.eval().requires_grad_(False)
    assert acceptance(target, draft, prompts[:4]) > before
    params = SamplingParams(max_new_tokens=24)
    ar = [r.token_ids for r in generate(DecodeEngine(target, None, max_batch_size=4, max_seq_len=96), prompts[:4], params)]
    for block in (2, 5):
        eng = DecodeEngine(target, None, max_batch_size=4, max_seq_len=96, spec=SpecConfig(5, block))
        eng.add_draft("d", draft)
        assert [r.token_ids for r in generate(eng, prompts[:4], params, ["d"] * 4)] == ar


def test_a_time_budget_stops_the_loop_and_runs_the_schedule_to_its_end(tmp_path, setup, monkeypatch):
    target, _, data = setup
    import training.distill as distill

    now = [0.0]
    monkeypatch.setattr(distill.time, "perf_counter", lambda: now[0])

    def tick(step, log):
        now[0] += 10.0  # every step "takes" 10 s

    cfg = config(tmp_path, steps=1000, max_seconds=50, warmup_steps=0, min_lr_ratio=0.1, eval_every=1000)
    result = train(cfg, target, data, data, callback=tick, progress=False)
    assert result.step == 6  # stops at the first step past the 50 s budget, not at 1000 steps
    last = result.history[-1]
    assert "time budget" in last["stopped"] and "eval" in last  # a final evaluation and checkpoint at the stop
    assert last["lr_adapters"] == pytest.approx(0.1 * cfg.lr_adapters)  # the cosine reached its floor with the clock
    assert torch.load(tmp_path / "ckpt" / "state.pt", weights_only=False)["step"] == 6


def test_an_interrupted_run_resumes_to_the_same_state(tmp_path, setup):
    target, _, data = setup
    straight = train(config(tmp_path / "a", steps=6, save_every=3), target, data, progress=False)

    def interrupt(step, log):
        if step == 4:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(config(tmp_path / "b", steps=6, save_every=3), target, data, callback=interrupt, progress=False)
    resumed = train(config(tmp_path / "b", steps=6, save_every=3), target, data, progress=False)
    assert resumed.step == 6
    for name, value in straight.draft.state_dict().items():
        assert torch.allclose(resumed.draft.state_dict()[name], value, atol=1e-6), name
    assert [h["loss"] for h in resumed.history] == pytest.approx([h["loss"] for h in straight.history], abs=1e-6)


def test_the_teacher_cache_gives_the_target_pass_its_own_states(tmp_path, setup):
    """Cached states (computed once, sorted by length) equal the target run on each batch, so training
    with the cache follows the same trajectory; a cache over its memory budget is not built."""
    target, _, data = setup
    ragged = TokenData([s[: 20 + 3 * i] for i, s in enumerate(data.sequences)], [w[: 20 + 3 * i] for i, w in enumerate(data.weights)])
    cache = TeacherCache(target, ragged, 1, torch.device("cpu"), batch_size=5)
    indices = [3, 0, 11, 7]
    tokens, weights = distill._batch(ragged, indices, torch.device("cpu"))
    trunk, final, _ = target_states(target, tokens, 1)
    c_trunk, c_final, _ = cache.gather(indices, torch.device("cpu"))
    real = weights > 0
    assert torch.allclose(c_trunk[real], trunk[real], atol=1e-5) and torch.allclose(c_final[real], final[real], atol=1e-5)
    assert not c_final[~real].any()  # padding points at the zero row
    # With a draft's extra feature layers, their states are cached too.
    layered = TeacherCache(target, ragged, 1, torch.device("cpu"), batch_size=5, capture=(2, 3))
    _, _, captured = target_states(target, tokens, 1, (2, 3))
    c_captured = layered.gather(indices, torch.device("cpu"))[2]
    assert len(c_captured) == 2 and all(torch.allclose(c[real], t[real], atol=1e-5) for c, t in zip(c_captured, captured))
    assert TeacherCache.size_gb(target, ragged, (2, 3)) == pytest.approx(2 * TeacherCache.size_gb(target, ragged))

    cached = train(config(tmp_path / "a", steps=8, eval_every=100), target, ragged, progress=False)
    plain = train(config(tmp_path / "b", steps=8, eval_every=100, teacher_cache_gb=0), target, ragged, progress=False)
    assert "teacher_cache_gb" in cached.history[0] and "teacher_cache_gb" not in plain.history[0]
    assert [h["loss"] for h in cached.history] == pytest.approx([h["loss"] for h in plain.history], rel=1e-4)
    size = TeacherCache.size_gb(target, ragged)
    assert size == pytest.approx(2 * (sum(map(len, ragged.sequences)) + 1) * 64 * 4 / 1e9)  # + the padding row
    small = train(config(tmp_path / "c", steps=3, teacher_cache_gb=size / 2), target, ragged, progress=False)
    assert "teacher_cache_gb" not in small.history[0] and "over teacher_cache_gb" in small.history[0]["teacher_cache_skipped"]
    assert "teacher_cache_skipped" not in plain.history[0]  # switched off, not skipped
    # 16 sequences, one step of 8: each sequence is read at most once, so a cache would only cost a pass.
    once = train(config(tmp_path / "d", steps=1), target, ragged, progress=False)
    assert "at most once" in once.history[0]["teacher_cache_skipped"]


def test_resume_refuses_another_target_or_other_settings(tmp_path, setup):
    target, _, data = setup
    train(config(tmp_path, steps=2, save_every=1), target, data, progress=False)
    with pytest.raises(TrainError, match="another target"):
        train(config(tmp_path, steps=4), tiny_target(seed=5), data, progress=False)
    with pytest.raises(TrainError, match="seq_len: checkpoint 64 vs now 32"):
        train(config(tmp_path, steps=4, seq_len=32), target, data, progress=False)
    with pytest.raises(TrainError, match=r"feature_layers: checkpoint \[\] vs now \[2\]"):
        train(config(tmp_path, steps=4, feature_layers=[2]), target, data, progress=False)
    with pytest.raises(TrainError, match="group_by_length: checkpoint True vs now False"):
        train(config(tmp_path, steps=4, group_by_length=False), target, data, progress=False)
    fresh = train(config(tmp_path, steps=1, seq_len=32, resume=False), target, data, progress=False)
    assert fresh.step == 1


def test_fine_tuning_starts_from_the_saved_draft_and_keeps_its_sub_vocabulary(tmp_path, setup):
    """--init-from: the run starts from the saved (fp16) weights and the draft's own sub-vocabulary, not one
    counted from the new data, so a fine-tune begins where the draft left off, far below a fresh start."""
    from drafts.checkpoint import save_draft

    target, prompts, data = setup
    trained = train(config(tmp_path / "a"), target, data, progress=False)
    folder = save_draft(trained.draft, tmp_path / "store" / "code" / "v1", "code", "v1")
    (tmp_path / "store" / "code" / "ACTIVE").write_text("v1\n")
    saved = {k: v.half().float() if v.is_floating_point() else v for k, v in trained.draft.state_dict().items()}
    other_vocab = torch.arange(64) + 100  # what counting the new data might give: must not replace the draft's

    frozen = train(config(tmp_path / "b", steps=1, lr_adapters=1e-12, lr_head=1e-12, init_from=str(folder)),
                   target, data, vocab_ids=other_vocab, progress=False)
    for name, value in frozen.draft.state_dict().items():
        assert torch.allclose(value.float(), saved[name].float(), atol=1e-6), name
    assert torch.equal(frozen.draft.vocab_ids, trained.draft.vocab_ids)

    fresh = train(config(tmp_path / "c", steps=1), target, data, progress=False)
    tuned = train(config(tmp_path / "d", steps=1, init_from=str(folder)), target, data, progress=False)
    assert tuned.history[0]["loss"] < 0.7 * fresh.history[0]["loss"]
    assert acceptance(target, tuned.draft, prompts[:4]) > acceptance(target, fresh.draft, prompts[:4])

    # A domain folder names its ACTIVE version; draft_shape reads the shape to train with.
    assert version_folder(tmp_path / "store" / "code") == folder and version_folder(folder) == folder
    assert distill.draft_shape(folder) == {"shared_layers": 1, "adapter_layers": 1, "head": "mlp_tied",
                                           "feature_input": "deep", "head_vocab": 64, "feature_layers": []}


def test_fine_tuning_refuses_a_draft_of_another_shape_target_or_no_draft(tmp_path, setup):
    from drafts.checkpoint import save_draft

    target, _, data = setup
    folder = save_draft(build_draft(target, config(tmp_path), torch.arange(64)), tmp_path / "v1", "code", "v1")
    with pytest.raises(TrainError, match=r"another shape \(adapter_layers: draft 1 vs options 2\)"):
        train(config(tmp_path / "a", adapter_layers=2, init_from=str(folder)), target, data, progress=False)
    with pytest.raises(TrainError, match="--init-from: .*another target"):
        train(config(tmp_path / "b", init_from=str(folder)), tiny_target(seed=5), data, progress=False)
    with pytest.raises(TrainError, match="--init-from: .*not a draft checkpoint folder"):
        train(config(tmp_path / "c", init_from=str(tmp_path / "nothing")), target, data, progress=False)
    with pytest.raises(TrainError, match="not a draft checkpoint folder"):
        distill.draft_shape(tmp_path / "nothing")


def test_length_grouped_batches_pad_less_and_keep_a_seeded_random_order():
    """Each epoch is still a seeded permutation; chunks of 4 batches hold the same sequences as the plain order's
    chunks, sorted longest first, so a batch pads to far fewer tokens on data mixing long and short sequences."""
    rng = np.random.default_rng(0)
    lengths = np.where(rng.random(1000) < 0.2, 700, rng.integers(100, 300, 1000))
    plain, grouped = distill._Order(1000, 32, seed=3), distill._Order(1000, 32, seed=3, lengths=lengths, group=4)
    for epoch in (0, 1):
        a, b = plain.epoch(epoch), grouped.epoch(epoch)
        assert sorted(b) == list(range(1000))
        for i in range(0, 1000, 128):
            assert set(a[i : i + 128]) == set(b[i : i + 128])
            assert (np.diff(lengths[b[i : i + 128]]) <= 0).all()
    assert not np.array_equal(grouped.epoch(0), grouped.epoch(1))
    assert np.array_equal(grouped.epoch(0), distill._Order(1000, 32, 3, lengths=lengths, group=4).epoch(0))

    def padded(order):  # tokens a micro-batch pads to, over two epochs
        return sum(32 * max(lengths[order.indices(g)]) for g in range(2 * 1000 // 32))

    assert padded(grouped) < 0.7 * padded(plain)
    assert padded(grouped) < 1.3 * 2 * lengths.sum()  # close to the tokens there are


def test_sub_vocabulary_is_the_most_frequent_tokens_plus_specials():
    data = TokenData([[5, 5, 5, 7, 7, 9], [7, 5, 3]], [[1.0] * 6, [1.0] * 3])
    vocab = frequent_vocab(data, 3, 256, special_ids=[1])
    assert vocab.tolist() == [5, 7, 1]
    assert frequent_vocab(data, 6, 256).tolist()[:4] == [5, 7, 9, 3]  # padded with unused ids
    with pytest.raises(TrainError, match="exceeds"):
        frequent_vocab(data, 300, 256)


class ByteTokenizer:
    eos_token_id = 1

    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [[2 + b % 254 for b in t.encode()] for t in texts]}

    def decode(self, ids, skip_special_tokens=True):
        return bytes(i - 2 for i in ids if i >= 2).decode(errors="replace")


def test_domain_sequences_use_self_distilled_replies_and_weight_the_prompt():
    rows = datasets.Dataset.from_dict({"prompt": ["ab", "cd"], "text": ["xyz", "w"]})
    data = domain_sequences(rows, ByteTokenizer(), seq_len=16, prompt_weight=0.5, responses={"cd": [40, 41]})
    assert data.sequences[0] == [99, 100, 122, 123, 124, 1]  # prompt, raw text, EOS
    assert data.weights[0] == [0.5, 0.5, 1, 1, 1, 1]
    assert data.sequences[1] == [101, 102, 40, 41]  # the target's own reply replaces the raw text
    cut = domain_sequences(datasets.Dataset.from_dict({"prompt": ["p" * 30], "text": ["t" * 30]}), ByteTokenizer(), 16)
    assert len(cut.sequences[0]) == 16 and cut.weights[0][-1] == 1.0  # prompt cut to half, response kept


def test_domain_sequences_add_one_sequence_per_extra_reply():
    rows = datasets.Dataset.from_dict({"prompt": ["ab", "cd"], "text": ["xyz", "w"]})
    data = domain_sequences(rows, ByteTokenizer(), seq_len=16, responses={"cd": [40, 41]},
                            extra_responses=[{"cd": [50]}, {"ab": [60, 61], "cd": [70]}])
    assert data.sequences == [[99, 100, 122, 123, 124, 1], [99, 100, 60, 61],
                              [101, 102, 40, 41], [101, 102, 50], [101, 102, 70]]
    assert data.weights[1] == [0.5, 0.5, 1.0, 1.0]


def test_self_distill_greedy_and_seeded_sampled_replies(tmp_path):
    from training.selfdistill import self_distill

    target = tiny_target()
    rows = {"prompt": ["def f(x):", "hello there", "why is the sky blue?", "sum a list"], "text": [""] * 4}
    kw = dict(max_new_tokens=12, batch_size=2, cache_root=tmp_path, progress=False)
    greedy = self_distill(target, ByteTokenizer(), "code", rows, 4, **kw)
    engine = DecodeEngine(target, None, max_batch_size=2, max_seq_len=64)
    ids = ByteTokenizer()(rows["prompt"])["input_ids"]
    expect = {p: r.token_ids for p, r in zip(rows["prompt"], generate(engine, ids, SamplingParams(max_new_tokens=12)))}
    assert greedy == expect  # the target's own greedy replies
    sampled = self_distill(target, ByteTokenizer(), "code", rows, 4, seed=1, temperature=1.0, **kw)
    assert set(sampled) == set(greedy) and sampled != greedy
    assert len(list(tmp_path.iterdir())) == 2  # greedy and sampled are cached apart
    for f in tmp_path.iterdir():
        f.unlink()
    assert self_distill(target, ByteTokenizer(), "code", rows, 4, seed=1, temperature=1.0, **kw) == sampled  # seeded
    assert self_distill(target, ByteTokenizer(), "code", rows, 4, seed=2, temperature=1.0, **kw) != sampled
    with pytest.raises(ValueError, match="temperature"):
        self_distill(target, ByteTokenizer(), "code", rows, 4, temperature=-1.0, **kw)


def test_bad_data_gives_clear_errors():
    with pytest.raises(TrainError, match="no text column.*columns: prompt"):
        domain_sequences(datasets.Dataset.from_dict({"prompt": ["a"]}), ByteTokenizer(), 16)
    with pytest.raises(TrainError, match="empty"):
        domain_sequences(datasets.Dataset.from_dict({"prompt": [], "text": []}), ByteTokenizer(), 16)
    with pytest.raises(ValueError, match="mlp_tied"):
        TrainConfig(domain="code", out_dir="x", head="conv")
    with pytest.raises(ValueError, match="unknown domain 'poetry'"):
        TrainConfig(domain="poetry", out_dir="x")


def cli_app() -> typer.Typer:
    from training.cli import train_draft

    app = typer.Typer()
    app.command("train-draft")(train_draft)
    app.command("noop")(lambda: None)
    return app


def test_train_draft_cli_refuses_bad_input_before_training(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHSPEC_HOME", str(tmp_path / "home"))
    runner = CliRunner()
    res = runner.invoke(cli_app(), ["train-draft", "--domain", "poetry", "--out", str(tmp_path / "run")])
    assert res.exit_code == 1 and "unknown domain 'poetry'" in res.output and "code, general, dialog" in res.output
    blocker = tmp_path / "file"
    blocker.write_text("x")
    res = runner.invoke(cli_app(), ["train-draft", "--domain", "code", "--store", str(blocker), "--out", str(tmp_path / "r")])
    assert res.exit_code == 1 and "cannot create" in res.output and str(blocker) in res.output
    res = runner.invoke(cli_app(), ["train-draft", "--domain", "code", "--steps", "0", "--store", str(tmp_path / "s")])
    assert res.exit_code == 1 and "steps" in res.output
    res = runner.invoke(cli_app(), ["train-draft", "--domain", "code", "--feature-layers", "ten", "--store", str(tmp_path / "s")])
    assert res.exit_code == 1 and "--feature-layers takes a comma list of integers" in res.output
    res = runner.invoke(cli_app(), ["train-draft", "--domain", "code", "--init-from", str(tmp_path / "none"),
                                    "--store", str(tmp_path / "s")])
    assert res.exit_code == 1 and "--init-from" in res.output and "not a draft checkpoint folder" in res.output

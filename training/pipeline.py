"""train -> evaluate -> publish -> gated activation, for one domain (what `flashspec train-draft` runs)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import datasets

from drafts.checkpoint import load_draft, save_draft
from drafts.store import DraftStore, default_store_root, shipped_drafts_dir
from engine.loading import load_model
from training import corpora
from training.distill import (ALL_DOMAINS, TrainConfig, TrainError, domain_sequences, run_vocab,
                              teacher_cache_plan, train)
from training.evaluate import evaluate_draft, held_out_prompts
from training.selfdistill import greedy_and_sampled as make_replies


def domain_rows(domain: str, split: str, data_dir: Path | None, max_rows: int | None = None, seed: int = 0) -> datasets.Dataset:
    """A split of one domain, or of all three shuffled together for `mixed`; errors if empty."""
    names = ALL_DOMAINS if domain == "mixed" else (domain,)
    parts = [corpora.load_domain(name, split, data_dir) for name in names]
    rows = datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]
    if len(rows) == 0:
        raise TrainError(f"the {domain} {split} split is empty; rebuild the data: flashspec data build --domains {domain}")
    if max_rows is not None and len(rows) > max_rows:
        rows = rows.shuffle(seed=seed).select(range(max_rows))
    return rows


def run_pipeline(cfg: TrainConfig, target: str = "default", store: Path | None = None, data_dir: Path | None = None,
                 dataset: str | None = None, text_field: str | None = None, messages_field: str | None = None,
                 self_distill: int = 0, self_distill_tokens: int = 128, self_distill_sampled: int = 0,
                 sample_temperature: float = 0.8, max_rows: int | None = None,
                 eval_prompts: int = 16, eval_tokens: int = 64, version: str | None = None, tolerance: float = 0.05,
                 activate: bool = True, echo: Callable[[str], None] = print) -> dict:
    """Run the whole pipeline; returns {'final': folder, 'eval': report, 'published': folder|None, 'activation': ...}."""
    if self_distill_sampled and not self_distill:
        raise TrainError("--self-distill-sampled needs --self-distill N (the prompts to answer)")
    out_dir = Path(cfg.out_dir)
    draft_store = None
    if cfg.domain != "mixed":
        # Check the store before spending the training time on a draft that cannot be published.
        draft_store = DraftStore(store or default_store_root())
        draft_store.check_writable(cfg.domain)
    if dataset is not None:
        if cfg.domain == "mixed":
            raise TrainError("--dataset trains one domain; pick code, general or dialog")
        data_dir = out_dir / "data"
        report = corpora.build_user_domain(dataset, cfg.domain, data_dir, text_field=text_field,
                                           messages_field=messages_field, seed=cfg.seed)
        echo(f"data: {dataset} -> {report.path} ({report.rows})")

    # Data: tokenized prompt + response rows; self-distilled replies replace raw text where present.
    loaded = load_model(target, device=cfg.device)
    tokenizer = loaded.tokenizer
    train_rows = domain_rows(cfg.domain, "train", data_dir, max_rows, cfg.seed)
    val_rows = domain_rows(cfg.domain, "validation", data_dir, cfg.eval_batches * cfg.batch_size, cfg.seed)
    replies, sampled = None, []
    if self_distill:
        replies, sampled = make_replies(loaded.model, tokenizer, cfg.domain, train_rows, self_distill,
                                        self_distill_sampled, sample_temperature, max_new_tokens=self_distill_tokens,
                                        batch_size=8 if cfg.device == "cpu" else 128, seed=cfg.seed)
        echo(f"self-distillation: {len(replies)} greedy target replies, {sum(map(len, sampled))} sampled")
    train_data = domain_sequences(train_rows, tokenizer, cfg.seq_len, cfg.prompt_weight, replies, sampled)
    val_data = domain_sequences(val_rows, tokenizer, cfg.seq_len, cfg.prompt_weight)
    vocab_ids = run_vocab(cfg, train_data, loaded.args.vocab_size, [*tokenizer.all_special_ids, *loaded.args.eos_token_ids])

    need, no_cache = teacher_cache_plan(cfg, loaded.model, train_data, tuple(cfg.feature_layers))
    if no_cache is not None and need > cfg.teacher_cache_gb > 0:  # over its budget
        echo(f"note: the target's states of the training set need {need:.1f} GB, over --teacher-cache-gb "
             f"{cfg.teacher_cache_gb:g}: the target runs on every batch (slower); raise --teacher-cache-gb "
             "if the device has the memory")
    # Train (resumes from out_dir/ckpt when present).
    result = train(cfg, loaded.model, train_data, val_data, vocab_ids)
    last_eval = next((h["eval"] for h in reversed(result.history) if "eval" in h), None)
    summary = {"steps": result.step, "seconds_this_run": round(result.seconds, 1), "sequences": len(train_data),
               "self_distilled": len(replies or {}), "sampled_replies": sum(map(len, sampled)), "dataset": dataset or str(data_dir or corpora.default_data_dir()),
               "target": loaded.name, "held_out": last_eval, "config": cfg.model_dump(exclude={"out_dir", "resume"})}
    echo(f"trained {result.step} steps in {result.seconds:.0f}s; held-out {json.dumps(last_eval)}")

    # Round trip through the checkpoint format: evaluate exactly what gets published.
    final = save_draft(result.draft, out_dir / "final", cfg.domain, "candidate", training=summary)
    draft = load_draft(final, loaded.model)
    out = {"final": final, "eval": None, "published": None, "activation": None}
    if cfg.domain == "mixed":
        echo(f"mixed draft saved to {final} (not published: the store holds routed domains only)")
        return out
    prompts = held_out_prompts(cfg.domain, tokenizer, eval_prompts, "validation", data_dir=data_dir)
    report = evaluate_draft(loaded.model, tokenizer, draft, prompts, eval_tokens)
    report.update({"domain": cfg.domain, "split": "validation", "target": loaded.name, "device": cfg.device})
    (out_dir / "eval.json").write_text(json.dumps(report, indent=2) + "\n")
    out["eval"] = report
    spec = report["spec"]
    echo("eval: mean accepted length {:.3f}, acceptance {:.3f}, by position {}; tokens/s AR {} | {}".format(
        report["mean_accepted_length"], report["acceptance_rate"], report["acceptance_by_position"],
        report["ar"]["tokens_per_s"], ", ".join(f"{k} {v['tokens_per_s']}" for k, v in spec.items())))

    # Publish, then activate through the gate.
    metrics = {k: v for k, v in report.items() if k != "draft"}
    published = draft_store.publish(draft, cfg.domain, version, training=summary, metrics=metrics)
    out["published"] = published
    echo(f"published {cfg.domain} {published.name} -> {published}")
    if activate:
        shipped = DraftStore(shipped_drafts_dir(), read_only=True)
        decision = draft_store.activate(cfg.domain, published.name, gate=True, tolerance=tolerance, fallback=shipped)
        out["activation"] = decision
        echo(decision.message)
    return out

"""The recipe that trains the shipped demo drafts (and the benchmark's seed-default-shape drafts).

    python -m training.demo_recipe export --out DIR [--shaped-prompts N]   # here: corpora -> plain JSON (gzip)
    python -m training.demo_recipe train --data DIR --out DIR --device cuda [--parallel] [--shaped-prompts]

`export` writes the rows training needs as plain JSON, so the GPU machine needs no `datasets`.
`train` runs the same pipeline pieces as `flashspec train-draft` per domain: self-distillation
(the target's own greedy replies to the domain's training prompts), teacher-forced distillation,
evaluation with the real decoder on validation prompts, then a fp16 checkpoint with its manifest.
`--parallel` trains every domain in its own process at once, spread round-robin over the visible
GPUs (a 135M target leaves one H200 mostly idle, so two runs share a GPU well).

`export --shaped-prompts N` also writes N training prompts of each of the GPU benchmark's two shapes per
domain (`bench.export_prompts.shaped_prompts` on the train split: the request with other documents
appended to 512 tokens, the request cut to 32); `train --shaped-prompts` adds them to the self-distilled
prompts (their greedy and sampled replies are the sequences; raise `--seq-len` above 512 + the reply
length, or the long ones keep only their last tokens). The shipped drafts never saw either shape, and
accept 1.7-1.8 tokens a round on cut requests (bench/RESULTS.md).

`train --init-from STORE` fine-tunes each domain's active draft of STORE (e.g. drafts/demo) instead of
training new adapters: its shape and sub-vocabulary are kept (`training.distill.warm_start`).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

DOMAINS = ("code", "general", "dialog")

# The demo drafts' shape: a cheap trunk (3 shared layers), one adapter, deep features (the target's
# final state and its states after layers 10 and 20), an 8k sub-vocabulary head tied to the target's
# lm_head: 5.5 M own parameters, 11 MB in fp16 (three drafts must stay under 40 MB, so a second
# adapter layer, 7 MB more each, does not fit). `--feature-layers ''` trains the final state alone.
DEMO = dict(shared_layers=3, adapter_layers=1, head="mlp_tied", feature_input="deep", head_vocab=8192,
            feature_layers=[10, 20])
# The shape the write-up describes: N = round(L/4), A = 2, full vocabulary, no deep features.
SEED_DEFAULT = dict(shared_layers=None, adapter_layers=2, head="mlp_tied", feature_input="none", head_vocab=None)
# A leaner draft for machines where a verify pass costs about the same for 1 or 6 tokens (CPUs with
# packed projections): the trunk is 1 layer, so drafting runs fewer target layers one token at a time.
LEAN = dict(shared_layers=1, adapter_layers=1, head="mlp_tied", feature_input="deep", head_vocab=8192)  # final state only
SHAPES = {"demo": DEMO, "seed-default": SEED_DEFAULT, "lean": LEAN}


class Rows(dict):
    """Columns as lists, with the `column_names` the pipeline functions look for."""

    @property
    def column_names(self) -> list[str]:
        return list(self.keys())

    def __len__(self) -> int:
        return len(next(iter(self.values()), []))


def export(out: Path, train_rows: int, val_rows: int, shaped: int = 0) -> None:
    from training.corpora import load_domain

    out.mkdir(parents=True, exist_ok=True)
    tok = None
    if shaped:
        from engine.loading import load_tokenizer

        tok = load_tokenizer("default")
    for domain in DOMAINS:
        data = {}
        for split, n in (("train", train_rows), ("validation", val_rows)):
            ds = load_domain(domain, split)
            ds = ds.shuffle(seed=0).select(range(min(n, len(ds))))
            data[split] = {"prompt": list(ds["prompt"]), "text": list(ds["text"])}
        if shaped:
            data["shaped"] = shaped_export(tok, domain, shaped)
        with gzip.open(out / f"{domain}.json.gz", "wt") as f:
            json.dump(data, f)
        print(domain, {k: len(v["prompt"]) for k, v in data.items()})


def shaped_export(tok, domain: str, n: int) -> dict[str, list[str]]:
    """n templated training prompts of each benchmark shape (train split, shuffled with another seed than
    the rows above), as text: {"prompt": [...], "shape": ["long" | "short", ...]}."""
    from bench.export_prompts import shaped_prompts
    from training.corpora import load_domain

    ds = load_domain(domain, "train").shuffle(seed=1)
    longs, shorts = shaped_prompts(tok, list(ds.select(range(min(len(ds), 4 * n)))), n)
    return {"prompt": [tok.decode(ids) for ids in longs + shorts], "shape": ["long"] * len(longs) + ["short"] * len(shorts)}


def with_shaped(rows: Rows, shaped: dict | None, replies: dict, sampled: list[dict],
                shaped_replies: dict, shaped_sampled: list[dict]) -> tuple[Rows, dict, list[dict]]:
    """The training rows with the shaped prompts appended (no raw text: their sequences are the target's
    replies), and the replies of both merged: what `domain_sequences` takes."""
    if not shaped:
        return rows, replies, sampled
    prompts = list(shaped["prompt"])
    merged = Rows({"prompt": list(rows["prompt"]) + prompts, "text": list(rows["text"]) + [""] * len(prompts)})
    more = [{**a, **b} for a, b in zip(sampled, shaped_sampled)] if shaped_sampled else sampled
    return merged, {**replies, **shaped_replies}, more


def start_shape(shape: dict, init_from: Path | None, domain: str) -> dict:
    """The TrainConfig shape fields of a domain's run: `shape`, or with `--init-from STORE` the shape of that
    store's active draft of the domain plus `init_from` (the run fine-tunes it)."""
    if init_from is None:
        return shape
    from drafts.checkpoint import version_folder
    from training.distill import draft_shape

    folder = version_folder(init_from / domain)
    return {**draft_shape(folder), "init_from": str(folder)}


def train_one(domain_name: str, rows: Rows, val: Rows, shape: dict, loaded, args, out: Path,
              shaped: dict | None = None) -> dict:
    from drafts.checkpoint import save_draft
    from training.distill import TrainConfig, domain_sequences, run_vocab, train
    from training.evaluate import evaluate_draft
    from training.selfdistill import greedy_and_sampled

    tok, model = loaded.tokenizer, loaded.model
    t0 = time.perf_counter()
    replies, sampled = greedy_and_sampled(model, tok, domain_name, rows, args.self_distill, args.sampled_replies,
                                          args.sample_temperature, max_new_tokens=args.reply_tokens,
                                          batch_size=args.gen_batch, progress=False)
    shaped = shaped if args.shaped_prompts else None
    if args.shaped_prompts and not shaped:
        raise SystemExit(f"{domain_name}: --shaped-prompts, but {args.data} has no shaped prompts; "
                         "export them: python -m training.demo_recipe export --out DIR --shaped-prompts N")
    shaped_replies, shaped_sampled = ({}, [])
    if shaped:  # every shaped prompt answered (its own cache entry: the domain name says "shaped")
        shaped_replies, shaped_sampled = greedy_and_sampled(
            model, tok, f"{domain_name}-shaped", Rows(prompt=shaped["prompt"]), len(shaped["prompt"]),
            args.sampled_replies, args.sample_temperature, max_new_tokens=args.reply_tokens, batch_size=args.gen_batch,
            progress=False, max_prompt_tokens=1024)
    rows, replies, sampled = with_shaped(rows, shaped, replies, sampled, shaped_replies, shaped_sampled)
    t_gen = time.perf_counter() - t0
    max_seconds = args.max_seconds
    if args.total_seconds:  # what is left of the whole run's budget, less a reserve for evaluation and saving
        left = args.total_seconds - (time.perf_counter() - args.started) - args.eval_reserve
        if left <= 0:
            raise SystemExit(f"{domain_name}: no time left to train (--total-seconds {args.total_seconds:g})")
        max_seconds = min(max_seconds or left, left)
    cfg = TrainConfig(domain=domain_name, steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
                      lr_adapters=args.lr_adapters, lr_head=args.lr_head, warmup_steps=args.steps // 20,
                      tv_weight=args.tv_weight,
                      eval_every=max(args.steps // 4, 1), save_every=args.steps, device=args.device,
                      max_seconds=max_seconds, teacher_cache_gb=args.teacher_cache_gb,
                      out_dir=str(out / "runs" / f"{domain_name}-{args.tag}"), resume=False,
                      group_by_length=args.group_by_length, **shape)
    data = domain_sequences(rows, tok, cfg.seq_len, cfg.prompt_weight, replies, sampled)
    val_data = domain_sequences(val, tok, cfg.seq_len, cfg.prompt_weight)
    vocab_ids = run_vocab(cfg, data, loaded.args.vocab_size, [*tok.all_special_ids, *loaded.args.eos_token_ids])
    t1 = time.perf_counter()
    result = train(cfg, model, data, val_data, vocab_ids, progress=False)
    t_train = time.perf_counter() - t1
    draft = result.draft.to(model.embed_tokens.weight.dtype).eval()
    prompts = [tok(p, add_special_tokens=False).input_ids[-args.eval_prompt_tokens:] for p in val["prompt"][: args.eval_prompts]]
    report = evaluate_draft(model, tok, draft, prompts, max_new_tokens=args.eval_tokens, blocks=(5,), quality=False)
    summary = {"steps": result.step, "train_seconds": round(t_train, 1), "self_distill_seconds": round(t_gen, 1),
               "sequences": len(data), "self_distilled": len(replies), "sampled_replies": sum(map(len, sampled)),
               "shaped_prompts": len(shaped["prompt"]) if shaped else 0,
               "sample_temperature": args.sample_temperature if sampled else None, "recipe": "training/demo_recipe.py",
               "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
               "config": cfg.model_dump(exclude={"out_dir", "resume"}),
               "held_out": next((h["eval"] for h in reversed(result.history) if "eval" in h), None)}
    metrics = {k: v for k, v in report.items() if k != "draft"}
    folder = save_draft(draft, out / args.tag / domain_name / args.version, domain_name, args.version,
                        training=summary, metrics=metrics)
    (out / args.tag / domain_name / "ACTIVE").write_text(args.version + "\n")
    line = {"domain": domain_name, "tag": args.tag, "train_s": round(t_train, 1), "gen_s": round(t_gen, 1),
            "steps": result.step, "sequences": len(data),
            "mean_accepted_length": report.get("mean_accepted_length"), "acceptance_rate": report.get("acceptance_rate"),
            "by_position": report.get("acceptance_by_position"), "folder": str(folder)}
    print(json.dumps(line), flush=True)
    return line


def matrix(args, loaded) -> None:
    """Mean accepted length of every (draft x prompt domain) pair, greedy, gamma 5, one verify per round."""
    from bench.domains import domain_matrix, format_table
    from drafts.checkpoint import load_draft

    tok = loaded.tokenizer
    prompts = {}
    for d in DOMAINS:
        val = json.load(gzip.open(args.data / f"{d}.json.gz", "rt"))["validation"]["prompt"]
        prompts[d] = [tok(p, add_special_tokens=False).input_ids[-512:] for p in val[: args.prompts]]
    drafts = {}
    for name in (*DOMAINS, "mixed"):
        folder = args.drafts / name
        if (folder / "ACTIVE").exists():
            drafts[name] = load_draft(folder / (folder / "ACTIVE").read_text().strip(), loaded.model, name=name)
    table = domain_matrix(loaded.model, tok, drafts, prompts, args.tokens)
    print(json.dumps(table))
    print(format_table(table, list(DOMAINS)))


def train_parallel(argv: list[str], domains: list[str], out: Path) -> None:
    """One `train` process per domain, round-robin over the visible GPUs; waits for all, then prints their results."""
    from engine.loading import resolve_model_dir

    resolve_model_dir("default")  # convert the default model once, before the runs race to do it
    gpus = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = gpus.split(",") if gpus else [str(i) for i in range(max(1, torch.cuda.device_count()))]
    (out / "logs").mkdir(parents=True, exist_ok=True)
    rest = [a for a in argv if a != "--parallel"]
    procs = []
    for i, domain in enumerate(domains):
        cmd = [sys.executable, "-m", "training.demo_recipe", *rest, "--domains", domain]  # the last --domains wins
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpus[i % len(gpus)]}
        log = open(out / "logs" / f"{domain}.log", "w")
        procs.append((domain, subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log))
        print(f"{domain}: GPU {env['CUDA_VISIBLE_DEVICES']}, log {log.name}", flush=True)
    failed = []
    for domain, proc, log in procs:
        if proc.wait() != 0:
            failed.append(domain)
        log.close()
        lines = [line for line in (out / "logs" / f"{domain}.log").read_text().splitlines() if line.startswith("{")]
        print(lines[-1] if lines else f"{domain}: no result (exit {proc.returncode})", flush=True)
    if failed:
        raise SystemExit(f"training failed for {', '.join(failed)}; see {out / 'logs'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export")
    e.add_argument("--out", type=Path, required=True)
    e.add_argument("--train-rows", type=int, default=8000)
    e.add_argument("--val-rows", type=int, default=64)
    e.add_argument("--shaped-prompts", type=int, default=0,
                   help="also N training prompts per domain of each GPU benchmark shape (long 512, short 32)")
    t = sub.add_parser("train")
    t.add_argument("--data", type=Path, required=True)
    t.add_argument("--out", type=Path, required=True)
    t.add_argument("--domains", default="code,general,dialog", help="comma list; 'mixed' trains one draft on all three")
    t.add_argument("--shape", choices=tuple(SHAPES), default="demo")
    t.add_argument("--feature-layers", default=None,
                   help="comma list of target layer counts fused in beside the final state (overrides the shape's)")
    t.add_argument("--teacher-cache-gb", type=float, default=32.0,
                   help="device memory for the target's cached states (train-draft --teacher-cache-gb)")
    t.add_argument("--tag", default="demo")
    t.add_argument("--version", default="demo-v8")
    t.add_argument("--device", default="cuda")
    t.add_argument("--steps", type=int, default=20000, help="optimizer steps (at most; see --max-seconds)")
    t.add_argument("--max-seconds", type=float, default=None, help="training-loop time budget per domain")
    t.add_argument("--total-seconds", type=float, default=None,
                   help="budget of a whole domain run from process start (self-distill + train + eval); training gets the rest")
    t.add_argument("--eval-reserve", type=float, default=60.0, help="seconds kept for evaluation and saving under --total-seconds")
    t.add_argument("--parallel", action="store_true", help="one process per domain, spread over the visible GPUs")
    t.add_argument("--batch-size", type=int, default=32)
    t.add_argument("--seq-len", type=int, default=384)
    t.add_argument("--lr-adapters", type=float, default=3e-4)
    t.add_argument("--lr-head", type=float, default=6e-4)
    t.add_argument("--tv-weight", type=float, default=0.0,
                   help="add this times the total variation distance to the target (a sampled token's rejection "
                        "probability) to the KL loss (train-draft --tv-weight)")
    t.add_argument("--self-distill", type=int, default=4000, help="prompts answered by the target (0: raw text only)")
    t.add_argument("--reply-tokens", type=int, default=160)
    t.add_argument("--sampled-replies", type=int, default=3,
                   help="extra sampled replies per self-distilled prompt (more of the target's own text per prompt)")
    t.add_argument("--sample-temperature", type=float, default=0.8)
    t.add_argument("--gen-batch", type=int, default=512)
    t.add_argument("--eval-prompts", type=int, default=16)
    t.add_argument("--eval-tokens", type=int, default=96)
    t.add_argument("--eval-prompt-tokens", type=int, default=512)
    t.add_argument("--no-group-by-length", dest="group_by_length", action="store_false",
                   help="uniformly random batches (the shipped v8 drafts' order) instead of batches of about one length")
    t.add_argument("--init-from", type=Path, default=None,
                   help="a draft store (<domain>/ACTIVE, e.g. drafts/demo): fine-tune each domain's active draft, "
                        "keeping its shape and sub-vocabulary, instead of training new adapters")
    t.add_argument("--shaped-prompts", action="store_true",
                   help="self-distill and train on the exported benchmark-shaped prompts too (export --shaped-prompts)")
    m = sub.add_parser("matrix", help="domain matrix of the trained drafts on held-out prompts of each domain")
    m.add_argument("--data", type=Path, required=True)
    m.add_argument("--drafts", type=Path, required=True, help="folder with <name>/<version>/ drafts (code, general, dialog, mixed)")
    m.add_argument("--device", default="cuda")
    m.add_argument("--prompts", type=int, default=16)
    m.add_argument("--tokens", type=int, default=96)
    args = parser.parse_args()
    args.started = time.perf_counter()
    if args.cmd == "export":
        export(args.out, args.train_rows, args.val_rows, args.shaped_prompts)
        return
    if args.cmd == "train" and args.parallel:
        train_parallel(sys.argv[1:], args.domains.split(","), args.out)
        return
    from engine.loading import load_model

    loaded = load_model("default", device=args.device, dtype="bfloat16" if args.device == "cuda" else "float32")
    if args.cmd == "matrix":
        matrix(args, loaded)
        return
    shape = SHAPES[args.shape]
    if args.feature_layers is not None:
        from training.distill import layer_list

        shape = {**shape, "feature_layers": layer_list(args.feature_layers)}
    if args.init_from is not None and "mixed" in args.domains.split(","):
        raise SystemExit("--init-from fine-tunes the routed domains' drafts; train 'mixed' without it")
    data = {d: json.load(gzip.open(args.data / f"{d}.json.gz", "rt")) for d in DOMAINS}
    for domain in args.domains.split(","):
        names = DOMAINS if domain == "mixed" else (domain,)
        rows = Rows({c: sum((data[n]["train"][c][: len(data[n]["train"][c]) // len(names)] for n in names), [])
                     for c in ("prompt", "text")})
        shaped = ({"prompt": sum((data[n]["shaped"]["prompt"] for n in names), [])}
                  if all("shaped" in data[n] for n in names) else None)
        val = Rows({c: sum((data[n]["validation"][c] for n in names), []) for c in ("prompt", "text")})
        train_one(domain, rows, val, start_shape(shape, args.init_from, domain), loaded, args, args.out, shaped)


if __name__ == "__main__":
    main()

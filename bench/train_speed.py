"""Training steps per second, two settings side by side: same data and settings, runs alternating.

    python -m bench.train_speed --data DIR [--compare cache|grouping] [--domain code] [--steps 250] [--runs 4]
                                [--shaped] [--device cuda]

DIR is a `training.demo_recipe export` folder; the domain's training rows are used as raw text (no
self-distillation), and with `--shaped` its benchmark-shaped prompts too (prompt only: long ones of 512
tokens, short ones of 32, the length mix `train --shaped-prompts` trains on). Each run is a fresh `train()`
of the demo draft shape, the first setting first:
- `--compare cache`: teacher cache off / on (`TrainConfig.teacher_cache_gb` 0 / 8); the time includes
  building the cache.
- `--compare grouping`: uniformly random batches / batches of about one length (`group_by_length`), with
  `--teacher-cache-gb` (default 8). Also prints the tokens the batches were padded to.
The first run also pays the warm-up. Peak memory is the process's peak so far (CUDA).
`--padding-only` trains nothing: the tokens one epoch's batches pad to, random and grouped, against the
tokens there are (the same orders `train()` uses, seed 0).
"""

from __future__ import annotations

import argparse
import gzip
import json
import tempfile
import time
from pathlib import Path

import torch

SETTINGS = {"cache": ("teacher_cache_gb", (0.0, 8.0)), "grouping": ("group_by_length", (False, True))}


def padded_tokens(order, lengths: list[int], batches: int) -> int:
    """Tokens the first `batches` micro-batches of `order` pad to (each to its longest sequence)."""
    return sum(order.batch_size * max(lengths[i] for i in order.indices(g)) for g in range(batches))


def main() -> None:
    from engine.loading import load_model
    from training.demo_recipe import Rows
    from training.distill import TeacherCache, TrainConfig, _Order, domain_sequences, train

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--compare", choices=tuple(SETTINGS), default="cache")
    parser.add_argument("--domain", default="code")
    parser.add_argument("--steps", type=int, default=250)
    parser.add_argument("--runs", type=int, default=4, help="alternating, starting with the first setting")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=384)
    parser.add_argument("--max-rows", type=int, default=None, help="use at most this many training rows")
    parser.add_argument("--shaped", action="store_true", help="add the exported benchmark-shaped prompts")
    parser.add_argument("--teacher-cache-gb", type=float, default=8.0, help="with --compare grouping")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--padding-only", action="store_true", help="print one epoch's padded tokens; no training")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    if args.padding_only:
        from engine.loading import load_tokenizer

        tokenizer = load_tokenizer("default")
    else:
        loaded = load_model("default", device=args.device, dtype="bfloat16" if cuda else "float32")
        tokenizer = loaded.tokenizer
    exported = json.load(gzip.open(args.data / f"{args.domain}.json.gz", "rt"))
    rows = Rows({k: v[: args.max_rows] for k, v in exported["train"].items()})
    if args.shaped:
        if "shaped" not in exported:
            raise SystemExit(f"error: {args.data} has no shaped prompts; export them: "
                             "python -m training.demo_recipe export --out DIR --shaped-prompts N")
        shaped = exported["shaped"]["prompt"]  # long ones first, then short: an even sample keeps the mix
        shaped = shaped[:: max(1, len(shaped) // args.max_rows)] if args.max_rows else shaped
        rows = Rows({"prompt": list(rows["prompt"]) + shaped, "text": list(rows["text"]) + [""] * len(shaped)})
    data = domain_sequences(rows, tokenizer, args.seq_len, 0.5)
    lengths = [len(s) for s in data.sequences]
    if args.padding_only:
        epoch = len(lengths) // args.batch_size
        rand, grouped = (padded_tokens(_Order(len(lengths), args.batch_size, 0, lengths=by), lengths, epoch)
                         for by in (None, lengths))
        print(f"{args.domain}: {len(lengths)} sequences, {sum(lengths)} tokens; seq-len {args.seq_len}, batch "
              f"{args.batch_size}, {epoch} batches: padded to {rand} random, {grouped} grouped ({grouped / rand:.3f}x; "
              f"the tokens there are / grouped {sum(lengths) / grouped:.3f})")
        return
    print(f"{len(data)} sequences, {sum(lengths)} tokens, cache {TeacherCache.size_gb(loaded.model, data):.2f} GB; "
          f"compare {args.compare}; batch {args.batch_size}, seq-len {args.seq_len}, device {args.device}", flush=True)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    field, values = SETTINGS[args.compare]
    for run in range(args.runs):
        value = values[run % 2]
        setting = {field: value}
        if args.compare == "grouping":
            setting["teacher_cache_gb"] = args.teacher_cache_gb
            padded = padded_tokens(_Order(len(data), args.batch_size, 0, lengths=lengths if value else None),
                                   lengths, args.steps)
        with tempfile.TemporaryDirectory() as tmp:
            cfg = TrainConfig(domain=args.domain, steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
                              lr_adapters=3e-4, lr_head=6e-4, warmup_steps=20, eval_every=10**6, save_every=10**6,
                              device=args.device, out_dir=tmp, resume=False, **setting)
            sync()
            start = time.perf_counter()
            result = train(cfg, loaded.model, data, None, progress=False)
            sync()
            seconds = time.perf_counter() - start
        peak = f"; peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB" if cuda else ""
        pad = f"; batches padded to {padded} tokens" if args.compare == "grouping" else ""
        print(f"{field}={value}: {result.step} steps in {seconds:.1f} s = {result.step / seconds:.2f} steps/s; "
              f"loss {result.history[-1]['loss']:.4f} top1 {result.history[-1]['top1_by_step']}{pad}{peak}", flush=True)


if __name__ == "__main__":
    main()

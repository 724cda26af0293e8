"""Training steps per second with and without the teacher cache: same data and settings, runs alternating.

    python -m bench.teacher_cache_speed --data DIR [--domain code] [--steps 250] [--runs 4] [--device cuda]

DIR is a `training.demo_recipe export` folder; the domain's training rows are used as raw text (no
self-distillation). Runs alternate cache off / on (`TrainConfig.teacher_cache_gb` 0 / 8), each a fresh
`train()` of the demo draft shape; the time includes building the cache. The first run also pays the
warm-up. Peak memory is the process's peak so far (CUDA).
"""

from __future__ import annotations

import argparse
import gzip
import json
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    from engine.loading import load_model
    from training.demo_recipe import Rows
    from training.distill import TeacherCache, TrainConfig, domain_sequences, train

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--domain", default="code")
    parser.add_argument("--steps", type=int, default=250)
    parser.add_argument("--runs", type=int, default=4, help="alternating off / on, starting with off")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=384)
    parser.add_argument("--max-rows", type=int, default=None, help="use at most this many training rows")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    loaded = load_model("default", device=args.device, dtype="bfloat16" if cuda else "float32")
    train_rows = json.load(gzip.open(args.data / f"{args.domain}.json.gz", "rt"))["train"]
    rows = Rows({k: v[: args.max_rows] for k, v in train_rows.items()})
    data = domain_sequences(rows, loaded.tokenizer, args.seq_len, 0.5)
    print(f"{len(data)} sequences, {sum(map(len, data.sequences))} tokens, "
          f"cache {TeacherCache.size_gb(loaded.model, data):.2f} GB", flush=True)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for run in range(args.runs):
        gb = 8.0 if run % 2 else 0.0
        with tempfile.TemporaryDirectory() as tmp:
            cfg = TrainConfig(domain=args.domain, steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
                              lr_adapters=3e-4, lr_head=6e-4, warmup_steps=20, eval_every=10**6, save_every=10**6,
                              device=args.device, out_dir=tmp, resume=False, teacher_cache_gb=gb)
            sync()
            start = time.perf_counter()
            result = train(cfg, loaded.model, data, None, progress=False)
            sync()
            seconds = time.perf_counter() - start
        peak = f"; peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB" if cuda else ""
        print(f"teacher_cache_gb={gb:g}: {result.step} steps in {seconds:.1f} s = {result.step / seconds:.1f} steps/s; "
              f"loss {result.history[-1]['loss']:.4f} top1 {result.history[-1]['top1_by_step']}{peak}", flush=True)


if __name__ == "__main__":
    main()

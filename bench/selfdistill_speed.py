"""How fast self-distillation generates on this machine: the target's replies to a domain's training prompts.

    python -m bench.selfdistill_speed --data DIR [--domain code] [--prompts 512] [--device cuda]

DIR is a `training.demo_recipe export` folder. Runs greedy at batch 128 and 256, then sampled (T=0.8) at
batch 256, each into an empty cache, and prints replies, tokens, seconds and tokens/s (the first row
includes the engine's graph captures).
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
    from training.selfdistill import self_distill

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--domain", default="code")
    parser.add_argument("--prompts", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=160)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    loaded = load_model("default", device=args.device, dtype="bfloat16" if args.device == "cuda" else "float32")
    train = json.load(gzip.open(args.data / f"{args.domain}.json.gz", "rt"))["train"]
    rows = {"prompt": train["prompt"][: args.prompts], "text": train["text"][: args.prompts]}
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    for batch, temperature in ((128, 0.0), (256, 0.0), (256, 0.8)):
        with tempfile.TemporaryDirectory() as tmp:
            sync()
            start = time.perf_counter()
            replies = self_distill(loaded.model, loaded.tokenizer, args.domain, rows, args.prompts,
                                   max_new_tokens=args.tokens, batch_size=batch, cache_root=Path(tmp), progress=False,
                                   temperature=temperature)
            sync()
            seconds = time.perf_counter() - start
        tokens = sum(map(len, replies.values()))
        print(f"batch {batch} T={temperature}: {len(replies)} replies, {tokens} tokens, {seconds:.1f} s, "
              f"{tokens / seconds:.0f} tok/s", flush=True)


if __name__ == "__main__":
    main()

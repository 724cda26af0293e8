"""Domain matrix: mean accepted length of every (draft domain x prompt domain) pair, plus a mixed draft.

    python -m bench.domains --device cpu --prompts 8 --tokens 64 [--mixed RUN/final] [--store DIR]

Drafts: each domain's active draft (user store first, then the shipped demo drafts), and optionally
one draft trained on all domains mixed (`train-draft --domain mixed` saves it to <out>/final).
Prompts: the held-out validation split of each domain. Greedy, gamma 5, one verify per round.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch


def domain_matrix(model, tokenizer, drafts: dict, prompts: dict[str, list[list[int]]], max_new_tokens: int,
                  gamma: int = 5) -> dict[str, dict[str, float]]:
    """{draft name: {prompt domain: mean accepted length}} from the real spec decoder."""
    from training.evaluate import evaluate_draft

    table: dict[str, dict[str, float]] = {}
    for name, draft in drafts.items():
        table[name] = {}
        for domain, ids in prompts.items():
            report = evaluate_draft(model, tokenizer, draft, ids, max_new_tokens, gamma, blocks=(gamma,),
                                    include_ar=False, quality=False)
            table[name][domain] = report["mean_accepted_length"]
    return table


def format_table(table: dict[str, dict[str, float]], domains: list[str]) -> str:
    lines = ["draft \\ prompts | " + " | ".join(domains), "---|" + "---|" * len(domains)]
    for name, row in table.items():
        cells = []
        for d in domains:
            best = max(table[n][d] for n in table)
            cell = f"{row[d]:.3f}"
            cells.append(f"**{cell}**" if row[d] == best else cell)
        lines.append(f"{name} | " + " | ".join(cells))
    for d in domains:
        if d in table:
            others = [table[n][d] for n in table if n != d]
            if others:
                lines.append(f"matched/best-other on {d}: {table[d][d] / max(others):.3f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    from drafts.checkpoint import load_draft
    from drafts.store import DOMAINS, resolve_draft
    from engine.loading import load_model
    from training.evaluate import held_out_prompts

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="default")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--store", default=None, help="draft store (default $FLASHSPEC_HOME/store)")
    parser.add_argument("--mixed", default=None, help="folder of a draft trained on all domains mixed")
    parser.add_argument("--prompts", type=int, default=8, help="held-out prompts per domain")
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per prompt")
    parser.add_argument("--split", default="validation")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None, help="also write the matrix as JSON here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    loaded = load_model(args.target, device=args.device)
    drafts = {}
    for domain in DOMAINS:
        folder = resolve_draft(domain, args.store)
        if folder is None:
            raise SystemExit(f"error: no active {domain} draft (store or shipped); train one: "
                             f"python -m training.cli train-draft --domain {domain}")
        drafts[domain] = load_draft(folder, loaded.model, name=domain)
    if args.mixed:
        drafts["mixed"] = load_draft(args.mixed, loaded.model, name="mixed")
    prompts = {d: held_out_prompts(d, loaded.tokenizer, args.prompts, args.split) for d in DOMAINS}

    start = time.perf_counter()
    table = domain_matrix(loaded.model, loaded.tokenizer, drafts, prompts, args.tokens)
    print(f"setup: target {loaded.name}, device {args.device} ({platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads), greedy, gamma 5, block 5, bs 1, {args.prompts} {args.split} prompts "
          f"per domain, {args.tokens} new tokens; {time.perf_counter() - start:.0f}s")
    print("mean accepted length (tokens per round):")
    print(format_table(table, list(DOMAINS)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"setup": vars(args), "mean_accepted_length": table}, f, indent=2)


if __name__ == "__main__":
    main()

"""Domain matrix: mean accepted length of every (draft domain x prompt domain) pair, plus a mixed draft.

    python -m bench.domains --device cpu --prompts 8 --tokens 64 [--mixed RUN/final] [--store DIR]
    python -m bench.domains --shapes --prompts 12 --tokens 64

--shapes: instead of the matrix, each domain's draft on prompts of three shapes from the same split: as
trained (the templated request, at most 512 tokens) and the GPU benchmark's two (bench.export_prompts:
the request with other documents appended to 512 tokens; the request cut to 32).

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


def setup_line(loaded, args, per: str, start: float) -> str:
    """The run's setup, for the printed table: target, device, decoding settings, prompts `per` ..., seconds."""
    return (f"setup: target {loaded.name}, device {args.device} ({platform.processor() or platform.machine()}, "
            f"{torch.get_num_threads()} threads), greedy, gamma 5, block 5, bs 1, {args.prompts} {args.split} prompts "
            f"{per}, {args.tokens} new tokens; {time.perf_counter() - start:.0f}s")


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
    parser.add_argument("--shapes", action="store_true",
                        help="each domain's draft on its prompts as trained, long (512) and short (32), not the matrix")
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
    if args.shapes:
        return shapes_table(loaded, drafts, prompts, args)

    start = time.perf_counter()
    table = domain_matrix(loaded.model, loaded.tokenizer, drafts, prompts, args.tokens)
    print(setup_line(loaded, args, "per domain", start))
    print("mean accepted length (tokens per round):")
    print(format_table(table, list(DOMAINS)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"setup": vars(args), "mean_accepted_length": table}, f, indent=2)


def shapes_table(loaded, drafts: dict, prompts: dict[str, list[list[int]]], args) -> dict:
    """Each domain's own draft on its split's prompts in three shapes: {domain: {shape: mean accepted length}}."""
    from bench.export_prompts import shaped_prompts
    from training.corpora import load_domain
    from training.evaluate import evaluate_draft

    start = time.perf_counter()
    table = {}
    for domain, as_trained in prompts.items():
        ds = load_domain(domain, args.split)
        longs, shorts = shaped_prompts(loaded.tokenizer, list(ds.select(range(min(len(ds), 8 * args.prompts)))),
                                       args.prompts)
        table[domain] = {}
        for shape, ids in (("as trained", as_trained), ("long 512", longs), ("short 32", shorts)):
            report = evaluate_draft(loaded.model, loaded.tokenizer, drafts[domain], ids, args.tokens, 5, blocks=(5,),
                                    include_ar=False, quality=False)
            table[domain][shape] = (report["mean_accepted_length"], len(ids), round(sum(map(len, ids)) / len(ids)))
    print(setup_line(loaded, args, "per domain and shape", start))
    print("mean accepted length of each domain's draft (prompts, mean prompt tokens):")
    print("draft | as trained | long 512 | short 32\n---|---|---|---|")
    for domain, row in table.items():
        print(f"{domain} | " + " | ".join(f"{mal:.3f} ({n}, {t})" for mal, n, t in row.values()))
    return table


if __name__ == "__main__":
    main()

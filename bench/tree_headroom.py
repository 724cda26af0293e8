"""What a draft tree that branches at the first drafted position could recover, greedy: how often the
target's next token is among the draft's top k there.

    python -m bench.tree_headroom --domain code --prompts 16 --tokens 64 --ks 1,2,3,4,8

The engine drafts a chain: one candidate a position, verified in one pass. A tree drafts k candidates at
a position (and chains after each) and verifies them all in the same pass, with a mask that lets each
node see only its own ancestors; at batch 1 on the GPU a pass over 20 tokens costs about what one over 6
does (bench/RESULTS.md, the kernel tables). Whether that pays depends on how often the target's token is
the draft's second to k-th choice where its first choice is wrong. This script measures exactly that at
the first drafted position, where the draft has the target's true features (as in a round's first step):
it decodes the target's greedy replies to held-out prompts, runs the target and the draft teacher-forced
over prompt + reply, and reports for each k the fraction of reply positions whose target argmax is in
the draft's top k (k = 1 is the chain's first-position acceptance). Deeper positions need the draft's
own proxies along each branch: not measured here.
"""

from __future__ import annotations

import argparse
import json

import torch


@torch.no_grad()
def top_k_coverage(target, draft, sequences: list[list[int]], starts: list[int], ks: tuple[int, ...]) -> dict[int, float]:
    """{k: mean over positions t >= start of [the target's argmax at t is among the draft's k best tokens]},
    the draft's first step with true features; tokens outside a draft's sub-vocabulary are never covered."""
    from training.distill import _shift, target_states

    hits = {k: 0 for k in ks}
    count = 0
    device = target.embed_tokens.weight.device
    for seq, start in zip(sequences, starts):
        tokens = torch.tensor([seq], device=device)
        trunk, final, captured = target_states(target, tokens, draft.shared_layers, draft.feature_layers)
        pos = torch.arange(len(seq), device=device)[None]
        want = target(tokens, pos).logits[0, start - 1:-1].float().argmax(-1)  # (n,): predicts seq[start:]
        feats = _shift(draft.target_features(final, captured)) if draft.feature_input == "deep" else None
        scores = draft.forward_train(trunk, feats, pos)[0][0, start - 1:-1].float()  # (n, K)
        order = scores.topk(min(max(ks), scores.shape[-1]), dim=-1).indices  # (n, k) indices into the head's vocab
        ids = order if draft.vocab_ids is None else draft.vocab_ids[order]
        found = ids == want[:, None]  # (n, k): at most one True a row
        for k in ks:
            hits[k] += int(found[:, :k].any(-1).sum())
        count += len(want)
    return {k: hits[k] / max(count, 1) for k in ks}


def main(argv: list[str] | None = None) -> None:
    from bench.gpu import load_drafts
    from engine.generate import generate
    from engine.loading import load_model
    from engine.sampling import SamplingParams
    from engine.scheduler import DecodeEngine
    from training.evaluate import held_out_prompts

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--domain", default="code")
    parser.add_argument("--drafts", default="drafts/demo", help="folder with <domain>/ drafts")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64, help="greedy reply tokens per prompt")
    parser.add_argument("--split", default="validation")
    parser.add_argument("--ks", default="1,2,3,4,8")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    ks = tuple(sorted(int(k) for k in args.ks.split(",")))
    if not ks or ks[0] < 1:
        raise SystemExit(f"--ks {args.ks!r}: give positive integers, e.g. --ks 1,2,4")
    loaded = load_model("default", device=args.device)
    drafts = load_drafts(args.drafts, loaded.model)
    if args.domain not in drafts:
        raise SystemExit(f"no {args.domain} draft under {args.drafts}: give --drafts a folder with {args.domain}/")
    prompts = held_out_prompts(args.domain, loaded.tokenizer, args.prompts, args.split)
    eng = DecodeEngine(loaded.model, loaded.tokenizer, max_batch_size=4,
                       max_seq_len=max(map(len, prompts)) + args.tokens + 8)
    replies = generate(eng, prompts, SamplingParams(max_new_tokens=args.tokens, eos_token_ids=()))
    sequences = [p + r.token_ids for p, r in zip(prompts, replies)]
    got = top_k_coverage(loaded.model, drafts[args.domain], sequences, [len(p) for p in prompts], ks)
    print(json.dumps({"domain": args.domain, "drafts": args.drafts, "split": args.split, "prompts": len(prompts),
                      "reply_tokens": args.tokens, "first_position_top_k": {str(k): round(v, 4) for k, v in got.items()}}))


if __name__ == "__main__":
    main()

"""What a draft tree could recover, greedy: how often the target's next token is among the draft's top k
at the first drafted position, and whole rounds of static trees played over the target's replies.

    python -m bench.tree_headroom --domain code --prompts 16 --tokens 64 --ks 1,2,3,4,8
    python -m bench.tree_headroom --domain code --trees "1,1,1,1,1;4,1,1,1,1;2,2,1,1,1"

The engine drafts a chain: one candidate a position, verified in one pass. A tree drafts several
candidates at a position (and chains after each) and verifies them all in the same pass, with a mask that
lets each node see only its ancestors. On the H200 a step's cost hardly depends on its tokens: a pass
over 48 token rows took 1.13 ms against 1.00 ms for 6 (bench/RESULTS.md, run 24's kernel table). Whether
a tree pays depends on how often the target's token is the draft's second to k-th choice.

The first measurement takes the first drafted position, where the draft has the target's true features
(as in a round's first step): it decodes the target's greedy replies to held-out prompts, runs the
target and the draft teacher-forced over prompt + reply, and reports for each k the fraction of reply
positions whose target argmax is in the draft's top k (k = 1: the chain's first-position acceptance).

`--trees` plays whole greedy rounds of static trees over the same replies. A tree "4,1,1,1,1" takes the
draft's 4 best tokens at the first drafted position and its best at each of the 4 after (4 chains of 5,
20 nodes); "1,1,1,1,1" is the engine's gamma-5 chain and "4,1,1,1,1" its draft tree of width 4
(`engine/tree.py`), and for these the engine's own round count is printed beside as a check of the
simulation. Each row also gives S(k), the share of rounds whose first k drafted tokens are accepted. Every node is drafted as the engine drafts a chain's token: the
target's trunk on the node's path, the adapters over the context with the target's true features and
over the path with the draft's own proxies (`DraftModel.forward_train`, no cache). The path that matches
the reply longest is accepted, then the target's next token: the rounds the engine would play with such
a tree (greedy output is the reply either way). Reports tokens a round and nodes verified a round.
"""

from __future__ import annotations

import json

import torch

from bench.draft_temperature import load_replies, replies_parser, teacher_forced


@torch.no_grad()
def top_k_coverage(target, draft, sequences: list[list[int]], starts: list[int], ks: tuple[int, ...]) -> dict[int, float]:
    """{k: mean over positions t >= start of [the target's argmax at t is among the draft's k best tokens]},
    the draft's first step with true features; tokens outside a draft's sub-vocabulary are never covered."""
    hits = {k: 0 for k in ks}
    count = 0
    device = target.embed_tokens.weight.device
    for seq, start in zip(sequences, starts):
        tokens = torch.tensor([seq], device=device)
        _, _, pos, scores, _ = teacher_forced(target, draft, tokens)
        want = target(tokens, pos).logits[0, start - 1:-1].float().argmax(-1)  # (n,): predicts seq[start:]
        scores = scores[0, start - 1:-1].float()  # (n, K)
        order = scores.topk(min(max(ks), scores.shape[-1]), dim=-1).indices  # (n, k) indices into the head's vocab
        ids = order if draft.vocab_ids is None else draft.vocab_ids[order]
        found = ids == want[:, None]  # (n, k): at most one True a row
        for k in ks:
            hits[k] += int(found[:, :k].any(-1).sum())
        count += len(want)
    return {k: hits[k] / max(count, 1) for k in ks}


def verified_step(proposed: list[int], seq: list[int], t: int) -> int:
    """Tokens a greedy round from position t of a known reply `seq` makes when it verifies `proposed` (the
    tokens for t + 1, t + 2, ...): the longest prefix of them the reply matches, then the target's next token,
    never past the reply's end."""
    accepted = next((i for i, tok in enumerate(proposed) if t + 1 + i >= len(seq) or tok != seq[t + 1 + i]),
                    len(proposed))
    return min(accepted + 1, len(seq) - 1 - t)


@torch.no_grad()
def simulate_tree_rounds(target, draft, sequences: list[list[int]], starts: list[int],
                         branching: tuple[int, ...], lookup=None) -> dict[str, float]:
    """Greedy rounds of a static tree (`branching[d]` candidates under each node at depth d) over known
    greedy replies: sequences[i][starts[i]] is the first reply token (the prefill's), each round drafts from
    the pending token, accepts the longest matching path and takes the next reply token after it. ->
    {"rounds", "tokens" (produced by rounds), "tokens_per_round", "nodes_per_round", "survival": S(1..depth),
    the probability that a round's first k drafted tokens are accepted (k = 1..depth; rounds whose reply ends
    before position k do not count at k), as the gamma controller estimates it from the engine's rounds}.

    lookup: a drafter without a model (`bench.ngram_headroom.ngram_lookup`), tokens so far -> proposed next
    tokens; where it proposes any, the round verifies those instead of drafting the tree
    ("lookup_rounds", "lookup_tokens"; the other counts, survival included, are the tree's rounds only)."""
    device = target.embed_tokens.weight.device
    deep = draft.feature_input == "deep"
    rounds = produced = lookup_rounds = lookup_tokens = 0
    reached, passed = [0] * len(branching), [0] * len(branching)  # per position k: rounds that got to it, accepted it
    nodes = sum(int(torch.tensor(branching[: d + 1]).prod()) for d in range(len(branching)))

    def best(scores: torch.Tensor, k: int) -> torch.Tensor:
        top = scores.topk(k, dim=-1).indices
        return top if draft.vocab_ids is None else draft.vocab_ids[top]

    for seq, start in zip(sequences, starts):
        tokens = torch.tensor([seq], device=device)
        _, feats, _, root_scores, root_out = teacher_forced(target, draft, tokens)  # the first drafted token, every position
        t = start
        while t < len(seq) - 1:
            proposed = lookup(seq[: t + 1]) if lookup is not None else []
            if proposed:  # verified as they are
                step = verified_step(proposed, seq, t)
                lookup_rounds += 1
                lookup_tokens += step
                t += step
                continue
            # Depth 1: the root's candidates. A level: paths (n, d) of drafted tokens, their proxies (n, d, H).
            paths = best(root_scores[0, t], branching[0])[:, None]
            proxies = draft.proxy_feature(root_out[0, t])[None, None].expand(len(paths), 1, -1)
            levels = [paths]
            for width in branching[1:]:
                n, d = paths.shape
                seq_in = torch.cat([tokens[:, : t + 1].expand(n, -1), paths], dim=1)  # (n, t + 1 + d)
                p = torch.arange(t + 1 + d, device=device)[None].expand(n, -1)
                tr = target(seq_in, p, layers=range(0, draft.shared_layers)).hidden
                f = torch.cat([feats[:, : t + 1].expand(n, -1, -1), proxies.to(feats.dtype)], dim=1) if deep else None
                scores, out = draft.forward_train(tr, f, p)
                children = best(scores[:, -1], width)  # (n, width)
                paths = torch.cat([paths.repeat_interleave(width, 0), children.reshape(-1, 1)], dim=1)
                proxies = torch.cat([proxies, draft.proxy_feature(out[:, -1])[:, None]], dim=1).repeat_interleave(width, 0)
                levels.append(paths)
            # The longest path matching the reply: at each depth, does any node continue the match?
            accepted = 0
            for d, level in enumerate(levels):
                if t + 1 + d >= len(seq):
                    break
                want = torch.tensor(seq[t + 1 : t + 2 + d], device=device)
                if not bool((level == want).all(-1).any()):
                    break
                accepted = d + 1
            for k in range(min(accepted + 1, len(branching))):
                if t + 1 + k < len(seq):
                    reached[k] += 1
                    passed[k] += k < accepted
            step = min(accepted + 1, len(seq) - 1 - t)
            rounds += 1
            produced += step
            t += step
    survival, alive = [], 1.0
    for r, a in zip(reached, passed):
        alive *= a / r if r else 0.0
        survival.append(round(alive, 4))
    out = {"rounds": rounds, "tokens": produced, "tokens_per_round": produced / max(rounds, 1),
           "nodes_per_round": nodes, "survival": survival}
    if lookup is not None:
        out.update(lookup_rounds=lookup_rounds, lookup_tokens=lookup_tokens)
    return out


def engine_chain_rounds(model, tokenizer, draft, prompts: list[list[int]], tokens: int, gamma: int,
                        width: int = 1) -> int:
    """How many greedy rounds the engine itself plays on these prompts: gamma-chains, or trees of `width`
    first tokens each continued as a chain (`engine.tree`; the static tree "width,1,...,1"). Its last round
    of a request may produce tokens past the limit, which it drops: compare rounds, not tokens a round."""
    from engine.generate import generate
    from engine.sampling import SamplingParams
    from engine.scheduler import DecodeEngine
    from engine.speculative import SpecConfig

    eng = DecodeEngine(model, tokenizer, max_batch_size=4, max_seq_len=max(map(len, prompts)) + tokens + gamma + 8,
                       spec=SpecConfig(gamma, gamma, tree_width=width, tree_max_batch=4))
    eng.add_draft("d", draft)
    outs = generate(eng, prompts, SamplingParams(max_new_tokens=tokens, eos_token_ids=()), "d")
    return sum(o.stats.rounds for o in outs)


def main(argv: list[str] | None = None) -> None:
    parser = replies_parser(__doc__.splitlines()[0], "greedy reply tokens per prompt")
    parser.add_argument("--ks", default="1,2,3,4,8")
    parser.add_argument("--trees", default="",
                        help="static trees to play whole rounds of, ';'-separated branching lists, e.g. '1,1,1,1,1;4,1,1,1,1'")
    args = parser.parse_args(argv)
    ks = tuple(sorted(int(k) for k in args.ks.split(",")))
    if not ks or ks[0] < 1:
        raise SystemExit(f"--ks {args.ks!r}: give positive integers, e.g. --ks 1,2,4")
    trees = [tuple(int(b) for b in tree.split(",")) for tree in filter(None, args.trees.split(";"))]
    if any(not tree or min(tree) < 1 for tree in trees):
        raise SystemExit(f"--trees {args.trees!r}: give branching lists of positive integers, e.g. '1,1,1,1,1;4,1,1,1,1'")
    loaded, draft, prompts, sequences = load_replies(args)
    got = top_k_coverage(loaded.model, draft, sequences, [len(p) for p in prompts], ks)
    print(json.dumps({"domain": args.domain, "drafts": args.drafts, "split": args.split, "prompts": len(prompts),
                      "reply_tokens": args.tokens, "first_position_top_k": {str(k): round(v, 4) for k, v in got.items()}}),
          flush=True)
    for tree in trees:
        sim = simulate_tree_rounds(loaded.model, draft, sequences, [len(p) for p in prompts], tree)
        row = {"tree": ",".join(map(str, tree)), **{k: round(v, 4) if isinstance(v, float) else v for k, v in sim.items()}}
        if all(b == 1 for b in tree[1:]) and tree[0] <= 16:  # a chain or the engine's tree: its own rounds beside it
            row["engine_rounds"] = engine_chain_rounds(loaded.model, loaded.tokenizer, draft, prompts, args.tokens,
                                                       len(tree), tree[0])
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

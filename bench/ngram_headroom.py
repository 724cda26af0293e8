"""What a drafter without a model could add: n-gram lookup in the request's own tokens, played over the
target's greedy replies, alone and beside the domain's draft.

    python -m bench.ngram_headroom --domain code --prompts 8 --tokens 192 --gamma 5
    python -m bench.ngram_headroom --domain dialog --shape request     # the plain held-out requests
    python -m bench.ngram_headroom --domain code --prompts 8 --tokens 256 --rules 5,8   # the rule's variants
    python -m bench.ngram_headroom --domain code --rules 5,8 --rules-max-n 3,6   # the longest n looked up
    python -m bench.ngram_headroom --domain code --prompts 8 --tokens 256 --streaks 8:15  # a streak's gamma
    python -m bench.ngram_headroom --domain code --rules 5,10 --candidates 1,2,3   # k proposals a round, verified

Prompt lookup (n-gram) drafting proposes, after the request's last n tokens, the tokens that followed the
most recent earlier occurrence of those n tokens in the prompt or the reply so far (n = max_n down to
min_n; nothing where none occurs). It needs no weights, and its round is one verify pass: on the H200 a
6-token verify pass costs about 1.08 decode steps, where a model draft's gamma-5 round costs about 2.3
(bench/RESULTS.md runs 24 and 31). Greedy verification keeps the target's own tokens whatever is proposed.

Three ways of playing the same greedy replies, each from the first reply token on (the prefill's):
* "draft": the domain's draft, gamma-chains, as `bench.tree_headroom` plays them (the engine's rounds);
* "lookup": a lookup round where the request's tokens propose anything, else a plain decoding step;
* "hybrid": a lookup round where they propose anything, else the draft's round.
Each row has its rounds and tokens a round, and a projected speed-up over plain decoding from the H200's
graph times (`--step-ms`, `--verify-ms`, `--draft-token-ms`): a projection, not a measurement; the host's
share and the lookup's own cost are not in it.

`--temperature T` samples the replies at T instead and gives, for every position where lookup proposes, a
lookup round's expected tokens there (`expected_lookup_tokens`), with the same kind of projection.

`--shape long` (the default) plays the GPU benchmark's long prompt shape, built from this split: the request
with the next rows' documents appended to 512 tokens (`bench.export_prompts.shaped_prompts`); `request`
plays the plain requests (`training.evaluate.held_out_prompts`).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch

from bench.draft_temperature import replies_parser, target_replies
from bench.tree_headroom import simulate_tree_rounds, verified_step
from engine.lookup import DEFAULT_MAX_N, continuation


def ngram_lookup(tokens: list[int], gamma: int, max_n: int = DEFAULT_MAX_N, min_n: int = 1, repeat: bool = True) -> list[int]:
    """The gamma tokens that followed the most recent earlier occurrence of the last n tokens (n = max_n down
    to min_n, the longest that occurs), repeated with their period where they reach the end of `tokens`
    (`repeat=False`: only those that followed, up to gamma); [] where none occurs."""
    found = ngram_candidates(tokens, gamma, 1, max_n, min_n, repeat)
    return found[0] if found else []


def ngram_match(tokens: list[int], gamma: int, max_n: int = DEFAULT_MAX_N, min_n: int = 1,
                repeat: bool = True) -> tuple[int, list[int]]:
    """(n, proposal): `ngram_lookup`'s proposal and the n of the match it follows (0 and [] where none occurs),
    `engine.lookup.propose(..., with_match=True)` on one row."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n:]
        for start in range(length - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return n, continuation(tokens, start + n, length, gamma, repeat)
    return 0, []


def ngram_candidates(tokens: list[int], gamma: int, k: int, max_n: int = DEFAULT_MAX_N, min_n: int = 1,
                     repeat: bool = True) -> list[list[int]]:
    """Up to k distinct proposals of gamma tokens (the rule of `ngram_lookup`, whose proposal is the first): what
    followed the earlier occurrences of the last n tokens, the longest n first and, for each n, the most recent
    occurrence first (never the suffix itself). A round verifying them all (a tree of k branches: 1 + k * gamma
    tokens a row) keeps the one the reply matches furthest."""
    length, found = len(tokens), []
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n:]
        for start in range(length - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                proposal = continuation(tokens, start + n, length, gamma, repeat)
                if proposal not in found:
                    found.append(proposal)
                    if len(found) == k:
                        return found
    return found


def candidate_rounds(sequences: list[list[int]], starts: list[int], gamma: int, k: int, max_n: int = DEFAULT_MAX_N) -> float:
    """Tokens a round where every round verifies `ngram_candidates`' k proposals and keeps the best (a round with
    none makes one token): `lookup_rounds` of the engine's rule at k = 1."""
    rounds = made = 0
    for seq, start in zip(sequences, starts):
        t = start
        while t < len(seq) - 1:
            step = max((verified_step(p, seq, t) for p in ngram_candidates(seq[: t + 1], gamma, k, max_n)), default=1)
            rounds += 1
            made += step
            t += step
    return made / max(rounds, 1)


def play_lookup(sequences: list[list[int]], starts: list[int], lookup: Callable[[list[int]], list[int]]) -> dict:
    """Lookup rounds where `lookup` proposes tokens, plain decoding steps elsewhere, over known greedy replies
    (sequences[i][starts[i]] the first reply token). -> {"lookup_rounds", "lookup_tokens", "plain_steps",
    "tokens"}."""
    rounds = made = steps = 0
    for seq, start in zip(sequences, starts):
        t = start
        while t < len(seq) - 1:
            proposed = lookup(seq[: t + 1])
            if not proposed:
                steps += 1
                t += 1
                continue
            step = verified_step(proposed, seq, t)
            rounds += 1
            made += step
            t += step
    return {"lookup_rounds": rounds, "lookup_tokens": made, "plain_steps": steps, "tokens": made + steps}


def lookup_rounds(sequences: list[list[int]], starts: list[int], lookup: Callable[[list[int]], list[int]]) -> float:
    """Tokens a round where every round is a lookup round, as a row on the lookup drafter runs in the engine: a
    round with nothing proposed makes one token (its verify pass paid for all the same)."""
    rounds = made = 0
    for seq, start in zip(sequences, starts):
        t = start
        while t < len(seq) - 1:
            proposed = lookup(seq[: t + 1])
            step = verified_step(proposed, seq, t) if proposed else 1
            rounds += 1
            made += step
            t += step
    return made / max(rounds, 1)


def streak_rounds(sequences: list[list[int]], starts: list[int], gamma: int, streak: int | None, lag: int = 2,
                  cost: float = 1.0, gamma_cost: float = 1.0) -> dict:
    """A lone lookup row's rounds over known greedy replies as the governor replays them (`LookupShadow`): each
    round proposes `gamma`, or `streak` where the round `lag` rounds before it accepted everything it proposed
    (`LookupDraft.streak_gammas`; None: never). A round at `streak` costs `cost`, one at `gamma` `gamma_cost` (in
    one unit of round cost: its verify pass's length). -> rounds, streak rounds, tokens a round and tokens per unit
    of round cost."""
    from engine.lookup import LookupShadow

    rounds = made = long = 0
    for seq, start in zip(sequences, starts):
        shadow = LookupShadow(seq[:start], gamma, streak_gamma=streak, lag=lag)
        for n in shadow.extend(seq[start:]):
            rounds, made = rounds + 1, made + n
        long += shadow.streak_rounds
    spent = (rounds - long) * gamma_cost + long * cost
    return {"rounds": rounds, "streak_rounds": long, "tokens_per_round": made / max(rounds, 1),
            "tokens_per_cost": made / max(spent, 1e-9)}


# --rules: the lookup rule's variants, (min_n, repeat); with --max-n 3 the first is the rule before run 38.
RULES = ((2, False), (1, False), (2, True), (1, True))


@torch.no_grad()
def expected_lookup_tokens(target, sequences: list[list[int]], starts: list[int],
                           lookup: Callable[[list[int]], list[int]], temperature: float, batch: int = 8) -> dict:
    """Over replies sampled at `temperature`: at every position t of a reply where `lookup` proposes tokens, the
    tokens a lookup round there makes in expectation: 1 + sum_k p_1 ... p_k, p_j the target's probability (at
    the temperature) of the j-th proposed token after the ones before it (rejection sampling keeps a proposed
    token with its target probability, a proposal being all its draft distribution's mass).
    -> {"positions", "proposed" (positions with a proposal), "expected_tokens" (their mean)}."""
    device = target.embed_tokens.weight.device
    jobs, positions = [], 0
    for seq, start in zip(sequences, starts):
        for t in range(start, len(seq) - 1):
            positions += 1
            proposal = lookup(seq[: t + 1])
            if proposal:
                jobs.append((seq[: t + 1], proposal))
    expected = []
    for i in range(0, len(jobs), batch):
        chunk = jobs[i:i + batch]
        width = max(len(c) + len(p) for c, p in chunk)
        tokens = torch.zeros(len(chunk), width, dtype=torch.long, device=device)  # right-padded: causal, unread
        for r, (c, p) in enumerate(chunk):
            tokens[r, :len(c) + len(p)] = torch.tensor(c + p, device=device)
        pos = torch.arange(width, device=device)[None].expand(len(chunk), -1)
        final = target(tokens, pos, compute_logits=False).final_hidden  # (b, width, H), normed
        for r, (c, p) in enumerate(chunk):
            rows = final[r, len(c) - 1:len(c) - 1 + len(p)]  # predict the proposed tokens
            probs = torch.softmax(target.lm_head(rows.to(target.lm_head.weight.dtype)).float() / temperature, dim=-1)
            kept = probs.gather(1, torch.tensor(p, device=device)[:, None])[:, 0]
            expected.append(1.0 + float(kept.cumprod(0).sum()))
    return {"positions": positions, "proposed": len(expected),
            "expected_tokens": sum(expected) / len(expected) if expected else 0.0}


def projected(tokens: int, step_ms: float, plain_steps: int = 0, lookup_rounds: int = 0, draft_rounds: int = 0,
              verify_ms: float = 0.0, round_ms: float = 0.0) -> float:
    """Plain decoding's time for `tokens` over the time of these steps and rounds."""
    spent = plain_steps * step_ms + lookup_rounds * verify_ms + draft_rounds * round_ms
    return tokens * step_ms / spent if spent else 0.0


def prompts_of(shape: str, domain: str, tokenizer, n: int, split: str) -> list[list[int]]:
    if shape == "request":
        from training.evaluate import held_out_prompts

        return held_out_prompts(domain, tokenizer, n, split)
    from bench.export_prompts import shaped_prompts
    from training.corpora import load_domain

    rows = load_domain(domain, split)
    longs, _ = shaped_prompts(tokenizer, list(rows.select(range(min(len(rows), 8 * n)))), n)
    return longs


def streak_pairs(text: str) -> tuple[tuple[int, int], ...]:
    """"8:15,5:12" -> ((8, 15), (5, 12)): a gamma and the longer one after a full round."""
    pairs = []
    for item in (t for t in text.split(",") if t):
        gamma, _, streak = item.partition(":")
        try:
            pair = (int(gamma), int(streak))
        except ValueError:
            pair = (0, 0)
        if not 1 <= pair[0] < pair[1]:
            raise argparse.ArgumentTypeError(f"{item!r}: give GAMMA:STREAK with 1 <= GAMMA < STREAK, e.g. 8:15")
        pairs.append(pair)
    return tuple(pairs)


def main(argv: list[str] | None = None) -> None:
    parser = replies_parser(__doc__.splitlines()[0], "greedy reply tokens per prompt")
    parser.add_argument("--gamma", type=int, default=5, help="tokens a round drafts or looks up")
    parser.add_argument("--max-n", type=int, default=DEFAULT_MAX_N,
                        help="the longest n-gram looked up (the engine's default, engine.lookup.DEFAULT_MAX_N)")
    parser.add_argument("--min-n", type=int, default=1)
    parser.add_argument("--shape", choices=("long", "request"), default="long")
    parser.add_argument("--rules", default=(), type=lambda v: tuple(int(g) for g in v.split(",") if g),
                        help="only the lookup rule's variants (n down to 2 or 1, with or without repeating a run's "
                             "period) at these gammas, e.g. 5,8: tokens a round where every round is a lookup round")
    parser.add_argument("--rules-max-n", default=(), type=lambda v: tuple(int(n) for n in v.split(",") if n),
                        help="with --rules: also the engine's rule (n down to 1, repeat) with the longest n at each of "
                             "these, on the same replies, e.g. 3,4,6,8")
    parser.add_argument("--candidates", default=(), type=lambda v: tuple(int(k) for k in v.split(",") if k),
                        help="with --rules: also rounds verifying K proposals (the K most recent distinct matches, the "
                             "longest n first; 1 + K x gamma tokens a row) and keeping the best, e.g. 2,3")
    parser.add_argument("--streaks", default=(), type=streak_pairs,
                        help="only a lone lookup row's rounds at GAMMA and at STREAK after a round that accepted "
                             "everything (LookupDraft.streak_gammas), e.g. 8:15, beside each gamma throughout")
    parser.add_argument("--streak-lag", type=int, default=2,
                        help="--streaks: the rounds between a round and the one whose outcome sets its gamma (2: an "
                             "overlapped engine, 1: one reading each round first)")
    parser.add_argument("--streak-cost", type=float, default=1.075,
                        help="--streaks: a round of the longer gamma's cost in rounds of GAMMA (H200 run 39: 15 "
                             "against 8, 0.974 / 0.906 ms a step)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="above 0: replies sampled at it, and a lookup round's expected tokens at every position "
                             "where lookup proposes (no draft rows)")
    parser.add_argument("--step-ms", type=float, default=0.732, help="a decode step's graph (H200, run 31)")
    parser.add_argument("--verify-ms", type=float, default=0.79,
                        help="a verify pass of gamma + 1 tokens (H200: 1.08 steps, run 24)")
    parser.add_argument("--draft-token-ms", type=float, default=0.174,
                        help="a drafted token of the shipped drafts (H200 run 31: a gamma-5 round 1.661 ms less the verify pass, / 5)")
    args = parser.parse_args(argv)
    if any(k < 1 for k in args.candidates) or (args.candidates and not args.rules):
        raise SystemExit(f"--candidates {','.join(map(str, args.candidates))}: give K >= 1 with --rules, e.g. "
                         "--rules 5,10 --candidates 1,2")
    if any(n < 1 for n in args.rules_max_n):
        raise SystemExit(f"--rules-max-n {','.join(map(str, args.rules_max_n))}: give n >= 1, e.g. 3,6")
    if args.gamma < 1 or not 1 <= args.min_n <= args.max_n:
        raise SystemExit(f"--gamma {args.gamma} --min-n {args.min_n} --max-n {args.max_n}: give gamma >= 1 and "
                         "1 <= min-n <= max-n, e.g. --gamma 5 --min-n 1 --max-n 3")
    from bench.gpu import load_drafts
    from engine.loading import load_model

    loaded = load_model("default", device=args.device)
    drafts = load_drafts(args.drafts, loaded.model)
    if args.domain not in drafts:
        raise SystemExit(f"no {args.domain} draft under {args.drafts}: give --drafts a folder with {args.domain}/")
    prompts = prompts_of(args.shape, args.domain, loaded.tokenizer, args.prompts, args.split)
    sequences = target_replies(loaded.model, loaded.tokenizer, prompts, args.tokens, args.temperature or None)
    starts = [len(p) for p in prompts]

    def lookup(tokens: list[int]) -> list[int]:
        return ngram_lookup(tokens, args.gamma, args.max_n, args.min_n)

    head = {"domain": args.domain, "shape": args.shape, "split": args.split, "prompts": len(prompts),
            "reply_tokens": args.tokens, "gamma": args.gamma, "n": [args.min_n, args.max_n]}
    # Every variant at --max-n, then the engine's rule (the last variant) at each other --rules-max-n.
    rules = [(args.max_n, *rule) for rule in RULES] + [(n, *RULES[-1]) for n in args.rules_max_n if n != args.max_n]
    for gamma in args.rules:
        for max_n, min_n, repeat in rules:
            rate = lookup_rounds(sequences, starts, lambda toks: ngram_lookup(toks, gamma, max_n, min_n, repeat))
            name = f"n {max_n}..{min_n}" + (", repeat" if repeat else "")
            print(json.dumps({**head, "gamma": gamma, "n": [min_n, max_n], "rule": name,
                              "tokens_per_round": round(rate, 3)}), flush=True)
        for k in args.candidates:  # k proposals verified side by side against one chain as long
            rate = candidate_rounds(sequences, starts, gamma, k, args.max_n)
            print(json.dumps({**head, "gamma": gamma, "candidates": k, "verify_tokens_a_row": 1 + k * gamma,
                              "tokens_per_round": round(rate, 3)}), flush=True)
    if args.rules:
        return
    for gamma, streak in args.streaks:
        plays = {f"gamma {gamma}": streak_rounds(sequences, starts, gamma, None),
                 f"gamma {streak}": streak_rounds(sequences, starts, streak, None, gamma_cost=args.streak_cost),
                 f"gamma {gamma}, {streak} after a full round": streak_rounds(
                     sequences, starts, gamma, streak, args.streak_lag, args.streak_cost)}
        for name, got in plays.items():
            print(json.dumps({**head, "play": name, "lag": args.streak_lag, "streak_cost": args.streak_cost,
                              **{k: round(v, 3) if isinstance(v, float) else v for k, v in got.items()}}), flush=True)
    if args.streaks:
        return
    if args.temperature > 0:
        got = expected_lookup_tokens(loaded.model, sequences, starts, lookup, args.temperature)
        share = got["proposed"] / max(got["positions"], 1)
        # Every position as a round's start: a lookup round where it proposes, else a plain step.
        rate = (share * got["expected_tokens"] + 1 - share) / (share * args.verify_ms / args.step_ms + 1 - share)
        print(json.dumps({**head, "temperature": args.temperature, "play": "lookup, expected", **got,
                          "expected_tokens": round(got["expected_tokens"], 3), "projected": round(rate, 3)}), flush=True)
        return

    chain = (1,) * args.gamma
    round_ms = args.verify_ms + args.gamma * args.draft_token_ms
    with torch.no_grad():
        draft = simulate_tree_rounds(loaded.model, drafts[args.domain], sequences, starts, chain)
        hybrid = simulate_tree_rounds(loaded.model, drafts[args.domain], sequences, starts, chain, lookup=lookup)
    alone = play_lookup(sequences, starts, lookup)
    tokens = alone["tokens"]
    rows = {
        "draft": {"rounds": draft["rounds"], "tokens_per_round": draft["tokens_per_round"],
                  "projected": projected(tokens, args.step_ms, draft_rounds=draft["rounds"], round_ms=round_ms)},
        "lookup": {"lookup_rounds": alone["lookup_rounds"], "plain_steps": alone["plain_steps"],
                   "tokens_per_lookup_round": alone["lookup_tokens"] / max(alone["lookup_rounds"], 1),
                   "tokens_in_lookup_rounds": alone["lookup_tokens"] / max(tokens, 1),
                   "projected": projected(tokens, args.step_ms, plain_steps=alone["plain_steps"],
                                          lookup_rounds=alone["lookup_rounds"], verify_ms=args.verify_ms)},
        "hybrid": {"lookup_rounds": hybrid["lookup_rounds"], "draft_rounds": hybrid["rounds"],
                   "tokens_per_lookup_round": hybrid["lookup_tokens"] / max(hybrid["lookup_rounds"], 1),
                   "tokens_per_draft_round": hybrid["tokens_per_round"],
                   "projected": projected(tokens, args.step_ms, lookup_rounds=hybrid["lookup_rounds"],
                                          draft_rounds=hybrid["rounds"], verify_ms=args.verify_ms, round_ms=round_ms)},
    }
    for name, row in rows.items():
        print(json.dumps({**head, "play": name, **{k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}}),
              flush=True)


if __name__ == "__main__":
    main()

"""The governor's per-request rules for a lone greedy request on n-gram lookup, replayed over the target's replies:
when it drops to plain decoding (`SpeculationGovernor.request_pays`, the per-request rule over its last
REQUEST_WINDOW rounds) and when it goes back (`returns_to` over its last `return_window` replayed rounds).

    python -m bench.lookup_policy --domain code --split validation --prompts 8 --tokens 256 --windows 32,16,8,4
    python -m bench.lookup_policy --domain dialog --shape request     # the plain held-out requests
    python -m bench.lookup_policy --domain code --tokens-alphas 0.01,0.001   # which drafter requests start on
    python -m bench.lookup_policy --batch 8 --policies "5;4;6;8:5,4:8,2:8;5/8@0.5;allot"   # a batch's lookup gamma
    python -m bench.lookup_policy --allot-table --split train --prompts 16   # engine.lookup.ALLOT_TABLE

Each reply is played as the engine plays a lone request with lookup as its drafter: lookup rounds (the `propose`
rule at `--gamma`, a round making its accepted tokens and one more) until the per-request rule drops it, then plain
decoding in calls of 4 tokens with the rounds replayed over them (`engine.lookup.LookupShadow`, as
`DecodeEngine._watch_lookup` keeps it) until `returns_to` takes it back. The governor is the real one
(`engine.governor.SpeculationGovernor`), its costs seeded with `--round-ms` (a lookup round at batch 1) and
`--plain-ms` (a plain token at batch 1), 300 samples each with 3 % noise: the H200's figures by default (run 38's
governor snapshot). Times are those costs summed, a projection and not a measurement (no host time, no prefill);
the rows compare rules over the same replies. Prompts come from our own splits, never the GPU benchmark's test
prompts (`--split test` is refused).

`--batch N` plays instead the three domains' replies (prompts taken in turn) as a closed batch of N rows, every row
on lookup: each step one round of every running row at the gamma a policy gives (`batch_play`), a finished row's
place taken by the next request. Policies: `G` (every batch size but 1 at G, a lone row at LookupDraft's 8), a table
`8:5,4:8,2:8` (by batch-size bucket; the rest as LookupDraft), or `LO/HI@SHARE` (HI where at least SHARE of the
rows' rounds two rounds back, as an overlapped engine knows them, kept everything they proposed; else LO), or
`allot` / `allot:G` (each row its own gamma up to G by its match's n, within the verify tokens of gamma 5's rounds:
`engine.lookup.allot`). A step
costs `--step-ms` plus `--row-ms` a verified token row of its bucket (the H200's 8-row plain step, 0.82 ms, run 31,
and 48-row lookup round, 1.08 ms, run 33, on a line); plain decoding is played the same way at one token a row. A
projection: no prefill, no host."""

from __future__ import annotations

import argparse
import json
import random

PLAIN_CALL = 4  # tokens a plain call makes (DecodeEngine.ar_steps_per_sync)


def seeded_governor(round_s: float, plain_s: float, return_window: int, seed: int = 0):
    """A governor whose lookup pool (batch 1) and plain decoding (batch 1) costs are known, as after a warm-up."""
    from engine.governor import SpeculationGovernor
    from engine.lookup import LOOKUP_POOL

    rnd = random.Random(seed)
    gov = SpeculationGovernor(return_window=return_window)
    for _ in range(300):
        gov.observe_ar(1, PLAIN_CALL * plain_s * (1 + 0.03 * rnd.gauss(0, 1)), PLAIN_CALL)
        gov.observe_pool(LOOKUP_POOL, 1, round_s * (1 + 0.03 * rnd.gauss(0, 1)), 1)
    gov.observe_tokens("replayed/lookup", LOOKUP_POOL, [1])  # the name a request is judged under: priced by the pool
    return gov


def play(prompt: list[int], reply: list[int], gov, gamma: int, round_s: float, plain_s: float,
         drop: bool = True) -> dict:
    """One lone request's reply (its first token the prefill's) under the governor's rules -> {"seconds", "drops",
    "returns", "lookup_tokens"}; `drop=False`: lookup throughout."""
    from bench.tree_headroom import verified_step
    from engine.lookup import LOOKUP_POOL, LookupShadow

    shadow, whole = LookupShadow(prompt, gamma), prompt + reply
    shadow.extend(reply[:1])
    pos, seconds, on_lookup, recent, drops, returns, looked = 1, 0.0, True, [], 0, 0, 0
    while pos < len(reply):
        if on_lookup:  # a live round from here: the rule's proposal over the tokens so far, verified
            made = verified_step(shadow.propose(len(prompt) + pos), whole, len(prompt) + pos - 1)
            shadow.extend(reply[pos:pos + made])
            pos, seconds, looked = pos + made, seconds + round_s, looked + made
            recent.append(made)
            if drop and len(recent) >= gov.min_samples and gov.request_pays("replayed/lookup", recent) is False:
                on_lookup, drops = False, drops + 1
        else:
            made = min(PLAIN_CALL, len(reply) - pos)
            shadow.extend(reply[pos:pos + made])
            pos, seconds = pos + made, seconds + made * plain_s
            if gov.returns_to(LOOKUP_POOL, shadow.recent):
                on_lookup, recent, returns = True, [], returns + 1
    return {"seconds": seconds, "drops": drops, "returns": returns, "lookup_tokens": looked}


def compare(sequences: list[tuple[list[int], list[int]]], windows: tuple[int, ...], gamma: int, round_s: float,
            plain_s: float) -> dict:
    """Rules side by side over (prompt, reply) pairs -> {rule: {"speedup" over plain decoding, "drops",
    "returns"}}: lookup throughout, then the governor's rules at each return window."""
    plain = sum(len(reply) for _, reply in sequences) * plain_s
    rules = {"lookup throughout": (None, False)} | {f"return window {w}": (w, True) for w in windows}
    out = {}
    for name, (window, drop) in rules.items():
        total, drops, returns = 0.0, 0, 0
        for prompt, reply in sequences:
            gov = seeded_governor(round_s, plain_s, window or max(windows))
            got = play(prompt, reply, gov, gamma, round_s, plain_s, drop)
            total, drops, returns = total + got["seconds"], drops + got["drops"], returns + got["returns"]
        out[name] = {"speedup": round(plain / total, 3), "drops": drops, "returns": returns}
    return out


def lookup_rounds(prompt: list[int], reply: list[int], gamma: int) -> list[int]:
    """Tokens each lookup round would make over a reply, replayed as the governor gets them (`LookupShadow.extend`,
    `SpeculationGovernor.observe_tokens`); a last round the reply ends inside is not counted."""
    from engine.lookup import LookupShadow

    return LookupShadow(prompt, gamma).extend(reply)


def admissions(sequences: list[tuple[list[int], list[int]]], alphas: tuple[float, ...], gamma: int, round_s: float,
               draft_s: float, passes: int = 4) -> dict:
    """Which drafter a domain's requests start on (`SpeculationGovernor.choose` at batch 1): lookup priced as the pool's
    round over the domain's replayed tokens a round (`observe_tokens`, a moving average of weight `alpha` a round),
    against the draft's `draft_s` a token. The requests run `passes` times in turn (a warm-up pass first, not
    counted), each replayed after its admission. -> {alpha: {"draft_starts", "against_own_reply", "admissions"}}:
    a choice is against its own reply where that reply's lookup, replayed whole, is priced on the other side of the
    draft (what the request would have been better started on, moves aside)."""
    from engine.governor import _Rate

    replays = [lookup_rounds(prompt, reply, gamma) for prompt, reply in sequences]
    out = {}
    for alpha in alphas:
        rate, starts, wrong, counted = _Rate(), 0, 0, 0
        for n in range(passes):
            for rounds in replays:
                if n:
                    on_draft = round_s / rate.value > draft_s
                    starts, counted = starts + on_draft, counted + 1
                    wrong += on_draft != (round_s * len(rounds) / sum(rounds) > draft_s)
                for t in rounds:
                    rate.update(t, 1, alpha)
        out[alpha] = {"draft_starts": starts, "against_own_reply": wrong, "admissions": counted}
    return out


def allot_table(sequences: list[tuple[list[int], list[int]]], max_gamma: int = 15, max_n: int | None = None) -> dict:
    """How likely a greedy lookup row accepts at least d of its proposal, by the n its match has (`engine.lookup.allot`'s
    table): at every reply position with max_gamma + 1 tokens of reply after it, the proposal of max_gamma tokens
    and the tokens of it the reply matches -> {"rows": [[P(>= 1), ..., P(>= max_gamma)] for n = 0 .. max_n],
    "positions": [count by n]}."""
    from bench.ngram_headroom import ngram_match
    from bench.tree_headroom import verified_step
    from engine.lookup import DEFAULT_MAX_N

    max_n = DEFAULT_MAX_N if max_n is None else max_n
    count, kept = [0] * (max_n + 1), [[0] * max_gamma for _ in range(max_n + 1)]
    for prompt, reply in sequences:
        seq = prompt + reply
        for t in range(len(prompt), len(seq) - max_gamma - 1):
            n, proposal = ngram_match(seq[: t + 1], max_gamma, max_n)
            accepted = verified_step(proposal, seq, t) - 1 if proposal else 0
            count[n] += 1
            for d in range(accepted):
                kept[n][d] += 1
    return {"rows": [[round(k / max(c, 1), 3) for k in row] for row, c in zip(kept, count)], "positions": count}


class Allotted:
    """`batch_play`'s policy "allot" (or "allot:G"): each row its own gamma, up to G (default
    `engine.lookup.ALLOT_MAX_GAMMA`), from its match's n within the bucket x (gamma + 1) verify tokens a round of
    `gamma` takes (`engine.lookup.allot`, the engine's table), the bucket's padding rows counted as rows without a
    match, as the engine's padded graph runs them."""

    def __init__(self, gamma: int, max_gamma: int) -> None:
        self.gamma, self.max_gamma = gamma, max_gamma

    def gammas(self, bucket: int, matched: list[int]) -> list[int]:
        import torch

        from engine.lookup import allot

        padded = torch.tensor(matched + [0] * (bucket - len(matched)))
        return allot(padded, bucket * (self.gamma + 1), self.max_gamma)[: len(matched)].tolist()


def gamma_policy(spec: str):
    """`batch_play`'s policy from its text (module docstring) -> f(bucket, the rows' known rounds) -> gamma, or an
    `Allotted` policy ("allot", "allot:G")."""
    from engine.lookup import ALLOT_MAX_GAMMA, MAX_GAMMA, LookupDraft

    if spec == "allot" or spec.startswith("allot:"):
        try:
            top = int(spec.partition(":")[2] or ALLOT_MAX_GAMMA)
        except ValueError:
            raise SystemExit(f"policy {spec!r}: give allot or allot:G, e.g. allot:8")
        if not 1 <= top <= MAX_GAMMA:
            raise SystemExit(f"policy {spec!r}: gammas 1..{MAX_GAMMA}")
        return Allotted(5, top)

    lone = LookupDraft()  # a lone row's gamma (8), as the engine's default
    table, lo, hi, share = None, 0, 0, 1.0
    try:
        if ":" in spec:
            table = {int(b): int(g) for b, g in (item.split(":") for item in spec.split(","))}
        elif "/" in spec:
            pair, _, at = spec.partition("@")
            (lo, hi), share = (int(g) for g in pair.split("/")), float(at)
        else:
            lo = hi = int(spec)
    except ValueError:
        raise SystemExit(f"policy {spec!r}: give G, a table BUCKET:G,... or LO/HI@SHARE, e.g. 5, 8:5,4:8 or 5/8@0.5")
    if not all(1 <= g <= MAX_GAMMA for g in (table.values() if table else (lo, hi))):
        raise SystemExit(f"policy {spec!r}: gammas 1..{MAX_GAMMA}")

    def policy(bucket: int, known: list) -> int:
        if table is not None:
            return table.get(bucket, lone.gamma_at(bucket, 5))
        if bucket == 1:
            return lone.gamma_at(1, 5)
        rounds = [k for k in known if k is not None]
        full = sum(1 for accepted, proposed in rounds if proposed and accepted == proposed)
        return hi if rounds and full >= share * len(rounds) else lo

    return policy


def batch_play(sequences: list[tuple[list[int], list[int]]], batch: int, policy, step_ms: float, row_ms: float,
               lag: int = 2, host_ms: float = 0.0) -> dict:
    """A closed batch of `batch` rows over (prompt, reply) pairs taken in order, every row on lookup (`policy`: None
    for plain decoding), each step one round of every running row at the policy's gamma for the step's batch-size
    bucket and the rows' rounds `lag` rounds back -> {"steps" by bucket, "fill" (running rows over batch x steps),
    "tokens_per_row_round", "ms", "chain_stops"}; a step costs step_ms + row_ms x bucket x (gamma + 1). An `Allotted`
    policy gives each row its own gamma within the same verify tokens as its gamma's rounds. `chain_stops`: the share
    of steps after which an overlapped engine could not chain the next round (`DecodeEngine._may_overlap_round`)
    because a row wants fewer tokens than both rounds could make ("both rounds", the rule of draft rounds) or than
    the step's round could ("this round", lookup rounds' rule), a row's largest round being its gamma + 1 (an
    allotted round's: its policy's largest gamma + 1). `host_ms`: what a step after which the engine's rule stops
    the chain costs more (the host's work between rounds, which a chained round hides) -> "ms_with_host"."""
    from bench.ngram_headroom import ngram_lookup, ngram_match
    from bench.tree_headroom import verified_step
    from engine.governor import batch_bucket
    from engine.lookup import LookupDraft

    queue, rows, steps, ms, row_rounds, made = list(range(len(sequences))), {}, {}, 0.0, 0, 0
    stops = [0, 0]  # steps the next round could not chain after: both rounds' rule, this round's
    whole = [prompt + reply for prompt, reply in sequences]
    while queue or rows:
        while queue and len(rows) < batch:
            i = queue.pop(0)
            rows[i] = (len(sequences[i][0]), [None] * lag)  # the prefill made the first reply token
        bucket = batch_bucket(len(rows))
        proposals = {}
        if isinstance(policy, Allotted) and bucket > 1:  # a lone row keeps its own gamma, as the engine runs it
            gamma = policy.gamma
            matches = {i: ngram_match(whole[i][: t + 1], policy.max_gamma) for i, (t, _) in rows.items()}
            for i, g in zip(matches, policy.gammas(bucket, [n for n, _ in matches.values()])):
                proposals[i] = matches[i][1][:g]
        elif isinstance(policy, Allotted):
            gamma = LookupDraft().gamma_at(1, policy.gamma)
        else:
            gamma = 0 if policy is None else policy(bucket, [known[0] for _, known in rows.values()])
        steps[bucket] = steps.get(bucket, 0) + 1
        ms += step_ms + row_ms * bucket * (gamma + 1)
        largest = (policy.max_gamma if isinstance(policy, Allotted) and bucket > 1 else gamma) + 1
        least = min(len(whole[i]) - 1 - t for i, (t, _) in rows.items())  # the fewest tokens a row still wants
        stops[0] += least < 2 * largest
        stops[1] += least < largest + 1
        for i, (t, known) in list(rows.items()):
            seq = whole[i]
            proposal = proposals[i] if i in proposals else ngram_lookup(seq[: t + 1], gamma) if gamma else []
            step = verified_step(proposal, seq, t) if proposal else 1
            row_rounds, made = row_rounds + 1, made + step
            if t + step >= len(seq) - 1:
                del rows[i]
            else:
                rows[i] = (t + step, known[1:] + [(step - 1, len(proposal))])
    total = sum(steps.values())
    return {"steps": dict(sorted(steps.items())), "fill": round(row_rounds / max(batch * total, 1), 3),
            "tokens_per_row_round": round(made / max(row_rounds, 1), 3), "ms": round(ms, 1),
            "chain_stops": {"both rounds": round(stops[0] / max(total, 1), 3),
                            "this round": round(stops[1] / max(total, 1), 3)},
            "ms_with_host": round(ms + host_ms * (stops[1] if policy is not None else stops[0]), 1)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--domain", default="code")
    parser.add_argument("--split", default="validation", choices=("train", "validation"),
                        help="our own splits only: the benchmark's test prompts judge, they do not tune")
    parser.add_argument("--shape", choices=("long", "request"), default="long")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--gamma", type=int, default=8, help="a lone lookup row's gamma (LookupDraft's default)")
    parser.add_argument("--windows", default="32,16,8,4", type=lambda v: tuple(int(w) for w in v.split(",") if w))
    parser.add_argument("--round-ms", type=float, default=0.872, help="a lookup round at batch 1 (H200, run 38)")
    parser.add_argument("--plain-ms", type=float, default=0.722, help="a plain token at batch 1 (H200, run 38)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens-alphas", default=None, type=lambda v: tuple(float(a) for a in v.split(",") if a),
                        help="instead of the windows: which drafter the domain's requests start on with the governor's "
                             "tokens_alpha at each of these (`admissions`), e.g. 0.01,0.001")
    parser.add_argument("--draft-ms", type=float, default=None,
                        help="with --tokens-alphas: the domain's draft a token at batch 1 (default: the H200's, run 40's "
                             "governor snapshot: code 0.45, general 0.62, dialog 0.64)")
    parser.add_argument("--batch", type=int, default=None,
                        help="instead: the three domains' replies as a closed batch of this many lookup rows, under "
                             "each of --policies (`batch_play`)")
    parser.add_argument("--policies", default="5;4;6", help="--batch: gamma policies separated by ';' (docstring)")
    parser.add_argument("--step-ms", type=float, default=0.768, help="--batch: a step's cost at no token rows")
    parser.add_argument("--row-ms", type=float, default=0.0065, help="--batch: a verified token row's cost")
    parser.add_argument("--host-ms", type=float, default=0.48,
                        help="--batch: what a step costs more where the engine cannot chain the next round (the host "
                             "between rounds: a bs 1 lookup round sequentially, H200 run 33)")
    parser.add_argument("--allot-table", action="store_true",
                        help="instead: the three domains' replies' chances that a lookup row keeps at least d of its "
                             "proposed tokens, by its match's n (`allot_table`, engine.lookup.ALLOT_TABLE's source)")
    args = parser.parse_args(argv)
    if args.batch is not None and args.batch < 1:
        raise SystemExit(f"--batch {args.batch}: give the rows of the batch, e.g. 8")
    policies = [(spec, gamma_policy(spec)) for spec in args.policies.split(";") if spec] if args.batch else []

    import torch

    from bench.draft_temperature import target_replies
    from bench.ngram_headroom import prompts_of
    from engine.loading import load_model

    torch.set_num_threads(args.threads)
    loaded = load_model("default", device="cpu", dtype="float32")
    if args.batch or args.allot_table:
        domains = ("code", "general", "dialog")
        per = {d: prompts_of(args.shape, d, loaded.tokenizer, args.prompts, args.split) for d in domains}
        prompts = [per[d][i] for i in range(args.prompts) for d in domains if i < len(per[d])]
        whole = target_replies(loaded.model, loaded.tokenizer, prompts, args.tokens)
        sequences = [(p, w[len(p):]) for p, w in zip(prompts, whole)]
        if args.allot_table:
            print(json.dumps({"split": args.split, "shape": args.shape, "requests": len(sequences),
                              "reply_tokens": args.tokens, **allot_table(sequences)}), flush=True)
            return
        plain = batch_play(sequences, args.batch, None, args.step_ms, args.row_ms, host_ms=args.host_ms)
        head = {"batch": args.batch, "split": args.split, "shape": args.shape, "requests": len(sequences),
                "reply_tokens": args.tokens, "step_ms": args.step_ms, "row_ms": args.row_ms, "host_ms": args.host_ms}
        print(json.dumps({**head, "policy": "plain decoding", **plain}), flush=True)
        for spec, policy in policies:
            got = batch_play(sequences, args.batch, policy, args.step_ms, args.row_ms, host_ms=args.host_ms)
            print(json.dumps({**head, "policy": spec, **got, "projected": round(plain["ms"] / got["ms"], 3),
                              "projected_with_host": round(plain["ms_with_host"] / got["ms_with_host"], 3)}),
                  flush=True)
        return
    prompts = prompts_of(args.shape, args.domain, loaded.tokenizer, args.prompts, args.split)
    whole = target_replies(loaded.model, loaded.tokenizer, prompts, args.tokens)
    sequences = [(p, w[len(p):]) for p, w in zip(prompts, whole)]
    if args.tokens_alphas:
        draft_ms = args.draft_ms or {"code": 0.45, "general": 0.62, "dialog": 0.64}[args.domain]
        starts = admissions(sequences, args.tokens_alphas, args.gamma, args.round_ms * 1e-3, draft_ms * 1e-3)
        print(json.dumps({"domain": args.domain, "split": args.split, "shape": args.shape, "prompts": len(prompts),
                          "reply_tokens": args.tokens, "gamma": args.gamma, "draft_ms": draft_ms,
                          "admissions": starts}), flush=True)
        return
    rules = compare(sequences, args.windows, args.gamma, args.round_ms * 1e-3, args.plain_ms * 1e-3)
    print(json.dumps({"domain": args.domain, "split": args.split, "shape": args.shape, "prompts": len(prompts),
                      "reply_tokens": args.tokens, "gamma": args.gamma, "rules": rules}), flush=True)


if __name__ == "__main__":
    main()

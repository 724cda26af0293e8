"""The governor's per-request rules for a lone greedy request on n-gram lookup, replayed over the target's replies:
when it drops to plain decoding (`SpeculationGovernor.request_pays`, the per-request rule over its last
REQUEST_WINDOW rounds) and when it goes back (`returns_to` over its last `return_window` replayed rounds).

    python -m bench.lookup_policy --domain code --split validation --prompts 8 --tokens 256 --windows 32,16,8,4
    python -m bench.lookup_policy --domain dialog --shape request     # the plain held-out requests
    python -m bench.lookup_policy --domain code --tokens-alphas 0.01,0.001   # which drafter requests start on

Each reply is played as the engine plays a lone request with lookup as its drafter: lookup rounds (the `propose`
rule at `--gamma`, a round making its accepted tokens and one more) until the per-request rule drops it, then plain
decoding in calls of 4 tokens with the rounds replayed over them (`engine.lookup.LookupShadow`, as
`DecodeEngine._watch_lookup` keeps it) until `returns_to` takes it back. The governor is the real one
(`engine.governor.SpeculationGovernor`), its costs seeded with `--round-ms` (a lookup round at batch 1) and
`--plain-ms` (a plain token at batch 1), 300 samples each with 3 % noise: the H200's figures by default (run 38's
governor snapshot). Times are those costs summed, a projection and not a measurement (no host time, no prefill);
the rows compare rules over the same replies. Prompts come from our own splits, never the GPU benchmark's test
prompts (`--split test` is refused)."""

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
    args = parser.parse_args(argv)

    import torch

    from bench.draft_temperature import target_replies
    from bench.ngram_headroom import prompts_of
    from engine.loading import load_model

    torch.set_num_threads(args.threads)
    loaded = load_model("default", device="cpu", dtype="float32")
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

"""The draft's sampling temperature at T=1, by expected acceptance rather than by sampled runs.

    python -m bench.draft_temperature --domain code --prompts 16 --tokens 64 --taus 0.6,0.7,0.8,0.9,1.0,1.1

A drafted token drawn from q is accepted with probability sum_x min(p(x), q(x)) = 1 - TV(p, q), p the
target's distribution. So the first draft position's acceptance can be computed exactly, position by
position, instead of estimated from a few hundred sampled rounds (where which text gets sampled moves
the figure more than the setting does). This script samples the target's own replies at T=1 to
held-out prompts (the text a T=1 request decodes through), then runs the target and the draft teacher-
forced over prompt + reply (the draft's first step: true features, as in the round's first drafted
token) and reports, for each draft temperature tau, the mean of sum_x min(p, q_tau) over the reply
positions, q_tau = softmax(draft scores / tau) over the draft's vocabulary. Verification is lossless at
every tau (it uses the distribution the draft drew from); tau only moves acceptance. It also reports the
target's mean probability mass on the draft's sub-vocabulary at those positions: the ceiling of that
acceptance at any tau (a draft never proposes a token outside it).
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F


def expected_acceptance(target, draft, sequences: list[list[int]], starts: list[int],
                        taus: tuple[float, ...], temperature: float = 1.0) -> dict[float, float]:
    """{tau: mean over positions t >= start (the reply's) of sum_x min(p_t(x), q_tau,t(x))}: p the target's
    next-token distribution at `temperature` over the whole vocabulary, q the draft's first-step
    distribution (true features) at tau, zero outside its sub-vocabulary."""
    return first_position_stats(target, draft, sequences, starts, taus, temperature)[0]


@torch.no_grad()
def teacher_forced(target, draft, tokens: torch.Tensor):
    """The draft's first drafted step at every position of `tokens` (1, T), with the target's true features
    (as in a round's first step): -> (trunk (1, T, H), features (1, T, H) or None, positions (1, T), scores
    (1, T, K or V), adapter outputs (1, T, H))."""
    from training.distill import _shift, target_states

    trunk, final, captured = target_states(target, tokens, draft.shared_layers, draft.feature_layers)
    feats = _shift(draft.target_features(final, captured)) if draft.feature_input == "deep" else None
    pos = torch.arange(tokens.shape[1], device=tokens.device)[None]
    scores, out = draft.forward_train(trunk, feats, pos)
    return trunk, feats, pos, scores, out


def target_replies(model, tokenizer, prompts: list[list[int]], tokens: int,
                   temperature: float | None = None) -> list[list[int]]:
    """prompt + the target's own reply of `tokens` tokens, per prompt: greedy (temperature None) or sampled
    at `temperature` with seed i for prompt i."""
    from engine.generate import generate
    from engine.sampling import SamplingParams
    from engine.scheduler import DecodeEngine

    eng = DecodeEngine(model, tokenizer, max_batch_size=4, max_seq_len=max(map(len, prompts)) + tokens + 8)
    if temperature is None:
        params = SamplingParams(max_new_tokens=tokens, eos_token_ids=())
    else:
        params = [SamplingParams(max_new_tokens=tokens, temperature=temperature, seed=i, eos_token_ids=())
                  for i in range(len(prompts))]
    return [p + r.token_ids for p, r in zip(prompts, generate(eng, prompts, params))]


@torch.no_grad()
def first_position_stats(target, draft, sequences: list[list[int]], starts: list[int], taus: tuple[float, ...],
                         temperature: float = 1.0) -> tuple[dict[float, float], float]:
    """(`expected_acceptance`, the mean target mass p_t(V) on the draft's vocabulary V): the second bounds
    the first at every tau, since a draft can only propose tokens of V (1 for a full-vocabulary head)."""
    totals = {tau: 0.0 for tau in taus}
    count, mass = 0, 0.0
    device = target.embed_tokens.weight.device
    for seq, start in zip(sequences, starts):
        tokens = torch.tensor([seq], device=device)
        _, _, pos, scores, _ = teacher_forced(target, draft, tokens)
        p = F.softmax(target(tokens, pos).logits[0, start - 1:-1].float() / temperature, dim=-1)  # predicts seq[start:]
        scores = scores[0, start - 1:-1].float()  # (n, K)
        p_sub = p if draft.vocab_ids is None else p[:, draft.vocab_ids]
        for tau in taus:
            q_sub = F.softmax(scores / tau, dim=-1)
            totals[tau] += torch.minimum(p_sub, q_sub).sum().item()
        mass += p_sub.sum().item()
        count += p.shape[0]
    return {tau: totals[tau] / max(count, 1) for tau in taus}, mass / max(count, 1)


def replies_parser(description: str, tokens_help: str) -> argparse.ArgumentParser:
    """The options of the first-position tools (this one, `bench.tree_headroom`): a domain's draft, its held-out
    prompts, the target's replies to them, the device."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--domain", default="code")
    parser.add_argument("--drafts", default="drafts/demo", help="folder with <domain>/ drafts")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64, help=tokens_help)
    parser.add_argument("--split", default="validation")
    parser.add_argument("--device", default="cpu")
    return parser


def load_replies(args, temperature: float = 0.0):
    """`replies_parser`'s options -> (the loaded default model, the domain's draft, the prompts, the target's
    replies (prompt + reply token ids) at this temperature)."""
    from bench.gpu import load_drafts
    from engine.loading import load_model
    from training.evaluate import held_out_prompts

    loaded = load_model("default", device=args.device)
    drafts = load_drafts(args.drafts, loaded.model)
    if args.domain not in drafts:
        raise SystemExit(f"no {args.domain} draft under {args.drafts}: give --drafts a folder with {args.domain}/")
    prompts = held_out_prompts(args.domain, loaded.tokenizer, args.prompts, args.split)
    return loaded, drafts[args.domain], prompts, target_replies(loaded.model, loaded.tokenizer, prompts, args.tokens,
                                                                temperature)


def main(argv: list[str] | None = None) -> None:
    parser = replies_parser(__doc__.splitlines()[0], "reply tokens sampled per prompt")
    parser.add_argument("--taus", default="0.6,0.7,0.8,0.9,1.0,1.1")
    parser.add_argument("--temperature", type=float, default=1.0, help="the requests' temperature")
    args = parser.parse_args(argv)
    taus = tuple(float(t) for t in args.taus.split(","))
    loaded, draft, prompts, sequences = load_replies(args, args.temperature)
    result, mass = first_position_stats(loaded.model, draft, sequences, [len(p) for p in prompts], taus,
                                        args.temperature)
    print(json.dumps({"domain": args.domain, "drafts": args.drafts, "split": args.split, "prompts": len(prompts),
                      "reply_tokens": args.tokens, "temperature": args.temperature,
                      "expected_first_position_acceptance": {f"{t:g}": round(v, 4) for t, v in result.items()},
                      "target_mass_on_draft_vocab": round(mass, 4)}))


if __name__ == "__main__":
    main()

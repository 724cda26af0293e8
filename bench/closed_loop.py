"""The engine alone under a closed loop of C clients: plain decoding vs speculation under the governor.

    python -m bench.closed_loop --clients 4 --seconds 30
    python -m bench.closed_loop --clients 16 --seconds 30 --modes off,governor,always

The serving benchmark (`bench/serve.py`) measures the same through Ray, HTTP and client processes that
share the machine's cores; this one drives `DecodeEngine.step()` directly, so what it shows is the
engine's and the governor's own behaviour. Each of C clients sends the next of the serve benchmark's six
chat prompts (code, general, dialog; each routed to its domain's shipped draft) as soon as its previous
request finishes, greedy, `--max-tokens` each. Modes, each on a fresh engine and governor, side by side:
  off       no drafts (plain decoding)
  governor  every request asks for its domain's draft; the governor decides (learning included)
  always    every request speculates (governor off)
  adaptive  every request speculates, each round's gamma picked by `engine.gamma` (governor off)
  governor+adaptive  both
Prints tokens/s per mode, the ratio to `off`, the speculative rounds run, and the governor's estimates.
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.ar import setup_line


def run_mode(loaded, drafts: dict, prompts: list, mode: str, clients: int, seconds: float, max_tokens: int,
             confidence: float) -> dict:
    import engine.scheduler as scheduler
    from engine.governor import SpeculationGovernor
    from engine.requests import Request
    from engine.sampling import SamplingParams
    from engine.scheduler import DecodeEngine
    from engine.speculative import SpecConfig

    from engine.gamma import GammaController

    governed = mode in ("governor", "governor+adaptive")
    gov = SpeculationGovernor(enabled=governed)
    gamma = GammaController(5) if mode.endswith("adaptive") else None
    eng = DecodeEngine(loaded.model, loaded.tokenizer, max_batch_size=max(clients, 1),
                       max_seq_len=max(len(p) for _, p in prompts) + max_tokens + 16,
                       spec=SpecConfig(5, 5, draft_confidence=confidence), governor=gov, gamma=gamma)
    if mode != "off":
        for name, draft in drafts.items():
            eng.add_draft(name, draft)
    if governed:
        eng.calibrate()
    rounds = []
    original = scheduler.spec_round

    def counting(engine, slots, slot_drafts, cfg):
        rounds.append(len(slots))
        return original(engine, slots, slot_drafts, cfg)

    params = SamplingParams(max_new_tokens=max_tokens)
    sent = 0

    def submit() -> None:
        nonlocal sent
        domain, ids = prompts[sent % len(prompts)]
        eng.add_request(Request(f"r{sent}", ids, params, None if mode == "off" else domain))
        sent += 1

    scheduler.spec_round = counting
    try:
        for _ in range(clients):
            submit()
        tokens, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            for out in eng.step():
                tokens += len(out.token_ids)
                if out.finished:
                    submit()
        elapsed = time.perf_counter() - t0
    finally:
        scheduler.spec_round = original
    return {"mode": mode, "tps": tokens / elapsed, "rounds": len(rounds), "requests": sent,
            "governor": gov.snapshot() if governed else None, "gamma": gamma.snapshot() if gamma else None}


def main(argv: list[str] | None = None) -> list[dict]:
    from bench.serve import PROMPTS
    from drafts.checkpoint import load_draft
    from drafts.store import DOMAINS, resolve_draft
    from engine.loading import load_model
    from services.prompts import chat_prompt_ids

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=30.0, help="measured seconds per mode")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--modes", default="off,governor", help="comma list of off, governor, always, adaptive, governor+adaptive")
    parser.add_argument("--draft-confidence", type=float, default=0.3, help="SpecConfig.draft_confidence (the CPU service's)")
    parser.add_argument("--store", default=None,
                        help="draft store (default $FLASHSPEC_HOME/store); each domain's active draft, else the shipped one")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the service's Generator uses 1 here)")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    loaded = load_model("default", device=args.device)
    folders = {d: resolve_draft(d, args.store) for d in DOMAINS}  # what the service would serve
    missing = [d for d, f in folders.items() if f is None]
    if missing:
        raise SystemExit(f"error: no active draft for {', '.join(missing)}; train one: "
                         f"python -m training.cli train-draft --domain {missing[0]}")
    drafts = {d: load_draft(f, loaded.model, name=d) for d, f in folders.items()}
    prompts = [(dom, chat_prompt_ids(loaded.tokenizer, [{"role": "user", "content": text}])) for dom, text in PROMPTS]
    rows = [run_mode(loaded, drafts, prompts, m, args.clients, args.seconds, args.max_tokens, args.draft_confidence)
            for m in args.modes.split(",")]
    base = next((r["tps"] for r in rows if r["mode"] == "off"), None)
    print(f"setup: {setup_line(args.device, args.threads)}; SmolLM2-135M-Instruct; engine closed loop, {args.clients} "
          f"clients, {args.seconds:g} s per mode, greedy, max_tokens {args.max_tokens}, gamma 5 (adaptive: at most 5), block 5, "
          f"draft_confidence {args.draft_confidence:g}, drafts "
          + ", ".join(f"{d}={f.parent.name}/{f.name}" for d, f in folders.items()))
    print("| mode | tokens/s | vs off | speculative rounds | requests |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        ratio = f"{r['tps'] / base:.2f}x" if base else "-"
        print(f"| {r['mode']} | {r['tps']:.1f} | {ratio} | {r['rounds']} | {r['requests']} |")
    for r in rows:
        if r["governor"]:
            print(f"{r['mode']}: governor estimates (seconds per token by batch bucket): {r['governor']}")
        if r["gamma"]:
            print(f"{r['mode']}: gamma controller (rounds per gamma, acceptance survival, round ms by key and gamma): "
                  f"{r['gamma']}")
    return rows


if __name__ == "__main__":
    main()

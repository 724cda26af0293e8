"""How often an overlapped batch of lookup rows launches a round unchained, with and without regrouped chains
(`DecodeEngine.regroup_chains`), on any machine: the engine's scheduling on emulated CUDA graphs (the graph path's
fixed shapes and padding, no capture) is the GPU's, so the count is the GPU's, the tokens aside (the CPU computes in
fp32 where the GPU runs bf16).

    python -m bench.chain_stops                                   # the GPU benchmark's bs 8 cell: 32 long prompts
    python -m bench.chain_stops --prompts 8 --new-tokens 64       # a quick look

An unchained round is one the host launches only after it has read the round before (`DecodeEngine._spec_round`,
counted by `bench.gpu.HostSplit` as on the GPU):
on the GPU the device idles meanwhile for the host's step (reading, committing, joining a request, launching; about
0.4-0.5 ms at bs 8 on the H200, bench/RESULTS.md run 43). A chained round was launched from the round in flight's
outcome on the device before the host read it; a regrouped one too, for a batch whose rows changed (rows that stopped
left, requests prefilled ahead joined). Every request names the n-gram lookup drafter at its default gammas, as
every row of the GPU benchmark's bs 8 service cell ran (run 47), each to its --new-tokens as there (`--eos`: to the
model's end-of-sequence tokens); the engine holds the service's CUDA setting of rows prefilled ahead (`--ahead`). One JSON line per setting, then one comparing them (the same tokens, or not).
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def count(model, prompts: list[list[int]], new_tokens: int, batch: int, ahead: int, regroup: bool,
          eos: tuple[int, ...] | None = ()) -> dict:
    """One pass of `prompts` as lookup rows: its rounds launched unchained, regrouped and in all, and the tokens."""
    from bench.gpu import HostSplit
    from engine.generate import generate
    from engine.lookup import LookupDraft
    from engine.sampling import SamplingParams
    from engine.scheduler import DecodeEngine
    from engine.speculative import SpecConfig

    # The service's context (2,048) where the prompts fit: a batch chains only while every row has room for both
    # rounds, so a context cut to the longest request would stop chains at the end of a pass that the service's don't.
    context = max(2048, 1 << (max(len(p) for p in prompts) + new_tokens + 64).bit_length())
    eng = DecodeEngine(model, None, max_batch_size=batch, max_seq_len=context, spec=SpecConfig(5, 5),
                       cuda_graphs="emulate", overlap=True, prefill_ahead=ahead)
    eng.regroup_chains = regroup
    eng.add_draft("lookup", LookupDraft())
    params = SamplingParams(max_new_tokens=new_tokens, eos_token_ids=eos)
    t0 = time.perf_counter()
    with HostSplit(eng) as split:  # a round launched from `_spec_round` is one the host launched unchained
        outs = generate(eng, prompts, params, "lookup")
    wall = time.perf_counter() - t0
    report = split.report(wall)
    rounds = sum(o.stats.rounds for o in outs if o.stats)
    return {"regroup_chains": regroup, "requests": len(prompts), "batch": batch, "prefill_ahead": ahead,
            "new_tokens": new_tokens, "tokens": sum(len(o.token_ids) for o in outs), "steps": report["steps"],
            "rows_rounds": rounds, "rounds_unchained": report["rounds"], "rounds_regrouped": report["rounds_regrouped"],
            "seconds": round(wall, 1), "_outs": [o.token_ids for o in outs]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=32, help="long prompts of the GPU benchmark (bs 8's order)")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--ahead", type=int, default=7, help="rows prefilled ahead (the service's CUDA setting at bs 8)")
    parser.add_argument("--dtype", default="float32", help="the model's dtype on the CPU")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--prompt-file", default="bench/data/gpu_prompts.json")
    parser.add_argument("--eos", action="store_true",
                        help="requests stop at the model's end-of-sequence tokens (the GPU benchmark's run to "
                             "--new-tokens, as here by default)")
    args = parser.parse_args(argv)
    from bench.gpu import pick_prompts
    from engine.loading import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    with open(args.prompt_file) as f:
        prompts, _ = pick_prompts(json.load(f), "long", args.batch, 24, args.prompts)
    loaded = load_model("default", device="cpu", dtype=args.dtype)
    rows = []
    for regroup in (True, False):
        with torch.inference_mode():
            row = count(loaded.model, prompts, args.new_tokens, args.batch, args.ahead, regroup,
                        eos=tuple(loaded.args.eos_token_ids) if args.eos else ())
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if not k.startswith("_")}), flush=True)
    on, off = rows
    print(json.dumps({"same_tokens": on["_outs"] == off["_outs"],
                      "unchained_rounds_saved": off["rounds_unchained"] - on["rounds_unchained"],
                      "unchained_share_of_steps": [round(r["rounds_unchained"] / max(r["steps"], 1), 3) for r in rows]}),
          flush=True)


if __name__ == "__main__":
    main()

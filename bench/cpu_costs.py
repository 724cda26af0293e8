"""Where the time goes on the CPU: projections, decode steps and FlashSpec rounds, in one run.

    python -m bench.cpu_costs [--threads 2] [--prompts 3] [--tokens 64]

1. One projection (x @ W.T) of the default model's shapes for 1 and 6 rows: F.linear (MKL) against
   oneDNN with the weight prepacked (engine/cpu_linear.py), laid out for 1 row and for the engine's
   `PACK_ROWS`.
2. A decode step (1 token) and a verify-sized pass (6 tokens) of the whole default model at a
   512-token context: unpacked, packed for 1 row, packed as the engine does.
3. The cost of one FlashSpec round (gamma 5, one verify) by draft shape, N = 0, 1, 3 shared layers
   with one adapter, deep features and the shipped code draft's 8k sub-vocabulary head. N = 0 and 1
   are untrained (only their cost means something), N = 3 is also run as the shipped code draft; plus
   plain decoding's time per token, on held-out code prompts.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from bench.ar import setup_line


def _ms(fn, iters: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters * 1e3


def projections() -> list[str]:
    from engine.cpu_linear import PACK_ROWS, _pack, packed_linear

    lines = [f"| projection (out x in) | rows | F.linear µs | packed for 1 row µs | packed for {PACK_ROWS} rows µs (used) |",
             "|---|---:|---:|---:|---:|"]
    for out_f, in_f in ((1536, 576), (576, 1536), (576, 576), (49152, 576)):
        w = torch.randn(out_f, in_f)
        one, used = _pack(w, 1), _pack(w)
        iters = 20 if out_f > 10000 else 200
        for rows in (1, 6):
            x = torch.randn(rows, in_f)
            plain = _ms(lambda: F.linear(x, w), iters) * 1e3
            fast1 = _ms(lambda: packed_linear(x, one, None), iters) * 1e3
            fast = _ms(lambda: packed_linear(x, used, None), iters) * 1e3
            lines.append(f"| {out_f} x {in_f} | {rows} | {plain:.0f} | {fast1:.0f} | {fast:.0f} |")
    return lines


def steps(model) -> list[str]:
    from engine.cpu_linear import PACK_ROWS, PackedLinear, PackedWeight

    cache = model.new_cache(1, 1024)
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    saved = [m._packed for m in packed]
    one_row = [PackedWeight(m.weight, rows=1) for m in packed]  # the same weights laid out for 1 row
    lines = [f"| model pass, 512-token context | tokens | F.linear ms | packed for 1 row ms | packed for {PACK_ROWS} rows ms (used) |",
             "|---|---:|---:|---:|---:|"]
    for tokens in (1, 6):
        ids = torch.zeros(1, tokens, dtype=torch.long)
        pos = (512 + torch.arange(tokens))[None]
        timed = {}
        for name, states in (("plain", [None] * len(packed)), ("one", one_row), ("packed", saved)):
            for m, state in zip(packed, states):
                m._packed = state
            with torch.no_grad():
                timed[name] = _ms(lambda: model(ids, pos, cache=cache, kv_len=512 + tokens), 10)
        for m, state in zip(packed, saved):
            m._packed = state
        lines.append(f"| {'decode step' if tokens == 1 else 'verify-sized pass'} | {tokens} | {timed['plain']:.1f} | "
                     f"{timed['one']:.1f} | {timed['packed']:.1f} |")
    return lines


def rounds(loaded, num_prompts: int, tokens: int) -> list[str]:
    from drafts.checkpoint import load_draft
    from drafts.config import DraftConfig
    from drafts.model import DraftModel
    from drafts.store import resolve_draft
    from engine.cpu_linear import pack_linears
    from engine.generate import generate
    from engine.sampling import SamplingParams
    from engine.scheduler import DecodeEngine
    from engine.speculative import SpecConfig
    from training.evaluate import held_out_prompts

    model, tok = loaded.model, loaded.tokenizer
    code = load_draft(resolve_draft("code"), model, name="code")
    prompts = held_out_prompts("code", tok, num_prompts, split="test")
    params = SamplingParams(max_new_tokens=tokens, temperature=0.0)

    def per_round(draft, name: str) -> tuple[float, float]:
        eng = DecodeEngine(model, tok, max_batch_size=1, max_seq_len=1024, spec=SpecConfig(5, 5))
        eng.add_draft(name, draft)
        generate(eng, [prompts[0]], params, [name])  # warm-up
        start, n_rounds, emitted = time.perf_counter(), 0, 0
        for p in prompts:
            stats = generate(eng, [p], params, [name])[0].stats
            n_rounds, emitted = n_rounds + stats.rounds, emitted + stats.emitted
        return (time.perf_counter() - start) / n_rounds * 1e3, emitted / n_rounds

    lines = ["| draft (gamma 5, one verify) | ms per round | tokens per round |", "|---|---:|---:|"]
    for n in (0, 1, 3):
        draft = DraftModel(model, DraftConfig(shared_layers=n, adapter_layers=1, head="mlp_tied", feature_input="deep",
                                              head_vocab=len(code.vocab_ids)), name=f"n{n}")
        draft.init_from_target()
        draft.set_vocab(code.vocab_ids.clone())
        draft.requires_grad_(False).eval()
        pack_linears(draft)
        ms, tpr = per_round(draft, f"n{n}")
        lines.append(f"| N={n}, untrained | {ms:.1f} | {tpr:.2f} |")
    ms, tpr = per_round(code, "code")
    lines.append(f"| N=3, shipped code draft | {ms:.1f} | {tpr:.2f} |")
    eng = DecodeEngine(model, tok, max_batch_size=1, max_seq_len=1024)
    generate(eng, [prompts[0]], params)
    start = time.perf_counter()
    n = sum(len(generate(eng, [p], params)[0].token_ids) for p in prompts)
    ar_ms = (time.perf_counter() - start) / n * 1e3
    lines += ["", f"plain decoding: {ar_ms:.1f} ms per token; a round pays when it yields more than "
                  "(ms per round) / (ms per token) tokens, 1.5x when it yields 1.5 times that"]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from engine.loading import load_model

    loaded = load_model("default", device="cpu")
    print(f"setup: {setup_line('cpu', args.threads)}; default model fp32; code test prompts x{args.prompts}, "
          f"{args.tokens} new tokens, greedy\n")
    for block in (projections(), steps(loaded.model), rounds(loaded, args.prompts, args.tokens)):
        print("\n".join(block) + "\n", flush=True)


if __name__ == "__main__":
    main()

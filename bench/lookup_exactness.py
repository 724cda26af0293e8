"""Do lookup rounds give plain decoding's greedy tokens, bit for bit? Rectangular rounds (every row the batch's
gamma) and allotted ones (`LookupDraft(allot=True)`: each row its own gamma, the chains packed one token a pass
row), on a random model, per dtype and attention backend, against plain decoding on the same engine settings.

    python -m bench.lookup_exactness                       # CUDA: fp32 and bf16, SDPA and Triton; CPU: SDPA
    python -m bench.lookup_exactness --dtypes float32 --requests 4 --tokens 40

fp32 must agree everywhere (greedy verification keeps the target's argmax, and fp32 leaves no near-tie to
rounding). In bf16 a verify pass computes a token with other kernel shapes than a decode step, so a near-tie
can fall the other way and the text drift from there: how far is what this prints, per request the first
position that differs (None: none). The prompts repeat themselves, so lookup proposes at most positions.
The model's shape matters for which kernels run: `--heads`/`--kv-heads` set the query heads a KV head (the
Triton attention tile holds heads-a-group x a row's tokens; at 64 tile rows and up Triton emits Hopper's
wgmma, below it mma.sync, `bench.kernel_ptx`).
"""

from __future__ import annotations

import argparse
import json

import torch

LENGTHS = (40, 17, 33, 25, 51, 12, 29, 44, 38, 21)  # each prompt: this many random tokens, three times over


def run(dtypes: tuple[str, ...], backends: tuple[str, ...] | None = None, requests: int = 10, tokens: int = 120,
        heads: int = 4, kv_heads: int = 2, batch: int = 8, seed: int = 0) -> list[dict]:
    """One dict per (dtype, backend, round kind): tokens the same as plain decoding's, of all, and each request's
    first differing position."""
    from engine.config import ModelArgs
    from engine.generate import generate
    from engine.lookup import LookupDraft
    from engine.model import Transformer
    from engine.sampling import SamplingParams
    from engine.scheduler import DecodeEngine
    from engine.speculative import SpecConfig

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if backends is None:
        backends = ("sdpa", "triton") if device == "cuda" else ("sdpa",)
    torch.manual_seed(seed)
    args = ModelArgs(model_type="llama", vocab_size=256, hidden_size=256, intermediate_size=512, num_layers=4,
                     num_heads=heads, num_kv_heads=kv_heads, head_dim=64, max_position_embeddings=1024)
    gen = torch.Generator().manual_seed(seed + 1)
    lengths = [LENGTHS[i % len(LENGTHS)] for i in range(requests)]
    prompts = [torch.randint(0, 16, (n,), generator=gen).tolist() * 3 for n in lengths]  # text repeating itself
    params = [SamplingParams(max_new_tokens=tokens, eos_token_ids=()) for _ in prompts]
    out = []
    for name in dtypes:
        with torch.device(device):
            target = Transformer(args, max_seq_len=1024).to(getattr(torch, name)).eval().requires_grad_(False)
        for backend in backends:
            target.set_attention_backend(backend)
            plain = generate(DecodeEngine(target, None, max_batch_size=batch, max_seq_len=512), prompts, params)
            for allot in (False, True):
                eng = DecodeEngine(target, None, max_batch_size=batch, max_seq_len=512, spec=SpecConfig(5, 5),
                                   overlap=True)
                eng.add_draft("lookup", LookupDraft(allot=allot, gammas={}, streak_gammas={}))
                got = generate(eng, prompts, params, "lookup")
                pairs = [(o.token_ids, p.token_ids) for o, p in zip(got, plain)]
                out.append({"dtype": name, "backend": backend, "rounds": "allotted" if allot else "rectangular",
                            "same": sum(a == b for o, p in pairs for a, b in zip(o, p)),
                            "tokens": sum(len(p) for _, p in pairs),
                            "first_divergence": [next((i for i, (a, b) in enumerate(zip(o, p)) if a != b), None)
                                                 for o, p in pairs]})
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--backends", default=None, help="default: sdpa,triton on CUDA, sdpa elsewhere")
    parser.add_argument("--requests", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=120)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    args = parser.parse_args(argv)
    rows = run(tuple(args.dtypes.split(",")), tuple(args.backends.split(",")) if args.backends else None,
               args.requests, args.tokens, args.heads, args.kv_heads)
    for row in rows:
        print(json.dumps(row), flush=True)
    print("\n| dtype | backend | rounds | same tokens as plain decoding | first divergence per request |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['dtype']} | {r['backend']} | {r['rounds']} | {r['same']} / {r['tokens']} | "
              f"{r['first_divergence']} |")


if __name__ == "__main__":
    main()

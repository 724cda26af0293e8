"""Does a query's attention output depend on how many queries share its call? On the GPU, for the engine's Triton
attention kernel (`engine.triton_attention`), by the warps of its wide tiles.

    python -m bench.tile_bits                                  # group 3 (SmolLM2), tokens 1,6,16, warps 4,2
    python -m bench.tile_bits --tokens 13,16 --warps 4,2,1 --batch 1,8

A row of T new tokens attends as one tile of group x T rows (`BLOCK_M`, a power of two, at least 16). A decode
step's tile is 16 rows, gamma 5's round 32, a lone row's 15-token streak round 64 (3 x 16 = 48 rows). At 4 warps
Triton compiles a 64-row tile's products to Hopper's `wgmma` and every smaller one to `mma.sync`
(`python -m bench.kernel_ptx`, compile only); this measures whether that moves a bf16 query's bits:

* each query of a T-token call against the same query alone (a 1-token call, 16-row tile, `mma.sync`) over the same
  cache, the same visible slots and the same split of the cache among programs (the alone call is given the wide
  call's last position, so both split the filled slots alike): elements differing, largest difference, and largest
  difference in units of the dtype's last place at the alone value (`max_units`: 1 = one rounding step apart);
* us a call (a CUDA graph of 20 calls, replayed) at each warps setting of the wide tiles
  (`engine.triton_attention.WIDE_WARPS`, 4 in the engine).

One JSON line per (batch, tokens, warps). Tiles of 32 rows or fewer always launch 4 warps: their lines show whether
`mma.sync` tiles of other widths agree bit for bit. On an H100 (bench/RESULTS.md run 48) they did not always (1 of
55,296 elements at batch 8, 6 tokens), 64-row tiles differed in 1-18 elements at 4 warps and alike at 2: the
instruction is not what moves the bits.
"""

from __future__ import annotations

import argparse
import json

import torch


def _inputs(batch: int, group: int, hkv: int, t: int, slots: int, dtype: torch.dtype, seed: int):
    """q (batch, group*hkv, t, 64); a cache layer of batch + 1 rows read in place (rows reversed, as scattered
    rows are); each row's t new tokens at the end of its own filled length; the causal mask."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    d = 64
    q = torch.randn(batch, group * hkv, t, d, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(batch + 1, hkv, slots, d, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(batch + 1, hkv, slots, d, device="cuda", dtype=dtype, generator=g)
    rows = torch.arange(batch, 0, -1, device="cuda")
    last = torch.randint(slots // 3, slots - 1, (batch, 1), device="cuda", generator=g)
    pos = last - (t - 1) + torch.arange(t, device="cuda")
    mask = torch.arange(slots, device="cuda")[None, None, None, :] <= pos[:, None, :, None]
    return q, k, v, rows, pos, mask


def measure(batch: int, group: int, t: int, warps: int, slots: int = 768, hkv: int = 3,
            dtype: torch.dtype = torch.bfloat16, seed: int = 0, timed: bool = True) -> dict:
    from bench.gpu import per_call_us
    from bench.round_profile import overridden
    from engine import triton_attention as ta

    q, k, v, rows, pos, mask = _inputs(batch, group, hkv, t, slots, dtype, seed)
    with overridden(ta, WIDE_WARPS=warps):
        call = lambda: ta.triton_attention(q, k, v, mask, rows=rows, kv_len=slots, positions=pos)  # noqa: E731
        wide = call()
        assert wide is not None, "the kernel declined the call"
        alone = torch.empty_like(wide)
        for j in range(t):  # query j alone: its own mask row, the wide call's last position (the same splits)
            alone[:, :, j:j + 1] = ta.triton_attention(q[:, :, j:j + 1].contiguous(), k, v, mask[:, :, j:j + 1],
                                                       rows=rows, kv_len=slots, positions=pos[:, -1:].contiguous())
        us = round(per_call_us(call), 2) if timed else None
        block_m, launched = ta.tile(group * t)
    differ = wide != alone
    gap = (wide.float() - alone.float()).abs()
    unit = torch.finfo(dtype).eps * torch.ldexp(torch.ones_like(gap), torch.frexp(alone.float()).exponent - 1)
    return {"batch": batch, "group": group, "tokens": t, "tile_rows": group * t, "BLOCK_M": block_m,
            "warps": launched, "elements": differ.numel(), "elements_differing": int(differ.sum()),
            "queries_differing": int(differ.any(dim=-1).sum()), "max_difference": float(gap.max()),
            "max_units": float((gap / unit).max()), "us_a_call": us}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="1,6,16", help="new tokens a row (comma list)")
    parser.add_argument("--warps", default="4,2", help="warps of tiles over 32 rows (comma list of 1, 2, 4, 8)")
    parser.add_argument("--batch", default="1", help="rows a call (comma list)")
    parser.add_argument("--group", type=int, default=3, help="query heads a KV head (SmolLM2: 3)")
    parser.add_argument("--slots", type=int, default=768, help="cache slots a row (the filled length varies below it)")
    parser.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    parser.add_argument("--seeds", type=int, default=3, help="inputs drawn per setting (bits counted over all)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.tile_bits needs a CUDA GPU (it runs the Triton attention kernel); run it on the GPU machine")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    ints = lambda text: tuple(int(x) for x in text.split(",") if x)  # noqa: E731
    from engine.triton_attention import tile

    for batch in ints(args.batch):
        for t in ints(args.tokens):
            wide = tile(args.group * t)[0] > 32
            for warps in ints(args.warps) if wide else (4,):
                runs = [measure(batch, args.group, t, warps, args.slots, dtype=dtype, seed=s, timed=s == 0)
                        for s in range(args.seeds)]
                row = dict(runs[0])
                for key in ("elements", "elements_differing", "queries_differing"):
                    row[key] = sum(r[key] for r in runs)
                for key in ("max_difference", "max_units"):
                    row[key] = max(r[key] for r in runs)
                row["seeds"] = args.seeds
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

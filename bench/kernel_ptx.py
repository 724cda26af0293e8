"""What the engine's Triton kernels compile to for a GPU, without one: Triton compiles through to PTX and cubin on
any machine with the triton package (its CUDA backend ships ptxas), for a target named here.

    python -m bench.kernel_ptx                              # sm_90 (H100 / H200): every case below
    python -m bench.kernel_ptx --arch 90 --tokens 1,6,16 --packed-tokens 13 --group 3 [--wide-warps 2]

Two kinds of case:
* the cache-writing kernels (`kv_write`, `rope_kv_write`, `step_context`, SmolLM2's shapes, bf16): their PTX
  instruction count and a hash of the instructions, to compare a change's compiled code across commits (run it at
  each: the same count and the same instructions reordered is the same kernel);
* the attention kernel (`engine.triton_attention`) for a row of T new tokens at `--group` query heads a KV head,
  split, with positions and rows (`--tokens`: rectangular rows, as a decode step, gamma 5's round (6) and a lone
  row's streak round (16) run; `--packed-tokens`: packed queries, as an allotted round's longest chain): its tile is group x T rows
  (`BLOCK_M`, at least 16, a power of two), and the MMA instructions it takes, Hopper's warpgroup `wgmma` or
  `mma.sync`. The two add in other orders, so two passes whose tiles take different ones can round a bf16 logit
  differently (bench/RESULTS.md run 47: allotted lookup rounds' 13-token chains at SmolLM2's 3 heads a group are
  39 tile rows, BLOCK_M 64, wgmma; a decode step's and gamma 5's tiles mma.sync).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import warnings


def _signature(fn, pointers: dict, constexprs: dict) -> dict:
    """Every argument of `fn`: a pointer type from `pointers`, constexpr, fp32 for `scale`, else i32."""
    return {n: "constexpr" if n in constexprs else pointers.get(n, "fp32" if n == "scale" else "i32")
            for n in fn.arg_names}


def _compile(fn, pointers: dict, constexprs: dict, arch: int, num_warps: int = 4) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    src = ASTSource(fn=fn, signature=_signature(fn, pointers, constexprs), constexprs=constexprs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})
    ptx = compiled.asm["ptx"]
    body = [line.strip() for line in ptx.splitlines()
            if line.strip() and not line.strip().startswith(("//", ".", "$", "{", "}"))]
    return {"instructions": len(body), "instructions_sha256": hashlib.sha256("\n".join(body).encode()).hexdigest()[:16],
            "wgmma": ptx.count("wgmma.mma_async"), "mma_sync": ptx.count("mma.sync"),
            "cubin_bytes": len(compiled.asm["cubin"])}


def cache_kernels(arch: int) -> list[dict]:
    """kv_write, rope_kv_write and step_context at SmolLM2's shapes (9 query heads, 3 KV heads, head size 64)."""
    from engine import triton_kernels

    k = triton_kernels._kernels()
    bf16, i64 = "*bf16", "*i64"
    cases = [
        ("kv_write", k.kv_write, {**dict.fromkeys(("K", "V", "KC", "VC"), bf16), "ROWS": i64, "POS": i64},
         {"H": 3, "D": 64, "HP": 4, "HAS_ROWS": True, "PDL": False}),
        ("rope_kv_write", k.rope_kv_write,
         {**dict.fromkeys(("QKV", "COS", "SIN", "QO", "KC", "VC"), bf16), "ROWS": i64, "POS": i64},
         {"HQ": 9, "HKV": 3, "D": 64, "HQP": 16, "HKP": 4, "HAS_ROWS": True, "PDL": False}),
        ("step_context", k.step_context,
         {"RC": "*fp32", "RS": "*fp32", "POS": i64, "COS": bf16, "SIN": bf16, "MASK": "*i8"},
         {"D": 64, "DP": 64, "BLOCK_S": 1024, "PDL": False}),
    ]
    return [{"kernel": name, **_compile(fn, ptrs, consts, arch)} for name, fn, ptrs, consts in cases]


def attention_tiles(arch: int, tokens: tuple[int, ...], group: int, packed: bool = False,
                    wide_warps: int | None = None) -> list[dict]:
    """The attention kernel for a row of t new tokens (each of `tokens`), as `triton_attention` launches it
    split, with rows and positions (queries packed, `qidx`, where `packed`), at its warps: 4, and for tiles over 32
    rows `wide_warps` (default `engine.triton_attention.WIDE_WARPS`, 4)."""
    from bench.round_profile import overridden
    from engine import triton_attention as ta

    attend, _ = ta._kernels()
    pointers = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "M": "*u8", "O": "*fp32", "LSE": "*fp32", "ROWS": "*i64",
                "POS": "*i64", "OUT": "*bf16", "CNT": "*bf16", "QIDX": "*i64"}
    out = []
    for t in tokens:
        with overridden(ta, WIDE_WARPS=ta.WIDE_WARPS if wide_warps is None else wide_warps):
            block_m, warps = ta.tile(group * t)  # as triton_attention picks them
        consts = dict(G=group, D=64, BLOCK_M=block_m, BLOCK_N=ta.BLOCK_N, IEEE=False, SPLIT=True, HAS_ROWS=True,
                      HAS_POS=True, BLOCK_T=max(2, 1 << (t - 1).bit_length()), PDL=False, INLINE_MERGE=False,
                      FENCE=False, HAS_QIDX=packed)
        out.append({"kernel": "attend", "tokens": t, "tile_rows": group * t, "BLOCK_M": block_m, "warps": warps,
                    "packed": consts["HAS_QIDX"], **_compile(attend, pointers, consts, arch, num_warps=warps)})
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100 / H200)")
    parser.add_argument("--tokens", default="1,6,16", help="attention, rectangular rows: a row's new tokens")
    parser.add_argument("--packed-tokens", default="13", help="attention, packed queries: a row's chain of tokens")
    parser.add_argument("--group", type=int, default=3, help="attention: query heads a KV head (SmolLM2: 3)")
    parser.add_argument("--wide-warps", type=int, default=None, choices=(1, 2, 4, 8),
                        help="attention: warps of tiles over 32 rows (default 4, the engine's)")
    args = parser.parse_args(argv)

    def ints(text: str) -> tuple[int, ...]:
        return tuple(int(t) for t in text.split(",") if t)

    rows = (cache_kernels(args.arch) + attention_tiles(args.arch, ints(args.tokens), args.group, wide_warps=args.wide_warps)
            + attention_tiles(args.arch, ints(args.packed_tokens), args.group, packed=True, wide_warps=args.wide_warps))
    for row in rows:
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

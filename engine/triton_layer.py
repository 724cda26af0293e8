"""Two Triton kernels that do most of a fused decoder layer's short step (decode, draft and verify steps
of at most `MAX_ROWS` token rows; the model calls them for batches up to 8 by default (MAX_ROWS), see
`DecoderLayer.forward_fused`) in two launches instead of six:

* `norm_qkv_rope_write`: the residual add, the input RMSNorm, the q|k|v projection, RoPE on q and k, and
  k and v into the KV cache. One program per head (query, key or value; or per column block of both
  of its halves, `CONFIG["c"]`): it normalizes the rows itself (they are a few KB), multiplies them by its
  head's rows of the projection, rotates the two halves of a query or key head against each other, and writes the result where the next kernel reads it: the
  queries to a new tensor, the keys and values into the cache at each token's position. It replaces
  `add_rms_norm`, the q|k|v GEMM and `rope_kv_write`.
* `norm_gate_up_silu`: the residual add after attention, the post-attention RMSNorm, the gate|up
  projection and SiLU(gate) * up. One program per block of intermediate columns computes both its gate
  and its up columns. It replaces `add_rms_norm`, the gate|up GEMM and `silu_mul`.

A third, `project` (on by default; FLASHSPEC_PROJ_KERNEL=0 turns it off), runs the output and down projections
of those steps in place of cuBLAS's GEMM: one program per 16 output columns, the whole reduction in one step
where it fits, the weight read before the kernel waits for the one before it (programmatic dependent launch),
so that every kernel of a short step's layer is a Triton launch the chain of dependent launches runs through.
With FLASHSPEC_LAYER_PREFETCH=1 (off: measured in run 30, it does not pay) the two layer kernels read their
weight's first features before that wait too.

The attention kernel stays as it was. Inside a CUDA
graph a short step of a small model costs its kernels' latencies one after another; these cut the
default model's decode step from 320 kernels to 200. On the H200 (bench/RESULTS.md, run 24) that is
0.945 -> 0.903 ms a decode step and 1.004 -> 0.978 ms a 6-token verify pass: each kernel takes 6-7 us,
about what the three it replaces took together (7.3 and 5.8 us), so the gain is the launches and gaps
saved, not the arithmetic. The projections' weights are read by few programs (15 for q|k|v, 48 for
gate|up), each streaming 74 KB; a split of the reduction over more programs is the next thing to try.
At 48 rows (one 64-row tile then) no launch setting beat the separate kernels: `MAX_ROWS`.

The arithmetic is the fused path's, rounding for rounding: the residual sum rounded to the model's
dtype, fp32 statistics, the normalized row rounded before the weight multiplies it, the projections
accumulated in fp32 and rounded to the dtype (as cuBLAS does), RoPE in fp32 from the rounded projection,
SiLU rounded before it multiplies the up column. Only the order of the fp32 sums differs (a GEMM's
tiling, the norm's reduction): the outputs agree with the unfused kernels to a few units in the last
place of bf16, as different GEMM tilings do, and to 1e-6 in fp32.

Each function returns None for a call it does not serve (biases, more rows than `MAX_ROWS`, an fp32
model on the GPU where `tl.dot` would round to tf32, CPU tensors outside Triton's interpreter): the
caller then runs the separate kernels as before. `ENABLED = False` (or FLASHSPEC_LAYER_KERNELS=0 in the
environment) switches both off for A/B runs (`bench.round_profile --no-layer-kernels`).
"""

from __future__ import annotations

import functools
import os

import torch

from engine.triton_kernels import _row_args, available, launch_config, pdl, served

ENABLED = os.environ.get("FLASHSPEC_LAYER_KERNELS", "1") != "0"
# Every program computes one tile of TILE_ROWS token rows (grid axis 1 over the tiles), so a row's output does not
# depend on how many rows share its call: a batch's decode steps, draft steps and verify passes round alike.
TILE_ROWS = 16


def _max_rows(text: str) -> int:
    try:
        rows = int(text)
    except ValueError:
        rows = 0
    if rows < 1:
        raise ValueError(f"FLASHSPEC_LAYER_ROWS={text!r}: expected a positive number of token rows, e.g. 16 or 128")
    return rows


# Token rows (batch x tokens per row) a call may have. The model gives the kernels a batch's short steps only
# where every one of them fits (DecoderLayer.forward_fused): by default (128) batches up to 8 (8 rows x 16
# tokens a step). Run 31 on the H200: at bs 8 a plain step's graph 11 % and a code-draft round's 8 % faster
# than the separate kernels, overlapped plain decoding 9,306 against 8,305 tokens/s, fp32 argmax agreement
# 0.996 against 0.994 (bench/RESULTS.md). FLASHSPEC_LAYER_ROWS=16 limits them to batch 1, as before run 31.
# Run 24 found one 64-row tile slower than the separate kernels at 48 rows (10.1 against 6.9 us for q|k|v);
# a 48-row call is now three 16-row tiles side by side.
MAX_ROWS = _max_rows(os.environ.get("FLASHSPEC_LAYER_ROWS", "128"))


def _config(text: str) -> dict[str, int]:
    """The kernels' launch settings: k = features per step of the reduction (1024 and up: the whole row at
    once), c = columns per half-head of a norm_qkv_rope_write program, g = intermediate columns per
    norm_gate_up_silu program, w = warps, s = software pipeline stages. FLASHSPEC_LAYER_CONFIG="k=256,c=16"
    overrides some (a tuning run: bench.round_profile --layer-sweep)."""
    config = launch_config("FLASHSPEC_LAYER_CONFIG", text, {"k": 128, "c": 32, "g": 32, "w": 8, "s": 3},  # the H200
                           {"k": 16, "c": 16, "g": 16, "w": 1})  # sweep's best (run 24); tl.dot's tiles at least 16 wide
    if config["s"] < 1:
        raise ValueError("FLASHSPEC_LAYER_CONFIG: s (pipeline stages) must be >= 1")
    return config


CONFIG = _config(os.environ.get("FLASHSPEC_LAYER_CONFIG", ""))


# The output and down projections of a short step (`project`) as a Triton launch in place of cuBLAS's (on by
# default: run 30 on the H200, a decode step's graph 0.832 -> 0.724 ms, the same greedy tokens; FLASHSPEC_PROJ_KERNEL=0
# turns it off). With every kernel of a layer a Triton launch, programmatic dependent launch chains all of them (a
# cuBLAS GEMM breaks the chain twice a layer), and each projection reads its weight before it waits for the kernel
# before it.
PROJ = os.environ.get("FLASHSPEC_PROJ_KERNEL", "1") != "0"
# The two layer kernels read their weight's first k features before they wait for the kernel before them (with
# programmatic dependent launch that read overlaps the kernel before; the sums are the same, in the same order).
# Off: on the H200 (run 30) it gained 8.5 % on a plain decoding step's graph with k=1024 but cost 2 % on a greedy
# round's, and with k=256 it cost 2 % on both. FLASHSPEC_LAYER_PREFETCH=1 turns it on.
PREFETCH = os.environ.get("FLASHSPEC_LAYER_PREFETCH", "0") == "1"
# n = output columns per program, k = features per step of the reduction (the whole row at once where it fits),
# w = warps, s = software pipeline stages; FLASHSPEC_PROJ_CONFIG="n=32,w=8" overrides some.
PROJ_CONFIG = launch_config("FLASHSPEC_PROJ_CONFIG", os.environ.get("FLASHSPEC_PROJ_CONFIG", ""),
                            {"n": 16, "k": 2048, "w": 4, "s": 1}, {"n": 16, "k": 16, "w": 1})


@functools.lru_cache(maxsize=1)
def _kernels():
    from engine import triton_layer_kernels as k

    return k.norm_qkv_rope_kernel, k.norm_gate_up_kernel, k.project_kernel


def _tiles(n: int) -> int:
    return -(-n // TILE_ROWS)  # tl.dot's smallest tile is 16 rows


def _block_k(hidden: int, step: int | None = None) -> int:
    """Features a step of the reduction: `step` (default CONFIG's k), at most the row rounded up to a power of two."""
    return min(CONFIG["k"] if step is None else step, max(16, 1 << (hidden - 1).bit_length()))


def _dtype_ok(*tensors: torch.Tensor | None) -> bool:
    tensors = tuple(t for t in tensors if t is not None)
    dtype = tensors[0].dtype
    if any(t.dtype != dtype for t in tensors):
        return False
    # On the GPU fp32 operands of tl.dot would round to tf32: only the 16-bit types there.
    allowed = (torch.bfloat16, torch.float16) if tensors[0].is_cuda else (torch.bfloat16, torch.float16, torch.float32)
    return dtype in allowed


def _usable(*tensors: torch.Tensor | None) -> bool:
    """The checks that decide most calls, first and cheapest: switched on, triton importable, the tensors
    where the kernels run (CUDA; the CPU only under the interpreter). The CPU decode loop stops here."""
    return ENABLED and available() and served(*(t for t in tensors if t is not None))


def _residual_outputs(x: torch.Tensor, delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(where the kernel writes x + delta: x itself when there is no delta, else a new tensor; the kernel's
    DELTA argument: the delta, or x, unread, when there is none)."""
    return (x, x) if delta is None else (torch.empty_like(x), delta)


def _residual_ok(x: torch.Tensor, delta: torch.Tensor | None, norm_weight: torch.Tensor) -> bool:
    n, k = x.shape if x.dim() == 2 else (0, 0)
    return (x.dim() == 2 and 0 < n <= MAX_ROWS and x.stride(1) == 1 and norm_weight.shape == (k,)
            and norm_weight.is_contiguous() and (delta is None or (delta.shape == x.shape and delta.stride(1) == 1)))


def norm_qkv_rope_write(x: torch.Tensor, delta: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                        w_qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, rows, input_pos: torch.Tensor, heads: int,
                        kv_heads: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """x, delta (N, H): the residual stream and the previous layer's pending output (None: none), N = B*T
    rows in (b, t) order; norm_weight (H,); w_qkv ((heads + 2 kv_heads) D, H), the fused projection without
    a bias; cos, sin (N, D); k_cache/v_cache (R, kv_heads, S, D) of one layer whose slot is the position;
    rows and input_pos (B, T) as `triton_kernels.kv_write`'s. Returns (x + delta, the rotated queries
    (N, heads, D)) and writes the rotated keys and the values into the cache, as `add_rms_norm`, the q|k|v
    GEMM and `rope_kv_write` do one after another. None for calls it does not serve."""
    if not _usable(x, delta, norm_weight, w_qkv, cos, sin, k_cache, v_cache, input_pos):
        return None
    bsz, t = input_pos.shape
    d = k_cache.shape[-1] if k_cache.dim() == 4 else 0
    if (not _residual_ok(x, delta, norm_weight) or d & (d - 1) or d < 32
            or not _dtype_ok(x, delta, norm_weight, w_qkv, cos, sin, k_cache, v_cache)
            or x.shape[0] != bsz * t or w_qkv.shape != ((heads + 2 * kv_heads) * d, x.shape[1]) or w_qkv.stride(1) != 1
            or cos.shape != (bsz * t, d) or sin.stride() != cos.stride() or k_cache.shape[1] != kv_heads
            or v_cache.shape != k_cache.shape or input_pos.dtype not in (torch.int64, torch.int32)
            or (isinstance(rows, torch.Tensor) and (not served(rows) or rows.shape != (bsz,)))):
        return None
    n, hidden = x.shape
    res, dd = _residual_outputs(x, delta)
    q = torch.empty(n, heads, d, device=x.device, dtype=x.dtype)
    row_ptr, row0, has_rows = _row_args(rows, input_pos)
    cols = min(CONFIG["c"], d // 2)
    _kernels()[0][((heads + 2 * kv_heads) * (d // 2 // cols), _tiles(n))](
        x, dd, res, norm_weight, w_qkv, cos, sin, q, k_cache, v_cache, row_ptr, input_pos, row0, t, k_cache.shape[2],
        n, eps, x.stride(0), dd.stride(0), res.stride(0), w_qkv.stride(0), *cos.stride(), *q.stride(),
        *k_cache.stride(), *v_cache.stride(), *input_pos.stride(),
        K=hidden, HQ=heads, HKV=kv_heads, D=d, BLOCK_M=TILE_ROWS, BLOCK_K=_block_k(hidden), COLS=cols,
        HAS_DELTA=delta is not None, HAS_ROWS=has_rows, PREFETCH=PREFETCH, num_warps=CONFIG["w"], num_stages=CONFIG["s"],
        **pdl(x))
    return res, q


def norm_gate_up_silu(x: torch.Tensor, delta: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                      w_gate_up: torch.Tensor, inter: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """x, delta (N, H) as `norm_qkv_rope_write`'s; w_gate_up (2 inter, H), the fused gate|up projection
    without a bias. Returns (x + delta, SiLU(gate) * up (N, inter)), as `add_rms_norm`, the gate|up GEMM
    and `silu_mul` do one after another. None for calls it does not serve."""
    if not _usable(x, delta, norm_weight, w_gate_up):
        return None
    if (not _residual_ok(x, delta, norm_weight)
            or not _dtype_ok(x, delta, norm_weight, w_gate_up)
            or w_gate_up.shape != (2 * inter, x.shape[1]) or w_gate_up.stride(1) != 1):
        return None
    n, hidden = x.shape
    res, dd = _residual_outputs(x, delta)
    out = torch.empty(n, inter, device=x.device, dtype=x.dtype)
    _kernels()[1][(-(-inter // CONFIG["g"]), _tiles(n))](
        x, dd, res, norm_weight, w_gate_up, out, n, eps, x.stride(0), dd.stride(0), res.stride(0),
        w_gate_up.stride(0), out.stride(0),
        K=hidden, INTER=inter, BLOCK_M=TILE_ROWS, BLOCK_N=CONFIG["g"], BLOCK_K=_block_k(hidden),
        HAS_DELTA=delta is not None, PREFETCH=PREFETCH, num_warps=CONFIG["w"], num_stages=CONFIG["s"], **pdl(x))
    return res, out


def project(x: torch.Tensor, weight: torch.Tensor, config: dict | None = None) -> torch.Tensor | None:
    """x (N, K) @ weight.T for weight (N_out, K) without a bias -> (N, N_out) in x's dtype, accumulated in fp32
    and rounded once, as cuBLAS's GEMM rounds it (only the order of the fp32 sums differs): the output and down
    projections of a short step. Every call runs the same 16-row tile, so a row's output does not depend on the
    rows sharing its call. None for calls it does not serve (`PROJ` off, more rows than `MAX_ROWS`, a strided
    weight, mixed or fp32 dtypes on the GPU, a gradient to carry): the caller runs F.linear. `config` overrides
    PROJ_CONFIG's entries (a sweep)."""
    if not (PROJ and _usable(x, weight)):
        return None
    cfg = {**PROJ_CONFIG, **(config or {})}
    n = x.shape[0] if x.dim() == 2 else 0
    if (not 0 < n <= MAX_ROWS or weight.dim() != 2 or weight.shape[1] != x.shape[1] or x.stride(1) != 1
            or weight.stride(1) != 1 or not _dtype_ok(x, weight)
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return None
    k, n_out = x.shape[1], weight.shape[0]
    out = torch.empty(n, n_out, device=x.device, dtype=x.dtype)
    _kernels()[2][(-(-n_out // cfg["n"]), _tiles(n))](
        x, weight, out, n, x.stride(0), weight.stride(0), out.stride(0),
        K=k, N=n_out, BLOCK_M=TILE_ROWS, BLOCK_N=cfg["n"], BLOCK_K=_block_k(k, cfg["k"]),
        num_warps=cfg["w"], num_stages=cfg["s"], **pdl(x))
    return out

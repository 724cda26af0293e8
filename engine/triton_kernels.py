"""Small Triton kernels for the engine's short GPU steps (decode, draft and verify): the KV-cache write
and the argmax over the vocabulary.

Inside a CUDA graph of a small model a step's time is its kernels' own latencies, one after another
(on the H200 about 1 us for the emptiest kernel; bench/RESULTS.md, "kernel profile"). Writing a layer's
new keys and values through advanced indexing costs 5-6 kernels (an `arange`, index computations, one
scatter for K and one for V) and 8-12 us a layer, about a sixth of a decode step; `kv_write` does the
same copy in one launch. It is an exact copy: nothing downstream changes by a bit. `argmax` returns
exactly torch.argmax's index (the first of equal maxima) in about a fifth of its time on one row.

Every function returns False / None for a call it does not serve (CPU tensors outside Triton's
interpreter, dtypes or shapes it is not written for); the caller then does the work as before.
"""

from __future__ import annotations

import functools
import os
import types

import torch

ENABLED = True  # False: every function here declines, callers do the work as before (A/B runs: bench.round_profile)


@functools.lru_cache(maxsize=1)
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def kv_write_kernel(K, V, KC, VC, ROWS, POS, row0, T, S,
                        skb, skh, skt, skd, svb, svh, svt, svd,
                        sckr, sckh, scks, sckd, scvr, scvh, scvs, scvd, spb, spt,
                        H: tl.constexpr, D: tl.constexpr, HP: tl.constexpr, HAS_ROWS: tl.constexpr):
        """One program per (row, new token): all KV heads' keys and values into the cache at its position."""
        i = tl.program_id(0)
        b = i // T
        t = i % T
        if HAS_ROWS:
            r = tl.load(ROWS + b).to(tl.int64)
        else:
            r = (row0 + b).to(tl.int64)
        p = tl.load(POS + b * spb + t * spt).to(tl.int64)
        h = tl.arange(0, HP)
        d = tl.arange(0, D)
        m = (h[:, None] < H) & (d[None, :] < D) & (p >= 0) & (p < S)
        k = tl.load(K + b * skb + h[:, None] * skh + t * skt + d[None, :] * skd, mask=m)
        tl.store(KC + r * sckr + h[:, None] * sckh + p * scks + d[None, :] * sckd, k, mask=m)
        v = tl.load(V + b * svb + h[:, None] * svh + t * svt + d[None, :] * svd, mask=m)
        tl.store(VC + r * scvr + h[:, None] * scvh + p * scvs + d[None, :] * scvd, v, mask=m)

    @triton.jit
    def argmax_partial(X, VAL, IDX, V, sxr, C, BLOCK: tl.constexpr):
        """Program (row, chunk): the largest value of one chunk of a row and its first index."""
        r = tl.program_id(0)
        c = tl.program_id(1)
        offs = c * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(X + r * sxr + offs, mask=offs < V, other=-float("inf")).to(tl.float32)
        x = tl.where(x != x, float("inf"), x)  # NaN counts as the largest value, as in torch.argmax
        v, i = tl.max(x, 0, return_indices=True, return_indices_tie_break_left=True)
        tl.store(VAL + r * C + c, v)
        tl.store(IDX + r * C + c, c * BLOCK + i)

    @triton.jit
    def argmax_final(VAL, IDX, OUT, C, CP: tl.constexpr):
        """Program row: the chunk with the largest value (the first of equals) -> the row's index."""
        r = tl.program_id(0)
        c = tl.arange(0, CP)
        v = tl.load(VAL + r * C + c, mask=c < C, other=-float("inf"))
        j = tl.argmax(v, 0, tie_break_left=True)
        tl.store(OUT + r, tl.load(IDX + r * C + j))

    @triton.jit
    def skinny_linear(X, DELTA, NW, W, BIAS, Y, RES, M, N, K, sxm, sdm, swn, sym, srm, eps,
                      PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr):
        """Y (M, N) = prologue(X) (M, K) @ W (N, K)^T (+ bias) for M <= BLOCK_M rows; one program per BLOCK_N
        columns. PROLOGUE 0: X as is; 1: SiLU(gate) * up of a fused gate|up X (M, 2K); 2: RMSNorm(X + DELTA)
        with weight NW, the sum X + DELTA also stored to RES (by program 0); 3: RMSNorm(X). Each rounds
        where the eager ops round (bf16 sums and products), as engine.fused's kernels do."""
        pid = tl.program_id(0)
        m = tl.arange(0, BLOCK_M)
        n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        live_m = m < M
        if PROLOGUE >= 2:  # the rows' mean squares (of the residual sum), in fp32
            ss = tl.zeros((BLOCK_M,), tl.float32)
            for k0 in range(0, K, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                msk = live_m[:, None] & (k[None, :] < K)
                x = tl.load(X + m[:, None] * sxm + k[None, :], mask=msk, other=0.0)
                if PROLOGUE == 2:
                    d = tl.load(DELTA + m[:, None] * sdm + k[None, :], mask=msk, other=0.0)
                    x = (x.to(tl.float32) + d.to(tl.float32)).to(x.dtype)
                    tl.store(RES + m[:, None] * srm + k[None, :], x, mask=msk & (pid == 0))
                xf = x.to(tl.float32)
                ss += tl.sum(xf * xf, 1)
            rstd = tl.rsqrt(ss / K + eps)
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            msk = live_m[:, None] & (k[None, :] < K)
            if PROLOGUE == 1:
                g = tl.load(X + m[:, None] * sxm + k[None, :], mask=msk, other=0.0)
                u = tl.load(X + m[:, None] * sxm + K + k[None, :], mask=msk, other=0.0)
                gf = g.to(tl.float32)
                x = ((gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32) * u.to(tl.float32)).to(g.dtype)
            else:
                x = tl.load(X + m[:, None] * sxm + k[None, :], mask=msk, other=0.0)
                if PROLOGUE == 2:
                    d = tl.load(DELTA + m[:, None] * sdm + k[None, :], mask=msk, other=0.0)
                    x = (x.to(tl.float32) + d.to(tl.float32)).to(x.dtype)
                if PROLOGUE >= 2:
                    nw = tl.load(NW + k, mask=k < K, other=0.0)
                    xn = (x.to(tl.float32) * rstd[:, None]).to(x.dtype)
                    x = (nw[None, :].to(tl.float32) * xn.to(tl.float32)).to(x.dtype)
            w = tl.load(W + n[:, None] * swn + k[None, :], mask=(n[:, None] < N) & (k[None, :] < K), other=0.0)
            acc += tl.dot(x, tl.trans(w))
        if HAS_BIAS:
            acc += tl.load(BIAS + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
        tl.store(Y + m[:, None] * sym + n[None, :], acc.to(Y.dtype.element_ty), mask=live_m[:, None] & (n[None, :] < N))

    return types.SimpleNamespace(kv_write=kv_write_kernel, argmax_partial=argmax_partial, argmax_final=argmax_final,
                                 linear=skinny_linear)


@functools.lru_cache(maxsize=1)
def available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def served(*tensors: torch.Tensor) -> bool:
    """Whether these tensors are where the kernels run: CUDA, or the CPU under Triton's interpreter (tests)."""
    if all(t.is_cuda for t in tensors):
        return True
    return all(t.device.type == "cpu" for t in tensors) and os.environ.get("TRITON_INTERPRET") == "1"


def kv_write(k_cache: torch.Tensor, v_cache: torch.Tensor, rows, input_pos: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> bool:
    """k_cache/v_cache (R, H, S, D) of one layer; rows: None (rows 0..B-1), a slice of consecutive rows or
    a (B,) index tensor; input_pos (B, T); k, v (B, H, T, D). Writes k, v at those rows and positions, as
    `cache[rows[:, None], :, input_pos] = k.transpose(1, 2)` does. Positions outside [0, S) are not written
    (the indexing version raises there; the engine never asks). Returns False for calls it does not serve."""
    bsz, heads, t, d = k.shape
    if (not ENABLED or not available() or not served(k_cache, v_cache, input_pos, k, v) or d & (d - 1) or d < 16
            or not (k.dtype == v.dtype == k_cache.dtype == v_cache.dtype) or v.shape != k.shape
            or k_cache.shape[1] != heads or input_pos.shape != (bsz, t) or input_pos.dtype not in (torch.int64, torch.int32)
            or (isinstance(rows, torch.Tensor) and (not served(rows) or rows.shape != (bsz,)))):
        return False
    if bsz * t == 0:
        return True
    if isinstance(rows, torch.Tensor):
        row_ptr, row0, has_rows = rows, 0, True
    else:
        row_ptr, row0, has_rows = input_pos, (rows.start or 0) if isinstance(rows, slice) else 0, False
    _kernels().kv_write[(bsz * t,)](
        k, v, k_cache, v_cache, row_ptr, input_pos, row0, t, k_cache.shape[2],
        *k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride(), *input_pos.stride(),
        H=heads, D=d, HP=max(1, 1 << (heads - 1).bit_length()), HAS_ROWS=has_rows, num_warps=1)
    return True


ARGMAX_CHUNK = 2048  # vocabulary entries per program of argmax's first pass


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1) (the first index of the largest value; NaN counts as largest) in two short passes:
    chunks of every row in parallel, then one program per row. torch's reduction gives a row to one
    block of threads: 15 us for a 49,152-entry vocabulary on an H200, a tenth of a draft step. Falls back
    to torch.argmax for calls it does not serve."""
    v = x.shape[-1]
    if (not ENABLED or not available() or not served(x) or x.dtype not in (torch.float32, torch.bfloat16, torch.float16)
            or x.numel() == 0 or x.stride(-1) != 1 or v < 2 * ARGMAX_CHUNK):
        return x.argmax(-1)
    rows = x.reshape(-1, v)  # a view for the engine's logits (contiguous rows); a copy otherwise
    n, chunks = rows.shape[0], -(-v // ARGMAX_CHUNK)
    val = torch.empty(n, chunks, device=x.device, dtype=torch.float32)
    idx = torch.empty(n, chunks, device=x.device, dtype=torch.int64)
    out = torch.empty(n, device=x.device, dtype=torch.int64)
    kernels = _kernels()
    kernels.argmax_partial[(n, chunks)](rows, val, idx, v, rows.stride(0), chunks, BLOCK=ARGMAX_CHUNK, num_warps=4)
    kernels.argmax_final[(n,)](val, idx, out, chunks, CP=max(2, 1 << (chunks - 1).bit_length()), num_warps=1)
    return out.view(x.shape[:-1])


MAX_LINEAR_ROWS = 16  # rows (tokens of a step) up to which `linear` serves a GEMM: one 16-row tile
MAX_LINEAR_WEIGHT = 8 * 2**20  # weight elements (N * K) up to which it does (measured on small models only)
PLAIN, SILU_MUL, ADD_RMS_NORM, RMS_NORM = 0, 1, 2, 3


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, prologue: int = PLAIN,
           delta: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 0.0):
    """F.linear for the few rows of a decode, draft or verify step (x (M, K), M <= 16; bf16/fp16 on CUDA),
    optionally with the elementwise op before it fused in: `SILU_MUL` (x is a fused gate|up (M, 2K)),
    `RMS_NORM` (norm_weight, eps), `ADD_RMS_NORM` (of x + delta; returns (x + delta, y)). cuBLAS runs a
    16-row GEMM of these shapes in 3.2-4.8 us on an H200; this kernel in 2.7-4.5 us, and the fused op
    saves its own launch. Every row goes through the same tile and reduction order whatever M is, so a
    verify pass's rows equal a decode step's bit for bit. Returns None for calls it does not serve."""
    m = x.shape[0]
    n, k = weight.shape
    if (not ENABLED or not available() or not served(x, weight) or x.dim() != 2 or not 0 < m <= MAX_LINEAR_ROWS
            or x.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != x.dtype or n * k > MAX_LINEAR_WEIGHT
            or weight.stride(1) != 1 or x.stride(1) != 1 or x.shape[1] != (2 * k if prologue == SILU_MUL else k)
            or (bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous()))
            or (prologue >= ADD_RMS_NORM and (norm_weight is None or norm_weight.dtype != x.dtype
                                               or not norm_weight.is_contiguous()))
            or (prologue == ADD_RMS_NORM and (delta is None or delta.shape != x.shape or delta.dtype != x.dtype
                                               or delta.stride(1) != 1))):
        return None
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    res = torch.empty_like(x) if prologue == ADD_RMS_NORM else y
    block_n = 16 if n <= 1024 else 32
    _kernels().linear[(-(-n // block_n),)](
        x, delta if delta is not None else x, norm_weight if norm_weight is not None else weight, weight,
        bias if bias is not None else weight, y, res, m, n, k, x.stride(0),
        delta.stride(0) if delta is not None else 0, weight.stride(0), y.stride(0), res.stride(0), float(eps),
        PROLOGUE=prologue, HAS_BIAS=bias is not None, BLOCK_M=MAX_LINEAR_ROWS, BLOCK_N=block_n, BLOCK_K=128,
        num_warps=2 if block_n == 16 else 4, num_stages=3)
    return (res, y) if prologue == ADD_RMS_NORM else y

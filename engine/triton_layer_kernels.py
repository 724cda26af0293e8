"""The jit kernels of engine/triton_layer.py (a module of their own: it imports triton, which the CPU install
lacks, and jit functions call each other only at module level). Read that module's docstring first."""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

@triton.jit
def _normalized(X, DELTA, NW, m, mask_m, k0, sxm, sdm, rstd, K: tl.constexpr, BLOCK_K: tl.constexpr,
                HAS_DELTA: tl.constexpr):
    """Rows m's features k0..k0+BLOCK_K of RMSNorm(x + delta), in x's dtype (rows, BLOCK_K)."""
    k = k0 + tl.arange(0, BLOCK_K)
    mk = mask_m[:, None] & (k[None, :] < K)
    x = tl.load(X + m[:, None] * sxm + k[None, :], mask=mk, other=0.0)
    if HAS_DELTA:
        x = (x.to(tl.float32) + tl.load(DELTA + m[:, None] * sdm + k[None, :], mask=mk, other=0.0).to(tl.float32))
        x = x.to(X.dtype.element_ty)  # the residual sum, rounded as the separate add rounds it
    h = (x.to(tl.float32) * rstd[:, None]).to(X.dtype.element_ty).to(tl.float32)
    w = tl.load(NW + k, mask=k < K, other=0.0).to(tl.float32)
    return (h * w[None, :]).to(X.dtype.element_ty)

@triton.jit
def _rstd(X, DELTA, RES, m, mask_m, sxm, sdm, srm, eps, write, K: tl.constexpr, BLOCK_M: tl.constexpr,
          BLOCK_K: tl.constexpr, HAS_DELTA: tl.constexpr):
    """1 / RMS of each row of x + delta (fp32), and (write) that sum into RES."""
    ss = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        mk = mask_m[:, None] & (k[None, :] < K)
        x = tl.load(X + m[:, None] * sxm + k[None, :], mask=mk, other=0.0)
        if HAS_DELTA:
            x = (x.to(tl.float32) + tl.load(DELTA + m[:, None] * sdm + k[None, :], mask=mk, other=0.0).to(tl.float32))
            x = x.to(X.dtype.element_ty)
            if write:
                tl.store(RES + m[:, None] * srm + k[None, :], x, mask=mk)
        xf = x.to(tl.float32)
        ss += tl.sum(xf * xf, axis=1)
    return 1.0 / tl.sqrt(ss / K + eps)

@triton.jit
def norm_qkv_rope_kernel(X, DELTA, RES, NW, W, COS, SIN, QO, KC, VC, ROWS, POS, row0, T, S, M, eps,
                         sxm, sdm, srm, swn, scm, scd, sqm, sqh, sqd,
                         sckr, sckh, scks, sckd, scvr, scvh, scvs, scvd, spb, spt,
                         K: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, COLS: tl.constexpr, HAS_DELTA: tl.constexpr,
                         HAS_ROWS: tl.constexpr, PDL: tl.constexpr = False, PREFETCH: tl.constexpr = False):
    """Program (h, c, r): columns c*COLS.. of both halves of head h of q|k|v (queries, then keys, then values)
    for the rows of tile r (grid axis 1): a half's column pairs with the same column of the other half under
    RoPE. PREFETCH: the weight's first BLOCK_K features are read before the wait for the kernel before (the
    same sums, in the same order)."""
    HALF: tl.constexpr = D // 2
    PARTS: tl.constexpr = HALF // COLS
    head = tl.program_id(0) // PARTS
    j = (tl.program_id(0) % PARTS) * COLS + tl.arange(0, COLS)
    if PREFETCH:
        k = tl.arange(0, BLOCK_K)
        w_lo0 = tl.load(W + (head * D + j)[:, None] * swn + k[None, :], mask=k[None, :] < K, other=0.0)
        w_hi0 = tl.load(W + (head * D + HALF + j)[:, None] * swn + k[None, :], mask=k[None, :] < K, other=0.0)
    if PDL:  # programmatic dependent launch (engine.triton_kernels.pdl)
        gdc_wait()
        gdc_launch_dependents()
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)  # this program's tile of rows
    mask_m = m < M
    rstd = _rstd(X, DELTA, RES, m, mask_m, sxm, sdm, srm, eps, tl.program_id(0) == 0, K, BLOCK_M, BLOCK_K, HAS_DELTA)
    lo = tl.zeros([BLOCK_M, COLS], dtype=tl.float32)
    hi = tl.zeros([BLOCK_M, COLS], dtype=tl.float32)
    if PREFETCH:
        a = _normalized(X, DELTA, NW, m, mask_m, 0, sxm, sdm, rstd, K, BLOCK_K, HAS_DELTA)
        lo += tl.dot(a, tl.trans(w_lo0))
        hi += tl.dot(a, tl.trans(w_hi0))
    for k0 in range(BLOCK_K if PREFETCH else 0, K, BLOCK_K):
        a = _normalized(X, DELTA, NW, m, mask_m, k0, sxm, sdm, rstd, K, BLOCK_K, HAS_DELTA)
        k = k0 + tl.arange(0, BLOCK_K)
        mk = k[None, :] < K
        w_lo = tl.load(W + (head * D + j)[:, None] * swn + k[None, :], mask=mk, other=0.0)  # (HALF, BLOCK_K)
        w_hi = tl.load(W + (head * D + HALF + j)[:, None] * swn + k[None, :], mask=mk, other=0.0)
        lo += tl.dot(a, tl.trans(w_lo))
        hi += tl.dot(a, tl.trans(w_hi))
    # The projection's output in the model's dtype, as the GEMM writes it.
    lo = lo.to(QO.dtype.element_ty).to(tl.float32)
    hi = hi.to(QO.dtype.element_ty).to(tl.float32)
    if head < HQ + HKV:  # rotate: (lo, hi) -> (lo cos - hi sin, hi cos + lo sin), rotate_half's formula
        c_lo = tl.load(COS + m[:, None] * scm + j[None, :] * scd, mask=mask_m[:, None], other=0.0).to(tl.float32)
        c_hi = tl.load(COS + m[:, None] * scm + (HALF + j)[None, :] * scd, mask=mask_m[:, None], other=0.0).to(tl.float32)
        s_lo = tl.load(SIN + m[:, None] * scm + j[None, :] * scd, mask=mask_m[:, None], other=0.0).to(tl.float32)
        s_hi = tl.load(SIN + m[:, None] * scm + (HALF + j)[None, :] * scd, mask=mask_m[:, None], other=0.0).to(tl.float32)
        lo, hi = lo * c_lo + (-hi) * s_lo, hi * c_hi + lo * s_hi
    if head < HQ:
        out = QO + m[:, None] * sqm + head * sqh
        tl.store(out + j[None, :] * sqd, lo.to(QO.dtype.element_ty), mask=mask_m[:, None])
        tl.store(out + (HALF + j)[None, :] * sqd, hi.to(QO.dtype.element_ty), mask=mask_m[:, None])
    else:
        b = m // T
        t = m % T
        if HAS_ROWS:
            r = tl.load(ROWS + b, mask=mask_m, other=0).to(tl.int64)
        else:
            r = (row0 + b).to(tl.int64)
        p = tl.load(POS + b * spb + t * spt, mask=mask_m, other=-1).to(tl.int64)
        mw = (mask_m & (p >= 0) & (p < S))[:, None]
        if head < HQ + HKV:
            out = KC + r[:, None] * sckr + (head - HQ) * sckh + p[:, None] * scks
            step = sckd
        else:
            out = VC + r[:, None] * scvr + (head - HQ - HKV) * scvh + p[:, None] * scvs
            step = scvd
        tl.store(out + j[None, :] * step, lo.to(KC.dtype.element_ty), mask=mw)
        tl.store(out + (HALF + j)[None, :] * step, hi.to(KC.dtype.element_ty), mask=mw)

@triton.jit
def norm_gate_up_kernel(X, DELTA, RES, NW, W, OUT, M, eps, sxm, sdm, srm, swn, som,
                        K: tl.constexpr, INTER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, HAS_DELTA: tl.constexpr, PDL: tl.constexpr = False,
                        PREFETCH: tl.constexpr = False):
    """Program (n, r): intermediate columns n*BLOCK_N.. of SiLU(gate) * up for the rows of tile r. PREFETCH as
    norm_qkv_rope_kernel's."""
    pid = tl.program_id(0)
    c = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_c = c < INTER
    if PREFETCH:
        k = tl.arange(0, BLOCK_K)
        mk = mask_c[:, None] & (k[None, :] < K)
        w_g0 = tl.load(W + c[:, None] * swn + k[None, :], mask=mk, other=0.0)
        w_u0 = tl.load(W + (INTER + c)[:, None] * swn + k[None, :], mask=mk, other=0.0)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)  # this program's tile of rows
    mask_m = m < M
    rstd = _rstd(X, DELTA, RES, m, mask_m, sxm, sdm, srm, eps, pid == 0, K, BLOCK_M, BLOCK_K, HAS_DELTA)
    gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if PREFETCH:
        a = _normalized(X, DELTA, NW, m, mask_m, 0, sxm, sdm, rstd, K, BLOCK_K, HAS_DELTA)
        gate += tl.dot(a, tl.trans(w_g0))
        up += tl.dot(a, tl.trans(w_u0))
    for k0 in range(BLOCK_K if PREFETCH else 0, K, BLOCK_K):
        a = _normalized(X, DELTA, NW, m, mask_m, k0, sxm, sdm, rstd, K, BLOCK_K, HAS_DELTA)
        k = k0 + tl.arange(0, BLOCK_K)
        mk = mask_c[:, None] & (k[None, :] < K)
        w_g = tl.load(W + c[:, None] * swn + k[None, :], mask=mk, other=0.0)  # (BLOCK_N, BLOCK_K)
        w_u = tl.load(W + (INTER + c)[:, None] * swn + k[None, :], mask=mk, other=0.0)
        gate += tl.dot(a, tl.trans(w_g))
        up += tl.dot(a, tl.trans(w_u))
    gate = gate.to(OUT.dtype.element_ty).to(tl.float32)
    up = up.to(OUT.dtype.element_ty).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(OUT.dtype.element_ty).to(tl.float32)  # SiLU, rounded as F.silu's
    tl.store(OUT + m[:, None] * som + c[None, :], (act * up).to(OUT.dtype.element_ty),
             mask=mask_m[:, None] & mask_c[None, :])

@triton.jit
def project_kernel(X, W, OUT, M, sxm, swn, som, K: tl.constexpr, N: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    """Program (n, r): output columns n*BLOCK_N.. of x @ w.T for the rows of tile r. The weight's first
    BLOCK_K features are read before the wait for the kernel before (a constant; with BLOCK_K >= K, all of
    this program's weight)."""
    c = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_c = c < N
    k = tl.arange(0, BLOCK_K)
    w = tl.load(W + c[:, None] * swn + k[None, :], mask=mask_c[:, None] & (k[None, :] < K), other=0.0)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)  # this program's tile of rows
    mask_m = m < M
    x = tl.load(X + m[:, None] * sxm + k[None, :], mask=mask_m[:, None] & (k[None, :] < K), other=0.0)
    acc = tl.dot(x, tl.trans(w))
    for k0 in range(BLOCK_K, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        mk = k[None, :] < K
        w = tl.load(W + c[:, None] * swn + k[None, :], mask=mask_c[:, None] & mk, other=0.0)
        x = tl.load(X + m[:, None] * sxm + k[None, :], mask=mask_m[:, None] & mk, other=0.0)
        acc += tl.dot(x, tl.trans(w))
    tl.store(OUT + m[:, None] * som + c[None, :], acc.to(OUT.dtype.element_ty), mask=mask_m[:, None] & mask_c[None, :])

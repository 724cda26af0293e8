"""Small Triton kernels for the engine's short GPU steps (decode, draft and verify): the KV-cache write
(alone, or with the fused path's rotary embedding), the argmax over the vocabulary, the sampled
steps' uniform draws, tempered softmax and inverse-CDF draw, the vocabulary projection, and the n-gram
lookup's proposals.

Inside a CUDA graph of a small model a step's time is its kernels' own latencies, one after another
(on the H200 about 1 us for the emptiest kernel; bench/RESULTS.md, runs 12-14). Writing a layer's new
keys and values through advanced indexing costs 5-6 kernels (an `arange`, index computations, one
scatter for K and one for V) and 7-12 us a layer, about a sixth of a decode step; `kv_write` does the
same copy in one launch. It is an exact copy: nothing downstream changes by a bit. `argmax` returns
exactly torch.argmax's index (the first of equal maxima) in about a fifth of its time on one row.

A sampled round draws gamma tokens from the draft and one from the verifier (the residual after a rejection,
else the bonus); in torch each draw is a softmax with its temperature and one-hot guards, then a float64
cumulative sum and a sorted search, about twenty kernels over the vocabulary. `tempered_softmax` and `inverse_cdf` do each half in one launch.
They give the same distribution, not always the same bits: a probability can differ from torch's in its
last bits (another summation order), so a draw lying within rounding of a CDF entry can pick its neighbour.
Both the captured round and the general loop use them, so the two still give the same tokens on a GPU.

The target's vocabulary projection (`vocab_projection`) reads the 16-bit lm_head weight itself, with fp32
sums, instead of an fp32 copy of it through cuBLAS: half the bytes, and one tile per 16 rows, so a row's
logits are the same in a decode step and in a verify pass.

Every function returns False / None for a call it does not serve (CPU tensors outside Triton's
interpreter, dtypes or shapes it is not written for); the caller then does the work as before.
"""

from __future__ import annotations

import functools
import os
import types

import torch

ENABLED = True  # False: every function here declines, callers do the work as before (A/B runs: bench.round_profile)
# False (or FLASHSPEC_SAMPLING_KERNELS=0 in the environment): only the sampling kernels (tempered_softmax,
# inverse_cdf) decline, for A/B runs (bench.gpu's setup line says which; bench.round_profile --sampling-compare)
SAMPLING = os.environ.get("FLASHSPEC_SAMPLING_KERNELS", "1") != "0"


@functools.lru_cache(maxsize=1)
def _kernels():
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @triton.jit
    def kv_write_kernel(K, V, KC, VC, ROWS, POS, row0, T, S,
                        skb, skh, skt, skd, svb, svh, svt, svd,
                        sckr, sckh, scks, sckd, scvr, scvh, scvs, scvd, spb, spt,
                        H: tl.constexpr, D: tl.constexpr, HP: tl.constexpr, HAS_ROWS: tl.constexpr,
                        PDL: tl.constexpr = False):
        """One program per (row, new token): all KV heads' keys and values into the cache at its position."""
        if PDL:  # programmatic dependent launch: wait for the kernel before, let the next one launch
            gdc_wait()
            gdc_launch_dependents()
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
        # A position outside the cache writes nothing. (The scalar test joins the block's through tl.where, not &:
        # Triton 3.9's interpreter gives a block & a scalar comparison an int32 mask, which a load refuses.)
        m = tl.where((p >= 0) & (p < S), (h[:, None] < H) & (d[None, :] < D), False)
        k = tl.load(K + b * skb + h[:, None] * skh + t * skt + d[None, :] * skd, mask=m)
        tl.store(KC + r * sckr + h[:, None] * sckh + p * scks + d[None, :] * sckd, k, mask=m)
        v = tl.load(V + b * svb + h[:, None] * svh + t * svt + d[None, :] * svd, mask=m)
        tl.store(VC + r * scvr + h[:, None] * scvh + p * scvs + d[None, :] * scvd, v, mask=m)

    @triton.jit
    def argmax_partial(X, VAL, IDX, V, sxr, C, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        """Program (row, chunk): the largest value of one chunk of a row and its first index."""
        if PDL:  # programmatic dependent launch: wait for the kernel before, let the next one launch
            gdc_wait()
            gdc_launch_dependents()
        r = tl.program_id(0)
        c = tl.program_id(1)
        offs = c * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(X + r * sxr + offs, mask=offs < V, other=-float("inf")).to(tl.float32)
        x = tl.where(x != x, float("inf"), x)  # NaN counts as the largest value, as in torch.argmax
        v, i = tl.max(x, 0, return_indices=True, return_indices_tie_break_left=True)
        tl.store(VAL + r * C + c, v)
        tl.store(IDX + r * C + c, c * BLOCK + i)

    @triton.jit
    def argmax_final(VAL, IDX, OUT, C, CP: tl.constexpr, PDL: tl.constexpr = False):
        """Program row: the chunk with the largest value (the first of equals) -> the row's index."""
        if PDL:  # programmatic dependent launch: wait for the kernel before, let the next one launch
            gdc_wait()
            gdc_launch_dependents()
        r = tl.program_id(0)
        c = tl.arange(0, CP)
        v = tl.load(VAL + r * C + c, mask=c < C, other=-float("inf"))
        j = tl.argmax(v, 0, tie_break_left=True)
        tl.store(OUT + r, tl.load(IDX + r * C + j))

    @triton.jit
    def rope_kv_write_kernel(QKV, COS, SIN, QO, KC, VC, ROWS, POS, row0, T, S,
                             sqn, sqw, scn, scd, son, soh, sod,
                             sckr, sckh, scks, sckd, scvr, scvh, scvs, scvd, spb, spt,
                             HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, HQP: tl.constexpr,
                             HKP: tl.constexpr, HAS_ROWS: tl.constexpr, PDL: tl.constexpr = False):
        """One program per (row, new token) of a fused q|k|v projection: RoPE on the query heads (out to QO)
        and on the key heads, and the keys and values written into the cache at the token's position. (Its
        first lines repeat kv_write_kernel's: a jit function defined in this closure cannot call another.)"""
        if PDL:  # programmatic dependent launch: wait for the kernel before, let the next one launch
            gdc_wait()
            gdc_launch_dependents()
        i = tl.program_id(0)
        b = i // T
        t = i % T
        if HAS_ROWS:
            r = tl.load(ROWS + b).to(tl.int64)
        else:
            r = (row0 + b).to(tl.int64)
        p = tl.load(POS + b * spb + t * spt).to(tl.int64)
        d = tl.arange(0, D)
        partner = (d + D // 2) % D  # rotate_half: x[d + D/2] negated in the first half, x[d - D/2] in the second
        sign = tl.where(d < D // 2, -1.0, 1.0)
        cos = tl.load(COS + i * scn + d * scd).to(tl.float32)
        sin = tl.load(SIN + i * scn + d * scd).to(tl.float32)
        row = QKV + i * sqn
        hq = tl.arange(0, HQP)
        mq = (hq[:, None] < HQ) & (d[None, :] < D)
        x = tl.load(row + (hq[:, None] * D + d[None, :]) * sqw, mask=mq, other=0.0).to(tl.float32)
        xr = tl.load(row + (hq[:, None] * D + partner[None, :]) * sqw, mask=mq, other=0.0).to(tl.float32)
        q = x * cos[None, :] + xr * sign[None, :] * sin[None, :]
        tl.store(QO + i * son + hq[:, None] * soh + d[None, :] * sod, q.to(QO.dtype.element_ty), mask=mq)
        hk = tl.arange(0, HKP)
        mk = (hk[:, None] < HKV) & (d[None, :] < D)
        mw = tl.where((p >= 0) & (p < S), mk, False)  # as kv_write_kernel's mask
        x = tl.load(row + ((HQ + hk[:, None]) * D + d[None, :]) * sqw, mask=mk, other=0.0).to(tl.float32)
        xr = tl.load(row + ((HQ + hk[:, None]) * D + partner[None, :]) * sqw, mask=mk, other=0.0).to(tl.float32)
        k = x * cos[None, :] + xr * sign[None, :] * sin[None, :]
        tl.store(KC + r * sckr + hk[:, None] * sckh + p * scks + d[None, :] * sckd, k.to(KC.dtype.element_ty), mask=mw)
        v = tl.load(row + ((HQ + HKV + hk[:, None]) * D + d[None, :]) * sqw, mask=mk, other=0.0)
        tl.store(VC + r * scvr + hk[:, None] * scvh + p * scvs + d[None, :] * scvd, v, mask=mw)

    @triton.jit
    def uniform_kernel(STATE, OUT, offset, per_row, ssb, ssc, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        """Program row: its stream's draws counter + offset + j, j < per_row (engine.sampling.uniform_at's
        int64 arithmetic, op for op)."""
        if PDL:  # programmatic dependent launch: wait for the kernel before, let the next one launch
            gdc_wait()
            gdc_launch_dependents()
        b = tl.program_id(0)
        key = tl.load(STATE + b * ssb)
        counter = tl.load(STATE + b * ssb + ssc)
        j = tl.arange(0, BLOCK)
        x = (counter + offset + j) & 0xFFFFFFFF
        for rnd in tl.static_range(2):  # lowbias32 twice: of the counter, then of that xor the stream's key
            if rnd == 1:
                x = x ^ key
            x = x ^ (x >> 16)
            x = (((((x >> 16) * 0x7FEB352D) & 0xFFFF) << 16) + (x & 0xFFFF) * 0x7FEB352D) & 0xFFFFFFFF
            x = x ^ (x >> 15)
            x = (((((x >> 16) * 0x846CA68B) & 0xFFFF) << 16) + (x & 0xFFFF) * 0x846CA68B) & 0xFFFFFFFF
            x = x ^ (x >> 16)
        bits = x
        tl.store(OUT + b * per_row + j, (bits >> 8).to(tl.float32) * (1.0 / 16777216.0), mask=j < per_row)

    @triton.jit
    def tempered_softmax_kernel(X, TEMP, OUT, sxr, sor, rows_per_temp, V: tl.constexpr, BLOCK: tl.constexpr,
                                PDL: tl.constexpr = False):
        """Program row: softmax(x / t) of its row in fp32, t = TEMP[row // rows_per_temp]; t == 0: one-hot at the
        first largest x (NaN counts as largest). A row longer than a block takes two passes: running max and
        sum, then the probabilities."""
        if PDL:  # programmatic dependent launch: wait for the kernel before, let the next one launch
            gdc_wait()
            gdc_launch_dependents()
        r = tl.program_id(0)
        t = tl.load(TEMP + r // rows_per_temp)
        offs0 = tl.arange(0, BLOCK)
        x_row = X + r.to(tl.int64) * sxr
        o_row = OUT + r.to(tl.int64) * sor
        if V <= BLOCK:  # the whole row in registers: read once (a draft's sub-vocabulary)
            x = tl.load(x_row + offs0, mask=offs0 < V, other=-float("inf")).to(tl.float32)
            if t == 0:
                x = tl.where(x != x, float("inf"), x)
                at = tl.argmax(x, 0, tie_break_left=True)
                tl.store(o_row + offs0, tl.where(offs0 == at, 1.0, 0.0), mask=offs0 < V)
            else:
                x = x / t
                e = tl.exp(x - tl.max(x, 0))
                tl.store(o_row + offs0, e / tl.sum(e, 0), mask=offs0 < V)
        elif t == 0:
            best = -float("inf")
            at = 0
            for start in range(0, V, BLOCK):
                offs = start + offs0
                x = tl.load(x_row + offs, mask=offs < V, other=-float("inf")).to(tl.float32)
                x = tl.where(x != x, float("inf"), x)
                v, i = tl.max(x, 0, return_indices=True, return_indices_tie_break_left=True)
                at = tl.where(v > best, start + i, at)
                best = tl.maximum(best, v)
            for start in range(0, V, BLOCK):
                offs = start + offs0
                tl.store(o_row + offs, tl.where(offs == at, 1.0, 0.0), mask=offs < V)
        else:
            m = -float("inf")
            s = 0.0
            for start in range(0, V, BLOCK):
                offs = start + offs0
                x = tl.load(x_row + offs, mask=offs < V, other=-float("inf")).to(tl.float32) / t
                m_new = tl.maximum(m, tl.max(x, 0))
                s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
                m = m_new
            for start in range(0, V, BLOCK):
                offs = start + offs0
                x = tl.load(x_row + offs, mask=offs < V, other=-float("inf")).to(tl.float32) / t
                tl.store(o_row + offs, tl.exp(x - m) / s, mask=offs < V)

    @triton.jit
    def inverse_cdf_kernel(P, U, OUT, spr, su, V: tl.constexpr, BLOCK: tl.constexpr,
                           PDL: tl.constexpr = False):
        """Program row: the number of fp64 CDF entries at or below u * total (a sorted search), capped at the
        last token of positive probability. A row longer than a block takes two passes, both summing the CDF
        block by block in the same order, so the total is exactly its last entry."""
        if PDL:  # programmatic dependent launch: wait for the kernel before, let the next one launch
            gdc_wait()
            gdc_launch_dependents()
        r = tl.program_id(0)
        offs0 = tl.arange(0, BLOCK)
        p_row = P + r.to(tl.int64) * spr
        if V <= BLOCK:  # the whole row at once (a draft's sub-vocabulary): one read, one sum
            p = tl.load(p_row + offs0, mask=offs0 < V, other=0.0).to(tl.float64)
            c = tl.cumsum(p, 0)
            point = tl.load(U + r * su).to(tl.float64) * tl.sum(tl.where(offs0 == BLOCK - 1, c, 0.0), 0)
            below = tl.sum(tl.where((c <= point) & (offs0 < V), 1, 0), 0)
            last = tl.max(tl.where(p > 0, offs0, 0), 0)
        else:
            total = tl.zeros((), tl.float64)
            last = 0
            for start in range(0, V, BLOCK):
                offs = start + offs0
                p = tl.load(p_row + offs, mask=offs < V, other=0.0).to(tl.float64)
                c = tl.cumsum(p, 0) + total
                total = tl.sum(tl.where(offs0 == BLOCK - 1, c, 0.0), 0)
                last = tl.maximum(last, tl.max(tl.where(p > 0, offs, 0), 0))
            point = tl.load(U + r * su).to(tl.float64) * total
            below = 0
            carry = tl.zeros((), tl.float64)
            for start in range(0, V, BLOCK):
                offs = start + offs0
                p = tl.load(p_row + offs, mask=offs < V, other=0.0).to(tl.float64)
                c = tl.cumsum(p, 0) + carry
                carry = tl.sum(tl.where(offs0 == BLOCK - 1, c, 0.0), 0)
                below += tl.sum(tl.where((c <= point) & (offs < V), 1, 0), 0)
        tl.store(OUT + r, tl.minimum(below, last).to(tl.int64))

    @triton.jit
    def vocab_projection_kernel(X, NW, W, OUT, NORMED, N, V, sxr, swr, sor, snr, eps, H: tl.constexpr,
                                BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, SPLIT: tl.constexpr, NORM: tl.constexpr,
                                TILE_MAJOR: tl.constexpr = False, PDL: tl.constexpr = False):
        """Program (vocabulary block, tile of 16 rows): OUT = X @ W.T over its block, X fp32, W 16-bit and read as
        it is, sums in fp32. SPLIT = 3 cuts each x into three 16-bit parts (hi + mid + lo: 24 mantissa bits
        between them, an fp32's) and adds three tensor-core products into one fp32 accumulator, smallest
        first; SPLIT = 0 widens W and multiplies in fp32 (no tf32). Each output is its row's and column's
        alone: a row gets the same bits whichever other rows share its call. NORM: X holds the model's final
        states (16-bit) and the program takes the final RMSNorm of its rows first (fp32 statistics, the
        normalized row NW * (x * rstd) in fp32, never rounded before the projection); program 0 of the
        vocabulary also writes it rounded to X's dtype into NORMED (the model's final hidden state). TILE_MAJOR: the
        grid is (tiles, vocabulary blocks) instead of (vocabulary blocks, tiles), so a block's tiles are neighbouring
        programs, which run at about the same time and read its weight rows once from memory between them; each
        program computes what it computes in the other order, bit for bit."""
        if PDL:  # programmatic dependent launch: wait for the kernel before, let the next one launch
            gdc_wait()
            gdc_launch_dependents()
        if TILE_MAJOR:
            pm = tl.program_id(0)
            pv = tl.program_id(1)
        else:
            pv = tl.program_id(0)
            pm = tl.program_id(1)
        v = pv * BLOCK_V + tl.arange(0, BLOCK_V)
        m = pm * 16 + tl.arange(0, 16)
        if NORM:
            ss = tl.zeros((16,), tl.float32)
            for k0 in tl.static_range(0, H, BLOCK_H):
                k = k0 + tl.arange(0, BLOCK_H)
                x = tl.load(X + m[:, None] * sxr + k[None, :], mask=(m[:, None] < N) & (k[None, :] < H), other=0.0)
                x = x.to(tl.float32)
                ss += tl.sum(x * x, 1)
            rstd = 1.0 / tl.sqrt(ss / H + eps)
        acc = tl.zeros((16, BLOCK_V), tl.float32)
        for k0 in tl.static_range(0, H, BLOCK_H):
            k = k0 + tl.arange(0, BLOCK_H)
            mk = (m[:, None] < N) & (k[None, :] < H)
            x = tl.load(X + m[:, None] * sxr + k[None, :], mask=mk, other=0.0).to(tl.float32)
            if NORM:
                x = tl.load(NW + k, mask=k < H, other=0.0).to(tl.float32)[None, :] * (x * rstd[:, None])
                if pv == 0:
                    tl.store(NORMED + m[:, None] * snr + k[None, :], x.to(NORMED.dtype.element_ty), mask=mk)
            w = tl.load(W + v[:, None].to(tl.int64) * swr + k[None, :], mask=(v[:, None] < V) & (k[None, :] < H),
                        other=0.0)
            wt = tl.trans(w)
            if SPLIT:
                hi = x.to(W.dtype.element_ty)
                rest = x - hi.to(tl.float32)
                mid = rest.to(W.dtype.element_ty)
                lo = (rest - mid.to(tl.float32)).to(W.dtype.element_ty)
                acc = tl.dot(lo, wt, acc)
                acc = tl.dot(mid, wt, acc)
                acc = tl.dot(hi, wt, acc)
            else:
                acc = tl.dot(x, wt.to(tl.float32), acc, input_precision="ieee")
        tl.store(OUT + m[:, None].to(tl.int64) * sor + v[None, :], acc, mask=(m[:, None] < N) & (v[None, :] < V))

    @triton.jit
    def step_context_kernel(RC, RS, POS, COS, SIN, MASK, T, S, L, spb, spt, src, srs,
                            D: tl.constexpr, DP: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr = False):
        """Program (i, j) for new token i = (row, token): block j of its visibility-mask row (slot s visible iff
        s <= its position), and for j = 0 its position's cos and sin rows in the output's dtype."""
        if PDL:  # programmatic dependent launch: wait for the kernel before, let the next one launch
            gdc_wait()
            gdc_launch_dependents()
        i = tl.program_id(0)
        p = tl.load(POS + (i // T) * spb + (i % T) * spt).to(tl.int64)
        s = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
        tl.store(MASK + i * S + s, (s <= p).to(tl.int8), mask=s < S)
        if tl.program_id(1) == 0:
            d = tl.arange(0, DP)
            m = tl.where((p >= 0) & (p < L), d < D, False)  # as kv_write_kernel's mask
            tl.store(COS + i * D + d, tl.load(RC + p * src + d, mask=m, other=0.0).to(COS.dtype.element_ty), mask=d < D)
            tl.store(SIN + i * D + d, tl.load(RS + p * srs + d, mask=m, other=0.0).to(SIN.dtype.element_ty), mask=d < D)

    @triton.jit
    def lookup_propose_kernel(H, LEN, PROP, COUNT, MATCH, S, shb, shs, slb, gamma,
                              MAX_N: tl.constexpr, MIN_N: tl.constexpr, BLOCK: tl.constexpr, GP: tl.constexpr,
                              REPEAT: tl.constexpr = True, PDL: tl.constexpr = False):
        """One program per row: the most recent earlier occurrence of its last n tokens, for n from MAX_N down to
        MIN_N (the longest that occurred wins), and the gamma tokens that followed it (repeated with their period
        where they reach the row's length); MATCH[r] the n found (0: none)."""
        if PDL:  # programmatic dependent launch: wait for the kernel before, let the next one launch
            gdc_wait()
            gdc_launch_dependents()
        r = tl.program_id(0).to(tl.int64)
        row = H + r * shb
        length = tl.load(LEN + r * slb).to(tl.int64)
        found = length < 0  # False, as a scalar tensor
        follow = length * 0
        matched = length * 0
        for k in tl.static_range(MAX_N - MIN_N + 1):
            # n = MAX_N - k, written out: a name assigned here would be a tensor, and static_range needs a constant
            best = length * 0 - 1
            for c in range(0, tl.where(found, 0, length), BLOCK):  # no scan once a longer n was found
                p = c + tl.arange(0, BLOCK).to(tl.int64)
                # strictly before the suffix, inside the history
                m = (p <= length - (MAX_N - k) - 1) & (p <= S - (MAX_N - k))
                for j in tl.static_range(MAX_N - k):
                    tail = tl.load(row + tl.minimum(tl.maximum(length - (MAX_N - k) + j, 0), S - 1) * shs)
                    m = m & (tl.load(row + (p + j) * shs, mask=m, other=0) == tail)
                best = tl.maximum(best, tl.max(tl.where(m, p, -1), axis=0))
            take = (best >= 0) & (found == 0)
            follow = tl.where(take, best + (MAX_N - k), follow)
            matched = tl.where(take, MAX_N - k, matched)
            found = found | take
        g = tl.arange(0, GP).to(tl.int64)
        if REPEAT:  # where the tokens that followed reach the end, they repeat with their period
            at = follow + g % tl.maximum(length - follow, 1)
            count = gamma + length * 0
        else:
            at = follow + g
            count = tl.minimum(tl.maximum(length - follow, 0), gamma)
        tl.store(PROP + r * gamma + g, tl.load(row + tl.minimum(at, S - 1) * shs), mask=g < gamma)
        tl.store(COUNT + r, tl.where(found, count, 0))
        tl.store(MATCH + r, matched)

    return types.SimpleNamespace(kv_write=kv_write_kernel, argmax_partial=argmax_partial, argmax_final=argmax_final,
                                 rope_kv_write=rope_kv_write_kernel, uniform=uniform_kernel,
                                 tempered_softmax=tempered_softmax_kernel, inverse_cdf=inverse_cdf_kernel,
                                 vocab_projection=vocab_projection_kernel, step_context=step_context_kernel,
                                 lookup_propose=lookup_propose_kernel)


@functools.lru_cache(maxsize=1)
def available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def served(*tensors: torch.Tensor) -> bool:
    """CUDA tensors, or CPU tensors under Triton's interpreter (tests)."""
    if all(t.is_cuda for t in tensors):
        return True
    return all(t.device.type == "cpu" for t in tensors) and os.environ.get("TRITON_INTERPRET") == "1"


# Programmatic dependent launch (Hopper and later): every engine kernel is launched so that the GPU may schedule it
# while the kernel before it still runs, and it waits for that kernel (griddepcontrol.wait) before it reads or writes
# anything. Inside a CUDA graph of a small model each kernel boundary is a launch latency; this hides part of it.
# On by default where the device supports it (GPU run 29: a plain step's graph -6 %, a greedy round's -4 %, the
# same tokens); FLASHSPEC_PDL=0 turns it off.
PDL = os.environ.get("FLASHSPEC_PDL", "1") != "0"


@functools.lru_cache(maxsize=16)
def _pdl_device(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def pdl(t: torch.Tensor) -> dict:
    """An engine kernel's launch options for tensors on t's device: the PDL constexpr (the kernel waits for the one
    before it, then lets the next one launch) and Triton's launch_pdl, both on where `PDL` is set and the GPU is a
    Hopper or later; PDL off otherwise (CPU tensors under Triton's interpreter included)."""
    if PDL and t.is_cuda and _pdl_device(t.device.index if t.device.index is not None else torch.cuda.current_device()):
        return _PDL_ON
    return _PDL_OFF


_PDL_ON, _PDL_OFF = {"PDL": True, "launch_pdl": True}, {"PDL": False}  # unpacked into launches, never changed


def _row_args(rows, input_pos: torch.Tensor) -> tuple[torch.Tensor, int, bool]:
    """The cache-row arguments of the write kernels: (row pointer, first row, HAS_ROWS) for rows None, a
    slice, or an index tensor (the pointer is unread without HAS_ROWS)."""
    if isinstance(rows, torch.Tensor):
        return rows, 0, True
    return input_pos, (rows.start or 0) if isinstance(rows, slice) else 0, False


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
    row_ptr, row0, has_rows = _row_args(rows, input_pos)
    _kernels().kv_write[(bsz * t,)](
        k, v, k_cache, v_cache, row_ptr, input_pos, row0, t, k_cache.shape[2],
        *k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride(), *input_pos.stride(),
        H=heads, D=d, HP=max(1, 1 << (heads - 1).bit_length()), HAS_ROWS=has_rows, num_warps=1, **pdl(k))
    return True


def rope_kv_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, rows, input_pos: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor | None:
    """The fused projection's rotary embedding and cache write in one launch, for a cache whose slot is the
    position: qkv (N, (heads + 2 kv_heads) D) with N = B*T rows in (b, t) order; cos, sin (N, D);
    k_cache/v_cache (R, kv_heads, S, D) of one layer; rows as `kv_write`'s; input_pos (B, T). Returns the
    rotated queries (N, heads, D) and writes the rotated keys and the values at the rows' positions, as
    `engine.rope.apply_rope_qk` followed by `kv_write` do (RoPE in fp32, rounded once to the cache's dtype,
    as the compiled `rope_qk` computes it). On the fused path that is one kernel a layer instead of two.
    None for calls it does not serve (the caller does both steps as before)."""
    bsz, t = input_pos.shape
    d = k_cache.shape[-1] if k_cache.dim() == 4 else 0
    if (not ENABLED or not available() or not served(qkv, cos, sin, k_cache, v_cache, input_pos) or d & (d - 1) or d < 16
            or qkv.dim() != 2 or qkv.shape != (bsz * t, (heads + 2 * kv_heads) * d) or cos.shape != (bsz * t, d)
            or sin.stride() != cos.stride() or k_cache.shape[1] != kv_heads
            or not (qkv.dtype == cos.dtype == sin.dtype == k_cache.dtype == v_cache.dtype)
            or input_pos.dtype not in (torch.int64, torch.int32)
            or (isinstance(rows, torch.Tensor) and (not served(rows) or rows.shape != (bsz,)))):
        return None
    q = torch.empty(bsz * t, heads, d, device=qkv.device, dtype=qkv.dtype)
    if bsz * t == 0:
        return q
    row_ptr, row0, has_rows = _row_args(rows, input_pos)
    _kernels().rope_kv_write[(bsz * t,)](
        qkv, cos, sin, q, k_cache, v_cache, row_ptr, input_pos, row0, t, k_cache.shape[2],
        *qkv.stride(), *cos.stride(), *q.stride(), *k_cache.stride(), *v_cache.stride(), *input_pos.stride(),
        HQ=heads, HKV=kv_heads, D=d, HQP=max(1, 1 << (heads - 1).bit_length()),
        HKP=max(1, 1 << (kv_heads - 1).bit_length()), HAS_ROWS=has_rows, num_warps=1, **pdl(qkv))
    return q


# A forward pass's shared inputs (`Transformer.context`: the new tokens' cos and sin rows and their visibility mask) in
# one launch instead of six small ones (two gathers, two casts, an arange and a comparison); a speculative round
# builds about 2 gamma + 2 of them. Off: on the H200 it took 3.8 % off a round's graphs but end to end its effect
# was inside the spread between processes (bench/RESULTS.md, run 31). FLASHSPEC_CONTEXT_KERNEL=1 turns it on.
CONTEXT = os.environ.get("FLASHSPEC_CONTEXT_KERNEL", "0") == "1"
CONTEXT_BLOCK = 1024  # mask slots a program writes


def step_context(rope_cos: torch.Tensor, rope_sin: torch.Tensor, input_pos: torch.Tensor, dtype: torch.dtype,
                 kv_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(cos, sin (B, 1, T, D) in `dtype`, mask (B, 1, T, kv_len) bool) for positions input_pos (B, T): what
    `rope_cos[input_pos].to(dtype)[:, None]`, the same of `rope_sin`, and `engine.cache.visibility_mask` (slot s
    visible iff s <= the position) give, bit for bit. None for calls it does not serve."""
    if (not (ENABLED and CONTEXT) or not available() or not served(rope_cos, rope_sin, input_pos) or input_pos.dim() != 2
            or input_pos.dtype not in (torch.int64, torch.int32) or rope_cos.dim() != 2 or rope_sin.shape != rope_cos.shape
            or rope_cos.stride(1) != 1 or rope_sin.stride(1) != 1 or kv_len < 1):
        return None
    bsz, t = input_pos.shape
    length, d = rope_cos.shape
    cos = torch.empty(bsz, 1, t, d, device=input_pos.device, dtype=dtype)
    sin = torch.empty_like(cos)
    mask = torch.empty(bsz, 1, t, kv_len, device=input_pos.device, dtype=torch.bool)
    if bsz * t:
        _kernels().step_context[(bsz * t, -(-kv_len // CONTEXT_BLOCK))](
            rope_cos, rope_sin, input_pos, cos, sin, mask.view(torch.uint8), t, kv_len, length, *input_pos.stride(),
            rope_cos.stride(0), rope_sin.stride(0), D=d, DP=max(2, 1 << (d - 1).bit_length()), BLOCK_S=CONTEXT_BLOCK,
            num_warps=4, **pdl(input_pos))
    return cos, sin, mask


LOOKUP_BLOCK = 1024  # history positions a program of lookup_propose compares at once


def lookup_propose(history: torch.Tensor, lengths: torch.Tensor, gamma: int, max_n: int, min_n: int,
                   repeat: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """`engine.lookup.propose(..., with_match=True)` in one launch, the same tensors bit for bit: (proposals
    (b, gamma) of history's dtype, counts (b,) int64, the n each row's match has (b,) int64). In torch it is about 20 small kernels for each n (shifted comparisons, a masked
    maximum, gathers), each a node of a lookup round's graph. None for calls it does not serve."""
    if (not ENABLED or not available() or not served(history, lengths) or history.dim() != 2
            or history.dtype not in (torch.int64, torch.int32) or lengths.shape != history.shape[:1]
            or lengths.dtype not in (torch.int64, torch.int32) or gamma < 1 or not 1 <= min_n <= max_n):
        return None
    b, s = history.shape
    proposals = torch.empty(b, gamma, device=history.device, dtype=history.dtype)
    counts = torch.empty(b, device=history.device, dtype=torch.int64)
    matched = torch.empty(b, device=history.device, dtype=torch.int64)
    if b:
        _kernels().lookup_propose[(b,)](history, lengths, proposals, counts, matched, s, *history.stride(),
                                        lengths.stride(0),
                                        gamma, MAX_N=max_n, MIN_N=min_n, BLOCK=LOOKUP_BLOCK, REPEAT=repeat,
                                        GP=max(2, 1 << (gamma - 1).bit_length()), num_warps=4, **pdl(history))
    return proposals, counts, matched


def uniform(state: torch.Tensor, offset: int, rows: int, per_row: int) -> torch.Tensor | None:
    """`engine.sampling.uniform_at`'s draws (rows, per_row) float32 in one launch: the hash of the counters is
    about 50 small integer ops, each a kernel of its own in torch, each a node of a sampled graph. Bit for bit
    the same numbers. None for calls it does not serve."""
    if (not ENABLED or not available() or not served(state) or state.dtype != torch.int64 or state.dim() != 2
            or state.shape != (rows, 2) or per_row < 1):
        return None
    out = torch.empty(rows, per_row, device=state.device, dtype=torch.float32)
    if rows:
        _kernels().uniform[(rows,)](state, out, offset, per_row, *state.stride(),
                                    BLOCK=max(2, 1 << (per_row - 1).bit_length()), num_warps=1, **pdl(state))
    return out


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
    kernels.argmax_partial[(n, chunks)](rows, val, idx, v, rows.stride(0), chunks, BLOCK=ARGMAX_CHUNK, num_warps=4,
                                        **pdl(x))
    kernels.argmax_final[(n,)](val, idx, out, chunks, CP=max(2, 1 << (chunks - 1).bit_length()), num_warps=1, **pdl(x))
    return out.view(x.shape[:-1])


SAMPLING_MAX_BLOCK = 8192  # vocabulary entries a sampling kernel's program holds at once


def _sampling_launch(v: int) -> dict:
    """A sampling kernel's vocabulary block (at most 8,192 entries a pass: a draft's sub-vocabulary at once, the
    target's 49,152 in 6) and warps (16 entries a thread): one program a row streams its row in few steps."""
    block = min(SAMPLING_MAX_BLOCK, max(16, 1 << (v - 1).bit_length()))
    return {"V": v, "BLOCK": block, "num_warps": max(1, min(16, block // 512))}


def tempered_softmax(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor | None:
    """`engine.sampling.processed_probs` without top-k / top-p in one launch: logits (B, ..., V) of any float
    dtype, temperature (B,) float32 -> float32 probabilities (B, ..., V), softmax(logits / t) per row, one-hot
    at the argmax where t == 0. In torch that is about ten kernels over the vocabulary (a sampled round drafts
    gamma times and verifies once). The same distribution; a probability may differ from torch's in its last
    bits (another summation order). None for calls it does not serve."""
    v = logits.shape[-1] if logits.dim() >= 2 else 0
    if (not ENABLED or not SAMPLING or not available() or not served(logits, temperature) or v == 0 or logits.numel() == 0
            or logits.dtype not in (torch.float32, torch.bfloat16, torch.float16) or logits.stride(-1) != 1
            or temperature.dtype != torch.float32 or temperature.shape != (logits.shape[0],)):
        return None
    rows = logits.reshape(-1, v)
    out = torch.empty(rows.shape, device=logits.device, dtype=torch.float32)
    _kernels().tempered_softmax[(rows.shape[0],)](rows, temperature.contiguous(), out, rows.stride(0), out.stride(0),
                                                  rows.shape[0] // logits.shape[0], **_sampling_launch(v),
                                                  **pdl(logits))
    return out.view(logits.shape)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor | None:
    """`engine.sampling.sample_with` in one launch: probs (B, V) float32 (need not sum to 1), u (B,) float32 in
    [0, 1) -> (B,) int64, the first token whose float64 CDF passes u * total (never one of zero probability).
    In torch a cast, a float64 cumulative sum, a search and the guards around it: about ten kernels. The same
    token but where u * total lands within float64 rounding of a CDF entry. None for calls it does not serve."""
    if (not ENABLED or not SAMPLING or not available() or not served(probs, u) or probs.dim() != 2 or probs.dtype != torch.float32
            or probs.shape[1] == 0 or probs.stride(-1) != 1 or u.shape != (probs.shape[0],) or u.dtype != torch.float32
            or (probs.shape[0] == 1 and probs.shape[1] > SAMPLING_MAX_BLOCK)):
        # One row longer than a block (the residual at batch 1): torch's search, which spreads the row over
        # the GPU, is faster there than this kernel's one program (17 against 28 us for 49,152 tokens, run 27)
        return None
    out = torch.empty(probs.shape[0], device=probs.device, dtype=torch.int64)
    if probs.shape[0]:
        _kernels().inverse_cdf[(probs.shape[0],)](probs, u, out, probs.stride(0), u.stride(0),
                                                  **_sampling_launch(probs.shape[1]), **pdl(probs))
    return out


# False (or FLASHSPEC_VOCAB_KERNEL=0 in the environment): `vocab_projection` declines and the model projects over an
# fp32 copy of its lm_head with F.linear, for A/B runs (bench.round_profile --vocab-calls, --no-vocab-kernel)
VOCAB = os.environ.get("FLASHSPEC_VOCAB_KERNEL", "1") != "0"
VOCAB_MAX_ROWS = 64  # rows a call may have: decode, draft and verify steps and a prefill's last positions


def launch_config(variable: str, text: str, defaults: dict[str, int], powers_of_two: dict[str, int]) -> dict[str, int]:
    """Kernel launch settings: `defaults` with the overrides in `text` ("k=256, c=16": the value of the environment
    variable `variable`, which errors name). The keys of `powers_of_two` must be powers of two of at least their
    value there (tile sizes, warps). A ValueError names what is wrong."""
    config = dict(defaults)
    for item in filter(None, text.replace(" ", "").split(",")):
        key, _, value = item.partition("=")
        if key not in config or not value.isdigit():
            raise ValueError(f"{variable}: {item!r} is not one of {', '.join(k + '=' for k in config)} with a number")
        config[key] = int(value)
    for key, low in powers_of_two.items():
        if config[key] < low or config[key] & (config[key] - 1):
            raise ValueError(f"{variable}: {key}={config[key]} must be a power of two >= {low}")
    return config


# Launch setting: v = vocabulary entries a program, h = features a step, w = warps, split = 3 (three bf16
# tensor-core products) or 0 (fp32 products on the CUDA cores: 4-6x slower than cuBLAS on the H200, kept as the
# path Triton's CPU interpreter can run, whose bf16 dot is wrong), t = 1 to launch a vocabulary block's 16-row tiles
# as neighbouring programs in a call of more than 16 rows (it reads the weight about once instead of once a tile;
# same bits), 0 to launch every block of one tile before the next tile's. v, h, w: the H200 sweep's best
# (`bench.round_profile --vocab-calls`, bench/RESULTS.md run 28); t = 1: run 44 (H100, 48 rows: 60 -> 50 us with the
# norm inside the launch). FLASHSPEC_VOCAB_CONFIG="v=64,w=8" overrides some.
def vocab_config(variable: str, text: str, defaults: dict[str, int]) -> dict[str, int]:
    """The vocabulary projection's launch setting: `defaults` with the overrides in `text` (`launch_config`, errors
    naming `variable`), split 3 or 0 and t 1 or 0. A ValueError names what is wrong."""
    config = launch_config(variable, text, defaults, {"v": 16, "h": 16, "w": 1})
    if config["split"] not in (0, 3):
        raise ValueError(f"{variable}: split={config['split']} must be 3 (bf16 parts) or 0 (fp32 products)")
    if config["t"] not in (0, 1):
        raise ValueError(f"{variable}: t={config['t']} must be 1 (a block's tiles side by side) or 0")
    return config


VOCAB_CONFIG = vocab_config("FLASHSPEC_VOCAB_CONFIG", os.environ.get("FLASHSPEC_VOCAB_CONFIG", ""),
                            {"v": 128, "h": 64, "w": 4, "split": 3, "t": 1})


def vocab_projection(x: torch.Tensor, weight: torch.Tensor, config: dict | None = None) -> torch.Tensor | None:
    """fp32 logits x @ weight.T of fp32 rows x (..., H) and a 16-bit vocabulary weight (V, H), read as it is:
    half the bytes of the fp32 copy F.linear needs (113 MB for the default model's 49,152 x 576). Each x is cut
    into three bf16 parts whose sum is x to fp32's 24 bits; each part's product with the weight runs on the
    tensor cores, accumulated in fp32. A logit agrees with F.linear's over the fp32 copy to fp32 rounding of
    its sum (within 5e-5 at logits of a few units in the H200 sweep). A row's logits do not depend on the
    other rows of its call: a decode step's row and the same row in a verify pass get the same bits, which
    cuBLAS's shape-dependent kernels do not promise. On the H200 (run 28) 22 against 33 us a decode step's
    projection, 23 against 56 us a 6-token verify pass's, 64 against 98 us at 48 rows. None for calls it does
    not serve (more than VOCAB_MAX_ROWS rows, other dtypes, fp16 weights, a gradient to carry): the caller projects
    as before.
    `config` overrides VOCAB_CONFIG's entries (a sweep)."""
    cfg = {**VOCAB_CONFIG, **(config or {})}
    if x.dtype != torch.float32 or not _serves(x, weight, cfg):
        return None
    return _project(x, weight, cfg)[0]


def _serves(x: torch.Tensor, weight: torch.Tensor, cfg: dict, *more: torch.Tensor) -> bool:
    """Whether the vocabulary kernel serves rows x (..., H) against weight (V, H) (and `more` tensors it reads)."""
    h = x.shape[-1] if x.dim() else 0
    return not (not ENABLED or not VOCAB or not available() or not served(x, weight, *more)
                or weight.dtype not in (torch.bfloat16, torch.float16) or weight.dim() != 2 or weight.shape[1] != h
                or weight.stride(1) != 1 or h == 0 or x.numel() == 0 or x.numel() // h > VOCAB_MAX_ROWS
                or (cfg["split"] and weight.dtype != torch.bfloat16)  # fp16 parts of an fp32 would underflow
                or (torch.is_grad_enabled() and any(t.requires_grad for t in (x, weight, *more))))  # no backward here


def _project(x: torch.Tensor, weight: torch.Tensor, cfg: dict, norm_weight: torch.Tensor | None = None,
             eps: float = 0.0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launch the vocabulary projection over x's rows (..., H): (logits (..., V) fp32, the normalized rows in x's
    dtype when norm_weight is given, else None)."""
    h = x.shape[-1]
    rows = x.reshape(-1, h)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    n, vocab = rows.shape[0], weight.shape[0]
    out = torch.empty(n, vocab, device=x.device, dtype=torch.float32)
    normed = None if norm_weight is None else torch.empty(n, h, device=x.device, dtype=x.dtype)
    block_h = min(cfg["h"], max(16, 1 << (h - 1).bit_length()))
    grid = (-(-vocab // cfg["v"]), -(-n // 16))
    tile_major = bool(cfg["t"]) and grid[1] > 1  # one tile: the launch of t=0, whatever t says
    _kernels().vocab_projection[grid[::-1] if tile_major else grid](
        rows, rows if norm_weight is None else norm_weight, weight, out, rows if normed is None else normed, n, vocab,
        rows.stride(0), weight.stride(0), out.stride(0), 0 if normed is None else normed.stride(0), eps,
        H=h, BLOCK_V=cfg["v"], BLOCK_H=block_h, SPLIT=cfg["split"], NORM=norm_weight is not None,
        TILE_MAJOR=tile_major, num_warps=cfg["w"], **pdl(x))
    return out.view(*x.shape[:-1], vocab), None if normed is None else normed.view(x.shape)


# True (the default; FLASHSPEC_VOCAB_NORM=0 turns it off): a low-precision model's final RMSNorm runs inside the
# vocabulary projection's launch (`norm_vocab_projection`) instead of as about eight small torch kernels before it
# (GPU run 29: a plain step's graph -1 %, the same greedy tokens).
VOCAB_NORM = os.environ.get("FLASHSPEC_VOCAB_NORM", "1") != "0"


def norm_vocab_projection(hidden: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                          config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The model's final step for rows of a low-precision model in one launch: hidden (..., H) in the model's dtype
    -> (fp32 logits (..., V) of weight * RMSNorm(hidden) in fp32, the normalized rows rounded to hidden's dtype),
    what `Transformer.forward` computes with torch ops (an fp32 norm, then `vocab_projection`): only the order of
    the fp32 sums differs. Every program normalizes its rows itself (they are a few KB). None for calls it does not
    serve (`VOCAB_NORM` off, and whatever `vocab_projection` declines)."""
    cfg = {**VOCAB_CONFIG, **(config or {})}
    if (not VOCAB_NORM or hidden.dtype not in (torch.bfloat16, torch.float16) or norm_weight.shape != hidden.shape[-1:]
            or not norm_weight.is_contiguous() or not _serves(hidden, weight, cfg, norm_weight)):
        return None
    return _project(hidden, weight, cfg, norm_weight, eps)

"""Attention for the engine's short steps as one Triton kernel (GPU; decode, draft and verify steps).

A decode, draft or verify step attends few new tokens per row (1 to 16) over a KV cache of a few
hundred to a few thousand slots, with the engine's boolean visibility mask. PyTorch SDPA serves that
with an attention kernel plus mask handling kernels around it, and a slower path once a row has more
than one query; inside a CUDA graph of a small model, where a layer is a few dozen microseconds, that
is a large share of the step. This kernel does the whole call in one launch:

* one program per (row, KV head, split of the cache): the query heads that share the KV head (GQA)
  are the rows of one tile, so K and V are read once for the whole group, never repeated per head;
* the visibility mask is read as it is (any mask: causal by position, deep-draft windows, padding);
* online softmax in fp32 over blocks of the cache (flash-decoding), each split writing a partial
  result and its log-sum-exp; a small second kernel merges the splits (one program per output row, all
  splits at once; one split: no merge kernel). With FLASHSPEC_ATTN_INLINE_MERGE=1 (off: 2-2.3x
  slower a call on the H200, bench/RESULTS.md run 31) there is no second kernel: each (row, KV head)'s
  last split program to finish, found by a count in global memory, merges that group's splits itself.

Queries whose mask shows them no key get zeros (SDPA would give NaN; the engine never asks for such a
row except on padding rows, whose output nobody reads). fp32 inputs are multiplied in IEEE fp32 (not
TF32), so an fp32 engine stays exact to rounding; bf16/fp16 inputs use the tensor cores with fp32
accumulation, as flash attention does.

`triton_attention` returns None when a call is outside what the kernel serves (not CUDA, too many
queries per row for one tile, an unsupported head size): the caller then uses SDPA.
"""

from __future__ import annotations

import functools
import os

import torch

from engine.triton_kernels import pdl, served

MAX_TILE_ROWS = 64  # query heads per KV head x new tokens per row served by one tile
BLOCK_N = 64  # cache slots per inner-loop block


# Warps of a program whose tile has more than 32 rows (BLOCK_M 64: a lone row's 15-token streak round at 3 query
# heads a KV head is 48 rows). At 4 warps Triton compiles such a tile's products to Hopper's warpgroup `wgmma`,
# where every smaller tile takes `mma.sync` (python -m bench.kernel_ptx). Measured on an H100 (python -m
# bench.tile_bits, bench/RESULTS.md run 48): a query's bf16 bits in a wide call differ from its bits alone in a few
# elements whatever the instruction (mma.sync tiles of 32 rows too), and 2 warps, which keep 64-row tiles on
# mma.sync, change none of that and cost 1.2-1.8x a call. So 4; the tools override it to measure.
WIDE_WARPS = 4


def tile(rows: int) -> tuple[int, int]:
    """(BLOCK_M, warps) of a program whose tile holds `rows` query rows (query heads of a KV head x new tokens): a
    power of two, at least 16 (tl.dot's smallest), and 4 warps, `WIDE_WARPS` past 32 rows."""
    block_m = max(16, 1 << (rows - 1).bit_length())
    return block_m, 4 if block_m <= 32 else WIDE_WARPS


@functools.lru_cache(maxsize=1)
def _kernels():
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @triton.jit
    def attend(Q, K, V, M, O, LSE, ROWS, POS, OUT, CNT, QIDX,
               sqb, sqh, sqt, sqd, skb, skh, sks, skd, svb, svh, svs, svd, smb, smt, sms,
               sob, soh, sot, sod, so_split, slb, slh, slt, sl_split, spb, spt, sfb, sfh, sft, sfd,
               T, S, per_split, n_split, scale,
               G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               IEEE: tl.constexpr, SPLIT: tl.constexpr, HAS_ROWS: tl.constexpr, HAS_POS: tl.constexpr,
               BLOCK_T: tl.constexpr, PDL: tl.constexpr = False, INLINE_MERGE: tl.constexpr = False,
               FENCE: tl.constexpr = False, HAS_QIDX: tl.constexpr = False):
        if PDL:  # programmatic dependent launch (engine.triton_kernels.pdl)
            gdc_wait()
            gdc_launch_dependents()
        b = tl.program_id(0)
        if HAS_ROWS:
            kb = tl.load(ROWS + b)  # the cache row this batch row reads, in place (no gathered copy)
        else:
            kb = b
        hk = tl.program_id(1)
        sp = tl.program_id(2)
        if HAS_POS:
            # Slot == position: nothing past the row's last query position is visible. The row's splits share
            # its filled slots (whole blocks each); splits past them exit at once. So a graph captured over the
            # whole cache reads only what the row has filled, whatever its length at replay.
            tt = tl.arange(0, BLOCK_T)
            used = tt < T
            if HAS_QIDX:  # only the row's packed queries: past its chain the slots may hold anything
                used = used & (tl.load(QIDX + b * T + tt, mask=used, other=-1) >= 0)
            limit = tl.max(tl.load(POS + b * spb + tt * spt, mask=used, other=0), 0) + 1
            limit = tl.minimum(limit, S).to(tl.int32)
            per = tl.cdiv(tl.cdiv(limit, BLOCK_N), n_split) * BLOCK_N
        else:
            limit = S
            per = per_split
        m = tl.arange(0, BLOCK_M)
        d = tl.arange(0, D)
        g = m // T  # query head within the group
        t = m % T  # new token
        live = m < G * T
        h = hk * G + g
        if HAS_QIDX:  # packed queries: row b's token t is query QIDX[b, t] of Q (N, Hq, 1, D) (-1: none)
            qi = tl.load(QIDX + b * T + t, mask=live, other=-1).to(tl.int64)
            live = live & (qi >= 0)
            q_at = qi[:, None] * sqb + h[:, None] * sqh
        else:
            q_at = b * sqb + h[:, None] * sqh + t[:, None] * sqt
        q = tl.load(Q + q_at + d[None, :] * sqd, mask=live[:, None], other=0.0)
        m_i = tl.full((BLOCK_M,), -1.0e30, tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, D), tl.float32)
        start = sp * per
        for n0 in range(0, per, BLOCK_N):  # per: a multiple of BLOCK_N
            n = start + n0 + tl.arange(0, BLOCK_N)
            inside = n < limit
            k = tl.load(K + kb * skb + hk * skh + n[:, None] * sks + d[None, :] * skd, mask=inside[:, None], other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = s * scale
            vis = tl.load(M + b * smb + t[:, None] * smt + n[None, :] * sms, mask=live[:, None] & inside[None, :], other=0)
            vis = vis != 0
            s = tl.where(vis, s, -1.0e30)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.where(vis, tl.exp(s - m_new[:, None]), 0.0)
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(V + kb * svb + hk * svh + n[:, None] * svs + d[None, :] * svd, mask=inside[:, None], other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        seen = l_i > 0
        out = acc / tl.where(seen, l_i, 1.0)[:, None]
        o_ptr = O + b * sob + h[:, None] * soh + t[:, None] * sot + d[None, :] * sod
        if SPLIT:  # partial results: O (splits, B, Hq, T, D) and LSE (splits, B, Hq, T), both fp32
            lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), -1.0e30)
            l_ptr = LSE + b * slb + h * slh + t * slt
            tl.store(l_ptr + sp * sl_split, lse, mask=live)
            tl.store(o_ptr + sp * so_split, out, mask=live[:, None])
            if INLINE_MERGE:
                # The (row, KV head)'s last split to finish merges them all into OUT (no merge kernel): every
                # thread fences its partial stores at GPU scope, a barrier, then one thread counts (acquire-release),
                # as CUDA's threadfence reduction does; the last program's count acquires every split's stores and
                # it reads them at L2 (.cg), past L1. It sets the count back to 0 for the next call.
                if FENCE:  # the GPU (Triton's interpreter has no inline assembly and runs programs one by one)
                    tl.inline_asm_elementwise("fence.acq_rel.gpu; mov.b32 $0, $1;", "=r,r", [live.to(tl.int32)],
                                              dtype=tl.int32, is_pure=False, pack=1)
                tl.debug_barrier()
                cnt = CNT + b * tl.num_programs(1) + hk
                if tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu") == n_split - 1:
                    m_all = tl.full((BLOCK_M,), -1.0e30, tl.float32)
                    for j in range(0, n_split):
                        m_all = tl.maximum(m_all, tl.load(l_ptr + j * sl_split, mask=live, other=-1.0e30,
                                                          cache_modifier=".cg"))
                    total = tl.zeros((BLOCK_M,), tl.float32)
                    merged = tl.zeros((BLOCK_M, D), tl.float32)
                    for j in range(0, n_split):
                        lse_j = tl.load(l_ptr + j * sl_split, mask=live, other=-1.0e30, cache_modifier=".cg")
                        w = tl.where(lse_j > -1.0e29, tl.exp(lse_j - m_all), 0.0)
                        total += w
                        merged += w[:, None] * tl.load(o_ptr + j * so_split, mask=live[:, None], other=0.0,
                                                       cache_modifier=".cg")
                    merged = merged / tl.where(total > 0, total, 1.0)[:, None]
                    f_ptr = OUT + b * sfb + h[:, None] * sfh + t[:, None] * sft + d[None, :] * sfd
                    tl.store(f_ptr, merged.to(OUT.dtype.element_ty), mask=live[:, None])
                    tl.atomic_xchg(cnt, 0, sem="relaxed", scope="gpu")
        elif HAS_QIDX:  # O is the packed output (N, Hq, 1, D)
            tl.store(O + qi[:, None] * sob + h[:, None] * soh + d[None, :] * sod, out.to(O.dtype.element_ty),
                     mask=live[:, None])
        else:
            tl.store(o_ptr, out.to(O.dtype.element_ty), mask=live[:, None])

    @triton.jit
    def merge(P, LSE, O, n_split, sp_o, sp_l, QIDX, HQ, D: tl.constexpr, SP: tl.constexpr, PDL: tl.constexpr = False,
              HAS_QIDX: tl.constexpr = False):
        """Partial outputs P (splits, R, D) with log-sum-exps LSE (splits, R) -> O (R, D), rows in (b, t, head)
        order; one program per row, every split loaded at once (a step's merge is latency, not work: no loop
        of dependent loads). HAS_QIDX: O is packed (N, HQ, D), row (b, t, head) going to QIDX[b, t] (none
        where -1)."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        r = tl.program_id(0)
        sp = tl.arange(0, SP)
        d = tl.arange(0, D)
        live = sp < n_split
        lse = tl.load(LSE + sp * sp_l + r, mask=live, other=-1.0e30)
        part = tl.load(P + sp[:, None] * sp_o + r * D + d[None, :], mask=live[:, None], other=0.0)
        m = tl.max(lse, 0)
        w = tl.where(lse > -1.0e29, tl.exp(lse - m), 0.0)
        total = tl.sum(w, 0)
        out = tl.sum(w[:, None] * part, 0) / tl.where(total > 0, total, 1.0)
        if HAS_QIDX:
            qi = tl.load(QIDX + r // HQ).to(tl.int64)
            tl.store(O + (qi * HQ + r % HQ) * D + d, out.to(O.dtype.element_ty), mask=(d * 0 + qi) >= 0)
        else:
            tl.store(O + r * D + d, out.to(O.dtype.element_ty))

    return attend, merge


# A split call's last program merges the splits (no merge kernel). Off: on the H200 a call took 2-2.3x as long
# as the split and merge kernels together (bench/RESULTS.md, run 31). FLASHSPEC_ATTN_INLINE_MERGE=1 turns it on.
INLINE_MERGE = os.environ.get("FLASHSPEC_ATTN_INLINE_MERGE", "0") == "1"
_COUNTS: dict[torch.device, torch.Tensor] = {}


def _merge_counts(device: torch.device, groups: int) -> torch.Tensor | None:
    """The finished-split counts of the inline merge, one int32 per (row, KV head), all 0 between calls (each
    call's last program sets its own back): one buffer per device, made on first use outside a CUDA graph
    capture (a capture's allocation would not outlive its graph). None (the merge kernel runs) where it cannot
    be made or is too small. Replays run one at a time on one stream (engine.cuda_graphs), so calls never
    share a count at the same time."""
    counts = _COUNTS.get(device)
    if counts is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        counts = _COUNTS[device] = torch.zeros(4096, dtype=torch.int32, device=device)
    return counts if groups <= counts.numel() else None


def _splits(batch_heads: int, slots: int) -> int:
    """Cache splits per (row, KV head): about 384 programs in all, at most 16 splits, each at least one
    block of slots. From the H200 (SmolLM2 shapes, bf16, the one-program-per-row merge): bs 1 at 704 slots
    4.3 us with 11 splits against 6.0 with 4 and 12.0 unsplit; bs 8 at 768 fastest with 12-16, bs 64 at
    1,024 with 2 (bench/RESULTS.md)."""
    return max(1, min(16, -(-384 // max(batch_heads, 1)), -(-slots // BLOCK_N)))


def triton_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     splits: int | None = None, rows: torch.Tensor | None = None,
                     kv_len: int | None = None, positions: torch.Tensor | None = None,
                     qidx: torch.Tensor | None = None) -> torch.Tensor | None:
    """q (B, Hq, T, D); k, v (B, Hkv, S, D); mask (B, 1, T, S) bool (True = visible) -> (B, Hq, T, D),
    or None when the kernel does not serve this call (use SDPA).

    With `qidx` (B, T) int64 (with `rows`): the queries are packed, q (N, Hq, 1, D), row b's token t being
    q[qidx[b, t]] (-1: none), and so is the output (N, Hq, 1, D): rows whose chains of new tokens differ in
    length (an allotted lookup round, `engine.lookup.allotted_verify`) attend as one tile a row, each row's
    keys and values read once, where one token a row would read them once a token.

    With `rows` (B,) int64: k and v are a whole cache layer (R, Hkv, S_max, D), batch row b attends the
    first `kv_len` slots of cache row rows[b] in place: no gathered copy of the rows' keys and values
    (`KVCache.read` with an index tensor copies them all, every layer of every step).

    With `positions` (B, T), the queries' positions in a cache whose slot is the position (the mask shows
    a query no slot past its own position): row b reads only slots up to its largest position, the rest
    of the S slots are skipped, not masked. S can then be the whole cache, and one CUDA graph serves every
    sequence length (`DecodeEngine.kv_bucket`)."""
    bsz, hq, t, d = q.shape
    if qidx is not None:  # packed queries (N, Hq, 1, D): B rows of T tokens, as qidx says
        if rows is None or qidx.dim() != 2 or qidx.dtype != torch.long or t != 1:
            return None
        (bsz, t), qidx = qidx.shape, qidx.contiguous()
    hkv = k.shape[1]
    s = k.shape[2] if rows is None else kv_len
    group = hq // hkv
    if (not served(q) or hq % hkv or group * t > MAX_TILE_ROWS or d not in (16, 32, 64, 128, 256)
            or q.dtype not in (torch.float32, torch.bfloat16, torch.float16) or not (k.dtype == v.dtype == q.dtype)
            or mask.dtype != torch.bool or mask.shape[1] != 1 or mask.shape[-1] != s
            or (rows is not None and (rows.shape != (bsz,) or rows.dtype != torch.long or s > k.shape[2]))
            or (positions is not None and positions.shape != (bsz, t))
            or (qidx is not None and mask.shape[:3] != (bsz, 1, t))):
        return None
    attend, merge = _kernels()
    block_m, warps = tile(group * t)
    n_split = splits if splits is not None else _splits(bsz * hkv, s)
    per_split = -(-s // n_split)
    per_split = -(-per_split // BLOCK_N) * BLOCK_N  # whole blocks per split
    if positions is None:
        n_split = -(-s // per_split)
    # else: each program splits its row's filled slots (in whole blocks) among the n_split programs itself
    m8 = mask.view(torch.uint8)
    mb, _, mt, ms = m8.stride()
    packed = qidx is not None
    common = dict(G=group, D=d, BLOCK_M=block_m, BLOCK_N=BLOCK_N, IEEE=q.dtype == torch.float32,
                  HAS_ROWS=rows is not None, HAS_POS=positions is not None,
                  BLOCK_T=max(2, 1 << (t - 1).bit_length()), HAS_QIDX=packed,
                  num_warps=warps, **pdl(q))
    qidx_ptr = qidx if packed else q  # unread without HAS_QIDX
    row_ptr = rows if rows is not None else q  # unread without HAS_ROWS
    pos_ptr, pos_strides = (positions, positions.stride()) if positions is not None else (q, (0, 0))
    scale = d ** -0.5
    # The output is laid out (B, T, Hq, D) and returned as its (B, Hq, T, D) view: the o_proj input
    # out.transpose(1, 2).reshape(B * T, Hq * D) is then a view, not a copy kernel a layer (verify and draft
    # steps, T > 1). Partial results are laid out the same way, so the merge writes rows in that order.
    if packed:  # (N, Hq, 1, D), laid out (N, 1, Hq, D) as the unpacked output is
        out = torch.empty(q.shape[0], 1, hq, d, device=q.device, dtype=q.dtype).transpose(1, 2)
    else:
        out = torch.empty(bsz, t, hq, d, device=q.device, dtype=q.dtype).transpose(1, 2)
    if n_split == 1:
        attend[(bsz, hkv, 1)](q, k, v, m8, out, out, row_ptr, pos_ptr, out, q, qidx_ptr, *q.stride(), *k.stride(),
                              *v.stride(), mb,
                              mt, ms, *out.stride(), 0, 0, 0, 0, 0, *pos_strides, *out.stride(), t, s, per_split, 1, scale,
                              SPLIT=False, **common)
        return out
    part = torch.empty(n_split, bsz, t, hq, d, device=q.device, dtype=torch.float32).transpose(2, 3)
    lse = torch.empty(n_split, bsz, t, hq, device=q.device, dtype=torch.float32).transpose(2, 3)
    counts = _merge_counts(q.device, bsz * hkv) if INLINE_MERGE and not packed else None
    attend[(bsz, hkv, n_split)](q, k, v, m8, part, lse, row_ptr, pos_ptr, out, counts if counts is not None else q,
                                qidx_ptr, *q.stride(), *k.stride(), *v.stride(), mb, mt, ms, *part.stride()[1:], part.stride(0),
                                *lse.stride()[1:], lse.stride(0), *pos_strides, *out.stride(), t, s, per_split, n_split,
                                scale, SPLIT=True, INLINE_MERGE=counts is not None, FENCE=counts is not None and q.is_cuda,
                                **common)
    if counts is None:
        merge[(bsz * hq * t,)](part, lse, out, n_split, part.stride(0), lse.stride(0), qidx_ptr, hq, D=d,
                               SP=max(2, 1 << (n_split - 1).bit_length()), HAS_QIDX=packed, num_warps=1, **pdl(q))
    return out

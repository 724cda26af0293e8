"""Llama-family decoder (Llama, Mistral, Qwen2) in plain PyTorch, runnable one layer range at a time.

Module names follow Hugging Face's so a checkpoint's state dict loads as it is (minus the
`model.` prefix). `Transformer.forward` runs any contiguous range of layers, from the embeddings
or from given hidden states: a FlashSpec draft runs layers [0, N) of this very module, and the
verifier later runs [N, L) from the hidden states the draft computed.

`Transformer.fuse_for_inference()` switches on the opt-in fused path (engine/fused.py): q/k/v and
gate/up as single GEMMs over views of the same parameters, and optionally compiled elementwise kernels.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.nn.functional as F

from engine import triton_kernels, triton_layer
from engine.attention import AttentionBackend, SdpaBackend
from engine.cache import KVCache
from engine.config import ModelArgs
from engine.rope import apply_rope, rope_tables

if TYPE_CHECKING:
    from engine.fused import FusedLinear, FusedOps, Kernels

log = logging.getLogger(__name__)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class _FusableProjections(nn.Module):
    """fuse() / unfuse() of the projections named in `_fused_parts` that read the same input, kept as
    one FusedLinear in the attribute `_fused_attr` (engine/fused.py)."""

    _fused_attr: str
    _fused_parts: tuple[str, ...]

    def fuse(self) -> None:
        from engine.fused import FusedLinear

        fused = getattr(self, self._fused_attr)
        if fused is None or not fused.intact():
            setattr(self, self._fused_attr, FusedLinear([getattr(self, name) for name in self._fused_parts]))

    def unfuse(self) -> None:
        fused = getattr(self, self._fused_attr)
        if fused is not None:
            fused.release()
            setattr(self, self._fused_attr, None)

    def _apply(self, fn, recurse=True):
        # .to() / .cuda() / .half() give each parameter new storage: fuse again over the converted ones.
        out = super()._apply(fn, recurse)
        fused = getattr(self, self._fused_attr, None)
        if fused is not None and not fused.intact():
            self.fuse()
        return out


def cached_attention(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, ctx: "StepContext",
                     cache_layer: int) -> torch.Tensor:
    """Attention of q (B, Hq, T, D) over the new k, v (B, Hkv, T, D) and, with a cache, everything cached:
    k and v are written at ctx.write_pos first (k and v None: the caller wrote them already). Scattered cache
    rows (an index tensor) are read in place by a backend that can (`attend_rows`: the Triton kernel),
    instead of gathering a copy of every row's keys and values each layer (on the H200 that copy was a
    quarter of a batch-8 round's kernel time)."""
    if ctx.cache is None:
        return ctx.backend(q, k, v, ctx.mask)
    cache = ctx.cache
    if k is not None:
        cache.write(cache_layer, ctx.rows, ctx.write_pos, k, v)
    positions = ctx.write_pos if cache.slot_is_position else None  # a backend may stop at each row's last one
    attend_rows = getattr(ctx.backend, "attend_rows", None)
    pack = ctx.pack
    if pack is not None and attend_rows is not None and cache.reads_in_place and cache.slot_is_position:
        out = attend_rows(q, cache.k[cache_layer], cache.v[cache_layer], pack.rows, ctx.kv_len, pack.mask,
                          pack.positions, qidx=pack.qidx)
        if out is not None:
            return out
    if attend_rows is not None and isinstance(ctx.rows, torch.Tensor) and cache.reads_in_place:
        out = attend_rows(q, cache.k[cache_layer], cache.v[cache_layer], ctx.rows, ctx.kv_len, ctx.mask, positions)
        if out is not None:
            return out
    k, v = cache.read(cache_layer, ctx.rows, ctx.kv_len)  # (B, Hkv, kv_len, D)
    return ctx.backend(q, k, v, ctx.mask, positions)


def short_linear(linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """A bias-free projection of a short step's rows (N, K) as one Triton launch where `triton_layer.project`
    serves it (on unless FLASHSPEC_PROJ_KERNEL=0), else the module."""
    out = triton_layer.project(x, linear.weight) if linear.bias is None else None
    return out if out is not None else linear(x)


class Attention(_FusableProjections):
    _fused_attr, _fused_parts = "qkv", ("q_proj", "k_proj", "v_proj")

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        self.q_proj = nn.Linear(args.hidden_size, args.num_heads * args.head_dim, bias=args.qkv_bias)
        self.k_proj = nn.Linear(args.hidden_size, args.num_kv_heads * args.head_dim, bias=args.qkv_bias)
        self.v_proj = nn.Linear(args.hidden_size, args.num_kv_heads * args.head_dim, bias=args.qkv_bias)
        self.o_proj = nn.Linear(args.num_heads * args.head_dim, args.hidden_size, bias=args.o_bias)
        self.qkv: FusedLinear | None = None  # set by fuse(): one GEMM over views of q/k/v_proj's parameters

    def forward_fused(self, x: torch.Tensor, shape: tuple[int, int], ctx: "StepContext", cache_layer: int,
                      kernels: "Kernels") -> torch.Tensor:
        """x (N, H) with N = B*T rows of shape (B, T) -> (N, H): one q|k|v GEMM, one RoPE pass over q and k."""
        bsz, seqlen = shape
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        n = bsz * seqlen
        qkv = self.qkv(x)  # (N, (Hq + 2 Hkv) D)
        cos, sin = ctx.cos.reshape(n, d), ctx.sin.reshape(n, d)
        cache, q = ctx.cache, None
        if cache is not None and cache.slot_is_position:
            # One kernel: RoPE on q and k, and k and v into the cache (on CUDA; None elsewhere).
            q = triton_kernels.rope_kv_write(qkv, cos, sin, cache.k[cache_layer], cache.v[cache_layer], ctx.rows,
                                             ctx.write_pos, hq, hkv)
        if q is not None:
            return self.attend(q, None, None, shape, ctx, cache_layer)  # k and v are in the cache already
        qk = kernels.rope_qk(qkv, cos, sin, hq + hkv, d)  # (N, Hq + Hkv, D)
        q, k = qk[:, :hq], qk[:, hq:].view(bsz, seqlen, hkv, d).transpose(1, 2)  # k (B, Hkv, T, D)
        v = qkv[:, (hq + hkv) * d :].view(bsz, seqlen, hkv, d).transpose(1, 2)
        return self.attend(q, k, v, shape, ctx, cache_layer)

    def attend(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, shape: tuple[int, int],
               ctx: "StepContext", cache_layer: int, short: bool = False) -> torch.Tensor:
        """The rotated queries (N, Hq, D) over the cache (and the new k, v (B, Hkv, T, D) unless they are in
        it already), then the output projection -> (N, H); `short`: a step the layer kernels take, whose
        projection may too (`short_linear`)."""
        bsz, seqlen = shape
        q = q.view(bsz, seqlen, self.num_heads, self.head_dim).transpose(1, 2)  # (B, Hq, T, D)
        out = cached_attention(q, k, v, ctx, cache_layer)  # (B, Hq, T, D)
        out = out.transpose(1, 2).reshape(bsz * seqlen, -1)
        return short_linear(self.o_proj, out) if short else self.o_proj(out)

    def norm_project_rope(self, x: torch.Tensor, delta: torch.Tensor | None, norm: "RMSNorm", shape: tuple[int, int],
                          ctx: "StepContext", cache_layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The residual add, `norm`, the q|k|v projection, RoPE and the cache write as one kernel
        (engine/triton_layer.py): -> (x + delta, the rotated queries (N, Hq, D)), or None where that kernel
        does not serve the call (the caller takes the separate kernels)."""
        cache = ctx.cache
        if cache is None or not cache.slot_is_position or self.qkv.bias is not None:
            return None
        n, d = x.shape[0], self.head_dim
        return triton_layer.norm_qkv_rope_write(x, delta, norm.weight, norm.eps, self.qkv.weight, ctx.cos.reshape(n, d),
                                                ctx.sin.reshape(n, d), cache.k[cache_layer], cache.v[cache_layer],
                                                ctx.rows, ctx.write_pos, self.num_heads, self.num_kv_heads)

    def forward(self, x: torch.Tensor, ctx: "StepContext", cache_layer: int) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        q = self.q_proj(x).view(bsz, seqlen, self.num_heads, self.head_dim).transpose(1, 2)  # (B, Hq, T, D)
        k = self.k_proj(x).view(bsz, seqlen, self.num_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        v = self.v_proj(x).view(bsz, seqlen, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q = apply_rope(q, ctx.cos, ctx.sin)
        k = apply_rope(k, ctx.cos, ctx.sin)
        out = cached_attention(q, k, v, ctx, cache_layer)  # (B, Hq, T, D)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, seqlen, -1))


class MLP(_FusableProjections):
    _fused_attr, _fused_parts = "gate_up", ("gate_proj", "up_proj")

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=args.mlp_bias)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=args.mlp_bias)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=args.mlp_bias)
        self.gate_up: FusedLinear | None = None  # set by fuse(): one GEMM over views of gate/up_proj's parameters

    def forward_fused(self, x: torch.Tensor, kernels: "Kernels") -> torch.Tensor:
        return self.down_proj(kernels.silu_mul(self.gate_up(x), self.gate_proj.out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.ops: FusedOps | None = None  # set by fuse(): the fused path is on
        self._warned_stale = False

    # ----- the fused inference path (engine/fused.py) -----------------------------------------
    def fuse(self, ops: "FusedOps") -> None:
        self.self_attn.fuse()
        self.mlp.fuse()
        self.ops = ops
        self._warned_stale = False

    def unfuse(self) -> None:
        self.self_attn.unfuse()
        self.mlp.unfuse()
        self.ops = None

    def fusion_active(self) -> bool:
        """Whether this call can take the fused path: fused, weights still aliased, no gradient needed."""
        if self.ops is None:
            return False
        qkv, gate_up = self.self_attn.qkv, self.mlp.gate_up
        if not (qkv.intact() and gate_up.intact()):
            if not self._warned_stale:
                self._warned_stale = True
                log.warning("a fused layer's q/k/v or gate/up parameters were replaced after fuse_for_inference(); "
                            "running it unfused (call fuse_for_inference() again to re-fuse)")
            return False
        return not (torch.is_grad_enabled() and (qkv.needs_grad() or gate_up.needs_grad()))

    def forward_fused(self, x: torch.Tensor, delta: torch.Tensor | None, shape: tuple[int, int], ctx: "StepContext",
                      cache_layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual stream x (N, H) plus a pending `delta` (the previous layer's MLP output, not yet added)
        -> (residual after attention, this layer's MLP output): the add is folded into the next norm."""
        kernels = self.ops.select(shape[1])
        ln1, ln2 = self.input_layernorm, self.post_attention_layernorm
        attn, mlp = self.self_attn, self.mlp
        # The layer kernels (engine/triton_layer.py) take decode, draft and verify steps, not a prefill, and only
        # for a batch all of whose short steps they serve (batches up to 8 by default; triton_layer.MAX_ROWS): then
        # every short step of a request runs the same kernels, so its speculative rounds and its plain decoding
        # round alike. Where a batch's decode steps (8 rows) took them and its verify passes (48 rows) did not,
        # greedy tokens differed between the two in bf16 (bench/RESULTS.md, run 24).
        short = (shape[1] <= self.ops.max_compiled_tokens
                 and shape[0] * self.ops.max_compiled_tokens <= triton_layer.MAX_ROWS)
        done = attn.norm_project_rope(x, delta, ln1, shape, ctx, cache_layer) if short else None
        if done is not None:  # one kernel up to the attention (engine/triton_layer.py)
            x, q = done
            a = attn.attend(q, None, None, shape, ctx, cache_layer, short=True)
        else:
            if delta is None:
                h = kernels.rms_norm(x, ln1.weight, ln1.eps)
            else:
                x, h = kernels.add_rms_norm(x, delta, ln1.weight, ln1.eps)
            a = attn.forward_fused(h, shape, ctx, cache_layer, kernels)
        done = (triton_layer.norm_gate_up_silu(x, a, ln2.weight, ln2.eps, mlp.gate_up.weight, mlp.gate_proj.out_features)
                if short and mlp.gate_up.bias is None else None)
        if done is not None:  # one kernel from the residual add to SiLU(gate) * up
            x, act = done
            return x, short_linear(mlp.down_proj, act)
        x, h = kernels.add_rms_norm(x, a, ln2.weight, ln2.eps)
        return x, mlp.forward_fused(h, kernels)

    def forward(self, x: torch.Tensor, ctx: "StepContext", cache_layer: int) -> torch.Tensor:
        if self.ops is not None and self.fusion_active():
            bsz, seqlen, hidden = x.shape
            res, delta = self.forward_fused(x.reshape(bsz * seqlen, hidden), None, (bsz, seqlen), ctx, cache_layer)
            return (res + delta).view(bsz, seqlen, hidden)
        x = x + self.self_attn(self.input_layernorm(x), ctx, cache_layer)
        return x + self.mlp(self.post_attention_layernorm(x))


@dataclasses.dataclass
class StepContext:
    """What every layer of one forward pass shares.

    input_pos: (B, T) positions of the new tokens; cos/sin: (B, 1, T, D); mask: (B, 1, T, S) bool;
    rows: (B,) cache rows the batch maps to (None = rows 0..B-1); kv_len: cache slots attended;
    slots: (B, T) cache slots the new tokens are written at, when they are not their positions (a draft
    tree's nodes: several tokens share a position, `engine.tree`); None = input_pos.
    """

    input_pos: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    mask: torch.Tensor
    cache: KVCache | None
    rows: torch.Tensor | None
    kv_len: int
    backend: AttentionBackend
    slots: torch.Tensor | None = None
    pack: "PackedRows | None" = None

    @property
    def write_pos(self) -> torch.Tensor:
        """(B, T) the cache slots this pass writes (and, where slot == position, the last one each row sees)."""
        return self.input_pos if self.slots is None else self.slots


@dataclasses.dataclass
class PackedRows:
    """A pass of one token a batch row whose tokens are cache rows' chains of new tokens (an allotted lookup round,
    `engine.lookup.allotted_verify`): `rows` (R,) the cache rows, `qidx` (R, T) the pass's row of each one's token t
    (-1: none), `positions` (R, T) their positions, `mask` (R, 1, T, kv_len) what each sees. A backend with packed
    attention (`attend_rows(..., qidx=)`, the Triton kernel) attends a cache row's tokens as one tile, reading its
    keys and values once; elsewhere each token row attends on its own (the same attention, by position)."""

    rows: torch.Tensor
    qidx: torch.Tensor
    positions: torch.Tensor
    mask: torch.Tensor


@dataclasses.dataclass
class ForwardOutput:
    hidden: torch.Tensor  # (B, T, H) residual stream after the last layer run
    final_hidden: torch.Tensor | None  # (B, T', H) after the final norm, when the range ends the model
    logits: torch.Tensor | None  # (B, T', V) when the range ends the model and logits were asked for
    captured: tuple[torch.Tensor, ...] = ()  # (B, T, H) residual stream after each layer count in `capture`


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs, max_seq_len: int | None = None) -> None:
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.backend: AttentionBackend = SdpaBackend()
        self._fused_ops: FusedOps | None = None  # set by fuse_for_inference()
        self._rope_len = 0
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)
        if max_seq_len != 0:  # 0: built on the meta device by the loader, tables come after loading
            self.ensure_rope(max_seq_len or min(args.max_position_embeddings, 4096))

    @property
    def num_layers(self) -> int:
        return self.args.num_layers

    def ensure_rope(self, max_seq_len: int) -> None:
        """Make the cos/sin tables cover positions [0, max_seq_len)."""
        if max_seq_len <= self._rope_len:
            return
        device = self.embed_tokens.weight.device
        cos, sin = rope_tables(self.args, max_seq_len, device="cpu")
        self.rope_cos, self.rope_sin = cos.to(device), sin.to(device)
        self._rope_len = max_seq_len

    def new_cache(self, batch_size: int, max_seq_len: int, layers: range | None = None) -> KVCache:
        self.args.check_context(max_seq_len)
        self.ensure_rope(max_seq_len)
        weight = self.embed_tokens.weight
        n = len(layers) if layers is not None else self.args.num_layers
        return KVCache(n, batch_size, self.args.num_kv_heads, max_seq_len, self.args.head_dim, weight.dtype, weight.device)

    def context(
        self,
        input_pos: torch.Tensor,
        cache: KVCache | None,
        rows: torch.Tensor | None = None,
        kv_len: int | None = None,
        slots: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> StepContext:
        """Everything layers share for one pass at positions input_pos (B, T). With a cache, `slots` (B, T) are
        where the tokens are written when that is not their positions, and `mask` (B, 1, T, kv_len) what each
        sees (both: a draft tree, `engine.tree`); default: slot == position, each sees the slots up to its own."""
        dtype = self.embed_tokens.weight.dtype
        if cache is not None:
            kv_len = min(kv_len or cache.max_seq_len, cache.max_seq_len)
            if mask is None and slots is not None:
                raise ValueError("tokens written at slots other than their positions need their own mask")
            # Slot == position (a plain KVCache's own mask): cos, sin and the mask in one launch where
            # engine.triton_kernels.step_context serves it (FLASHSPEC_CONTEXT_KERNEL=1), the same values.
            fused = (triton_kernels.step_context(self.rope_cos, self.rope_sin, input_pos, dtype, kv_len)
                     if mask is None and type(cache).visibility is KVCache.visibility else None)
            if fused is not None:
                cos, sin, mask = fused
                return StepContext(input_pos, cos, sin, mask, cache, rows, kv_len, self.backend, slots)
        cos = self.rope_cos[input_pos].to(dtype)[:, None]  # (B, 1, T, D)
        sin = self.rope_sin[input_pos].to(dtype)[:, None]
        if cache is None:
            # No cache (training): attend among the given tokens by position.
            mask = input_pos[:, None, None, :] <= input_pos[:, None, :, None]  # (B, 1, T, T)
            kv_len = input_pos.shape[1]
        elif mask is None:
            mask = cache.visibility(input_pos, rows, kv_len)
        return StepContext(input_pos, cos, sin, mask, cache, rows, kv_len, self.backend, slots)

    def forward(
        self,
        tokens: torch.Tensor | None,
        input_pos: torch.Tensor,
        layers: range | None = None,
        hidden: torch.Tensor | None = None,
        cache: KVCache | None = None,
        rows: torch.Tensor | None = None,
        kv_len: int | None = None,
        logits_index: torch.Tensor | None = None,
        compute_logits: bool = True,
        ctx: StepContext | None = None,
        capture: tuple[int, ...] = (),
    ) -> ForwardOutput:
        """Run layers `layers` (default: all) on tokens (B, T) or on hidden (B, T, H) at input_pos (B, T).

        Cache layer i holds model layer i. `logits_index` (B,) picks one position per row for the
        final norm and logits (e.g. each row's last prompt token); None keeps all T positions.
        `capture`: layer counts c (increasing, layers.start < c < layers.stop) whose residual stream
        (after layers [0, c)) is returned in `captured`, in order (a deep draft's extra features).
        """
        layers = layers if layers is not None else range(self.args.num_layers)
        if hidden is None:
            if layers.start != 0:
                raise ValueError(f"a layer range starting at {layers.start} needs the hidden states entering it")
            hidden = self.embed_tokens(tokens)  # (B, T, H)
        ctx = ctx or self.context(input_pos, cache, rows, kv_len)
        if capture and (any(not layers.start < c < layers.stop for c in capture) or list(capture) != sorted(set(capture))):
            raise ValueError(f"capture {capture} must be increasing layer counts inside ({layers.start}, {layers.stop})")
        captured = []
        for start, stop in zip((layers.start, *capture), (*capture, layers.stop)):
            if self._fused_ops is not None:
                hidden = self._fused_layers(hidden, range(start, stop), ctx)
            else:
                for i in range(start, stop):
                    hidden = self.layers[i](hidden, ctx, i)
            if stop != layers.stop:
                captured.append(hidden)
        captured = tuple(captured)
        if layers.stop != self.args.num_layers:
            return ForwardOutput(hidden, None, None, captured)
        final = hidden
        if logits_index is not None:
            final = hidden[torch.arange(hidden.shape[0], device=hidden.device), logits_index][:, None]  # (B, 1, H)
        if final.dtype == torch.float32:
            final = self.norm(final)
            logits = self.lm_head(final) if compute_logits else None
            return ForwardOutput(hidden, final, logits, captured)
        # Low-precision models: the final norm and the vocabulary projection run in fp32. Greedy
        # decisions are argmaxes over the logits; bf16 logits (8-bit mantissa) tie and flip often,
        # and would make speculative and plain decoding disagree more than their hidden states do.
        fused = (triton_kernels.norm_vocab_projection(final, self.norm.weight, self.norm.eps, self.lm_head.weight)
                 if compute_logits else None)
        if fused is not None:  # both in one launch on the GPU (FLASHSPEC_VOCAB_NORM, on by default)
            logits, normed = fused
            return ForwardOutput(hidden, normed, logits, captured)
        x = final.float()
        x = self.norm.weight.float() * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.norm.eps))
        logits = self._project_vocab(x) if compute_logits else None
        return ForwardOutput(hidden, x.to(final.dtype), logits, captured)

    def _project_vocab(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 logits of fp32 rows x (..., H) for a low-precision model: on the GPU one Triton launch reads the
        16-bit lm_head weight as it is, each row cut into three bf16 parts, the products summed in fp32
        (`triton_kernels.vocab_projection`: half the bytes); otherwise, or for calls of many rows, F.linear over an
        fp32 copy of the weight."""
        logits = triton_kernels.vocab_projection(x, self.lm_head.weight)
        return logits if logits is not None else F.linear(x, self._lm_head_fp32())

    # ----- the fused inference path (engine/fused.py) ---------------------------------------------
    def fuse_for_inference(self, compile: bool | None = None, **kwargs) -> "Transformer":
        """Switch on the fused inference path, in place (off by default; inference only).

        Hand fusion: q/k/v and gate/up each run as one GEMM over a concatenated weight whose slices
        *are* the modules' parameters (views): module structure, parameters and state_dict unchanged,
        no extra memory; the residual add is folded into the following RMSNorm. compile: also
        torch.compile the elementwise pieces (RMSNorm + residual add, RoPE on q and k, SiLU * up) for
        steps of at most 16 tokens per row; None = on when the model is on CUDA. A compile failure
        logs one warning and runs them eagerly. kwargs: `backend`, `max_compiled_tokens`
        (engine.fused.fuse_for_inference). Fuse before building a DecodeEngine on this model.
        """
        from engine.fused import fuse_for_inference

        fuse_for_inference(self, compile, **kwargs)
        return self

    def set_attention_backend(self, name: str) -> "Transformer":
        """Attention for every later pass (`engine.attention.make_backend`: auto, sdpa, flex, triton, ...;
        auto picks by this model's device). Set it before building a DecodeEngine on this model: captured
        CUDA graphs keep the kernels they saw."""
        from engine.attention import make_backend

        self.backend = make_backend(name, self.embed_tokens.weight.device)
        return self

    def unfuse_for_inference(self) -> "Transformer":
        """Back to the unfused path, every parameter in its own storage again."""
        from engine.fused import unfuse

        unfuse(self)
        return self

    @property
    def fused(self) -> str | None:
        """None (unfused), "hand" (fused GEMMs, eager elementwise) or "compiled" (plus compiled elementwise kernels)."""
        ops = self._fused_ops
        if ops is None:
            return None
        return "compiled" if ops.compiling else "hand"

    def _fused_layers(self, hidden: torch.Tensor, layers: range, ctx: StepContext) -> torch.Tensor:
        """Layers `layers` on hidden (B, T, H) as (N, H) rows, each layer's last residual add deferred into
        the next layer's first norm (one kernel fewer per layer). Layers that cannot take the fused path
        right now (see DecoderLayer.fusion_active) run unfused."""
        bsz, seqlen, size = hidden.shape
        x, delta = hidden.reshape(bsz * seqlen, size), None
        for i in layers:
            layer = self.layers[i]
            if layer.fusion_active():
                x, delta = layer.forward_fused(x, delta, (bsz, seqlen), ctx, i)
            else:
                if delta is not None:
                    x, delta = x + delta, None
                x = layer(x.view(bsz, seqlen, size), ctx, i).reshape(bsz * seqlen, size)
        if delta is not None:
            x = x + delta
        return x.view(bsz, seqlen, size)

    def _lm_head_fp32(self) -> torch.Tensor:
        """An fp32 copy of the (frozen) lm_head weight, made once (only a call `_project_vocab`'s kernel does not
        serve needs it)."""
        w = self.lm_head.weight
        cached = getattr(self, "_lm_head_f32", None)
        if cached is None or cached.device != w.device or cached.shape != w.shape:
            cached = self._lm_head_f32 = w.detach().float()
        return cached

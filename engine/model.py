"""Llama-family decoder (Llama, Mistral, Qwen2) in plain PyTorch, runnable one layer range at a time.

Module names follow Hugging Face's so a checkpoint's state dict loads as it is (minus the
`model.` prefix). `Transformer.forward` runs any contiguous range of layers, from the embeddings
or from given hidden states: a FlashSpec draft runs layers [0, N) of this very module, and the
verifier later runs [N, L) from the hidden states the draft computed.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F

from engine.attention import AttentionBackend, SdpaBackend
from engine.cache import KVCache
from engine.config import ModelArgs
from engine.rope import apply_rope, rope_tables


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


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        self.q_proj = nn.Linear(args.hidden_size, args.num_heads * args.head_dim, bias=args.qkv_bias)
        self.k_proj = nn.Linear(args.hidden_size, args.num_kv_heads * args.head_dim, bias=args.qkv_bias)
        self.v_proj = nn.Linear(args.hidden_size, args.num_kv_heads * args.head_dim, bias=args.qkv_bias)
        self.o_proj = nn.Linear(args.num_heads * args.head_dim, args.hidden_size, bias=args.o_bias)

    def forward(self, x: torch.Tensor, ctx: "StepContext", cache_layer: int) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        q = self.q_proj(x).view(bsz, seqlen, self.num_heads, self.head_dim).transpose(1, 2)  # (B, Hq, T, D)
        k = self.k_proj(x).view(bsz, seqlen, self.num_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        v = self.v_proj(x).view(bsz, seqlen, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q = apply_rope(q, ctx.cos, ctx.sin)
        k = apply_rope(k, ctx.cos, ctx.sin)
        if ctx.cache is not None:
            ctx.cache.write(cache_layer, ctx.rows, ctx.input_pos, k, v)
            k, v = ctx.cache.read(cache_layer, ctx.rows, ctx.kv_len)  # (B, Hkv, kv_len, D)
        out = ctx.backend(q, k, v, ctx.mask)  # (B, Hq, T, D)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, seqlen, -1))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=args.mlp_bias)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=args.mlp_bias)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=args.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x: torch.Tensor, ctx: "StepContext", cache_layer: int) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx, cache_layer)
        return x + self.mlp(self.post_attention_layernorm(x))


@dataclasses.dataclass
class StepContext:
    """What every layer of one forward pass shares.

    input_pos: (B, T) positions of the new tokens; cos/sin: (B, 1, T, D); mask: (B, 1, T, S) bool;
    rows: (B,) cache rows the batch maps to (None = rows 0..B-1); kv_len: cache slots attended.
    """

    input_pos: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    mask: torch.Tensor
    cache: KVCache | None
    rows: torch.Tensor | None
    kv_len: int
    backend: AttentionBackend


@dataclasses.dataclass
class ForwardOutput:
    hidden: torch.Tensor  # (B, T, H) residual stream after the last layer run
    final_hidden: torch.Tensor | None  # (B, T', H) after the final norm, when the range ends the model
    logits: torch.Tensor | None  # (B, T', V) when the range ends the model and logits were asked for


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
    ) -> StepContext:
        """Everything layers share for one pass at positions input_pos (B, T)."""
        dtype = self.embed_tokens.weight.dtype
        cos = self.rope_cos[input_pos].to(dtype)[:, None]  # (B, 1, T, D)
        sin = self.rope_sin[input_pos].to(dtype)[:, None]
        if cache is None:
            # No cache (training): attend among the given tokens by position.
            mask = input_pos[:, None, None, :] <= input_pos[:, None, :, None]  # (B, 1, T, T)
            kv_len = input_pos.shape[1]
        else:
            kv_len = min(kv_len or cache.max_seq_len, cache.max_seq_len)
            mask = cache.visibility(input_pos, rows, kv_len)
        return StepContext(input_pos, cos, sin, mask, cache, rows, kv_len, self.backend)

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
    ) -> ForwardOutput:
        """Run layers `layers` (default: all) on tokens (B, T) or on hidden (B, T, H) at input_pos (B, T).

        Cache layer i holds model layer i. `logits_index` (B,) picks one position per row for the
        final norm and logits (e.g. each row's last prompt token); None keeps all T positions.
        """
        layers = layers if layers is not None else range(self.args.num_layers)
        if hidden is None:
            if layers.start != 0:
                raise ValueError(f"a layer range starting at {layers.start} needs the hidden states entering it")
            hidden = self.embed_tokens(tokens)  # (B, T, H)
        ctx = ctx or self.context(input_pos, cache, rows, kv_len)
        for i in layers:
            hidden = self.layers[i](hidden, ctx, i)
        if layers.stop != self.args.num_layers:
            return ForwardOutput(hidden, None, None)
        final = hidden
        if logits_index is not None:
            final = hidden[torch.arange(hidden.shape[0], device=hidden.device), logits_index][:, None]  # (B, 1, H)
        if final.dtype == torch.float32:
            final = self.norm(final)
            logits = self.lm_head(final) if compute_logits else None
            return ForwardOutput(hidden, final, logits)
        # Low-precision models: the final norm and the vocabulary projection run in fp32. Greedy
        # decisions are argmaxes over the logits; bf16 logits (8-bit mantissa) tie and flip often,
        # and would make speculative and plain decoding disagree more than their hidden states do.
        x = final.float()
        x = self.norm.weight.float() * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.norm.eps))
        logits = F.linear(x, self._lm_head_fp32()) if compute_logits else None
        return ForwardOutput(hidden, x.to(final.dtype), logits)

    def _lm_head_fp32(self) -> torch.Tensor:
        """An fp32 copy of the (frozen) lm_head weight, made once."""
        w = self.lm_head.weight
        cached = getattr(self, "_lm_head_f32", None)
        if cached is None or cached.device != w.device or cached.shape != w.shape:
            cached = self._lm_head_f32 = w.detach().float()
        return cached

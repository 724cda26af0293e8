"""Rotary position embeddings, precomputed as cos/sin tables indexed by position."""

from __future__ import annotations

import math

import torch

from engine.config import ModelArgs, RopeScaling


def inv_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """(head_dim/2,) float32 inverse frequencies, with Llama-3 or linear scaling applied."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    old_ctx = scaling.original_max_position_embeddings
    low_freq_wavelen = old_ctx / scaling.low_freq_factor
    high_freq_wavelen = old_ctx / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_ctx / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_tables(args: ModelArgs, max_seq_len: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables of shape (max_seq_len, head_dim), float32."""
    inv_freq = inv_frequencies(args.head_dim, args.rope_theta, args.rope_scaling).to(device)
    positions = torch.arange(max_seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)  # (S, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (S, D)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, H, T, D); cos/sin (B, 1, T, D) in x's dtype."""
    return x * cos + rotate_half(x) * sin


def apply_rope_qk(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """RoPE on the query and key heads of a fused q|k|v projection, in one pass.

    qkv (N, W) with the `heads` = Hq + Hkv rotated heads first (v's columns after them are not read);
    cos/sin (N, D) in qkv's dtype. Returns (N, heads, D): the rotated q heads, then the k heads. The
    arithmetic is `apply_rope`'s, element for element.
    """
    x = qkv[:, : heads * head_dim].reshape(qkv.shape[0], heads, head_dim)
    return apply_rope(x, cos[:, None], sin[:, None])

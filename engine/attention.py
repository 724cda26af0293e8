"""Attention backends behind one small interface.

A backend takes queries for the new tokens and the cached keys/values of the rows (already
containing the new tokens) plus a boolean visibility mask, and returns the attention output.
PyTorch SDPA is the default and always available. FlexAttention and the Triton kernel
(`engine.triton_attention`, GPU) are imported lazily; each falls back to SDPA, with a log line, where it
is unavailable, and the Triton backend hands SDPA every call its kernel does not serve (prefill, CPU).
flash-attn and flashinfer are not wired in: asking for them runs SDPA and says so.
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


class AttentionBackend(Protocol):
    """A backend may also offer `attend_rows(q, cache_k, cache_v, rows, kv_len, mask, positions)`: the same
    attention read in place from whole cache layers for scattered cache rows (B,), or None where it does not
    serve the call (`engine.model.cached_attention`).

    `positions` (B, T), where given, are the queries' positions in a cache whose slot is the position: a
    backend with `bounds_by_position` reads no slot past a row's last position (the mask hides them anyway),
    so a step over the whole cache costs what the rows have filled; the others ignore it."""

    name: str

    bounds_by_position: bool

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                 positions: torch.Tensor | None = None) -> torch.Tensor:
        """q (B, Hq, T, D); k, v (B, Hkv, S, D); mask (B, 1, T, S) bool, True = visible. Returns (B, Hq, T, D)."""
        ...


class SdpaBackend:
    name = "sdpa"
    bounds_by_position = False

    def __call__(self, q, k, v, mask, positions=None):
        # GQA without materializing repeated K/V heads.
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1])


class FlexBackend:
    """FlexAttention with the same position mask (GPU; compiled on first use)."""

    name = "flex"
    bounds_by_position = False

    def __init__(self) -> None:
        from torch.nn.attention.flex_attention import flex_attention

        self._flex = torch.compile(flex_attention, dynamic=False)

    def __call__(self, q, k, v, mask, positions=None):
        from torch.nn.attention.flex_attention import create_block_mask

        def mask_mod(b, h, q_idx, kv_idx):
            return mask[b, 0, q_idx, kv_idx]

        block_mask = create_block_mask(mask_mod, q.shape[0], None, q.shape[2], k.shape[2], device=q.device)
        return self._flex(q, k, v, block_mask=block_mask, enable_gqa=k.shape[1] != q.shape[1])


class TritonBackend:
    """One Triton kernel per call for the short steps (decode, draft, verify: up to 64 query heads x new
    tokens per KV head); SDPA for everything else (prefill, CPU tensors). On CUDA it reads no cache slot past a
    row's last position (`positions`)."""

    name = "triton"

    def __init__(self) -> None:
        from engine.triton_attention import triton_attention

        self._kernel = triton_attention
        self._sdpa = SdpaBackend()

    def __call__(self, q, k, v, mask, positions=None):
        out = self._kernel(q, k, v, mask, positions=positions) if q.is_cuda else None
        return out if out is not None else self._sdpa(q, k, v, mask)

    @property
    def bounds_by_position(self) -> bool:
        """Whether the kernel serves this process's steps (CUDA; not Triton's CPU interpreter)."""
        return torch.cuda.is_available()

    def attend_rows(self, q, cache_k, cache_v, rows, kv_len, mask, positions=None):
        """Attention over the first kv_len slots of cache rows `rows` (B,) of whole cache layers, read in place;
        None where the kernel does not serve the call (CPU tensors outside Triton's interpreter included: the
        caller then gathers the rows and calls the backend)."""
        return self._kernel(q, cache_k, cache_v, mask, rows=rows, kv_len=kv_len, positions=positions)


BACKENDS = ("auto", "sdpa", "flex", "triton", "flash_attn", "flashinfer")


def make_backend(name: str = "sdpa", device: str | torch.device | None = None) -> AttentionBackend:
    """`sdpa` (default), `flex`, `triton`, or `auto`: triton for a CUDA `device` where the triton package
    is installed, SDPA otherwise (silently). `flash_attn` and `flashinfer` fall back to SDPA with a warning."""
    if name == "auto":
        from engine.triton_kernels import available

        cuda = device is not None and torch.device(device).type == "cuda"
        return TritonBackend() if cuda and available() else SdpaBackend()
    if name == "sdpa":
        return SdpaBackend()
    if name == "triton":
        from engine.triton_kernels import available

        if available():
            return TritonBackend()
        log.warning("the triton attention backend needs the triton package (it comes with CUDA builds of torch); "
                    "using PyTorch SDPA")
        return SdpaBackend()
    if name == "flex":
        try:
            return FlexBackend()
        except Exception as exc:  # noqa: BLE001 - any import/compile failure means "not available here"
            log.warning("FlexAttention unavailable (%s); using PyTorch SDPA", exc)
            return SdpaBackend()
    if name in ("flash_attn", "flashinfer"):
        # Not wired into this engine yet: asking for them is accepted, and says plainly what runs.
        log.warning("the %s attention backend is not available in this build; using PyTorch SDPA", name)
        return SdpaBackend()
    raise ValueError(f"unknown attention backend {name!r}; choose one of: {', '.join(BACKENDS)}")

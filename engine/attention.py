"""Attention backends behind one small interface.

A backend takes queries for the new tokens and the cached keys/values of the rows (already
containing the new tokens) plus a boolean visibility mask, and returns the attention output.
PyTorch SDPA is the default and always available. FlexAttention, the Triton kernel
(`engine.triton_attention`, GPU) and flashinfer are imported lazily; each falls back to SDPA, with a log
line, where it is unavailable, and the Triton and flashinfer backends hand SDPA every call they do not serve
(prefill, CPU). flash-attn is not wired in: asking for it runs SDPA and says so.
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


class AttentionBackend(Protocol):
    """A backend may also offer `attend_rows(q, cache_k, cache_v, rows, kv_len, mask, positions, qidx=None)`: the
    same attention read in place from whole cache layers for scattered cache rows (B,), or None where it does not
    serve the call (`engine.model.cached_attention`); with `qidx`, for packed queries (`engine.model.PackedRows`).

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

    def attend_rows(self, q, cache_k, cache_v, rows, kv_len, mask, positions=None, qidx=None):
        """Attention over the first kv_len slots of cache rows `rows` (B,) of whole cache layers, read in place;
        None where the kernel does not serve the call (CPU tensors outside Triton's interpreter included: the
        caller then gathers the rows and calls the backend). `qidx` (B, T): packed queries q (N, Hq, 1, D) and
        output, row b's token t at qidx[b, t] (`triton_attention`; `engine.model.PackedRows`)."""
        return self._kernel(q, cache_k, cache_v, mask, rows=rows, kv_len=kv_len, positions=positions, qidx=qidx)


class FlashInferBackend:
    """flashinfer's attention (GPU; bf16/fp16; its kernels compile with nvcc on first use): each row of a short step
    (decode, draft, verify: up to `max_tokens` new tokens) is one `single_prefill_with_kv_cache` call over the row's
    keys and values as they lie in the cache (heads, slots, dim: flashinfer's HND layout), with the engine's mask as
    its custom mask, so any mask (causal, deep-draft windows, trees) is served; SDPA takes the rest (prefill, fp32,
    CPU). On the H200 at the default model's shapes its calls cost more than the Triton kernel's (bs 1, 704 slots:
    8.3 against 5.0 us a decode call, 6.8 against 5.8 a 6-token verify call; bench/RESULTS.md, run 28), so `auto`
    stays on Triton; flashinfer is there for models and batches where its kernels may win. Its FA3 (sm90) prefill
    kernel stopped the process (SIGFPE) on a 6-token call: the FA2 one is asked for."""

    name = "flashinfer"
    bounds_by_position = False
    max_tokens = 64
    devices = ("cuda",)  # tests add "cpu" with a stand-in module

    def __init__(self) -> None:
        import flashinfer

        self._prefill = flashinfer.single_prefill_with_kv_cache
        self._sdpa = SdpaBackend()

    def __call__(self, q, k, v, mask, positions=None):
        bsz, _, t, _ = q.shape
        if (q.device.type not in self.devices or q.dtype not in (torch.bfloat16, torch.float16) or t > self.max_tokens
                or not (k.dtype == v.dtype == q.dtype) or mask.shape[1] != 1):
            return self._sdpa(q, k, v, mask)
        rows = [self._prefill(q[b].transpose(0, 1).contiguous(), k[b], v[b], custom_mask=mask[b, 0], kv_layout="HND",
                              backend="fa2") for b in range(bsz)]  # each (T, Hq, D)
        return torch.stack(rows).transpose(1, 2)  # (B, Hq, T, D)


BACKENDS = ("auto", "sdpa", "flex", "triton", "flash_attn", "flashinfer")


def make_backend(name: str = "sdpa", device: str | torch.device | None = None) -> AttentionBackend:
    """`sdpa` (default), `flex`, `triton`, `flashinfer`, or `auto`: triton for a CUDA `device` where the triton
    package is installed, SDPA otherwise (silently). `flex`, `triton` and `flashinfer` fall back to SDPA with a
    warning where they cannot run; `flash_attn` is not wired in and does the same."""
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
    if name == "flashinfer":
        try:
            return FlashInferBackend()
        except Exception as exc:  # noqa: BLE001 - not installed (or not importable here): say so, run SDPA
            log.warning("the flashinfer attention backend needs the flashinfer-python package (%s); using PyTorch SDPA",
                        exc)
            return SdpaBackend()
    if name == "flash_attn":
        # Not wired into this engine: asking for it is accepted, and says plainly what runs.
        log.warning("the flash_attn attention backend is not available in this build; using PyTorch SDPA")
        return SdpaBackend()
    raise ValueError(f"unknown attention backend {name!r}; choose one of: {', '.join(BACKENDS)}")

"""Sampling parameters and the pure functions that turn logits into a distribution and a token.

Greedy is temperature 0: its "distribution" is one-hot at the argmax, so the same rejection
sampler verifies greedy and sampled rows (one-hot vs one-hot accepts exactly on a match).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from engine import triton_kernels
from engine.cache import to_device


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    eos_token_ids: tuple[int, ...] | None = None  # None = the model's EOS ids
    draft_temperature: float | None = None  # None = same as temperature (the lossless-friendly default)

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        for name in ("temperature", "draft_temperature"):
            value = getattr(self, name)
            if value is not None and (not math.isfinite(value) or value < 0):
                raise ValueError(f"{name} must be a finite number >= 0 (0 = greedy), got {value!r}")
        if not math.isfinite(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def processed_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                    filtered: bool = True) -> torch.Tensor:
    """Probabilities after temperature, top-k and top-p, row-wise; temperature 0 gives one-hot argmax.

    logits (B, ..., V); temperature, top_p (B,) float; top_k (B,) long (0 = off). Returns float32 (B, ..., V).
    filtered=False promises that no row uses top-k or top-p (the caller knows from the parameters): the
    sort over the vocabulary they need is skipped, which is most of the cost on a CPU.
    """
    if not filtered:
        fast = triton_kernels.tempered_softmax(logits, temperature)  # one launch on CUDA
        if fast is not None:
            return fast
    logits = logits.float()
    extra = (1,) * (logits.dim() - 2)
    temp = temperature.view(-1, *extra, 1)
    greedy = temp == 0
    scaled = logits / torch.where(greedy, torch.ones_like(temp), temp)
    one_hot = torch.zeros_like(scaled).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    if not filtered:
        return torch.where(greedy, one_hot, torch.softmax(scaled, dim=-1))
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab)).view(-1, *extra, 1)
    sorted_logits, sorted_idx = scaled.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)
    remove = ranks >= k  # (B, ..., V) in sorted order
    sorted_probs = torch.softmax(sorted_logits.masked_fill(remove, -math.inf), dim=-1)
    # top-p: drop tokens once the mass *before* them reaches top_p (the top token always stays).
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    remove = remove | (mass_before >= top_p.view(-1, *extra, 1))
    sorted_logits = sorted_logits.masked_fill(remove, -math.inf)
    probs = torch.zeros_like(scaled).scatter_(-1, sorted_idx, torch.softmax(sorted_logits, dim=-1))
    return torch.where(greedy, one_hot, probs)


def param_tensors(params, device: torch.device) -> dict[str, torch.Tensor]:
    """Per-row sampling parameters as (B,) device tensors: temperature, draft_temperature (the request's
    temperature where unset), top_p (float32, one host-to-device copy) and top_k (long, one more)."""
    floats = to_device([[p.temperature for p in params],
                        [p.draft_temperature if p.draft_temperature is not None else p.temperature for p in params],
                        [p.top_p for p in params]], device, torch.float32)
    temperature, draft_temperature, top_p = floats.unbind(0)  # contiguous rows of one transfer
    return {"temperature": temperature, "draft_temperature": draft_temperature, "top_p": top_p,
            "top_k": to_device([p.top_k for p in params], device)}


def needs_filters(params) -> bool:
    """Whether any of these SamplingParams uses top-k or top-p (processed_probs' `filtered`)."""
    return any(p.top_k > 0 or p.top_p < 1 for p in params)


# ----- random numbers: one counter-based stream per request ---------------------------------------
# Draw n of a request is a hash of (its seed, n): rows of a batch draw in one vectorized call (no
# per-row generator, no per-row kernel launch), and a request's draws do not depend on which other
# requests share its batch or on how many numbers they take.
_M32 = 0xFFFFFFFF


def _mul32(x, c: int):
    """(x * c) mod 2**32 for x in [0, 2**32) (int64 tensor or int), in 16-bit halves: no int64 overflow."""
    return (((((x >> 16) * c) & 0xFFFF) << 16) + (x & 0xFFFF) * c) & _M32


def _hash32(x):
    """A bijection of 32-bit integers with full avalanche (C. Wellons' lowbias32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


class RandomStream:
    """A request's random numbers, reproducible from its seed (None: a seed drawn from torch's global RNG,
    so torch.manual_seed still makes unseeded runs repeatable)."""

    __slots__ = ("key", "drawn")

    def __init__(self, seed: int | None = None) -> None:
        if seed is None:
            seed = int(torch.randint(0, 2**62, ()).item())
        seed = int(seed) % 2**64
        self.key = _hash32(_hash32(seed & _M32) ^ (seed >> 32))
        self.drawn = 0


def stream_state(streams: list[RandomStream], device: torch.device) -> torch.Tensor:
    """(B, 2) int64 [key, next counter] of these streams, on `device` (pinned, queued copy on CUDA)."""
    return to_device([[s.key, s.drawn] for s in streams], device)


def advance(streams: list[RandomStream], n: int) -> None:
    """Count n draws per row as taken (what a device-side `uniform_at` over them used)."""
    for s in streams:
        s.drawn = (s.drawn + n) & _M32


def uniform_at(state: torch.Tensor, offset: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Uniform [0, 1) float32 draws (24 bits) from device state (B, 2) (`stream_state`), starting `offset`
    draws past each row's counter: row b's draws are its stream's, whatever else runs in the batch. Pure
    tensor code without host values, so it can sit inside a CUDA graph with `state` as its input."""
    per_row = math.prod(shape[1:])
    fast = triton_kernels.uniform(state, offset, shape[0], per_row)  # one launch on CUDA, the same numbers
    if fast is not None:
        return fast.view(shape)
    counters = (state[:, 1:] + offset + torch.arange(per_row, device=state.device)) & _M32  # (B, per_row)
    bits = _hash32(_hash32(counters) ^ state[:, :1])
    return ((bits >> 8).float() * 2.0**-24).view(shape)


def uniform(shape: tuple[int, ...], streams: list[RandomStream], device: torch.device) -> torch.Tensor:
    """Uniform [0, 1) float32 draws (24 bits), row b from streams[b]; shape[0] == len(streams)."""
    if not streams:
        return torch.empty(shape, device=device)
    state = stream_state(streams, device)
    advance(streams, math.prod(shape[1:]))
    return uniform_at(state, 0, shape)


def sample_with(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row from probs (B, V) (need not sum to 1) by inverse CDF at the uniforms u (B,)."""
    fast = triton_kernels.inverse_cdf(probs, u)  # one launch on CUDA
    if fast is not None:
        return fast
    cdf = probs.double().cumsum(-1)  # float64: no token's share drifts by float32 rounding over the vocabulary
    total = cdf[:, -1:]
    # u < 1, but the product can round up to the total: keep the point below it, so the first entry of
    # the CDF above it is a token of positive probability, never the zero tail after the last one.
    point = torch.minimum(u.double()[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, point, right=True).squeeze(1)


def sample(probs: torch.Tensor, streams: list[RandomStream]) -> torch.Tensor:
    """One token per row from probs (B, V) (need not sum to 1) by inverse CDF: one uniform per row, no host sync."""
    return sample_with(probs, uniform((probs.shape[0],), streams, probs.device))

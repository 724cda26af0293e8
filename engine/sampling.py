"""Sampling parameters and the pure functions that turn logits into a distribution and a token.

Greedy is temperature 0: its "distribution" is one-hot at the argmax, so the same rejection
sampler verifies greedy and sampled rows (one-hot vs one-hot accepts exactly on a match).
"""

from __future__ import annotations

import dataclasses
import math

import torch


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


def processed_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Probabilities after temperature, top-k and top-p, row-wise; temperature 0 gives one-hot argmax.

    logits (B, ..., V); temperature, top_p (B,) float; top_k (B,) long (0 = off). Returns float32 (B, ..., V).
    """
    logits = logits.float()
    extra = (1,) * (logits.dim() - 2)
    temp = temperature.view(-1, *extra, 1)
    greedy = temp == 0
    scaled = logits / torch.where(greedy, torch.ones_like(temp), temp)
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
    one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    return torch.where(greedy, one_hot, probs)


def sample(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row from probs (B, V) by the exponential race argmax(p / E): no host sync."""
    noise = torch.empty_like(probs)
    for row, gen in enumerate(generators):
        noise[row].exponential_(1.0, generator=gen)
    return (probs / noise).argmax(-1)


def uniform(shape: tuple[int, ...], generators: list[torch.Generator | None], device: torch.device) -> torch.Tensor:
    """Uniform [0, 1) draws, row b from generators[b]; shape[0] == len(generators)."""
    out = torch.empty(shape, device=device)
    for row, gen in enumerate(generators):
        out[row].uniform_(0.0, 1.0, generator=gen)
    return out

"""Keeps speculation from making decoding slower: measured cost per token, per draft, online.

Every autoregressive step and every speculative round reports its wall time and the tokens it
produced. The governor keeps an exponential moving average of seconds per token for plain decoding
and for each draft, and turns a draft off (its requests decode plainly) while its cost per token is
above plain decoding's. A disabled draft is still tried on every `probe_every`-th request so its
estimate follows the traffic, and plain decoding is probed likewise while everything speculates.
"""

from __future__ import annotations

import dataclasses
import threading


@dataclasses.dataclass
class _Ema:
    value: float | None = None
    count: int = 0

    def update(self, x: float, alpha: float) -> None:
        self.value = x if self.value is None else (1 - alpha) * self.value + alpha * x
        self.count += 1


class SpeculationGovernor:
    def __init__(self, enabled: bool = True, alpha: float = 0.1, min_samples: int = 8, probe_every: int = 16,
                 tolerance: float = 1.0) -> None:
        """tolerance: speculation stays on while spec_cost <= tolerance * plain_cost."""
        self.enabled = enabled
        self.alpha = alpha
        self.min_samples = min_samples
        self.probe_every = probe_every
        self.tolerance = tolerance
        self._ar = _Ema()
        self._spec: dict[str, _Ema] = {}
        self._admissions: dict[str, int] = {}
        self._lock = threading.Lock()

    def observe_ar(self, rows: int, seconds: float, tokens: int) -> None:
        if tokens:
            with self._lock:
                self._ar.update(seconds / tokens, self.alpha)

    def observe_spec(self, draft: str, rows: int, seconds: float, tokens: int) -> None:
        if tokens:
            with self._lock:
                self._spec.setdefault(draft, _Ema()).update(seconds / tokens, self.alpha)

    def allow(self, draft: str) -> bool:
        """Should the next request for `draft` speculate?"""
        if not self.enabled:
            return True
        with self._lock:
            n = self._admissions.get(draft, 0) + 1
            self._admissions[draft] = n
            spec, ar = self._spec.get(draft), self._ar
            if spec is None or spec.count < self.min_samples:
                return True
            if ar.count < self.min_samples:
                return n % self.probe_every != 0  # measure plain decoding now and then
            pays = spec.value <= self.tolerance * ar.value
            return pays or n % self.probe_every == 0

    def snapshot(self) -> dict:
        with self._lock:
            return {
                "ar_seconds_per_token": self._ar.value,
                "spec_seconds_per_token": {k: v.value for k, v in self._spec.items()},
            }

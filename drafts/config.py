"""Shape of a FlashSpec draft: how much of the target it shares and what it adds."""

from __future__ import annotations

import dataclasses
from typing import Any

HEADS = ("mlp", "mlp_tied")
FEATURE_INPUTS = ("none", "deep")


@dataclasses.dataclass(frozen=True)
class DraftConfig:
    shared_layers: int | None = None  # N; None = round(L / 4)
    adapter_layers: int = 2  # A
    head: str = "mlp"  # "mlp": fc1 h->h/2, SiLU, fc2 h/2->vocab; "mlp_tied": fc2 h/2->h, then the target's lm_head
    feature_input: str = "none"  # "deep": the target's last hidden state at the previous position fused in
    init_from_target: bool = True  # adapters start as copies of target layers [N, N + A)
    head_vocab: int | None = None  # draft over the K most frequent tokens only (cheaper head); None = full vocab
    # Deep drafts: target layer counts c (N < c < L) whose residual stream at the previous position is
    # fused in beside the final hidden state (low/mid-level features, as in EAGLE-3). () = final only.
    feature_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.head not in HEADS:
            raise ValueError(f"head must be one of {HEADS}, got {self.head!r}")
        if self.feature_input not in FEATURE_INPUTS:
            raise ValueError(f"feature_input must be one of {FEATURE_INPUTS}, got {self.feature_input!r}")
        if self.adapter_layers < 0 or (self.shared_layers is not None and self.shared_layers < 0):
            raise ValueError("shared_layers and adapter_layers must be >= 0")
        if self.head_vocab is not None and self.head_vocab < 2:
            raise ValueError(f"head_vocab must be >= 2 or unset, got {self.head_vocab}")
        if self.adapter_layers == 0 and self.feature_input == "deep":
            raise ValueError("a deep-feature draft needs at least one adapter layer to fuse the features into")
        object.__setattr__(self, "feature_layers", tuple(int(c) for c in self.feature_layers))
        if self.feature_layers and self.feature_input != "deep":
            raise ValueError("feature_layers needs feature_input='deep' (they are fused with the target's final hidden state)")
        if list(self.feature_layers) != sorted(set(self.feature_layers)):
            raise ValueError(f"feature_layers must be increasing and distinct, got {list(self.feature_layers)}")

    def resolve(self, num_target_layers: int) -> "DraftConfig":
        """Fill the default N = round(L/4) and check it fits the target."""
        n = round(num_target_layers / 4) if self.shared_layers is None else self.shared_layers
        if n > num_target_layers:
            raise ValueError(f"shared_layers={n} exceeds the target's {num_target_layers} layers")
        bad = [c for c in self.feature_layers if not n < c < num_target_layers]
        if bad:
            raise ValueError(f"feature_layers {bad} must lie strictly between shared_layers={n} and the "
                             f"target's {num_target_layers} layers (the verify pass runs layers [{n}, {num_target_layers}))")
        return dataclasses.replace(self, shared_layers=n)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["feature_layers"] = list(self.feature_layers)
        if not self.feature_layers:
            del data["feature_layers"]  # drafts without them keep the manifest they always had
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "DraftConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown draft config fields: {sorted(unknown)}")
        return cls(**data)

"""Model shapes: one frozen dataclass read from a Hugging Face `config.json`."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


class UnsupportedModelError(ValueError):
    """The checkpoint describes a model this engine cannot run."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3-style frequency scaling (`rope_type: llama3`) or plain linear scaling."""

    rope_type: str  # "llama3" | "linear"
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelArgs:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 (and Llama with attention_bias) add a bias to q/k/v
    o_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def num_kv_groups(self) -> int:
        return self.num_heads // self.num_kv_heads

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of KV cache one token costs across all layers (K and V)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def check_context(self, max_seq_len: int) -> None:
        """Refuse a context this model cannot attend over exactly."""
        if self.sliding_window is not None and self.sliding_window < max_seq_len:
            raise UnsupportedModelError(
                f"this {self.model_type} model uses a sliding attention window of {self.sliding_window} "
                f"tokens, shorter than the requested context of {max_seq_len}; sliding-window attention "
                f"is not supported: request max_seq_len <= {self.sliding_window}"
            )

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelArgs":
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)} "
                "(Llama-family decoders)"
            )
        hidden = cfg["hidden_size"]
        heads = cfg["num_attention_heads"]
        kv_heads = cfg.get("num_key_value_heads") or heads
        if heads % kv_heads:
            raise UnsupportedModelError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        head_dim = cfg.get("head_dim") or hidden // heads
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"hidden_act {act!r} is not supported (only 'silu')")
        rope_scaling = _rope_scaling(cfg)
        rope_theta = cfg.get("rope_theta")
        if rope_theta is None:  # transformers 5 keeps it under rope_parameters
            rope_theta = (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        sliding = cfg.get("sliding_window") if cfg.get("use_sliding_window", model_type == "mistral") else None
        attention_bias = bool(cfg.get("attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=attention_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            sliding_window=sliding,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelArgs":
        return cls.from_hf_config(json.loads(Path(path).read_text()))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _rope_scaling(cfg: dict[str, Any]) -> RopeScaling | None:
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if not scaling:
        return None
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type == "default":
        return None
    if rope_type == "llama3":
        return RopeScaling(
            rope_type="llama3",
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
            high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(scaling.get("original_max_position_embeddings", 8192)),
        )
    if rope_type == "linear":
        return RopeScaling(rope_type="linear", factor=float(scaling["factor"]))
    raise UnsupportedModelError(f"rope_scaling type {rope_type!r} is not supported (supported: llama3, linear)")

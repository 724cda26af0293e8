"""The FlashSpec draft: the target's first N layers (referenced, frozen), A adapter layers, a head.

The trunk is *the target's own modules*: nothing is copied, so the trunk's KV entries are the
target's KV entries for layers [0, N). Only the adapters, the optional feature fusion, the output
norm and the head are the draft's own (and the only tensors in its checkpoint).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from drafts.config import DraftConfig
from engine import cpu_linear
from engine.model import DecoderLayer, RMSNorm, StepContext, Transformer
from engine.speculative import full_vocab_scores
from engine.triton_kernels import argmax


class DraftHead(nn.Module):
    """fc1 h->h/2, SiLU, fc2 h/2->vocab (`mlp`) or h/2->h followed by the target's frozen lm_head (`mlp_tied`).

    With a sub-vocabulary (the K most frequent tokens) the head scores only those K tokens: for the
    tied head, the rows of the target's lm_head for those tokens (gathered once, then reused).
    """

    def __init__(self, hidden: int, vocab: int, tied: bool) -> None:
        super().__init__()
        self.tied = tied
        self.fc1 = nn.Linear(hidden, hidden // 2)
        self.fc2 = nn.Linear(hidden // 2, hidden if tied else vocab)
        self._sub_weight: torch.Tensor | None = None
        self._packed: dict = {}  # engine.cpu_linear's packed copy of the sub-vocabulary rows (CPU inference)

    def forward(self, x: torch.Tensor, lm_head: nn.Linear, vocab_ids: torch.Tensor | None) -> torch.Tensor:
        """Scores (..., K) over vocab_ids (or (..., V) over the whole vocabulary)."""
        y = self.fc2(F.silu(self.fc1(x)))
        if not self.tied:
            return y
        # Residual around the small MLP: starts as the target's own projection of x.
        if vocab_ids is None:
            return lm_head(x + y)
        w = self._sub_weight
        if w is None or w.device != lm_head.weight.device or w.dtype != lm_head.weight.dtype or w.shape[0] != len(vocab_ids):
            w = self._sub_weight = lm_head.weight[vocab_ids].detach().clone()
        return cpu_linear.linear(x + y, w, self._packed, "sub_vocab")


class DraftModel(nn.Module):
    def __init__(self, target: Transformer, config: DraftConfig, name: str = "draft", version: str = "0") -> None:
        super().__init__()
        args = target.args
        config = config.resolve(args.num_layers)
        self.config = config
        self.name, self.version = name, version
        self.shared_layers = config.shared_layers
        self.adapter_layers = config.adapter_layers
        self.feature_input = config.feature_input
        self.feature_layers = config.feature_layers
        # Held in a list so they are neither registered nor saved: the target owns them.
        self._target = [target]
        h = args.hidden_size
        self.fuse = nn.Linear(2 * h, h, bias=False) if config.feature_input == "deep" else None
        # Extra target layers' states and the final state -> one H-wide feature (the draft's own
        # proxy stands in for it at later draft steps, as for final-only drafts).
        k = len(config.feature_layers)
        self.feat_proj = nn.Linear((k + 1) * h, h, bias=False) if k else None
        self.adapters = nn.ModuleList(DecoderLayer(args) for _ in range(config.adapter_layers))
        self.out_norm = RMSNorm(h, args.rms_norm_eps)
        k = config.head_vocab
        self.head = DraftHead(h, k or args.vocab_size, tied=config.head == "mlp_tied")
        # Token ids the head scores (frequency-ranked sub-vocabulary); saved with the draft.
        self.register_buffer("vocab_ids", torch.arange(k) if k else None)
        self._fused_ops = None  # set by engine.fused.fuse_for_inference: out_norm then runs its compiled RMSNorm
        weight = target.embed_tokens.weight
        self.to(device=weight.device, dtype=weight.dtype)

    @property
    def target(self) -> Transformer:
        return self._target[0]

    @property
    def trunk(self) -> list[nn.Module]:
        """The target's layers [0, N): the same module objects, not copies."""
        return list(self.target.layers[: self.shared_layers])

    def init_from_target(self) -> None:
        """Adapters start as the target's layers [N, N+A), the norm as its final norm; fusion passes
        the trunk state through. So the untrained draft is an early exit of the target."""
        t = self.target
        with torch.no_grad():
            for i, layer in enumerate(self.adapters):
                src = self.shared_layers + i
                if src < t.args.num_layers:
                    layer.load_state_dict(t.layers[src].state_dict())
            self.out_norm.weight.copy_(t.norm.weight)
            h = t.args.hidden_size
            if self.fuse is not None:
                self.fuse.weight.zero_()
                self.fuse.weight[:, :h].copy_(torch.eye(h))
            if self.feat_proj is not None:  # starts as the final state alone: a final-only draft
                self.feat_proj.weight.zero_()
                self.feat_proj.weight[:, -h:].copy_(torch.eye(h))
            self.head.fc2.weight.mul_(0.0 if self.head.tied else 1.0)
            if self.head.tied:
                self.head.fc2.bias.zero_()

    def trainable_parameters(self) -> list[nn.Parameter]:
        return list(self.parameters())

    # ----- the engine's Draft protocol ------------------------------------------------------
    def adapters_forward(self, trunk_hidden: torch.Tensor, features: torch.Tensor | None, ctx: StepContext | None) -> torch.Tensor:
        x = trunk_hidden
        if self.fuse is not None:
            x = self.fuse(torch.cat([trunk_hidden, features.to(trunk_hidden.dtype)], dim=-1))  # (b, T, H)
        for i, layer in enumerate(self.adapters):
            x = layer(x, ctx, i)
        return x

    def target_features(self, final: torch.Tensor, captured: tuple[torch.Tensor, ...] | list = ()) -> torch.Tensor:
        """(..., H) feature from the target's states at one position: its final hidden state, and with
        `feature_layers` the residual streams after those layers (`captured`, in order), each RMS-scaled
        (their norms grow with depth), concatenated and projected."""
        if self.feat_proj is None:
            return final
        if len(captured) != len(self.feature_layers):
            raise ValueError(f"expected the states after target layers {list(self.feature_layers)}, got {len(captured)}")
        parts = [(c.float() * torch.rsqrt(c.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(final.dtype)
                 for c in captured]
        return self.feat_proj(torch.cat([*parts, final], dim=-1))

    def set_vocab(self, token_ids: torch.Tensor) -> None:
        """Use these K token ids (most frequent first) as the head's sub-vocabulary."""
        if self.vocab_ids is None or len(token_ids) != len(self.vocab_ids):
            raise ValueError(f"expected {0 if self.vocab_ids is None else len(self.vocab_ids)} token ids, got {len(token_ids)}")
        self.vocab_ids.copy_(token_ids.to(self.vocab_ids))
        self.head._sub_weight = None

    def _norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """out_norm: one compiled kernel once fused for inference (the same arithmetic), else the module."""
        ops, weight = self._fused_ops, self.out_norm.weight
        if ops is None or (torch.is_grad_enabled() and weight.requires_grad):
            return self.out_norm(hidden)
        return ops.select(1).rms_norm(hidden, weight, self.out_norm.eps)

    def head_scores(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., H) -> (..., K) scores over `vocab_ids` (or (..., V) without a sub-vocabulary)."""
        return self.head(self._norm(hidden), self.target.lm_head, self.vocab_ids)

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(b, H) -> (b, V) logits; tokens outside the sub-vocabulary get -inf (never drafted)."""
        return full_vocab_scores(self, self.head_scores(hidden), self.target.args.vocab_size)

    def proxy_feature(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._norm(hidden)

    def predict(self, hidden: torch.Tensor, greedy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A draft step's outputs from (b, H) adapter outputs, the norm computed once: the greedy token ids (b,)
        (the argmax over the sub-vocabulary's K scores, mapped to token ids: no (b, V) tensor) or the (b, K)
        scores over `vocab_ids` ((b, V) logits without a sub-vocabulary: the engine samples over the K
        tokens the head scores), and the proxy feature (b, H) of a deep draft (None otherwise)."""
        normed = self._norm(hidden)
        scores = self.head(normed, self.target.lm_head, self.vocab_ids)
        proxy = normed if self.feature_input == "deep" else None
        if not greedy:
            return scores, proxy
        token = argmax(scores)
        return (token if self.vocab_ids is None else self.vocab_ids[token]), proxy

    # ----- training ------------------------------------------------------------------------
    def forward_train(self, trunk_hidden: torch.Tensor, features: torch.Tensor | None, input_pos: torch.Tensor):
        """Teacher-forced pass without a cache: (B, T, H) trunk states -> (scores (B, T, K), out (B, T, H)).

        Scores are over `vocab_ids` when the draft has a sub-vocabulary, else over the whole vocabulary.
        """
        ctx = self.target.context(input_pos, None)
        out = self.adapters_forward(trunk_hidden, features, ctx)
        return self.head_scores(out), out

"""Distillation of a FlashSpec draft from its target (teacher forcing, multi-step "training-time test").

Per batch: the target runs once under no_grad (bf16 autocast on CUDA, fp32 on CPU) giving the trunk
hidden states (layers [0, N)), its final hidden states and next-token logits. The draft is trained
to match the target's next-token distribution: KL(target || draft), restricted to the draft's
sub-vocabulary (renormalized) when it has one, + tv_weight * the total variation distance between the
two (1 - sum_x min(p, q): the probability that a token the draft samples is rejected, so this term aims
at T=1 acceptance itself) + ce_weight * CE on the data + (deep drafts) a
regression of its proxy feature onto the target's final hidden state. Deep drafts also run
`rollout_steps - 1` extra passes whose feature inputs are the draft's own proxy features of the
previous pass, shifted by one position: what the draft sees from its 2nd drafted token on.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import random
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Callable, Literal, Optional

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, field_validator

from drafts.checkpoint import target_fingerprint
from drafts.config import DraftConfig
from drafts.model import DraftModel
from engine.model import Transformer

ALL_DOMAINS = ("code", "general", "dialog")


class TrainError(RuntimeError):
    """Training cannot start or continue; the message says what to fix."""


def layer_list(text: str, option: str = "--feature-layers") -> list[int]:
    """A command line's comma list of layer counts: '10,20' -> [10, 20]; '' -> []."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{option} takes a comma list of integers such as 10,20, got {text!r}") from None


class TrainConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    domain: str = Field(description="Domain the draft is for: code, general, dialog, or mixed (all three).")
    # Draft shape (defaults: the demo drafts' recipe).
    shared_layers: Optional[int] = Field(3, description="N: target layers shared as the trunk (None: round(L/4)).")
    adapter_layers: int = Field(1, description="A: trained adapter decoder layers.")
    head: Literal["mlp", "mlp_tied"] = Field("mlp_tied", description="Head type (mlp_tied reuses the target's lm_head).")
    feature_input: Literal["none", "deep"] = Field("deep", description="'deep': fuse the target's last hidden state in.")
    head_vocab: Optional[int] = Field(8192, description="Sub-vocabulary size K (most frequent tokens); None = full vocab.")
    feature_layers: list[int] = Field(default_factory=list, description="Deep drafts: target layer counts (between N "
                                      "and L) whose states at the previous position are fused in beside the final one.")
    init_from_target: bool = Field(True, description="Adapters start as copies of target layers [N, N+A).")
    init_from: Optional[str] = Field(None, description="Fine-tune: start from this draft checkpoint folder (its "
                                     "weights and sub-vocabulary) instead of fresh adapters; the shape must match it.")
    # Optimisation.
    steps: int = Field(300, ge=1, description="Optimizer steps.")
    max_seconds: Optional[float] = Field(None, gt=0, description="Wall-clock budget of the loop: the schedule "
                                         "runs on whichever of steps or time is further along, and stops at either.")
    batch_size: int = Field(8, ge=1, description="Sequences per micro-batch.")
    grad_accum: int = Field(1, ge=1, description="Micro-batches per optimizer step.")
    seq_len: int = Field(256, ge=8, description="Tokens per training sequence (longer ones are cut).")
    lr_adapters: float = Field(5e-5, gt=0, description="Learning rate of adapters, fusion and output norm.")
    lr_head: float = Field(1e-4, gt=0, description="Learning rate of the head.")
    weight_decay: float = Field(0.01, ge=0, description="AdamW weight decay (matrices only).")
    warmup_steps: int = Field(20, ge=0, description="Linear warmup steps, then cosine decay.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Final learning rate as a fraction of the peak.")
    clip: float = Field(1.0, gt=0, description="Gradient-norm clipping.")
    ce_weight: float = Field(0.0, ge=0, description="Weight of cross-entropy on the data next token.")
    tv_weight: float = Field(0.0, ge=0, description="Weight of the total variation distance to the target's "
                             "distribution (1 - sum min(p, q): a sampled draft token's rejection probability).")
    feature_weight: float = Field(0.1, ge=0, description="Weight of the proxy-feature regression (deep drafts).")
    rollout_steps: int = Field(2, ge=1, le=3, description="Draft passes per batch (deep drafts): 2nd/3rd feed on own features.")
    prompt_weight: float = Field(0.5, ge=0, description="Loss weight of prompt tokens (response tokens weigh 1).")
    teacher_cache_gb: float = Field(8.0, ge=0, description="Keep the target's trunk and final hidden states of the "
                                    "whole training set in device memory when they fit in this many GB, so each "
                                    "epoch after the first skips the target's forward pass (0: run it every batch).")
    # Bookkeeping.
    eval_every: int = Field(100, ge=1, description="Held-out loss and top-1 agreement every this many steps.")
    eval_batches: int = Field(4, ge=1, description="Validation micro-batches per evaluation.")
    save_every: int = Field(100, ge=1, description="Checkpoint (for resume) every this many steps.")
    group_by_length: bool = Field(True, description="Micro-batches of sequences of about one length (each epoch's "
                                  "order sorted by length in chunks of 64 batches): less padding, more steps a second.")
    seed: int = Field(0, description="Seed of the initialisation and the data order.")
    device: str = Field("cpu", description="cpu or cuda.")
    out_dir: str = Field(description="Run folder: ckpt/ (resume state), final/ (draft), train_log.jsonl.")
    resume: bool = Field(True, description="Continue from out_dir/ckpt when present.")

    @field_validator("domain")
    @classmethod
    def _known_domain(cls, value: str) -> str:
        return check_train_domain(value)

    def draft_config(self) -> DraftConfig:
        return DraftConfig(shared_layers=self.shared_layers, adapter_layers=self.adapter_layers, head=self.head,
                           feature_input=self.feature_input, init_from_target=self.init_from_target,
                           head_vocab=self.head_vocab, feature_layers=tuple(self.feature_layers))


@dataclasses.dataclass(frozen=True)
class TokenData:
    """Training sequences: token ids and per-token loss weights (0 = no loss), same lengths."""

    sequences: list[list[int]]
    weights: list[list[float]]

    def __post_init__(self) -> None:
        if not self.sequences:
            raise TrainError("no training sequences: the dataset is empty or every row was empty")

    def __len__(self) -> int:
        return len(self.sequences)


@dataclasses.dataclass
class TrainResult:
    draft: DraftModel  # fp32 master weights, on the training device
    step: int
    history: list[dict]
    out_dir: Path
    seconds: float


# ----- data ---------------------------------------------------------------------------------
def check_train_domain(domain: str) -> str:
    if domain not in (*ALL_DOMAINS, "mixed"):
        raise ValueError(f"unknown domain {domain!r}; valid domains: {', '.join(ALL_DOMAINS)}, mixed")
    return domain


def domain_sequences(rows, tokenizer, seq_len: int, prompt_weight: float = 0.5,
                     responses: dict[str, list[int]] | None = None,
                     extra_responses: list[dict[str, list[int]]] = ()) -> TokenData:
    """Rows with `prompt` (templated request) and `text` -> prompt + response token sequences.

    The response is the target's own greedy reply when `responses` has one for the prompt
    (self-distillation), else the row's raw `text`. Each dict of `extra_responses` (e.g. sampled
    replies) adds one more sequence, prompt + that reply, for every row whose prompt it has. Prompts
    keep at most half of seq_len (cut from the left) so every sequence keeps some response tokens.
    """
    columns = set(rows.column_names) if hasattr(rows, "column_names") else set(rows[0]) if rows else set()
    missing = {"prompt", "text"} - columns
    if missing:
        raise TrainError(f"the dataset has no {', '.join(sorted(missing))} column (columns: {', '.join(sorted(columns))}); "
                         "build it with: flashspec data build (or --dataset ... --text-field/--messages-field)")
    prompts, texts = list(rows["prompt"]), list(rows["text"])
    enc_prompts = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    enc_texts = tokenizer(texts, add_special_tokens=False)["input_ids"]
    eos = getattr(tokenizer, "eos_token_id", None)
    seqs, weights = [], []

    def add(p_ids: list[int], r_ids: list[int]) -> None:
        if not r_ids and not p_ids:
            return
        keep_prompt = max(seq_len - len(r_ids), seq_len // 2)
        p_ids = list(p_ids)[-keep_prompt:] if keep_prompt else []
        ids = (p_ids + r_ids)[:seq_len]
        w = ([prompt_weight] * len(p_ids) + [1.0] * len(r_ids))[:seq_len]
        if len(ids) >= 2:
            seqs.append(ids)
            weights.append(w)

    for prompt, p_ids, t_ids in zip(prompts, enc_prompts, enc_texts):
        add(p_ids, list(responses[prompt]) if responses and prompt in responses else list(t_ids) + ([eos] if eos is not None else []))
        for more in extra_responses:
            if prompt in more:
                add(p_ids, list(more[prompt]))
    return TokenData(seqs, weights)


def run_vocab(cfg: "TrainConfig", data: TokenData, vocab_size: int, special_ids=()) -> torch.Tensor | None:
    """The sub-vocabulary a run counts from its data (`frequent_vocab`), or None: a full-vocabulary head, or a
    fine-tune (`init_from`), which keeps its draft's own (`train` takes it from the draft)."""
    if not cfg.head_vocab or cfg.init_from:
        return None
    return frequent_vocab(data, cfg.head_vocab, vocab_size, special_ids)


def frequent_vocab(data: TokenData, k: int, vocab_size: int, special_ids=()) -> torch.Tensor:
    """The K most frequent token ids of the data (most frequent first), always including special ids."""
    if k > vocab_size:
        raise TrainError(f"head_vocab={k} exceeds the target's vocabulary of {vocab_size}")
    counts = collections.Counter(t for seq in data.sequences for t in seq)
    specials = [s for s in dict.fromkeys(special_ids) if s is not None and 0 <= s < vocab_size]
    ranked = [t for t, _ in counts.most_common()]
    # Pad with the lowest unused ids when the data has fewer than K distinct tokens.
    ranked += [t for t in range(vocab_size) if t not in counts][: max(0, k - len(ranked))]
    chosen = ranked[: k - len([s for s in specials if s not in ranked[:k]])]
    chosen += [s for s in specials if s not in chosen]
    return torch.tensor(chosen[:k], dtype=torch.long)


def _batch(data: TokenData, indices, device) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens (B, T) right-padded with 0, weights (B, T) with 0 on padding."""
    t = max(len(data.sequences[i]) for i in indices)
    tokens = torch.zeros(len(indices), t, dtype=torch.long)
    weights = torch.zeros(len(indices), t)
    for row, i in enumerate(indices):
        seq = data.sequences[i]
        tokens[row, : len(seq)] = torch.tensor(seq)
        weights[row, : len(seq)] = torch.tensor(data.weights[i])
    return tokens.to(device), weights.to(device)


class _Order:
    """Seeded, resumable data order: micro-batch g of the run is always the same indices.

    With `lengths`, each epoch's shuffled order is cut into chunks of `group` micro-batches and each chunk
    sorted longest first, so a micro-batch holds sequences of about one length: a batch is padded to its
    longest sequence, and a random batch of a set mixing 700-token and 200-token sequences nearly always
    holds a long one. Which sequences meet in a chunk, and the chunks' order, stay random."""

    def __init__(self, n: int, batch_size: int, seed: int, lengths: list[int] | None = None, group: int = 64) -> None:
        self.n, self.batch_size, self.seed = n, batch_size, seed
        self.lengths = None if lengths is None else np.asarray(lengths)
        self.group = group
        self._perms: dict[int, np.ndarray] = {}

    def epoch(self, epoch: int) -> np.ndarray:
        perm = np.random.default_rng([self.seed, epoch]).permutation(self.n)
        if self.lengths is None:
            return perm
        size = self.batch_size * self.group
        return np.concatenate([c[np.argsort(-self.lengths[c], kind="stable")]
                               for c in (perm[i : i + size] for i in range(0, self.n, size))])

    def indices(self, g: int) -> list[int]:
        out = []
        for i in range(g * self.batch_size, (g + 1) * self.batch_size):
            epoch, pos = divmod(i, self.n)
            if epoch not in self._perms:
                self._perms = {epoch: self.epoch(epoch)}
            out.append(int(self._perms[epoch][pos]))
        return out


# ----- the loss -------------------------------------------------------------------------------
def _autocast(device: torch.device):
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()


def _shift(x: torch.Tensor) -> torch.Tensor:
    """features[:, t] = x[:, t - 1], zeros at t = 0.  (B, T, H) -> (B, T, H)"""
    return torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], dim=1)


@torch.no_grad()
def target_states(target: Transformer, tokens: torch.Tensor, n_trunk: int,
                  capture: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
    """The target on right-padded tokens (B, T): trunk hidden (B, T, H), final hidden (B, T, H) and the
    states (B, T, H) after each layer count in `capture` (a draft's `feature_layers`)."""
    pos = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)  # (B, T)
    with _autocast(tokens.device):
        trunk = target(tokens, pos, layers=range(0, n_trunk)).hidden
        out = target(None, pos, layers=range(n_trunk, target.args.num_layers), hidden=trunk,
                     compute_logits=False, capture=tuple(capture))
    return trunk, out.final_hidden, out.captured


@torch.no_grad()
def target_logits(target: Transformer, final: torch.Tensor, vocab_ids: torch.Tensor | None) -> torch.Tensor:
    """Next-token logits (..., K or V) in fp32 from final hidden states."""
    with _autocast(final.device):
        weight = target.lm_head.weight if vocab_ids is None else target.lm_head.weight[vocab_ids]
        return F.linear(final, weight).float()


class TeacherCache:
    """The target's trunk, final (and `capture`d) hidden states for every token of the training set, in device memory.

    Distillation runs the whole target once per batch, and a training run passes over a few thousand
    sequences tens of times: the target's forward pass is most of a step. The target is frozen and
    attention is causal, so a token's states do not depend on the epoch or on the padding of its
    batch; they are computed once (sequences sorted by length, little padding) and gathered per
    batch. Logits are recomputed from the final states (one small projection), so the cache holds
    (2 + len(capture)) x H values per token, not a vocabulary's worth.
    """

    def __init__(self, target: Transformer, data: TokenData, n_trunk: int, device: torch.device, batch_size: int = 64,
                 capture: tuple[int, ...] = ()):
        lengths = [len(s) for s in data.sequences]
        self.offsets = np.concatenate([[0], np.cumsum(lengths)])
        total, h = int(self.offsets[-1]), target.args.hidden_size
        dtype = target.embed_tokens.weight.dtype  # the residual stream's dtype, autocast or not
        # One extra zero row at the end: where padding positions point.
        self.trunk = torch.zeros(total + 1, h, dtype=dtype, device=device)
        self.final = torch.zeros(total + 1, h, dtype=dtype, device=device)
        self.captured = tuple(torch.zeros(total + 1, h, dtype=dtype, device=device) for _ in capture)
        order = np.argsort(lengths, kind="stable")
        for start in range(0, len(order), batch_size):
            idx = [int(i) for i in order[start : start + batch_size]]
            tokens, _ = _batch(data, idx, device)
            trunk, final, captured = target_states(target, tokens, n_trunk, capture)
            for row, i in enumerate(idx):
                a, b = int(self.offsets[i]), int(self.offsets[i + 1])
                self.trunk[a:b] = trunk[row, : b - a]
                self.final[a:b] = final[row, : b - a]
                for store, c in zip(self.captured, captured):
                    store[a:b] = c[row, : b - a]
        self.lengths = lengths

    @staticmethod
    def size_gb(target: Transformer, data: TokenData, capture: tuple[int, ...] = ()) -> float:
        tokens = sum(len(s) for s in data.sequences) + 1
        per_token = (2 + len(capture)) * target.args.hidden_size * target.embed_tokens.weight.element_size()
        return tokens * per_token / 1e9

    def gather(self, indices: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, tuple]:
        """Trunk, final and captured hidden (B, T, H) of these sequences, right-padded with zeros like `_batch`."""
        t = max(self.lengths[i] for i in indices)
        pad = len(self.trunk) - 1
        flat = np.full((len(indices), t), pad, dtype=np.int64)
        for row, i in enumerate(indices):
            flat[row, : self.lengths[i]] = np.arange(self.offsets[i], self.offsets[i + 1])
        flat = torch.from_numpy(flat).to(device)
        return self.trunk[flat], self.final[flat], tuple(c[flat] for c in self.captured)


def teacher_cache_plan(cfg: TrainConfig, target: Transformer, data: TokenData,
                       capture: tuple[int, ...] = ()) -> tuple[float, str | None]:
    """(GB the teacher cache of this run would hold, why it is not built: None = it is built)."""
    gb = TeacherCache.size_gb(target, data, capture)
    if cfg.teacher_cache_gb <= 0:
        return gb, "off"
    if gb > cfg.teacher_cache_gb:
        return gb, (f"the target's states need {gb:.2f} GB, over teacher_cache_gb={cfg.teacher_cache_gb:g}: "
                    "the target runs on every batch")
    # Building it is one target pass over the whole set: it saves time only if the run reads its
    # sequences more than once (a short run on a large set would pay for states it never reads).
    if cfg.steps * cfg.batch_size * cfg.grad_accum <= len(data):
        return gb, "the run reads each sequence at most once: the target runs on each batch"
    return gb, None


def distill_loss(target: Transformer, draft: DraftModel, tokens: torch.Tensor, weights: torch.Tensor,
                 cfg: TrainConfig, states: tuple | None = None) -> tuple[torch.Tensor, dict]:
    """Loss of one micro-batch and its parts per draft step, as tensors (one host transfer when the caller
    reads them): KL, top-1 agreement and the expected acceptance of a sampled token (sum_x min(p, q) at
    temperature 1), all over the head's vocabulary (the target's distribution renormalized on it).
    `states`: the target's trunk and final (and captured) hidden states of these tokens when already known
    (`TeacherCache`); else the target runs."""
    vocab_ids = draft.vocab_ids
    if states is None:
        states = target_states(target, tokens, draft.shared_layers, draft.feature_layers)
    trunk, final, captured = states
    pos = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    logits = target_logits(target, final, vocab_ids)
    target_logp = F.log_softmax(logits, dim=-1)  # (B, T, K): renormalized over the sub-vocabulary
    target_prob = target_logp.exp()
    target_top = logits.argmax(-1)  # (B, T)
    denom = weights.sum().clamp_min(1e-6)
    deep = draft.feature_input == "deep"
    steps = cfg.rollout_steps if deep else 1  # without features the draft's inputs are the true trunk states
    ce_labels = None
    if cfg.ce_weight > 0:
        # Next data token, in head-vocabulary indices (-100: outside it or no next token).
        nxt = torch.cat([tokens[:, 1:], torch.full_like(tokens[:, :1], -1)], dim=1)
        if vocab_ids is not None:
            lookup = torch.full((target.args.vocab_size + 1,), -100, dtype=torch.long, device=tokens.device)
            lookup[vocab_ids] = torch.arange(len(vocab_ids), device=tokens.device)
            ce_labels = lookup[nxt]  # index -1 hits the trailing -100 slot
        else:
            ce_labels = nxt.masked_fill(nxt < 0, -100)
        ce_labels = ce_labels.masked_fill(weights == 0, -100)
    total = torch.zeros((), device=tokens.device)
    parts: dict = {"kl": [], "top1": [], "accept": []}
    with _autocast(tokens.device):
        feats = _shift(draft.target_features(final, captured)) if deep else None
        for k in range(steps):
            scores, out = draft.forward_train(trunk, feats, pos)  # (B, T, K), (B, T, H)
            draft_logp = F.log_softmax(scores.float(), dim=-1)
            kl = ((target_prob * (target_logp - draft_logp)).sum(-1) * weights).sum() / denom
            loss = kl
            with torch.set_grad_enabled(torch.is_grad_enabled() and cfg.tv_weight > 0):  # else only a metric
                accept = (torch.minimum(target_prob, draft_logp.exp()).sum(-1) * weights).sum() / denom  # 1 - TV
            if cfg.tv_weight > 0:
                loss = loss + cfg.tv_weight * (1 - accept)
            if ce_labels is not None:
                ce = F.nll_loss(draft_logp.flatten(0, 1), ce_labels.flatten(), ignore_index=-100)
                loss = loss + cfg.ce_weight * ce
            if deep:
                proxy = draft.proxy_feature(out)  # (B, T, H): stands in for the target's feature at the next position
                if cfg.feature_weight > 0:
                    reg = F.smooth_l1_loss(proxy.float(), final.float(), reduction="none").mean(-1)
                    loss = loss + cfg.feature_weight * (reg * weights).sum() / denom
                if k + 1 < steps:
                    feats = _shift(proxy)
            total = total + loss / steps
            agree = ((draft_logp.argmax(-1) == target_top).float() * (weights > 0)).sum() / (weights > 0).sum().clamp_min(1)
            parts["kl"].append(kl.detach())
            parts["top1"].append(agree)
            parts["accept"].append(accept.detach())
    return total, {k: torch.stack(v) for k, v in parts.items()}


@torch.no_grad()
def held_out(target: Transformer, draft: DraftModel, data: TokenData, cfg: TrainConfig, device) -> dict:
    """Mean loss, KL and top-1 agreement per draft step over the first eval_batches validation batches."""
    draft.eval()
    n = min(len(data), cfg.eval_batches * cfg.batch_size)
    losses, by_step = [], collections.defaultdict(list)
    for start in range(0, n, cfg.batch_size):
        tokens, weights = _batch(data, list(range(start, min(n, start + cfg.batch_size))), device)
        loss, parts = distill_loss(target, draft, tokens, weights, cfg)
        losses.append(float(loss))
        for name, values in parts.items():
            by_step[name].append(values.tolist())
    draft.train()
    return {"loss": float(np.mean(losses)),
            **{f"{name}_by_step": np.mean(v, axis=0).round(4).tolist() for name, v in by_step.items()}}


# ----- the loop -------------------------------------------------------------------------------
def build_draft(target: Transformer, cfg: TrainConfig, vocab_ids: torch.Tensor | None) -> DraftModel:
    torch.manual_seed(cfg.seed)
    draft = DraftModel(target, cfg.draft_config(), name=cfg.domain, version="training")
    if cfg.init_from_target:
        draft.init_from_target()
    if draft.vocab_ids is not None:
        if vocab_ids is None:
            raise TrainError("a head_vocab draft needs its sub-vocabulary (vocab_ids)")
        draft.set_vocab(vocab_ids)
    return draft.float().train()  # fp32 master weights (bf16 autocast computes on GPU)


def _param_groups(draft: DraftModel, cfg: TrainConfig) -> list[dict]:
    groups = {("head", True): [], ("head", False): [], ("adapters", True): [], ("adapters", False): []}
    for name, p in draft.named_parameters():
        part = "head" if name.startswith("head.") else "adapters"  # adapters, fuse, out_norm share a rate
        groups[(part, p.dim() >= 2)].append(p)
    return [{"params": ps, "lr": cfg.lr_head if part == "head" else cfg.lr_adapters,
             "weight_decay": cfg.weight_decay if decay else 0.0}
            for (part, decay), ps in groups.items() if ps]


def _lr_lambda(cfg: TrainConfig, clock: Callable[[], float] | None = None) -> Callable[[int], float]:
    """Linear warmup, then cosine to min_lr_ratio. With a time budget, `clock()` (the fraction of
    max_seconds spent) moves the cosine too: the schedule follows whichever is further along."""

    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / (cfg.warmup_steps + 1)
        progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        if clock is not None:
            progress = max(progress, clock())
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return f


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


SHAPE_KEYS = ("shared_layers", "adapter_layers", "head", "feature_input", "head_vocab", "feature_layers")


def draft_shape(folder: str | Path) -> dict:
    """The TrainConfig shape fields of a saved draft (its manifest's draft_config): what `--init-from` keeps."""
    from drafts.checkpoint import DraftLoadError, read_manifest
    from drafts.config import DraftConfig

    try:
        config = DraftConfig.from_dict(read_manifest(Path(folder))["draft_config"])
    except (DraftLoadError, KeyError, TypeError, ValueError) as exc:
        raise TrainError(f"--init-from {folder}: not a draft checkpoint folder ({exc}); name a draft's version "
                         "folder (manifest.json and draft.safetensors: <store>/code/<version>) or a store's domain "
                         "folder (<store>/code, its ACTIVE version)") from exc
    return {k: list(v) if k == "feature_layers" else v for k, v in vars(config).items() if k in SHAPE_KEYS}


def warm_start(cfg: TrainConfig, target: Transformer) -> dict[str, torch.Tensor]:
    """The weights of the draft `cfg.init_from` names (checked like a served draft: sha256, target fingerprint,
    tensor shapes), as a state dict for a draft of `cfg`'s shape; TrainError when it is another shape."""
    from drafts.checkpoint import DraftLoadError, load_draft

    try:
        start = load_draft(cfg.init_from, target)
    except DraftLoadError as exc:
        raise TrainError(f"--init-from: {exc}") from exc
    want = cfg.draft_config().resolve(target.args.num_layers)
    diff = {k: (getattr(start.config, k), getattr(want, k)) for k in SHAPE_KEYS
            if getattr(start.config, k) != getattr(want, k)}
    if diff:
        shown = ", ".join(f"{k}: draft {a!r} vs options {b!r}" for k, (a, b) in diff.items())
        raise TrainError(f"--init-from {cfg.init_from} is a draft of another shape ({shown}); train with its shape "
                         "(training.distill.draft_shape reads it), or leave out --init-from to train a new draft")
    return {k: v.detach().float() if v.is_floating_point() else v for k, v in start.state_dict().items()}


_RESUME_KEYS = ("domain", *SHAPE_KEYS, "batch_size", "grad_accum", "seq_len", "seed", "rollout_steps", "group_by_length")


def _load_checkpoint(path: Path, cfg: TrainConfig, fingerprint: str) -> dict:
    state = torch.load(path, map_location="cpu", weights_only=False)
    if state["fingerprint"] != fingerprint:
        raise TrainError(f"{path} was written for another target (fingerprint {state['fingerprint'][:12]}, this target "
                         f"{fingerprint[:12]}); resume with the same --target, or start over with a new --out or --no-resume")
    saved = state["config"]
    saved = {"feature_layers": [], "group_by_length": False, **saved}  # what checkpoints from before these options had
    diff = {k: (saved.get(k), getattr(cfg, k)) for k in _RESUME_KEYS if saved.get(k) != getattr(cfg, k)}
    if diff:
        shown = ", ".join(f"{k}: checkpoint {a!r} vs now {b!r}" for k, (a, b) in diff.items())
        raise TrainError(f"{path} belongs to a run with other settings ({shown}); use the same settings to resume, "
                         "or a new --out / --no-resume to start over")
    return state


def train(cfg: TrainConfig, target: Transformer, train_data: TokenData, val_data: TokenData | None = None,
          vocab_ids: torch.Tensor | None = None, callback: Callable[[int, dict], None] | None = None,
          progress: bool = True) -> TrainResult:
    """Train (or resume) a draft; checkpoints to out_dir/ckpt/state.pt. `callback(step, log)` runs after each step."""
    from tqdm.auto import tqdm

    # Setup: device, output folder, resume state.
    check_train_domain(cfg.domain)
    device = torch.device(cfg.device)
    out_dir = Path(cfg.out_dir)
    try:
        (out_dir / "ckpt").mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise TrainError(f"cannot create the run folder {out_dir}: {exc.strerror or exc}; choose a writable --out") from exc
    if not os.access(out_dir / "ckpt", os.W_OK):
        raise TrainError(f"no write permission on {out_dir / 'ckpt'}; choose a writable --out")
    ckpt_path = out_dir / "ckpt" / "state.pt"
    fingerprint = target_fingerprint(target)
    state = _load_checkpoint(ckpt_path, cfg, fingerprint) if cfg.resume and ckpt_path.is_file() else None
    start = warm_start(cfg, target) if cfg.init_from and state is None else None  # a resume keeps its own weights
    if start is not None:
        vocab_ids = start.get("vocab_ids")  # the draft's own sub-vocabulary, not one counted from this data
    if vocab_ids is None:
        vocab_ids = run_vocab(cfg, train_data, target.args.vocab_size,
                              [target.args.bos_token_id, *target.args.eos_token_ids])
    if state is not None:
        vocab_ids = state["draft"].get("vocab_ids")
    draft = build_draft(target, cfg, vocab_ids)
    if start is not None:
        draft.load_state_dict(start)  # into the fp32 master weights
    optimizer = torch.optim.AdamW(_param_groups(draft, cfg), betas=(0.9, 0.95))
    resumed_seconds, started = 0.0, time.perf_counter()  # loop time of the runs before a resume; this run's start

    def elapsed() -> float:  # reads the two names above as they are when called
        return resumed_seconds + time.perf_counter() - started

    clock = (lambda: elapsed() / cfg.max_seconds) if cfg.max_seconds else None
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(cfg, clock))
    step, history = 0, []
    if state is not None:
        draft.load_state_dict(state["draft"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        _set_rng_state(state["rng"])
        step, history = state["step"], state["history"]
        resumed_seconds = state.get("elapsed", 0.0)
    order = _Order(len(train_data), cfg.batch_size, cfg.seed,
                   lengths=[len(s) for s in train_data.sequences] if cfg.group_by_length else None)
    log_file = out_dir / "train_log.jsonl"
    started = time.perf_counter()  # the teacher cache is built on the loop's clock
    teacher = None
    cache_gb, no_cache = teacher_cache_plan(cfg, target, train_data, draft.feature_layers)
    if no_cache is None:
        teacher = TeacherCache(target, train_data, draft.shared_layers, device, capture=draft.feature_layers)

    def save() -> None:
        tmp = ckpt_path.with_name(f".state.pt.tmp-{os.getpid()}")
        torch.save({"step": step, "draft": draft.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "rng": _rng_state(), "config": cfg.model_dump(),
                    "fingerprint": fingerprint, "history": history, "elapsed": elapsed()}, tmp)
        os.replace(tmp, ckpt_path)

    # Loop: accumulate micro-batches, clip, step, log; evaluate and checkpoint periodically.
    bar = tqdm(total=cfg.steps, initial=step, desc=f"distill {cfg.domain}", disable=not progress, dynamic_ncols=True)
    first_logged = len(history)
    while step < cfg.steps:
        optimizer.zero_grad(set_to_none=True)
        sums = None  # (loss, kl per draft step..., top1 per draft step..., accept per draft step...) on the device
        for micro in range(cfg.grad_accum):
            indices = order.indices(step * cfg.grad_accum + micro)
            tokens, weights = _batch(train_data, indices, device)
            states = teacher.gather(indices, device) if teacher is not None else None
            loss, parts = distill_loss(target, draft, tokens, weights, cfg, states)
            (loss / cfg.grad_accum).backward()
            row = torch.cat([loss.detach()[None], parts["kl"], parts["top1"], parts["accept"]]) / cfg.grad_accum
            sums = row if sums is None else sums + row
        grad_norm = torch.nn.utils.clip_grad_norm_(draft.parameters(), cfg.clip)
        optimizer.step()
        scheduler.step()
        step += 1
        out_of_time = clock is not None and clock() >= 1.0
        *values, norm = torch.cat([sums, grad_norm.reshape(1)]).tolist()  # the step's one host transfer
        n = len(parts["kl"])
        log = {"step": step, "loss": round(values[0], 5), "kl_by_step": np.round(values[1 : 1 + n], 4).tolist(),
               "top1_by_step": np.round(values[1 + n : 1 + 2 * n], 4).tolist(),
               "accept_by_step": np.round(values[1 + 2 * n :], 4).tolist(), "grad_norm": round(norm, 4),
               "lr_adapters": scheduler.get_last_lr()[-1]}
        if len(history) == first_logged:  # this process's first step (also after a resume)
            if teacher is not None:
                log["teacher_cache_gb"] = round(cache_gb, 3)
            elif no_cache != "off":  # said once: every step runs the target
                log["teacher_cache_skipped"] = no_cache
        if out_of_time:
            log["stopped"] = f"time budget of {cfg.max_seconds:g} s reached"
        if val_data is not None and (step % cfg.eval_every == 0 or step == cfg.steps or out_of_time):
            log["eval"] = held_out(target, draft, val_data, cfg, device)
        history.append(log)
        with open(log_file, "a") as f:
            f.write(json.dumps(log) + "\n")
        bar.update(1)
        bar.set_postfix(loss=f"{log['loss']:.3f}", top1=f"{log['top1_by_step'][0]:.2f}")
        if step % cfg.save_every == 0 or step == cfg.steps or out_of_time:
            save()
        if callback is not None:
            callback(step, log)
        if out_of_time:
            break
    bar.close()
    return TrainResult(draft, step, history, out_dir, time.perf_counter() - started)

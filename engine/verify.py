"""Verification of drafted tokens: pure functions of (draft tokens, draft probs, target logits/probs).

Vocabulary: drafted tokens are *accepted* while the test passes; at the first failure a
*recovered* token is sampled from normalize(max(0, target_prob - draft_prob)); when every drafted
token of the last block is accepted, a *bonus* token is sampled from the target's next distribution.

Index math, for k drafted tokens d[0..k-1] and k+1 target distributions t[0..k] where t[i] is the
target's distribution for the position of d[i] (and t[k] the one after d[k-1]):
    accepted = [d0 ok, d1 ok, d2 rejected]  ->  num_accepted = 2, next token ~ adjusted(t[2], draft[2])
    accepted = [ok, ok, ok] (k = 3)          ->  num_accepted = 3, next token ~ t[3] (the bonus)
"""

from __future__ import annotations

import dataclasses

import torch

from engine.sampling import RandomStream, advance, sample_with, stream_state, uniform_at
from engine.triton_kernels import argmax


@dataclasses.dataclass
class VerifyResult:
    num_accepted: torch.Tensor  # (B,) long, 0..k
    next_token: torch.Tensor  # (B,) long: recovered token (num_accepted < k) or bonus token (== k)


def verify_greedy(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> VerifyResult:
    """Longest prefix of draft_tokens (B, k) matching the target's argmax over target_logits (B, k+1, V)."""
    target_tokens = argmax(target_logits)  # (B, k+1)
    k = draft_tokens.shape[1]
    matches = (draft_tokens == target_tokens[:, :k]).long()
    num_accepted = matches.cumprod(dim=1).sum(dim=1)  # (B,)
    next_token = target_tokens.gather(1, num_accepted[:, None]).squeeze(1)
    return VerifyResult(num_accepted, next_token)


def verify_sampled(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    streams: list[RandomStream] | None = None,
    draws: torch.Tensor | None = None,
    draft_vocab: torch.Tensor | None = None,
    draft_index: torch.Tensor | None = None,
) -> VerifyResult:
    """Leviathan et al.'s rejection sampling.

    draft_tokens (B, k); draft_probs (B, k, V) the distributions they were drawn from;
    target_probs (B, k+1, V) with the same temperature/top-k/top-p applied. Random draws: k + 1 per
    row, from `streams` (advanced), or given as `draws` (B, k + 1), those same numbers drawn ahead on the
    device (`engine.sampling.uniform_at`; nothing on the host: the captured sampled round).

    A draft that scores only a sub-vocabulary drew over it: then draft_probs is (B, k, K) over each row's
    `draft_vocab` (B, K) token ids (no zeros over the other V - K tokens), and `draft_index` (B, k) says
    where each drafted token sits in it. Same acceptance and same residual distribution: the draft's
    probability is zero outside its sub-vocabulary.
    """
    batch, k = draft_tokens.shape
    if draws is None:
        draws = uniform_at(stream_state(streams, draft_tokens.device), 0, (batch, k + 1))
        advance(streams, k + 1)
    target_prob = target_probs[:, :k].gather(-1, draft_tokens[..., None]).squeeze(-1)  # (B, k)
    at = draft_tokens if draft_vocab is None else draft_index
    draft_prob = draft_probs.gather(-1, at[..., None]).squeeze(-1)  # (B, k)
    u = draws[:, :k]
    accepted = (u * draft_prob < target_prob).long()  # accept with probability min(1, target/draft)
    num_accepted = accepted.cumprod(dim=1).sum(dim=1)  # (B,)
    # Pad the draft with a zero distribution at index k, so the bonus case is adjusted(t[k], 0) = t[k].
    padded_draft = torch.cat([draft_probs, torch.zeros_like(draft_probs[:, :1])], dim=1)  # (B, k+1, V or K)
    rows = torch.arange(batch, device=draft_tokens.device)
    target_at = target_probs[rows, num_accepted]  # (B, V)
    draft_at = padded_draft[rows, num_accepted]
    if draft_vocab is not None:  # the row's draft distribution over the whole vocabulary
        draft_at = torch.zeros_like(target_at).scatter_(-1, draft_vocab, draft_at.to(target_at.dtype))
    adjusted = (target_at - draft_at).clamp_min(0)
    total = adjusted.sum(-1, keepdim=True)
    # target == draft exactly leaves no mass: then rejection never happens, keep the target as is.
    adjusted = torch.where(total > 0, adjusted / total.clamp_min(1e-30), target_at)
    return VerifyResult(num_accepted, sample_with(adjusted, draws[:, k]))

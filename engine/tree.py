"""Draft trees: a greedy round drafts `width` branches and the target verifies them all in one pass.

The chain drafts gamma tokens, each the draft's best guess after the one before; one early miss ends the
round. A greedy tree of width k takes the draft's k best tokens for the first position (where a miss costs the
most and the draft's second and third guesses are often right: `bench.tree_headroom`) and continues each
greedily to depth gamma. The trunk and the adapters draft the k branches side by side (k tokens a step,
not k steps), the deep layers verify the 1 + k * gamma nodes in one pass, and the round keeps the branch
whose prefix the target accepts furthest (the first such branch on ties), then the target's own next
token after it. Greedy output is exactly plain decoding's: every kept token is the target's argmax given
the tokens before it.

Layout, per row, with the pending token t0 at position (and slot) p:

    slot     p    p+1   p+2  ..  p+k   p+k+1 ..  p+2k  ..  p+(g-1)k+1 .. p+gk
    node     t0   b0d1  b1d1 ..  bk-1  b0d2  ..  bk-1  ..  b0dg       .. bk-1dg
    position p    p+1   p+1  ..  p+1   p+2   ..  p+2   ..  p+g        .. p+g

Node (branch i, depth d) sits at slot p + 1 + (d - 1) k + i with RoPE position p + d, and sees the slots up
to p and its own branch's nodes up to itself (`tree_mask`): attention over exactly the keys a sequential
decode of that branch would see. After verification the kept branch's K and V (every target layer, and the
adapters' for drafts without deep features, whose next round rewrites its window anyway) move to slots
p + 1 .. p + gamma (`KVCache.move`), where the next round expects a chain; what lies past the row's new
length is never seen and gets overwritten.

Sampled rounds (`accept_tree_sampled`): the first position's `width` candidates are independent draws from the
draft, tried in turn against what the target's distribution leaves after the candidates rejected before them
(SpecInfer's multi-candidate speculative sampling); the accepted candidate's branch continues as a chain checked by
the usual rejection sampling. Output keeps the target's distribution (tested by total variation). Rounds holding
a seeded sampled request keep the chain: a tree there would make its tokens depend on whether the batch was
small enough for one.

Rows of the batch run the same tree; one graph per (batch bucket, width, gamma, greedy or sampled).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.cache import row_index, to_device
from engine.sampling import advance, needs_filters, param_tensors, processed_probs, sample_with, stream_state, uniform_at
from engine.speculative import draft_features, full_vocab_scores
from engine.triton_kernels import argmax
from engine.verify import verify_sampled

if TYPE_CHECKING:
    from engine.scheduler import DecodeEngine
    from engine.speculative import Draft


def tree_layout(pos0: torch.Tensor, width: int, gamma: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B,) pending positions -> (slots, positions) (B, 1 + width * gamma) of the root and the nodes in slot order."""
    n = torch.arange(width * gamma, device=pos0.device)
    offsets = torch.cat([n.new_zeros(1), n + 1])  # slot - p
    depths = torch.cat([n.new_zeros(1), n // width + 1])  # position - p
    return pos0[:, None] + offsets[None], pos0[:, None] + depths[None]


def tree_mask(pos0: torch.Tensor, width: int, gamma: int, kv_len: int) -> torch.Tensor:
    """(B, 1, 1 + width * gamma, kv_len) bool: what the root and each node see (slot order, as `tree_layout`):
    every slot up to the pending token's, then its own branch's nodes up to itself."""
    slots = torch.arange(kv_len, device=pos0.device)
    rel = slots[None, :] - pos0[:, None] - 1  # (B, S): < 0 for the prefix and the root
    q = torch.arange(-1, width * gamma, device=pos0.device)  # (Q,): the root is -1
    rel_k, q = rel[:, None, :], q[None, :, None]
    same_branch = torch.remainder(rel_k, width) == torch.remainder(q, width)
    return ((rel_k < 0) | ((rel_k <= q) & same_branch))[:, None]


def accept_tree(tokens: torch.Tensor, target_tokens: torch.Tensor, width: int, gamma: int):
    """The longest accepted branch. tokens (B, width * gamma) the drafted nodes in slot order; target_tokens
    (B, 1 + width * gamma) the target's argmax at the root and each node. -> (num_accepted (B,), branch (B,),
    the branch's tokens (B, gamma), next token (B,): the target's after the branch's accepted prefix)."""
    b = tokens.shape[0]
    n = torch.arange(width * gamma, device=tokens.device)
    parent = torch.where(n < width, 0, n + 1 - width)  # root at 0, node n at n + 1
    ok = (tokens == target_tokens[:, parent]).long().view(b, gamma, width)
    accepted = ok.cumprod(dim=1).sum(dim=1)  # (B, width)
    num_accepted, branch = accepted.max(dim=1)  # the first of equals
    path = tokens.view(b, gamma, width).gather(2, branch[:, None, None].expand(b, gamma, 1))[..., 0]
    last = torch.where(num_accepted > 0, (num_accepted - 1) * width + branch + 1, 0)
    return num_accepted, branch, path, target_tokens.gather(1, last[:, None])[:, 0]


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalize(max(0, p - q)) row-wise: what the target's distribution p leaves once a draw from q is rejected
    (p itself where nothing is left: p == q never rejects)."""
    left = (p - q).clamp_min(0)
    total = left.sum(-1, keepdim=True)
    return torch.where(total > 0, left / total.clamp_min(1e-30), p)


def accept_tree_sampled(tokens: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor, width: int,
                        gamma: int, draws: torch.Tensor):
    """Lossless acceptance of a sampled tree (SpecInfer's multi-candidate speculative sampling at the root, then
    Leviathan et al.'s along the kept branch).

    tokens (B, width * gamma) drafted nodes in slot order; the first `width` are independent draws from the draft's
    root distribution, each later one a draw from the distribution the draft gave after its parent. draft_probs
    (B, 1 + width * (gamma - 1), V): the root distribution, then the one each node of depth 1 .. gamma - 1 drew its
    child from (slot order). target_probs (B, 1 + width * gamma, V) at the root and every node. draws (B,
    width + gamma) uniforms. The root's candidates are tried in turn, each against the target's distribution
    left by the ones rejected before it (normalize(max(0, p - q))); the first accepted one's branch continues as
    a chain; none accepted: the next token comes from what is left. -> (num_accepted, branch, the branch's
    tokens (B, gamma), next token)."""
    b = tokens.shape[0]
    rows = torch.arange(b, device=tokens.device)
    q = draft_probs[:, 0]
    p = target_probs[:, 0]
    branch = torch.full((b,), -1, dtype=torch.long, device=tokens.device)
    for i in range(width):
        x = tokens[:, i : i + 1]
        ok = (branch < 0) & (draws[:, i] * q.gather(1, x)[:, 0] < p.gather(1, x)[:, 0])
        branch = torch.where(ok, i, branch)
        p = torch.where((branch < 0)[:, None], residual(p, q), p)
    found = branch >= 0
    branch = branch.clamp_min(0)
    path = tokens.view(b, gamma, width)[rows, :, branch]  # (B, gamma)
    nodes = 1 + torch.arange(gamma, device=tokens.device)[None] * width + branch[:, None]  # the branch's nodes
    if gamma > 1:  # the branch's later tokens: a chain checked against the target at their parents
        parents = nodes[:, :-1]  # nodes of depth 1 .. gamma - 1
        chain_q = draft_probs[rows[:, None], parents]  # node n of depth < gamma drew its child from draft_probs[:, n]
        chain = verify_sampled(path[:, 1:], chain_q, target_probs[rows[:, None], nodes], draws=draws[:, width:])
        num_chain, after = chain.num_accepted, chain.next_token
    else:  # nothing left to check: the bonus token after the root's accepted candidate
        num_chain = torch.zeros_like(branch)
        after = sample_with(target_probs[rows, nodes[:, 0]], draws[:, width])
    rest = sample_with(p, draws[:, width + gamma - 1])  # no candidate accepted: from the root's residual
    num_accepted = torch.where(found, 1 + num_chain, 0)
    return num_accepted, branch, path, torch.where(found, after, rest)


def launch_tree_round(eng: "DecodeEngine", slots: list, draft: "Draft", gamma: int, width: int, kv_len: int,
                      greedy: bool = True, pending: torch.Tensor | None = None, pos0: torch.Tensor | None = None,
                      sub_vocab_draws: bool = True):
    """One tree round, launched (one CUDA graph when the engine captures): -> (packed (b, gamma + 2) on the device,
    per row [num_accepted, next token, the kept branch's gamma tokens], as `launch_round`; pos0 (b,)).
    `pending` / `pos0` as `launch_round`'s. Sampled rounds draw every drafted token and every verify decision
    from the rows' streams on the device (width * gamma + width + gamma draws a round) and advance them after;
    sub_vocab_draws: the draft draws over its own sub-vocabulary when it has one (`SpecConfig.sub_vocab_draws`)."""
    model, device = eng.model, eng.device
    n_trunk, deep = draft.shared_layers, draft.feature_input == "deep"
    capture = tuple(getattr(draft, "feature_layers", ()))
    kv_len = eng.kv_bucket(kv_len + (width - 1) * gamma)
    draft_kv = eng.draft_kv_len(kv_len)
    num_layers = model.args.num_layers
    rows = row_index([s.slot for s in slots], device)
    if pos0 is None:
        pos0 = to_device([s.length for s in slots], device)
        pending = to_device([s.pending for s in slots], device)
    inputs = {"pending": pending, "pos0": pos0}
    filtered = False
    n_draws = width * gamma + width + gamma
    vocab = model.args.vocab_size
    vocab_ids = getattr(draft, "vocab_ids", None)
    sub = None if vocab_ids is None or not sub_vocab_draws else vocab_ids  # the draft draws over these K tokens
    if not greedy:
        params = [s.request.params for s in slots]
        filtered = needs_filters(params)
        inputs.update(state=stream_state([s.random for s in slots], device), **param_tensors(params, device))

    def tree_round(pending, pos0, rows=rows, state=None, temperature=None, draft_temperature=None, top_k=None,
                   top_p=None):
        b = pending.shape[0]
        draws = None if greedy else uniform_at(state, 0, (b, n_draws))  # drafting takes the first width * gamma
        draft_probs = []  # sampled: the distribution each depth's tokens were drawn from, (b, V) or (b, width, V)

        def draw(scores, first: int):
            """Sampled: `width` tokens (b, width) from the draft's scores (b, m, K or V) at draws first .. first +
            width - 1: m == 1, the root's one distribution drawn from `width` times; m == width, one draw each."""
            if sub is None:
                scores = full_vocab_scores(draft, scores, vocab)
            probs = processed_probs(scores, draft_temperature, top_k, top_p, filtered)  # (b, m, K or V)
            m = probs.shape[1]
            index = torch.stack([sample_with(probs[:, i % m], draws[:, first + i]) for i in range(width)], dim=1)
            full = probs if sub is None else probs.new_zeros((b, m, vocab)).scatter_(-1, sub.expand(b, m, -1), probs)
            draft_probs.append(full)
            return index if sub is None else sub[index]

        rows_t = rows if isinstance(rows, torch.Tensor) else torch.arange(rows.start, rows.stop, device=device)
        all_slots, all_pos = tree_layout(pos0, width, gamma)
        mask = tree_mask(pos0, width, gamma, kv_len)
        draft_mask = mask if draft_kv == kv_len else tree_mask(pos0, width, gamma, draft_kv)
        ar = torch.arange(b, device=device)

        def span(j):  # the root (j = 0) or the nodes at depth j, in slot order
            return slice(0, 1) if j == 0 else slice(1 + (j - 1) * width, 1 + j * width)

        trunks, nodes, proxy = [], [], None
        tokens = pending[:, None]  # (b, 1), then (b, width) a step
        for j in range(gamma + 1):
            s = span(j)
            ctx = model.context(all_pos[:, s], eng.cache, rows, kv_len, slots=all_slots[:, s], mask=mask[:, :, s])
            trunk = model(tokens, all_pos[:, s], layers=range(0, n_trunk), cache=eng.cache, rows=rows,
                          ctx=ctx).hidden  # (b, 1 or width, H)
            trunks.append(trunk)
            if j == gamma and deep:
                break  # the next round's window rewrites the adapters' KV here
            if deep and j == 0:
                window, feats, index, win_pos = eng.deep_window(rows_t, trunk[:, 0], pos0)
                out = draft.adapters_forward(window, feats, model.context(win_pos, eng.draft_cache, rows, draft_kv))
                out = out[ar, index][:, None]  # (b, 1, H)
            else:
                dctx = model.context(all_pos[:, s], eng.draft_cache, rows, draft_kv, slots=all_slots[:, s],
                                     mask=draft_mask[:, :, s])
                out = draft.adapters_forward(trunk, proxy if deep else None, dctx)  # (b, 1 or width, H)
            if j == gamma:
                break
            t = out.shape[1]
            if j == 0:  # greedy: the draft's `width` best first tokens; sampled: `width` independent draws
                scores, p = draft.predict(out[:, 0], False)
                if greedy:
                    top = scores.topk(width, dim=-1).indices  # (b, width)
                    tokens = top if vocab_ids is None else vocab_ids[top]
                else:
                    tokens = draw(scores[:, None], 0)
                if deep:
                    proxy = p[:, None].expand(b, width, p.shape[-1])
            else:
                tok, p = draft.predict(out.reshape(b * t, -1), greedy)
                tokens = tok.view(b, width) if greedy else draw(tok.view(b, width, -1), j * width)
                if deep:
                    proxy = p.view(b, width, -1)
            nodes.append(tokens)
        hidden = torch.cat(trunks, dim=1)  # (b, 1 + width * gamma, H), slot order
        vctx = model.context(all_pos, eng.cache, rows, kv_len, slots=all_slots, mask=mask)
        out = model(None, all_pos, layers=range(n_trunk, num_layers), hidden=hidden, cache=eng.cache, rows=rows,
                    ctx=vctx, capture=capture)
        drafted = torch.cat(nodes, dim=1)  # (b, width * gamma)
        if greedy:
            num_accepted, branch, path, nxt = accept_tree(drafted, argmax(out.logits), width, gamma)
        else:
            target_probs = processed_probs(out.logits, temperature, top_k, top_p, filtered)
            num_accepted, branch, path, nxt = accept_tree_sampled(drafted, torch.cat(draft_probs, dim=1), target_probs,
                                                                  width, gamma, draws[:, width * gamma :])
        # The kept branch moves to slots p + 1 .. p + gamma (its nodes' slots, in order of depth).
        depth = torch.arange(gamma, device=device)
        src = pos0[:, None] + 1 + depth[None] * width + branch[:, None]  # (b, gamma)
        dst = pos0[:, None] + 1 + depth[None]
        eng.cache.move(rows_t, src, dst)
        if not deep:
            eng.draft_cache.move(rows_t, src, dst)
        else:  # the next round's window: the kept branch's trunk states and target features, root first
            keep = torch.cat([torch.zeros_like(src[:, :1]), src - pos0[:, None]], dim=1)  # (b, 1 + gamma) node index
            feats = out.final_hidden
            if capture:
                feats = draft_features(draft, feats, out.captured, capture).to(feats.dtype)
            pick = keep[..., None].expand(-1, -1, hidden.shape[-1])
            eng.store_deep_round(rows_t, pos0, hidden.gather(1, pick), feats.gather(1, pick), num_accepted)
        return (torch.cat([num_accepted[:, None], nxt[:, None], path], dim=1),)

    if not eng.graphs.enabled:
        (packed,) = tree_round(**inputs)
    else:
        key = ("greedy-tree" if greedy else ("sampled-tree", filtered, sub is not None), width, kv_len, gamma, capture)
        (packed,) = eng.run_graph(key, tree_round, rows, inputs, owners=(id(draft),))
    if not greedy:
        advance([s.random for s in slots], n_draws)
    return packed, pos0

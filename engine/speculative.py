"""FlashSpec decoding: shared-trunk drafting and block-wise verification, for a batch of rows.

A draft runs the target's own layers [0, N) (its *trunk*; KV goes straight into the target cache),
then its adapters (own small KV cache) and its head. Verification runs only layers [N, L) of the
target, starting from the trunk hidden states the draft already computed.

One round for a row whose pending token t0 sits at position p (gamma = 5, block_size = 2):
    draft step on t0 -> trunk(t0), d1;  step on d1 -> trunk(d1), d2;  step on d2 -> trunk(d2), d3
    verify block 1: deep layers on [t0, d1, d2] -> target distributions checking d1, d2, and (d3)
    if d1, d2 accepted: steps on d3, d4 -> verify deep [d3, d4] (checks d3 with the carried one, d4)
    last block: step on d5 (trunk only) -> verify deep [d5] -> d5 checked, bonus token sampled
The round stops at the first rejection: the recovered token becomes the row's next pending token.
Rows of a batch run the same schedule; a row that rejected early just ignores later blocks (its
extra cache writes sit past its length, invisible, and get overwritten).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Protocol

import torch

from engine.cache import WindowedKVCache, row_index, to_device
from engine.lookup import is_lookup, propose, record_round
from engine.model import StepContext
from engine.requests import repeats_its_seed
from engine.sampling import (advance, needs_filters, param_tensors, processed_probs, sample, sample_with, stream_state,
                             uniform_at)
from engine.triton_kernels import argmax
from engine.verify import verify_greedy, verify_sampled

if TYPE_CHECKING:
    from engine.scheduler import DecodeEngine


class Draft(Protocol):
    """What the decode loop needs from a draft model (drafts/ implements it)."""

    name: str
    version: str
    shared_layers: int  # N: target layers [0, N) form the trunk
    adapter_layers: int  # A: the draft's own decoder layers
    feature_input: str  # "none" | "deep" (target's last hidden state at the previous position fused in)
    feature_layers: tuple[int, ...]  # deep drafts: target layer counts whose states are fused in too (may be empty)

    def adapters_forward(self, trunk_hidden: torch.Tensor, features: torch.Tensor | None, ctx: StepContext) -> torch.Tensor:
        """Adapter layers on (b, T, H) trunk hidden states (+ (b, T, H) features); writes adapter KV via ctx."""
        ...

    def predict(self, hidden: torch.Tensor, greedy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(b, H) adapter output -> (the draft's greedy token ids (b,) if greedy, else its logits (b, K) over the
        token ids of its `vocab_ids` attribute when it has one that is not None (a sub-vocabulary), else (b, V);
        for deep drafts the (b, H) stand-in for the target's feature at the next step, else None)."""
        ...

    def target_features(self, final: torch.Tensor, captured: list[torch.Tensor]) -> torch.Tensor:
        """The target's final states (..., H) and its states after `feature_layers` -> (..., H) feature
        input (deep drafts with feature_layers; the engine passes the final states alone otherwise)."""
        ...


def feature_layers_of(drafts) -> tuple[int, ...]:
    """The target layer counts whose states some of these drafts fuse in (sorted; () for none): what a
    pass over their rows captures (`Transformer.forward(capture=...)`)."""
    return tuple(sorted({c for d in drafts if d is not None for c in getattr(d, "feature_layers", ())}))


def draft_features(draft, final: torch.Tensor, captured, capture: tuple[int, ...]) -> torch.Tensor:
    """A deep draft's feature input (..., H) from the target's final states and the states `captured`
    after the layer counts `capture` (a superset of the draft's `feature_layers`, in order)."""
    layers = getattr(draft, "feature_layers", ())
    if not layers:
        return final
    return draft.target_features(final, [captured[capture.index(c)] for c in layers])


def draft_vocab_size(drafts) -> int | None:
    """K when every one of these drafts scores a sub-vocabulary of K tokens of its own (`vocab_ids`): a
    sampled round then draws each drafted token over those K (softmax and inverse CDF over K, not the whole
    vocabulary) and the verifier spreads only the row it needs over the vocabulary. None when a draft scores
    the whole vocabulary or the sizes differ: every draft's scores are then spread over the whole
    vocabulary first (-inf outside its sub-vocabulary)."""
    sizes = {None if getattr(d, "vocab_ids", None) is None else len(d.vocab_ids) for d in drafts}
    return next(iter(sizes)) if len(sizes) == 1 else None


def full_vocab_scores(draft, scores: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """A draft's (b, K) scores over its sub-vocabulary as (b, V) logits, -inf elsewhere (as they are without one)."""
    ids = getattr(draft, "vocab_ids", None)
    if ids is None:
        return scores
    return scores.new_full((*scores.shape[:-1], vocab_size), float("-inf")).index_copy_(-1, ids, scores)


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    num_speculative_tokens: int = 5  # gamma
    block_size: int = 2  # verify as soon as this many tokens are drafted; == gamma: one verify per round
    draft_kv_window: int | None = None  # adapters attend only the last W positions (ring-buffer cache)
    # Stop drafting a round early once, for every row, the draft gives its next token less than this
    # probability (softmax of its logits); the round then verifies what it has. 0 = always draft gamma.
    # Which tokens are drafted never changes what is accepted (lossless either way); it saves the draft
    # steps (and verify width) that would mostly be rejected. The one-graph GPU round ignores it.
    draft_confidence: float = 0.0
    # Sampled rounds draw each drafted token over the draft's own sub-vocabulary when its head has one
    # (`draft_vocab_size`): a softmax and an inverse CDF over K tokens, not the whole vocabulary. False
    # spreads its scores over the vocabulary first (the way it was done before; both are lossless, they
    # draw different tokens from the same seed). For comparisons (`flashspec bench spec --full-vocab-draws`).
    sub_vocab_draws: bool = True
    # Draft trees (`engine.tree`): rounds of at most tree_max_batch rows holding one draft (and no seeded sampled
    # request) draft tree_width first tokens (greedy: the draft's best; sampled: independent draws) and continue
    # each to gamma; one verify pass over all branches keeps the longest accepted one. 1: the chain. Such rounds
    # verify once, whatever block_size says, and draft every position (draft_confidence does not apply).
    tree_width: int = 1
    tree_max_batch: int = 1
    # Seeded sampled requests take trees too. Off by default: a seeded request's tokens would then depend on
    # whether its batch was small enough for a tree; for benchmarks, whose seeds only fix their draws.
    tree_seeded: bool = False

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        if not 1 <= self.block_size:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.draft_kv_window is not None and self.draft_kv_window < 1:
            raise ValueError(f"draft_kv_window must be >= 1 or unset, got {self.draft_kv_window}")
        if not 1 <= self.tree_width <= 16:
            raise ValueError(f"tree_width must be in [1, 16], got {self.tree_width}")
        if self.tree_max_batch < 1:
            raise ValueError(f"tree_max_batch must be >= 1, got {self.tree_max_batch}")
        if not 0.0 <= self.draft_confidence < 1.0:
            raise ValueError(f"draft_confidence must be in [0, 1), got {self.draft_confidence}")

    def blocks(self) -> list[int]:
        gamma, k = self.num_speculative_tokens, min(self.block_size, self.num_speculative_tokens)
        return [min(k, gamma - start) for start in range(0, gamma, k)]


@dataclasses.dataclass
class RoundResult:
    tokens: list[list[int]]  # per row: accepted drafts then the recovered/bonus token
    num_accepted: list[int]
    drafted: list[int]  # tokens drafted for the row before its round ended
    verify_passes: list[int]


class _Groups:
    """Rows of the batch grouped by the draft they use: adapters and head run once per group.

    items: (draft, batch indices (g,), cache rows of those indices: a slice when consecutive).
    """

    def __init__(self, drafts: list[Draft], slots: list[int], device: torch.device) -> None:
        self.items: list[tuple[Draft, torch.Tensor, object]] = []
        order: dict[int, list[int]] = {}
        by_id: dict[int, Draft] = {}
        for i, d in enumerate(drafts):
            order.setdefault(id(d), []).append(i)
            by_id[id(d)] = d
        for key, idx in order.items():
            self.items.append((by_id[key], to_device(idx, device), row_index([slots[i] for i in idx], device)))


def spec_round(eng: "DecodeEngine", slots: list, drafts: list[Draft], cfg: SpecConfig) -> RoundResult:
    """One draft-and-verify round for the given slot states (all with a draft). Mutates the caches."""
    greedy = all(s.request.params.greedy for s in slots)
    gamma = cfg.num_speculative_tokens
    kv_len = max(s.length for s in slots) + gamma + 2  # from the host's lengths: no device sync
    if captured_path(eng, drafts, cfg, slots, greedy) or tree_round(eng, slots, drafts, cfg, greedy):
        return _captured_round(eng, slots, drafts, gamma, kv_len, greedy, cfg)

    model = eng.model
    device = eng.device
    b = len(slots)
    rows_t = to_device([s.slot for s in slots], device)  # (b,) cache row of each batch row
    rows = row_index([s.slot for s in slots], device)  # the same rows as a slice when consecutive
    n_trunk = drafts[0].shared_layers
    pos0 = to_device([s.length for s in slots], device)  # (b,) position of each pending token
    pending = to_device([s.pending for s in slots], device)
    streams = [s.random for s in slots]
    temperature = draft_temperature = top_k = top_p = None  # read by the sampled branches only
    filtered = False
    if not greedy:  # greedy rounds copy no sampling parameters to the device
        sampling = param_tensors([s.request.params for s in slots], device)
        temperature, draft_temperature = sampling["temperature"], sampling["draft_temperature"]
        top_k, top_p = sampling["top_k"], sampling["top_p"]
        filtered = needs_filters(s.request.params for s in slots)
    groups = _Groups(drafts, [s.slot for s in slots], device)
    deep_rows = [i for i, d in enumerate(drafts) if d.feature_input == "deep"]
    capture = feature_layers_of(drafts)  # only what this round's drafts fuse in

    proxy = torch.zeros(b, model.args.hidden_size, device=device, dtype=eng.dtype)

    # Greedy rounds take the drafts' tokens straight from their heads, unless drafting may stop early (it
    # reads the draft's probabilities).
    draft_greedy = greedy and cfg.draft_confidence == 0
    vocab = model.args.vocab_size
    sub = None if draft_greedy or not cfg.sub_vocab_draws else draft_vocab_size(drafts)  # drawn over the sub-vocabulary
    if sub is not None:
        vocab_rows = torch.empty(b, sub, dtype=torch.long, device=device)  # each row's draft's token ids
        for draft, idx, _ in groups.items:
            vocab_rows[idx] = draft.vocab_ids

    def draft_step(tokens: torch.Tensor, positions: torch.Tensor, first: bool, with_head: bool):
        """Trunk (into the target cache) + adapters + head for one token per row at `positions` (b,):
        -> (trunk (b, 1, H), the drafted tokens (b,) when draft_greedy else the draft logits (b, K or V))."""
        trunk, _, _, _ = eng.run_target(tokens[:, None], positions[:, None], range(0, n_trunk), None, rows, kv_len)  # (b, 1, H)
        if not with_head:
            pred = None
        elif draft_greedy:
            pred = torch.empty(b, dtype=torch.long, device=device)
        else:
            pred = torch.empty(b, sub or vocab, device=device, dtype=eng.dtype)
        for draft, idx, g_rows in groups.items:
            if not with_head and draft.feature_input == "deep":
                continue  # the next round's window rewrites this position's adapter KV anyway
            if draft.feature_input == "deep" and first:
                # Re-run the adapters over last round's verified tokens with the target's true features.
                window, feats, index, win_pos = eng.deep_window(rows_t[idx], trunk[idx, 0], pos0[idx])
                out, g_pred, g_proxy = eng.run_draft(draft, window, feats, win_pos, g_rows, kv_len, pick=index,
                                                     greedy=draft_greedy)
            else:
                feats = proxy[idx, None] if draft.feature_input == "deep" else None
                out, g_pred, g_proxy = eng.run_draft(draft, trunk[idx], feats, positions[idx, None], g_rows, kv_len,
                                                     with_head=with_head, greedy=draft_greedy)
            if not with_head:
                continue  # last token of the round: its adapter KV is needed, its prediction is not
            if sub is None and not draft_greedy:
                g_pred = full_vocab_scores(draft, g_pred, vocab)
            pred[idx] = g_pred.to(pred.dtype)
            if g_proxy is not None:
                proxy[idx] = g_proxy.to(proxy.dtype)
        return trunk, pred

    # Each row's draws: its stream's counter at the round's start, moved to a fixed budget past it at the end, so
    # the next round's draws do not depend on how far the batch went in this one (rows finished early still draw).
    starts = None if greedy else [s.drawn for s in streams]
    # Per-row outcome of the round.
    done = torch.zeros(b, dtype=torch.bool, device=device)
    num_accepted = torch.zeros(b, dtype=torch.long, device=device)
    final_token = torch.zeros(b, dtype=torch.long, device=device)
    drafted = torch.zeros(b, dtype=torch.long, device=device)
    passes = torch.zeros(b, dtype=torch.long, device=device)
    drafted_tokens: list[torch.Tensor] = []
    verify_trunk: list[torch.Tensor] = []  # trunk hidden states that entered verification, in order
    verify_final: list[tuple] = []  # the target's final hidden states for them, and its captured states (deep drafts)

    trunk, draft_pred = draft_step(pending, pos0, first=True, with_head=True)
    queued = [trunk]  # trunk states not yet run through the deep layers
    q_start = 0  # offset from pos0 of the first queued state
    carry_probs = None  # target distribution carried from the previous block (checks its first token)
    n_done = 0
    blocks = cfg.blocks()
    stopped = False  # drafting ended early (cfg.draft_confidence): this block is the round's last
    for block_no, block_len in enumerate(blocks):
        block_tokens, block_probs, block_index = [], [], []
        for j in range(block_len):
            if (j > 0 or block_no > 0) and cfg.draft_confidence > 0:
                logits = draft_pred.float()  # top probability = exp(max - logsumexp): no softmax tensor
                confident = (logits.amax(-1) - logits.logsumexp(-1)).exp() >= cfg.draft_confidence
                if not bool((confident & ~done).any()):
                    stopped = True  # no live row trusts its next token: verify the j drafted so far
                    break
            if draft_greedy:
                token, probs = draft_pred, None  # the heads' own greedy tokens
            else:
                if greedy:
                    index, probs = argmax(draft_pred), None
                else:
                    probs = processed_probs(draft_pred, draft_temperature, top_k, top_p, filtered)
                    index = sample(probs, streams)
                token = index if sub is None else vocab_rows.gather(1, index[:, None])[:, 0]
                block_index.append(index)
            block_tokens.append(token)
            block_probs.append(probs)
            drafted_tokens.append(token)
            last_of_round = block_no == len(blocks) - 1 and j == block_len - 1
            trunk, draft_pred = draft_step(token, pos0 + n_done + j + 1, first=False, with_head=not last_of_round)
            queued.append(trunk)
        if stopped and not block_tokens:
            # Stopped between blocks: rows that accepted everything so far take the bonus token from the
            # target distribution the last verify pass already gave for the next position.
            bonus = carry_probs[:, 0].argmax(-1) if greedy else sample(carry_probs[:, 0], streams)
            final_token = torch.where(done, final_token, bonus)
            break
        # Verify: the deep layers on every queued trunk state, starting where the trunk left off.
        q_hidden = torch.cat(queued, dim=1)  # (b, n_in, H); block 0: [t0, d1..dk], later: the block's k
        n_in = q_hidden.shape[1]
        q_pos = pos0[:, None] + q_start + torch.arange(n_in, device=device)[None]  # (b, n_in)
        _, final_hidden, target_logits, captured = eng.run_target(
            None, q_pos, range(n_trunk, model.args.num_layers), q_hidden, rows, kv_len,
            capture)  # target_logits (b, n_in, V)
        queued = []
        q_start += n_in
        verify_trunk.append(q_hidden)
        verify_final.append((final_hidden, captured))
        block_len = len(block_tokens)
        block = torch.stack(block_tokens, dim=1)  # (b, k)
        if greedy:
            if carry_probs is not None:
                target_logits = torch.cat([carry_probs, target_logits], dim=1)
            res = verify_greedy(block, target_logits)
            carry_next = target_logits[:, -1:]
        else:
            target_probs = processed_probs(target_logits, temperature, top_k, top_p, filtered)
            if carry_probs is not None:
                target_probs = torch.cat([carry_probs, target_probs], dim=1)
            res = verify_sampled(block, torch.stack(block_probs, dim=1), target_probs, streams,
                                 draft_vocab=None if sub is None else vocab_rows,
                                 draft_index=None if sub is None else torch.stack(block_index, dim=1))
            carry_next = target_probs[:, -1:]
        live = ~done
        passes += live.long()
        drafted += live.long() * block_len
        rejected = live & (res.num_accepted < block_len)
        last_block = block_no == len(blocks) - 1 or stopped
        finishing = live if last_block else rejected
        num_accepted += torch.where(live, res.num_accepted, torch.zeros_like(res.num_accepted))
        final_token = torch.where(finishing, res.next_token, final_token)
        done |= finishing
        carry_probs = carry_next
        n_done += block_len
        if bool(done.all()):
            break

    if starts is not None:
        settle_draws(streams, starts, round_draws(cfg))
    # Host side: one transfer for the whole round.
    acc = num_accepted.tolist()
    fin = final_token.tolist()
    dr = drafted.tolist()
    ps = passes.tolist()
    all_drafted = torch.stack(drafted_tokens, dim=1).tolist()  # (b, drafted so far)
    tokens = [all_drafted[i][: acc[i]] + [fin[i]] for i in range(b)]
    if deep_rows:
        trunk_seq = torch.cat(verify_trunk, dim=1)  # (b, n, H): positions pos0 .. pos0 + n - 1
        final_seq = torch.cat([f for f, _ in verify_final], dim=1)  # (b, n, H)
        captured = [torch.cat(c, dim=1) for c in zip(*(c for _, c in verify_final))]
        feat_seq = final_seq
        if captured:  # some draft fuses extra layers: each row gets its own draft's features
            feat_seq = final_seq.clone()
            for draft, idx, _ in groups.items:
                if draft.feature_input == "deep":
                    feat_seq[idx] = draft_features(draft, final_seq[idx], [c[idx] for c in captured], capture).to(feat_seq.dtype)
        eng.store_deep_round(rows_t, pos0, trunk_seq, feat_seq, num_accepted)
    return RoundResult(tokens, acc, dr, ps)


def round_draws(cfg: SpecConfig) -> int:
    """Random draws a sampled round takes per row at most: per block, one a drafted token and one a verified
    token plus the next token's; and one more for a bonus token when drafting stops between blocks. A one-block
    round takes 2 * gamma + 1, as the captured round does (`launch_round`)."""
    blocks = cfg.blocks()
    return 2 * cfg.num_speculative_tokens + len(blocks) + (len(blocks) > 1)


def settle_draws(streams, starts: list[int], budget: int) -> None:
    """Move each stream to `budget` draws past its round's start (never back: no draw is used twice), so every
    row's next round starts where its own rounds put it, whatever the other rows of its batch did."""
    for stream, start in zip(streams, starts):
        used = (stream.drawn - start) & 0xFFFFFFFF
        stream.drawn = (start + max(used, budget)) & 0xFFFFFFFF


def graph_drafts(eng: "DecodeEngine", drafts: list[Draft]) -> list[Draft]:
    """The drafts a captured round over rows holding `drafts` runs, in graph order (ascending ids: one graph
    key per draft or per mix): the one draft of a single-draft batch; for a mix, every loaded draft and any
    replaced one the rows still hold (`launch_round`). Rows holding the lookup drafter beside rows holding
    drafts make a mix too; the lookup drafter itself is no draft of the graph."""
    held = {id(d): d for d in drafts if not is_lookup(d)}
    if len(held) > 1 or (held and any(is_lookup(d) for d in drafts)):  # a mix (lookup rows beside drafts are one)
        held.update((id(d), d) for d in eng.drafts.values() if not is_lookup(d))
    return sorted(held.values(), key=id)


def tree_round(eng: "DecodeEngine", slots: list, drafts: list[Draft], cfg: SpecConfig, greedy: bool) -> bool:
    """Whether these rows' round is a draft tree of cfg.tree_width (`engine.tree`): a round of at most
    cfg.tree_max_batch rows that all hold one draft, with caches whose slot is the position, and no seeded sampled
    request (its tokens would then depend on whether other requests shared its batch; `SpecConfig.tree_seeded`
    lifts that). Otherwise the chain."""
    if cfg.tree_width <= 1 or len(slots) > cfg.tree_max_batch:
        return False
    if not (greedy or cfg.tree_seeded) and any(repeats_its_seed(s.request) for s in slots):
        return False
    return all(d is drafts[0] for d in drafts) and not isinstance(eng.draft_cache, WindowedKVCache)


def captured_path(eng: "DecodeEngine", drafts: list[Draft], cfg: SpecConfig, slots: list | None = None,
                  greedy: bool | None = None) -> bool:
    """Whether `spec_round` runs these rows' round as one graph (`_captured_round`); with the rows and whether
    they are all greedy, a draft tree's round counts too. Rows holding the lookup drafter beside rows holding
    drafts share one only when greedy (sampled, they run a draft round and then a lookup round)."""
    if not eng.graphs.enabled:
        return False
    if any(is_lookup(d) for d in drafts):  # lookup rows beside drafts: one greedy round (`launch_round`)
        return greedy is True and len(cfg.blocks()) == 1 and eng.mixed_round_graph and not all(map(is_lookup, drafts))
    if slots is not None and tree_round(eng, slots, drafts, cfg, bool(greedy)):
        return True
    return len(cfg.blocks()) == 1 and (eng.mixed_round_graph or all(d is drafts[0] for d in drafts))


def _captured_round(eng: "DecodeEngine", slots: list, drafts: list[Draft], gamma: int, kv_len: int,
                    greedy: bool, cfg: SpecConfig | None = None) -> RoundResult:
    """`launch_round`, then its result (one host transfer)."""
    packed, _ = launch_round(eng, slots, drafts, gamma, kv_len, greedy, cfg=cfg)
    return round_result(packed.tolist(), gamma)


def round_result(packed: list[list[int]], gamma: int) -> RoundResult:
    """A captured round's result from its packed output, per row [num_accepted, next token, drafted...]."""
    return RoundResult([p[2 : 2 + p[0]] + [p[1]] for p in packed], [p[0] for p in packed], [gamma] * len(packed),
                       [1] * len(packed))


def launch_round(eng: "DecodeEngine", slots: list, drafts: list[Draft], gamma: int, kv_len: int, greedy: bool,
                 pending: torch.Tensor | None = None, pos0: torch.Tensor | None = None,
                 cfg: SpecConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The GPU fast path for rounds with one verify per round (block_size >= gamma), launched: -> (packed (b,
    gamma + 2) on the device, per row [num_accepted, next token, drafted...]; pos0 (b,), the positions of the
    rows' pending tokens). `pending` and `pos0` (b,) on the device (the last round's outcome, not read yet by
    the host: `DecodeEngine(overlap=True)`) replace the host's.

    The whole round (gamma + 1 trunk steps, every draft's adapters and head, the drafted tokens, the
    verify pass, the accepted prefix, the deep features for the next round) is one CUDA graph: the host
    sees only the round's result, in one transfer. Greedy rows take argmaxes and the longest matching
    prefix. Otherwise rows sample: their temperature, top-k, top-p and random-stream state are graph
    inputs, the draft samples and the rejection sampler draw from the streams on the device (the same
    draws, in the same order, as the general loop: same tokens), and the host advances each stream by
    the round's 2 * gamma + 1 draws afterwards. `draft_confidence` does not apply here.

    A batch mixing drafts runs every one of its drafts over all its rows, with each row's draft index a
    graph input: a draft reads and writes its adapter cache and deep-feature buffers only at its own rows
    (the others point at the scratch row) and its predictions are kept only there. So the graph depends
    neither on how many rows each draft has nor on their order. A batch of one draft runs that draft alone; a batch
    mixing drafts runs every loaded draft (and any replaced one its rows still hold), whichever of them it
    holds: with three drafts that is 4 graphs per batch bucket and gamma, not 7, all of which
    `DecodeEngine.warmup` captures. On a GPU a few rows more per draft cost nothing: these GEMMs are
    latency-bound; a pair of drafts pays the third's layers (on the H200, batch 8, gamma 5: 3.3 ms a round
    for three drafts against 3.0 for two, run 20), never a capture in the middle of serving.
    Scattered cache rows run padded to a batch-size bucket with the rows as a graph input
    (`DecodeEngine.run_graph`). Same tokens as the general loop.

    Greedy rows holding the n-gram lookup drafter (`engine.lookup`) may share the round with rows holding drafts:
    a mix whose lookup rows take their proposal (`propose`, from the history buffer) where a draft's rows take
    its tokens, step by step through the trunk, then the one verify pass for every row; the round writes its
    tokens into the history as a lookup round does. One verify pass for both kinds, not one each.

    A round `cfg` (default: the engine's) makes a draft tree is `engine.tree.launch_tree_round`'s instead
    (same output).
    """
    cfg = cfg or eng.spec
    if tree_round(eng, slots, drafts, cfg, greedy):
        from engine.tree import launch_tree_round

        return launch_tree_round(eng, slots, drafts[0], gamma, cfg.tree_width, kv_len, greedy, pending, pos0,
                                 cfg.sub_vocab_draws)
    model = eng.model
    device = eng.device
    order = graph_drafts(eng, drafts)
    ids = {id(d): g for g, d in enumerate(order)}  # draft id -> its index in the graph
    lookup = next((d for d in drafts if is_lookup(d)), None)  # the batch's rows look up with its first one's n
    if lookup is not None:
        if not greedy:
            raise ValueError("sampled rows holding the lookup drafter run their own round (launch_lookup_round)")
        ids[id(lookup)] = len(order)  # its rows: no draft's (their adapters write the scratch row)
    mixed = len(order) > 1 or lookup is not None
    n_trunk = order[0].shared_layers
    any_deep = any(d.feature_input == "deep" for d in order)
    capture = feature_layers_of(order)  # only what this round's drafts fuse in
    kv_len = eng.kv_bucket(kv_len)
    draft_kv = eng.draft_kv_len(kv_len)

    rows = row_index([s.slot for s in slots], device)
    if pos0 is None:
        pos0 = to_device([s.length for s in slots], device)
        pending = to_device([s.pending for s in slots], device)
    inputs = {"pending": pending, "pos0": pos0}
    if mixed:  # each row's draft (padding rows get draft 0 and the scratch row: nothing of theirs is read)
        inputs["which"] = to_device([ids[id(lookup) if is_lookup(d) else id(d)] for d in drafts], device)
    filtered = False
    n_draws = 2 * gamma + 1  # `round_draws` of a one-block round at this gamma (cfg's own gamma may differ)
    if not greedy:
        params = [s.request.params for s in slots]
        filtered = needs_filters(params)
        inputs.update(state=stream_state([s.random for s in slots], device), **param_tensors(params, device))

    def round_all(pending, pos0, rows=rows, which=None, state=None, temperature=None, draft_temperature=None, top_k=None,
                  top_p=None):
        # Cache rows: the constant slice 0..b-1 or the (padded) rows input; as a tensor for the deep buffers.
        rows_t = rows if isinstance(rows, torch.Tensor) else torch.arange(rows.start, rows.stop, device=pos0.device)
        if mixed:  # draft g's rows, the others sent to the scratch row
            member = [which == g for g in range(len(order))]
            scratch = torch.full_like(rows_t, eng.scratch_row)
            own = [torch.where(m, rows_t, scratch) for m in member]
        else:
            member, own = [None], [rows]

        def pick(values):
            """Each row's own draft's value from one tensor per draft (first dim: rows)."""
            out = values[0]
            for m, v in zip(member[1:], values[1:]):
                out = torch.where(m.view(-1, *([1] * (v.dim() - 1))), v, out)
            return out

        sub = None if greedy or not eng.spec.sub_vocab_draws else draft_vocab_size(order)  # sampled: over the sub-vocabulary
        if sub is not None:  # each row's draft's token ids (bucket, K)
            vocab_rows = pick([d.vocab_ids[None].expand(pending.shape[0], -1) for d in order])
        tokens, trunks, drafted, draft_probs, draft_index = pending, [], [], [], []
        # The round's 2 * gamma + 1 draws at once (draft j takes draw j, the verifier the rest): one hash of
        # the counters instead of one per draft step and two for the verifier, about 50 small kernels each.
        draws = None if greedy else uniform_at(state, 0, (pending.shape[0], n_draws))
        proxies: list = [None] * len(order)
        ar = torch.arange(pending.shape[0], device=pending.device)
        if lookup is not None:  # the lookup rows' proposals, from each row's tokens up to its pending one
            history = eng.history[rows]  # (b, S): a view for a slice of rows, else a gathered copy written back below
            proposals, _ = propose(history, pos0 + 1, gamma, *lookup.rule)
            looks = which == len(order)
        for j in range(gamma + 1):
            positions = (pos0 + j)[:, None]  # (bucket, 1)
            trunk = model(tokens[:, None], positions, layers=range(0, n_trunk), cache=eng.cache, rows=rows,
                          kv_len=kv_len).hidden  # (bucket, 1, H)
            trunks.append(trunk)
            if j == gamma and not any(d.feature_input != "deep" for d in order):
                break  # deep drafts only: the next round's window rewrites this position's adapter KV
            predictions = []
            for g, draft in enumerate(order):
                deep = draft.feature_input == "deep"
                if j == gamma and deep:
                    continue
                g_rows = own[g]
                if deep and j == 0:
                    g_rows_t = g_rows if isinstance(g_rows, torch.Tensor) else rows_t
                    window, feats, index, win_pos = eng.deep_window(g_rows_t, trunk[:, 0], pos0)
                    ctx = model.context(win_pos, eng.draft_cache, g_rows, draft_kv)
                    out = draft.adapters_forward(window, feats, ctx)[ar, index]  # (bucket, H)
                else:
                    ctx = model.context(positions, eng.draft_cache, g_rows, draft_kv)
                    out = draft.adapters_forward(trunk, proxies[g][:, None] if deep else None, ctx)[:, 0]
                if j == gamma:
                    continue  # last token: adapter KV written, no prediction needed
                prediction, proxy = draft.predict(out, greedy)  # greedy: token ids; else logits
                if not greedy and sub is None:
                    prediction = full_vocab_scores(draft, prediction, model.args.vocab_size)
                predictions.append(prediction)
                if deep:
                    proxies[g] = proxy
            if j == gamma:
                break
            if greedy:
                tokens = pick(predictions)  # (bucket,)
                if lookup is not None:
                    tokens = torch.where(looks, proposals[:, j], tokens)
            else:  # draw j of the round (the general loop's order: gamma draft samples, then the verifier's)
                probs = processed_probs(pick(predictions), draft_temperature, top_k, top_p, filtered)
                index = sample_with(probs, draws[:, j])
                tokens = index if sub is None else vocab_rows.gather(1, index[:, None])[:, 0]
                draft_probs.append(probs)
                draft_index.append(index)
            drafted.append(tokens)
        drafted, trunks = torch.stack(drafted, dim=1), torch.cat(trunks, dim=1)  # (bucket, gamma), (bucket, gamma + 1, H)
        # Verification in the same graph: the deep layers on the round's trunk states, the longest
        # matching prefix, and the deep drafts' features for the next round.
        q_pos = pos0[:, None] + torch.arange(gamma + 1, device=pos0.device)[None]  # (bucket, gamma + 1)
        out = model(None, q_pos, layers=range(n_trunk, model.args.num_layers), hidden=trunks, cache=eng.cache,
                    rows=rows, kv_len=kv_len, capture=capture)
        if greedy:
            res = verify_greedy(drafted, out.logits)
        else:
            target_probs = processed_probs(out.logits, temperature, top_k, top_p, filtered)
            res = verify_sampled(drafted, torch.stack(draft_probs, dim=1), target_probs, draws=draws[:, gamma:],
                                 draft_vocab=None if sub is None else vocab_rows,
                                 draft_index=None if sub is None else torch.stack(draft_index, dim=1))
        if lookup is not None:  # every row's round into its history (only lookup rows ever read theirs)
            record_round(eng, history, rows, pos0, drafted, res)
        if any_deep:  # every row's buffers (only rows of deep drafts ever read theirs; padding hits the scratch row)
            feats = out.final_hidden
            if capture:  # each row gets its own draft's features
                feats = pick([draft_features(d, feats, out.captured, capture).to(feats.dtype) for d in order])
            eng.store_deep_round(rows_t, pos0, trunks, feats, res.num_accepted)
        return (torch.cat([res.num_accepted[:, None], res.next_token[:, None], drafted], dim=1),)

    looked = None if lookup is None else lookup.rule
    key = ("greedy-round" if greedy else ("sampled-round", filtered), len(order), kv_len, gamma, capture) + (
        (("lookup", *looked),) if looked else ())
    (packed,) = eng.run_graph(key, round_all, rows, inputs, owners=tuple(ids))
    if not greedy:
        advance([s.random for s in slots], n_draws)
    return packed, pos0

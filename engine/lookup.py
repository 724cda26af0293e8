"""N-gram lookup proposals on the device: a drafter without weights.

After a request's last n tokens, propose the gamma tokens that followed the most recent earlier occurrence of
those n tokens in its own history (prompt and reply so far), for the longest n from max_n down to min_n that
occurred; nothing where none did. Where the tokens that followed reach the end of the history (the match is
less than gamma tokens back), the proposal goes on repeating them: a run that repeats with period p proposes
its next gamma tokens, not just the p it has seen (what proposing again after those p would give). Verified
like any draft, so the output is the target's (greedy: the same tokens; sampled: a proposal is a draft
distribution that puts all its mass on one token).

`propose` does it for a batch of rows at once with fixed shapes and no host synchronization, so it can run
inside a captured CUDA graph, and each round's proposals can come from the round before without the host.
`bench.ngram_headroom` plays the same rule over the target's replies (`ngram_lookup`, its reference here).
"""

from __future__ import annotations

import collections
import dataclasses

import torch

from engine import triton_kernels


# The longest n-gram the rule looks up. 6 rather than 3: over our own splits (CPU, 12 cells of 16 long prompts a domain)
# 0.0 to +4.6 % tokens a round (median +1.9 %), never fewer; a longer n picks, among the places where the last 3 tokens
# occurred, the one whose longer context matches too. The GPU proposer stops at the longest n found, so the extra n
# cost scans only where they miss. Run 44 (H100, side by side): bs 8 lookup alone +0.6/+1.1 % and the service's
# setting +1.6/+1.6 % (two processes); bs 1 lookup alone +0.5 %, the service's setting -0.6 % (one process).
DEFAULT_MAX_N = 6


def propose(history: torch.Tensor, lengths: torch.Tensor, gamma: int, max_n: int = DEFAULT_MAX_N, min_n: int = 1,
            repeat: bool = True, with_match: bool = False) -> tuple[torch.Tensor, ...]:
    """history (b, S) token ids, row i's tokens in history[i, :lengths[i]] (the rest is ignored); lengths (b,)
    -> (proposals (b, gamma), counts (b,)): row i proposes proposals[i, :counts[i]], the gamma tokens that
    followed the most recent earlier occurrence of its last n tokens (the longest n in max_n .. min_n that
    occurred), repeated with their period where they reach the row's length; counts[i] == 0 where none
    occurred (proposals[i] then undefined), else gamma. `repeat=False`: the rule before the repeat, only the
    tokens that followed, never past the row's length (counts up to gamma). The same as
    `bench.ngram_headroom.ngram_lookup` on each row. `with_match`: a third tensor (b,), the n each row's match
    has (0 where none occurred), what `allot` ranks rows by."""
    if gamma < 1 or not 1 <= min_n <= max_n:
        raise ValueError(f"gamma {gamma}, n {min_n}..{max_n}: need gamma >= 1 and 1 <= min_n <= max_n")
    fast = triton_kernels.lookup_propose(history, lengths, gamma, max_n, min_n, repeat)  # one launch on the GPU
    if fast is not None:
        return fast if with_match else fast[:2]
    b, s = history.shape
    lengths = lengths.to(device=history.device, dtype=torch.long)
    found = torch.zeros(b, dtype=torch.bool, device=history.device)
    follow = torch.zeros(b, dtype=torch.long, device=history.device)  # where the proposal starts
    matched = torch.zeros(b, dtype=torch.long, device=history.device)  # the n found
    for n in range(max_n, min_n - 1, -1):
        if n >= s:
            continue
        # The row's last n tokens (clamped to the row: a row shorter than n + 1 has no earlier occurrence).
        tail = history.gather(1, (lengths[:, None] - n + torch.arange(n, device=history.device)).clamp(0, s - 1))
        starts = torch.arange(s - n + 1, device=history.device)  # candidate occurrences at p .. p + n - 1
        match = starts[None] <= lengths[:, None] - n - 1  # strictly before the suffix itself
        for j in range(n):
            match = match & (history[:, j:s - n + 1 + j] == tail[:, j:j + 1])
        last = torch.where(match, starts[None], -1).amax(dim=1)  # the most recent occurrence, -1 if none
        take = (last >= 0) & ~found  # the longest n that occurred wins
        follow = torch.where(take, last + n, follow)
        matched = torch.where(take, n, matched)
        found = found | take
    offsets = torch.arange(gamma, device=history.device)[None]
    if repeat:
        offsets = offsets % (lengths - follow).clamp(min=1)[:, None]  # the period: from the match's end to the row's
    proposals = history.gather(1, (follow[:, None] + offsets).clamp(max=s - 1))
    counts = torch.where(found, gamma if repeat else (lengths - follow).clamp(min=0, max=gamma), 0)
    return (proposals, counts, matched) if with_match else (proposals, counts)


# How likely a greedy lookup row accepts at least d of its proposed tokens, by the n its match has: ALLOT_TABLE[n][d - 1]
# for n = 0 .. 6 (0: nothing occurred) and d = 1 .. 15, over our train split's greedy replies (`python -m
# bench.lookup_policy --allot-table --split train`: every position of 8 long prompts a domain, 256 tokens each). A
# match of 6 tokens (text repeating itself) keeps most of what it proposes; one of 1 or 2 tokens little. `allot`
# ranks a batch's rows by it.
ALLOT_TABLE = (
    (0.0,) * 15,
    (0.186, 0.093, 0.064, 0.056, 0.051, 0.045, 0.043, 0.035, 0.029, 0.024, 0.024, 0.021, 0.019, 0.019, 0.019),
    (0.43, 0.28, 0.21, 0.178, 0.159, 0.131, 0.112, 0.098, 0.089, 0.079, 0.075, 0.061, 0.061, 0.061, 0.061),
    (0.669, 0.482, 0.41, 0.381, 0.324, 0.295, 0.273, 0.259, 0.201, 0.194, 0.173, 0.165, 0.165, 0.165, 0.158),
    (0.732, 0.616, 0.562, 0.491, 0.455, 0.429, 0.402, 0.321, 0.312, 0.286, 0.277, 0.277, 0.25, 0.232, 0.205),
    (0.752, 0.673, 0.584, 0.545, 0.515, 0.485, 0.396, 0.386, 0.356, 0.347, 0.337, 0.307, 0.277, 0.248, 0.248),
    (0.968, 0.948, 0.932, 0.916, 0.9, 0.885, 0.874, 0.863, 0.853, 0.842, 0.832, 0.823, 0.814, 0.806, 0.798),
)
# The most tokens an allotted round gives one row.
ALLOT_MAX_GAMMA = 12


_TABLES: dict[torch.device, torch.Tensor] = {}


def allot_table(device: torch.device, table=None) -> torch.Tensor:
    """`allot`'s ranks from a table of chances (default `ALLOT_TABLE`, then made once per device and kept: outside
    any CUDA graph capture, which cannot copy from the host): each row made non-increasing in depth (a deeper token
    is kept only with the shallower ones) and less a hair per depth, so that a row's picks are always its
    shallowest (a prefix of its proposal) and ties go shallower first."""
    device = torch.device(device)
    if table is None and device in _TABLES:
        return _TABLES[device]
    chance = torch.tensor(ALLOT_TABLE if table is None else table, dtype=torch.float32, device=device)
    ranks = chance.cummin(dim=1).values - 1e-6 * torch.arange(chance.shape[1], device=device)
    if table is None:
        _TABLES[device] = ranks
    return ranks


def allot(matched: torch.Tensor, budget: int, max_gamma: int, table=None) -> torch.Tensor:
    """Per-row gammas of an allotted lookup round: matched (b,), the n each row's match has (`propose(...,
    with_match=True)`); budget, the round's verify tokens (at least b: each row verifies its pending token) -> (b,)
    gammas, each at most max_gamma, summing to budget - b (or to b x max_gamma where that is less). The budget's
    tokens go to the (row, depth) pairs most likely accepted (`table[n][d - 1]`, default `ALLOT_TABLE`), a row's
    deeper ones only after its shallower ones (ties: shallower first). `table` may be a table of chances or the
    ranks `allot_table` makes of one (a tensor: so inside a CUDA graph, made on the device beforehand). Fixed
    shapes, no host synchronization: it runs inside a round's CUDA graph."""
    b = matched.shape[0]
    if budget < b or max_gamma < 1:
        raise ValueError(f"budget {budget} for {b} rows, max gamma {max_gamma}: need budget >= rows and max gamma >= 1")
    ranks = table if isinstance(table, torch.Tensor) else allot_table(matched.device, table)
    chance = ranks[matched.clamp(0, ranks.shape[0] - 1), :max_gamma]
    picks = min(budget - b, b * max_gamma)
    top = chance.flatten().topk(picks).indices
    return torch.zeros(b * max_gamma, dtype=torch.long, device=matched.device).index_fill_(0, top, 1).view(
        b, max_gamma).sum(dim=1)


def continuation(seq: list[int], follow: int, length: int, gamma: int, repeat: bool = True) -> list[int]:
    """What a match proposes in the history seq[:length], its tokens following from `follow` on: gamma of them,
    repeated with their period (length - follow) where they reach the end; `repeat=False`: only those there are,
    up to gamma. One row of `propose` (its counted tokens), for the host's statements of the rule."""
    if not repeat:
        return seq[follow:follow + min(gamma, length - follow)]
    return [seq[follow + k % (length - follow)] for k in range(gamma)]


# The governor's pool of lookup drafters: every lookup alternative's round costs a verify pass whatever the domain
# (`SpeculationGovernor.observe_pool`), so their rounds' seconds are pooled and their tokens replayed per domain.
LOOKUP_POOL = "lookup"


class LookupShadow:
    """What lookup rounds would make of a greedy request's tokens, replayed on the host as they come.

    A greedy request's tokens are the target's whichever drafter (or none) produced them, so the rounds the n-gram
    lookup drafter would have run over them are known exactly from the tokens alone: from each round's start, the
    `propose` rule over the history so far (prompt and reply), the proposal's prefix the reply matches, and the
    token after it. `extend` takes a request's new tokens and returns the tokens each round completed by them
    made. The governor prices lookup from these (`SpeculationGovernor.observe_tokens`): every greedy request of a
    domain tells what lookup would make of it, while only the requests that ran lookup would measure it. The
    shadow does not see tokens a real round accepts where nothing occurred (`counts` 0: whatever the proposal
    holds matching by chance), so it may understate lookup by those. An n-gram index per n keeps it O(1) a token."""

    def __init__(self, prompt_ids: list[int], gamma: int, max_n: int = DEFAULT_MAX_N, min_n: int = 1, window: int = 32,
                 repeat: bool = True, streak_gamma: int | None = None, lag: int = 2) -> None:
        if gamma < 1 or not 1 <= min_n <= max_n or (streak_gamma is not None and streak_gamma < 1) or lag < 1:
            raise ValueError(f"gamma {gamma}, streak gamma {streak_gamma}, n {min_n}..{max_n}, lag {lag}: need gammas "
                             f">= 1, 1 <= min_n <= max_n and lag >= 1")
        self.gamma, self.max_n, self.min_n, self.repeat = gamma, max_n, min_n, repeat
        # A round's gamma is `streak_gamma` (None: never) where the round `lag` rounds before it accepted every token
        # it proposed (`LookupDraft.streak_gammas`): lag 2 as an overlapped engine chooses it (a round is launched
        # before the one before it is read), 1 as an engine reading each round before it launches the next.
        self.streak_gamma, self.lag = streak_gamma, lag
        self._full: collections.deque = collections.deque(maxlen=lag)  # its last rounds: each accepted everything?
        self.seq = list(prompt_ids)
        self.start = len(self.seq) + 1  # the first round's history: the prompt and the prefill's token
        self._index: dict[int, dict[tuple, int]] = {n: {} for n in range(min_n, max_n + 1)}
        self._indexed = {n: 0 for n in self._index}  # next start of an n-gram to index
        self.rounds = 0
        self.tokens = 0
        self.streak_rounds = 0  # rounds at the streak gamma
        self.recent: collections.deque = collections.deque(maxlen=window)  # tokens of its last rounds
        self._proposal: list[int] | None = None
        self._gamma = gamma  # the gamma of the round at `start`

    def propose(self, length: int, gamma: int | None = None) -> list[int]:
        """The proposal of `gamma` (default its gamma) after the history's first `length` tokens
        (`engine.lookup.propose` on one row, only the tokens it counts)."""
        gamma = self.gamma if gamma is None else gamma
        seq = self.seq
        for n in range(self.max_n, self.min_n - 1, -1):
            index = self._index[n]
            q, last = self._indexed[n], length - n - 1  # occurrences strictly before the suffix, with a token after
            if last - q > 32:  # a prompt: at once (a later occurrence overwrites an earlier one)
                index.update(zip(zip(*(seq[q + j:last + 1 + j] for j in range(n))), range(q, last + 1)))
                q = last + 1
            while q <= last:
                index[tuple(seq[q:q + n])] = q
                q += 1
            self._indexed[n] = q
            if length - n - 1 < 0:
                continue
            at = index.get(tuple(seq[length - n:length]))
            if at is not None:
                return continuation(seq, at + n, length, gamma, self.repeat)
        return []

    def extend(self, tokens: list[int]) -> list[int]:
        """Take the request's next tokens -> the tokens each lookup round they complete would have made."""
        self.seq.extend(tokens)
        made = []
        while True:
            if self._proposal is None:  # the proposal of the round at `start`, kept while its outcome is not known
                full = self.streak_gamma is not None and len(self._full) == self.lag and self._full[0]
                self._gamma = self.streak_gamma if full else self.gamma
                self._proposal = self.propose(self.start, self._gamma)
            proposal = self._proposal
            if len(self.seq) < self.start + len(proposal) + 1:
                # Not known yet: a round's outcome needs the reply up to its last proposed token and one more
                # (earlier where the reply already departs from the proposal).
                known = self.seq[self.start:]
                if len(known) == len(proposal[:len(known)]) and known == proposal[:len(known)]:
                    break
            accepted = 0
            while accepted < len(proposal) and self.seq[self.start + accepted] == proposal[accepted]:
                accepted += 1
            made.append(accepted + 1)
            self._full.append(accepted == self._gamma)
            self.streak_rounds += self._gamma != self.gamma
            self.start += accepted + 1
            self._proposal = None
        self.rounds += len(made)
        self.tokens += sum(made)
        self.recent.extend(made)
        return made


# Greedy lookup rounds' gamma by batch-size bucket where it differs from the engine's: a lone row drafts 8 (on the
# H200 a lone lookup row ran 3-7 % faster at 8 than at 5, runs 33-34 and 37), a batch the engine's gamma (at 8 rows,
# gamma 8 ran 0.79x of gamma 5's tokens/s: every row pays for the longest verify; run 37). A lone row at 12 or 15
# ran slower than at 8 (run 39: 6 % more tokens a round on the benchmark's replies for a round 7.5 % dearer).
DEFAULT_GAMMAS = {1: 8}
# A greedy lookup round's gamma by batch-size bucket after a round of the batch's rows accepted every token it proposed
# (every row's last committed round did; `DecodeEngine.lookup_gamma`). Text that just repeated itself for a whole
# round tends to go on repeating, and a round after a miss proposes again at the bucket's gamma, so a long proposal
# is paid for mostly where it is taken. Over our own splits' greedy replies (`python -m bench.ngram_headroom --streaks
# 8:15`), with a 15-token round priced 1.075 of an 8-token one (the H200, run 39), tokens per unit of round cost
# rose in every cell (+5.0 to +28.4 % on long prompts, +0.8 to +1.9 % on plain requests), where gamma 15 throughout
# lost 3.7-4.8 % on plain requests. On the H200 (run 41) the service's setting at bs 1 ran 3.4-4.1 % faster.
DEFAULT_STREAK_GAMMAS = {1: 15}
# The most tokens a greedy lookup round may propose: its verify pass (gamma + 1 tokens a row) stays within the steps
# the compiled layer kernels and the attention kernel serve (engine.fused.MAX_COMPILED_TOKENS, 16 tokens a row).
# The engine's cache margin holds it whatever its own gamma (`DecodeEngine.margin`), so a lookup drafter's gamma
# is not capped by a draft's.
MAX_GAMMA = 15


class LookupDraft:
    """A drafter without weights, registered like a draft (`DecodeEngine.add_draft(name, LookupDraft())`): a
    request that names it runs lookup rounds (`launch_lookup_round`). It has no trunk split, adapters, head or
    cache of its own.

    `gammas`: the tokens a greedy lookup round proposes, by batch-size bucket (1, 2, 4, ...), where it differs from
    the engine's gamma (default `DEFAULT_GAMMAS`; `{}`: the engine's at every batch size), at most `MAX_GAMMA`
    (the engine's cache margin holds that much whatever its own gamma; `DecodeEngine.lookup_gamma`). Sampled
    rounds take the engine's gamma: a seeded request's draws must not depend on its batch. `streak_gammas`: a
    greedy round's gamma by bucket after a round that accepted every token it proposed (default
    `DEFAULT_STREAK_GAMMAS`; `{}`: never), at most `MAX_GAMMA`. `max_n`, `min_n`, `repeat`: the rule (`propose`).
    `allot`: a greedy round of a batch (bucket 2 and up) gives each row its own gamma, up to `ALLOT_MAX_GAMMA`,
    within the verify tokens the bucket's gamma gives the batch, by how likely its match's tokens are kept
    (`allot`, `launch_lookup_round(..., allotted=...)`): rows repeating a long stretch propose more, rows with a
    one-token match less."""

    shared_layers = 0
    adapter_layers = 0
    feature_input = "none"
    feature_layers: tuple[int, ...] = ()

    def __init__(self, max_n: int = DEFAULT_MAX_N, min_n: int = 1, gammas: dict[int, int] | None = None,
                 repeat: bool = True, streak_gammas: dict[int, int] | None = None, allot: bool = False) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n {min_n}..{max_n}: need 1 <= min_n <= max_n, e.g. max_n=6, min_n=1")
        gammas = dict(DEFAULT_GAMMAS if gammas is None else gammas)
        streak_gammas = dict(DEFAULT_STREAK_GAMMAS if streak_gammas is None else streak_gammas)
        for what, table, example in (("gammas", gammas, "{1: 8}"), ("streak gammas", streak_gammas, "{1: 15}")):
            bad = {b: g for b, g in table.items()
                   if not (isinstance(b, int) and isinstance(g, int) and b >= 1 and b & (b - 1) == 0
                           and 1 <= g <= MAX_GAMMA)}
            if bad:
                raise ValueError(f"lookup {what} {bad}: need {{batch-size bucket (1, 2, 4, ...): gamma "
                                 f"1..{MAX_GAMMA}}}, e.g. {example}")
        self.max_n, self.min_n, self.gammas, self.repeat = max_n, min_n, gammas, repeat
        self.streak_gammas = streak_gammas
        self.allot = allot

    @property
    def rule(self) -> tuple[int, int, bool]:
        """(max_n, min_n, repeat): `propose`'s settings."""
        return self.max_n, self.min_n, self.repeat

    def gamma_at(self, bucket: int, default: int, streak: bool = False) -> int:
        """A greedy round's gamma at this batch-size bucket (`default`: the engine's); `streak`: after a round that
        accepted every token it proposed (`streak_gammas`, where the bucket has one)."""
        if streak and bucket in self.streak_gammas:
            return self.streak_gammas[bucket]
        return self.gammas.get(bucket, default)

    def trainable_parameters(self) -> list:
        return []

    def __repr__(self) -> str:
        return (f"LookupDraft(max_n={self.max_n}, min_n={self.min_n}, gammas={self.gammas}, repeat={self.repeat}, "
                f"streak_gammas={self.streak_gammas}, allot={self.allot})")


def is_lookup(draft) -> bool:
    return isinstance(draft, LookupDraft)


def add_lookup_alternative(eng, names, name: str = "lookup", draft: LookupDraft | None = None) -> None:
    """Register the lookup drafter (`draft`, default `LookupDraft()`) under `name` and make it the alternative of
    each draft in `names` (`DecodeEngine.set_alternatives`), as the service's `lookup_alternative` does."""
    eng.add_draft(name, draft or LookupDraft())
    for draft in names:
        eng.set_alternatives(draft, [name])


def record_round(eng, history: torch.Tensor, rows, pos0: torch.Tensor, proposed: torch.Tensor, res) -> None:
    """A round's tokens into the rows' history (`history` = eng.history[rows]: a view for a slice of rows, else a
    gathered copy, written back): the proposed ones after each row's pending token, then the verdict's next token
    after the accepted ones (what lies past a row's new length is never read)."""
    steps = torch.arange(proposed.shape[1], device=pos0.device)
    history.scatter_(1, pos0[:, None] + 1 + steps[None], proposed)
    history.scatter_(1, (pos0 + 1 + res.num_accepted)[:, None], res.next_token[:, None])
    if not isinstance(rows, slice):
        eng.history[rows] = history


def allotted_verify(eng, pending: torch.Tensor, pos0: torch.Tensor, proposals: torch.Tensor, matched: torch.Tensor,
                    rows, kv_len: int, budget: int, table: torch.Tensor | None = None):
    """The verify pass of an allotted round -> (VerifyResult, gammas (b,)): each row's gamma from `allot` (its
    match's n, within `budget` tokens), and the target over the rows' [pending, first gamma proposed] chains packed
    into `budget` token rows of one token each, each row of the pass reading and writing its chain's cache row at
    its own position (a row's tokens see the tokens before them in the cache: every layer writes the pass's keys
    and values before it attends). Greedy: each row keeps the longest prefix of its allotted proposal the target's
    argmaxes match, and the target's next token. `table`: `allot`'s ranks (default `allot_table`'s)."""
    from engine.model import PackedRows
    from engine.triton_kernels import argmax
    from engine.verify import VerifyResult

    b, top = proposals.shape
    gammas = allot(matched, budget, top, table)
    width = top + 1
    chain = torch.arange(width, device=pos0.device)
    flat = torch.arange(b * width, device=pos0.device).view(b, width)
    # The chains' slots in order: every (row, depth) with depth <= the row's gamma, exactly `budget` of them (the
    # gammas sum to budget - b where top x b reaches that, which the caller ensures).
    order = torch.where(chain[None] <= gammas[:, None], flat, b * width).flatten().sort().values[:budget]
    row_of, depth = order // width, order % width
    rows = torch.arange(rows.start, rows.stop, device=pos0.device) if isinstance(rows, slice) else rows
    tokens = torch.cat([pending[:, None], proposals], dim=1).flatten()[order]
    positions = (pos0[row_of] + depth)[:, None]
    # Where the attention backend takes packed queries (the Triton kernel), each cache row's tokens attend as one
    # tile over its keys and values, read once (`PackedRows`); elsewhere each token row attends on its own.
    chains = pos0[:, None] + chain[None]  # (b, width): the positions a row's chain may hold
    qidx = torch.full((b * width,), -1, dtype=torch.long, device=pos0.device).scatter_(
        0, order, torch.arange(budget, device=pos0.device)).view(b, width)
    ctx = dataclasses.replace(eng.model.context(positions, eng.cache, rows[row_of], kv_len),
                              pack=PackedRows(rows, qidx, chains, eng.cache.visibility(chains, rows, kv_len)))
    logits = eng.model(tokens[:, None], positions, cache=eng.cache, rows=rows[row_of], kv_len=kv_len,
                       ctx=ctx).logits  # (budget, 1, V)
    target = torch.zeros(b * width, dtype=torch.long, device=pos0.device).scatter_(0, order, argmax(logits[:, 0]))
    target = target.view(b, width)
    matches = ((proposals == target[:, :top]) & (chain[None, :top] < gammas[:, None])).long()
    num_accepted = matches.cumprod(dim=1).sum(dim=1)
    return VerifyResult(num_accepted, target.gather(1, num_accepted[:, None]).squeeze(1)), gammas


def allotted_result(packed: list[list[int]]):
    """An allotted lookup round's result from its packed output, per row [num_accepted, next token, proposed...,
    the row's gamma]: `engine.speculative.round_result` with each row's own gamma as what it drafted."""
    from engine.speculative import RoundResult

    return RoundResult([p[2:2 + p[0]] + [p[1]] for p in packed], [p[0] for p in packed], [p[-1] for p in packed],
                       [1] * len(packed))


def launch_lookup_round(eng, slots: list, gamma: int, kv_len: int, greedy: bool = True,
                        pending: torch.Tensor | None = None,
                        pos0: torch.Tensor | None = None, allotted: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A lookup round for rows holding a LookupDraft, launched: -> (packed (b, gamma + 2) on the device, per row
    [num_accepted, next token, proposed...], as `engine.speculative.launch_round` packs a draft's round; pos0 (b,),
    the positions of the rows' pending tokens). `pending` and `pos0` on the device (the round before's outcome,
    not read by the host yet: `DecodeEngine(overlap=True)`) replace the host's.

    One pass: each row's proposal from its history (`propose`, the history up to and including its pending
    token), the target over [pending, proposal] (gamma + 1 tokens, every layer, into the cache), the verdict,
    and the round's tokens written into the history after the pending one (what lies past the row's new
    length is never read). Greedy rows keep the longest prefix the target's argmaxes match and its next token
    (`verify_greedy`). Sampled rows take Leviathan et al.'s rejection sampling with a draft distribution that
    puts all its mass on the proposed token (`verify_sampled`): a proposed token is kept with the target's
    probability of it, and at the first one refused the next token is drawn from the target's distribution
    without it. Either way the output is the target's (greedy: its tokens; sampled: its distribution)
    whatever was proposed, so a row with nothing to propose verifies whatever its buffer held, at no risk.
    A sampled round takes the draws a draft's round of this gamma takes (2 gamma + 1: the verifier's are the
    last gamma + 1), so a seeded request's streams move alike whichever drafter served it. With graphs it is
    one CUDA graph per (batch bucket, row layout, kv bucket, gamma, rule, sampling kind). The batch's rows look up
    with its first row's rule (drafters registered with other settings share a round that way).

    `allotted` (greedy only): each row proposes its own number of tokens, up to `gamma`, within the verify tokens a
    round of `allotted` takes (bucket x (allotted + 1)), by how likely its match's tokens are kept (`allot`,
    `allotted_verify`): packed is then (b, gamma + 3), [num_accepted, next token, proposed (gamma)..., the row's
    gamma]."""
    from engine.cache import row_index, to_device
    from engine.sampling import advance, needs_filters, param_tensors, processed_probs, stream_state, uniform_at
    from engine.verify import verify_greedy, verify_sampled

    if allotted is not None and (not greedy or not 1 <= allotted <= gamma):
        raise ValueError(f"an allotted lookup round of {allotted} tokens a row on average, up to {gamma}: greedy rows "
                         "only, and 1 <= allotted <= gamma")
    model, device = eng.model, eng.device
    draft = slots[0].draft
    kv_len = eng.kv_bucket(kv_len)
    rows = row_index([s.slot for s in slots], device)
    if pos0 is None:
        pos0 = to_device([s.length for s in slots], device)
        pending = to_device([s.pending for s in slots], device)
    steps = torch.arange(gamma + 1, device=device)
    inputs = {"pending": pending, "pos0": pos0}
    filtered, n_draws = False, 2 * gamma + 1  # `engine.speculative.round_draws` of a one-block round
    if not greedy:
        params = [s.request.params for s in slots]
        filtered = needs_filters(params)
        inputs.update(state=stream_state([s.random for s in slots], device), **param_tensors(params, device))
    vocab = model.args.vocab_size
    table = allot_table(device) if allotted is not None else None  # made here: a capture cannot copy from the host

    def fn(pending, pos0, rows=rows, state=None, temperature=None, draft_temperature=None, top_k=None, top_p=None):
        history = eng.history[rows]  # (b, S): a view for a slice of rows, else a gathered copy written back below
        if allotted is not None:
            proposals, _, matched = propose(history, pos0 + 1, gamma, *draft.rule, with_match=True)
            res, gammas = allotted_verify(eng, pending, pos0, proposals, matched, rows, kv_len,
                                          pending.shape[0] * (allotted + 1), table)
            record_round(eng, history, rows, pos0, proposals, res)
            return (torch.cat([res.num_accepted[:, None], res.next_token[:, None], proposals, gammas[:, None]], dim=1),)
        proposals, _ = propose(history, pos0 + 1, gamma, *draft.rule)
        tokens = torch.cat([pending[:, None], proposals], dim=1)  # (b, gamma + 1)
        logits = model(tokens, pos0[:, None] + steps[None], cache=eng.cache, rows=rows, kv_len=kv_len).logits
        if greedy:
            res = verify_greedy(proposals, logits)
        else:
            target_probs = processed_probs(logits, temperature, top_k, top_p, filtered)
            one_point = torch.nn.functional.one_hot(proposals, vocab).to(target_probs.dtype)  # (b, gamma, V)
            draws = uniform_at(state, 0, (pending.shape[0], n_draws))
            res = verify_sampled(proposals, one_point, target_probs, draws=draws[:, gamma:])
        record_round(eng, history, rows, pos0, proposals, res)
        return (torch.cat([res.num_accepted[:, None], res.next_token[:, None], proposals], dim=1),)

    if not eng.graphs.enabled:
        (packed,) = fn(**inputs)
    else:
        kind = ("greedy" if allotted is None else ("allotted", allotted)) if greedy else ("sampled", filtered)
        (packed,) = eng.run_graph(("lookup-round", kind, kv_len, gamma, *draft.rule), fn, rows, inputs)
    if not greedy:
        advance([s.random for s in slots], n_draws)
    return packed, pos0

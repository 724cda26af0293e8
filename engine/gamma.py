"""Adaptive gamma: each speculative round drafts the number of tokens expected to give the most tokens a second.

A round that drafts gamma tokens makes 1 + S(1) + ... + S(gamma) tokens on average, S(k) the probability
that the first k drafted tokens are all accepted; it costs one draft step and one verified token more per
drafted token. Where a draft step is dear against the verify pass (a small target whose steps are bound by
kernel launches: on the H200 a drafted token costs about a fifth of a decode step), the last drafted tokens,
accepted only a fifth of the time, cost more than they bring, and a smaller gamma is faster; where it is
cheap, a larger one is. Which gamma is best depends on the hardware, the batch size, the draft and the text,
so it is measured, not configured:

* Acceptance, per draft: how often position k was reached (the k - 1 tokens before it accepted, k <= the
  round's gamma) and how often it was accepted, as decayed counts over about 1/alpha rows. A round of gamma
  g shows every position up to g, so S at every smaller gamma follows from rounds at a larger one (greedy:
  the very tokens that smaller round would have made); p_k = accepted_k / reached_k leans on p_(k-1) while
  position k has few samples, and S(k) = p_1 ... p_k.
* Cost, per (batch-size bucket, number of drafts in the batch, greedy or sampled): the round's seconds at
  each gamma (moving averages), and a straight line through them by least squares, which stands in for a
  gamma not measured lately.
* Each round takes the gamma with the most expected tokens per predicted second. Until every gamma of a
  key has `min_rounds` cost samples, rounds cycle through them; after that every `explore_every`-th round
  runs the next gamma of that cycle, so every cost and the far positions' acceptance stay current.

Draft trees (`engine.tree`): with `widths` beyond 1 each arm is a (gamma, width) pair. A tree's extra branches
raise the survival of the first positions (the draft's second and third guesses) and cost wider draft steps
and verify passes, so acceptance is counted per (draft, width) and cost per (key, width); a round takes the arm
with the most expected tokens per predicted second among those the batch may run (trees serve greedy
batches of one draft, `DecodeEngine` says which). On the H200 at batch 1 a width-3 tree gained 15 % at a fixed
gamma 5 but little once gamma adapts (bench/RESULTS.md run 25): choosing the width per round is how it pays
where it does and costs nothing where it does not.

Lossless whatever it picks: which tokens are drafted never changes what is accepted. Greedy output stays
identical and sampled output keeps its distribution; but a sampled request's tokens depend on the gammas
its rounds took, so `DecodeEngine` runs rounds holding a seeded sampled request at the full gamma (the same
seed then gives the same tokens again).
"""

from __future__ import annotations

import dataclasses
import threading


@dataclasses.dataclass
class _Acceptance:
    reached: list[float]  # index k - 1: decayed count of rows whose round reached position k
    accepted: list[float]  # ... and accepted the token there

    def survival(self, prior: float, shrink: float) -> list[float]:
        """S(1..G): the probability that the first k drafted tokens are all accepted."""
        out, p, s = [], prior, 1.0
        for reached, accepted in zip(self.reached, self.accepted):
            p = (accepted + shrink * p) / (reached + shrink)  # few samples at k: close to p at k - 1
            s *= p
            out.append(s)
        return out


@dataclasses.dataclass
class _Cost:
    seconds: float = 0.0
    count: int = 0

    def update(self, seconds: float, alpha: float) -> None:
        self.count += 1
        self.seconds += max(alpha, 1.0 / self.count) * (seconds - self.seconds)


def _cost_key(key: tuple, width: int) -> tuple:
    """The cost table of a round of this key and tree width (a chain's: the key itself)."""
    return key if width == 1 else (*key, "tree", width)


def _on_line(line: tuple[float, float], gamma: int) -> float:
    """Seconds at gamma on a fitted (intercept, slope) cost line, kept positive."""
    return max(line[0] + line[1] * gamma, 1e-9)


class GammaController:
    def __init__(self, max_gamma: int, enabled: bool = True, alpha: float = 0.01, cost_alpha: float = 0.05,
                 min_rounds: int = 2, explore_every: int = 16, min_gamma: int = 1, prior: float = 0.5,
                 shrink: float = 2.0, pin_seeded: bool = True, widths: tuple[int, ...] = (1,)) -> None:
        """max_gamma: the engine's num_speculative_tokens (its caches and margins are sized for it).
        alpha: acceptance counts decay by 1 - alpha a row (about 1/alpha rows remembered); cost_alpha: the
        cost averages' weight of a new round (a plain mean of the first 1/cost_alpha).
        min_rounds / explore_every: the cycle through all gammas of a new key, then one round in
        explore_every. prior / shrink: p_1 with no samples, and the pseudo-count pulling p_k to p_(k-1).
        pin_seeded: rounds holding a seeded sampled request run max_gamma (DecodeEngine reads it); False
        adapts them too (a benchmark's seeds fix its prompts' draws, not a promise of repeated tokens).
        widths: the draft-tree widths rounds may take (1: the chain; `DecodeEngine` sets (1, tree_width) when its
        SpecConfig has trees)."""
        if not 1 <= min_gamma <= max_gamma:
            raise ValueError(f"need 1 <= min_gamma <= max_gamma, got {min_gamma} and {max_gamma}")
        if explore_every < 2:
            raise ValueError(f"explore_every must be >= 2, got {explore_every}")
        self.enabled = enabled
        self.max_gamma, self.min_gamma = max_gamma, min_gamma
        self.alpha, self.cost_alpha = alpha, cost_alpha
        self.min_rounds, self.explore_every = min_rounds, explore_every
        self.prior, self.shrink = prior, shrink
        self.pin_seeded = pin_seeded
        self.forced: int | None = None  # every round at this gamma (DecodeEngine.warmup captures each one's graphs)
        self.forced_width = 1  # ... and this tree width, where the batch may take a tree
        self.widths = widths
        self._acceptance: dict[tuple[str, int], _Acceptance] = {}  # (draft, width)
        self._costs: dict[tuple, dict[int, _Cost]] = {}
        self._rounds: dict[tuple, int] = {}
        self.chosen: dict[int, int] = {}  # gamma -> rounds that ran it
        self.chosen_widths: dict[int, int] = {}  # tree width -> rounds that ran it
        self._lock = threading.Lock()

    @property
    def gammas(self) -> range:
        return range(self.min_gamma, self.max_gamma + 1)

    @property
    def widths(self) -> tuple[int, ...]:
        return self._widths

    @widths.setter
    def widths(self, widths) -> None:
        widths = tuple(sorted(set(widths)))
        if not widths or widths[0] != 1:
            raise ValueError(f"tree widths must include 1 (the chain) and be >= 1, got {list(widths)}")
        self._widths = widths

    def arms(self, trees: bool = False) -> list[tuple[int, int]]:
        """(gamma, width) pairs a round may take; trees: whether the batch may take a tree."""
        return [(g, w) for w in (self.widths if trees else (1,)) for g in self.gammas]

    # ----- estimates ---------------------------------------------------------------------------
    def survival(self, draft: str, width: int = 1) -> list[float]:
        """S(1..max_gamma) for this draft's rounds of this tree width (the prior alone before any such round)."""
        acc = self._acceptance.get((draft, width)) or _Acceptance([0.0] * self.max_gamma, [0.0] * self.max_gamma)
        return acc.survival(self.prior, self.shrink)

    def expected_tokens(self, drafts: list[str], gamma: int, width: int = 1) -> float:
        """Tokens a round at gamma makes on average, summed over the batch's rows (one draft name each)."""
        return self._expected_by_gamma(drafts, width)[gamma - 1]

    def _expected_by_gamma(self, drafts: list[str], width: int = 1) -> list[float]:
        """`expected_tokens` at every gamma 1..max_gamma: each draft's survival computed once."""
        counts: dict[str, int] = {}
        for name in drafts:
            counts[name] = counts.get(name, 0) + 1
        out = [0.0] * self.max_gamma
        for name, n in counts.items():
            total = 1.0
            for k, s in enumerate(self.survival(name, width)):
                total += s
                out[k] += n * total
        return out

    def cost(self, key: tuple, gamma: int, width: int = 1) -> float | None:
        """Predicted seconds of a round at gamma: the least-squares line through the measured gammas' average
        seconds (weighted by their sample counts, up to 1/cost_alpha); None before any sample. With one
        gamma measured, its own average."""
        line = self._cost_line(_cost_key(key, width))
        return None if line is None else _on_line(line, gamma)

    def _cost_line(self, key: tuple) -> tuple[float, float] | None:
        """(intercept, slope) of `cost`'s line for this key; slope 0 with one gamma measured."""
        costs = {g: c for g, c in self._costs.get(key, {}).items() if c.count}
        if not costs:
            return None
        if len(costs) == 1:
            return next(iter(costs.values())).seconds, 0.0
        cap = 1.0 / self.cost_alpha
        w = {g: min(c.count, cap) for g, c in costs.items()}
        sw = sum(w.values())
        mg = sum(w[g] * g for g in costs) / sw
        ms = sum(w[g] * c.seconds for g, c in costs.items()) / sw
        var = sum(w[g] * (g - mg) ** 2 for g in costs)
        slope = sum(w[g] * (g - mg) * (c.seconds - ms) for g, c in costs.items()) / var
        return ms - slope * mg, slope

    # ----- decisions ---------------------------------------------------------------------------
    def choose(self, drafts: list[str], key: tuple) -> int:
        """The gamma of the next round (a chain) for a batch whose rows use these drafts (names, one per row);
        `key` says what its cost depends on (DecodeEngine: batch bucket, drafts in the batch, greedy)."""
        return self.choose_arm(drafts, key)[0]

    def choose_arm(self, drafts: list[str], key: tuple, trees: bool = False) -> tuple[int, int]:
        """(gamma, tree width) of the next round, as `choose`; trees: whether this batch may take a tree."""
        arms = self.arms(trees)
        if self.forced is not None:
            return max(self.min_gamma, min(self.forced, self.max_gamma)), self.forced_width if trees else 1
        if not self.enabled or len(arms) == 1:
            return self.max_gamma, (max(self.widths) if trees else 1)
        with self._lock:
            n = self._rounds.get(key, 0)
            self._rounds[key] = n + 1
            unmeasured = [a for a in arms if self._costs.get(_cost_key(key, a[1]), {}).get(a[0], _Cost()).count
                          < self.min_rounds]
            if unmeasured:
                arm = arms[n % len(arms)] if arms[n % len(arms)] in unmeasured else unmeasured[0]
            elif n % self.explore_every == self.explore_every - 1:
                arm = arms[(n // self.explore_every) % len(arms)]
            else:  # each width's fitted line and each draft's survival once per choice, not once per arm
                rates = {}
                for w in dict.fromkeys(w for _, w in arms):
                    expected, line = self._expected_by_gamma(drafts, w), self._cost_line(_cost_key(key, w))
                    rates.update({(g, w): expected[g - 1] / _on_line(line, g) for g in self.gammas})
                arm = max(arms, key=rates.__getitem__)
            self.chosen[arm[0]] = self.chosen.get(arm[0], 0) + 1
            self.chosen_widths[arm[1]] = self.chosen_widths.get(arm[1], 0) + 1
            return arm

    def observe(self, key: tuple, gamma: int, seconds: float | None, rows: list[tuple[str, int, int]],
                width: int = 1) -> None:
        """A round at `gamma` (a tree of `width`) took `seconds` (None: not a clean sample, e.g. it captured a
        graph); rows: per row (draft name, tokens accepted, tokens drafted for it before its round ended)."""
        if not self.enabled or self.forced is not None:
            return  # forced rounds (warm-up) are no sample of real traffic
        with self._lock:
            keep = 1.0 - self.alpha
            for name, accepted, drafted in rows:
                acc = self._acceptance.get((name, width))
                if acc is None:
                    acc = self._acceptance[(name, width)] = _Acceptance([0.0] * self.max_gamma, [0.0] * self.max_gamma)
                for k in range(self.max_gamma):
                    acc.reached[k] *= keep
                    acc.accepted[k] *= keep
                for k in range(min(accepted + 1, drafted, self.max_gamma)):
                    acc.reached[k] += 1.0
                for k in range(min(accepted, self.max_gamma)):
                    acc.accepted[k] += 1.0
            if seconds is not None:
                self._costs.setdefault(_cost_key(key, width), {}).setdefault(gamma, _Cost()).update(seconds, self.cost_alpha)

    def forget(self, draft: str) -> None:
        """Drop a draft's acceptance counts (a new version under the same name starts from the prior)."""
        with self._lock:
            for k in [k for k in self._acceptance if k[0] == draft]:
                del self._acceptance[k]

    def snapshot(self) -> dict:
        with self._lock:
            return {
                "chosen": dict(sorted(self.chosen.items())),
                **({"widths": dict(sorted(self.chosen_widths.items()))} if len(self.widths) > 1 else {}),
                "survival": {(name if w == 1 else f"{name} (tree {w})"): [round(s, 3) for s in self.survival(name, w)]
                             for name, w in sorted(self._acceptance)},
                "round_ms": {str(key): {g: round(c.seconds * 1e3, 3) for g, c in sorted(costs.items())}
                             for key, costs in self._costs.items()},
            }

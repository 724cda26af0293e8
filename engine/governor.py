"""Keeps speculation from making decoding slower: measured cost per token, per draft, online.

Every plain decoding step and every speculative round reports its wall time, its batch size and
the tokens it produced (a step mixing plain and speculating rows charges speculation the step less
what its plain tokens cost at plain decoding's rate: `spec_step_seconds`; one mixing n-gram lookup rows
and draft rows charges the drafts what is left after the lookup tokens' cost at lookup's rate, and lookup
is measured only in steps without draft rows: `draft_step_seconds`). The governor keeps the
seconds per token of plain decoding and of each draft (moving averages of seconds and of tokens:
`_Rate`), per batch-size bucket (a batched plain step is much cheaper per token than a single one, so only like
is compared with like), and speculation for a draft stays on
only while its cost per token is at most plain decoding's, within the two estimates' standard error:
- a new request for a draft that does not pay decodes plainly (every `probe_every`-th one still
  speculates, and so does the first one after `probe_seconds` without a round of that draft, so the
  estimate follows the traffic, also when requests are few);
- a running request whose draft stops paying drops to plain decoding for the rest of its tokens
  (always safe: the target cache is complete);
- so does a request running alone whose own rounds make too few tokens, though its draft pays on
  average: its draft's round at batch 1 over the tokens its last rounds made, against plain decoding's
  cost a token (`request_pays`). A prompt the draft fits badly (or one the router sent to the wrong draft)
  then costs a few rounds, not its whole answer. In a batch the round is shared and a row turned plain
  would add a plain step to every round, so there only the draft's average decides;
- while every request speculates, every `probe_every`-th decodes plainly to measure the other side.
`DecodeEngine.calibrate()` seeds the plain-decoding estimate at every batch-size bucket at start-up.
The n-gram lookup drafter's rounds also feed a pool (`observe_pool`: seconds a row's round, from rounds where every
running row is a lookup row) and each lookup name's tokens a row's round (`observe_tokens`). A batch all of whose
rows can run lookup moves to it together where an all-lookup batch is priced below plain decoding and below each
moving row's draft (`batch_moves`): a round is shared, so judged row by row a batch never reaches the batch of lookup
rows that pays. With the engine's `lookup_replay` (by default for requests admitted to run alone), tokens come from
replays over those greedy requests, each domain's lookup is priced from the pool over them (`_spec_cost`), and a
request running alone moves from its draft to lookup where the replay over its own tokens says it is cheaper
(`prefers_alternative`).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import statistics
import threading
import time
from collections.abc import Sequence

# A cost sample (a plain call's, a round's) taking more than OUTLIER_FACTOR times the median of the last
# OUTLIER_WINDOW samples of its estimate is left out of it (`_Rate(robust=True)`): a garbage-collection pause or a
# graph's first replay (its upload) in one of the few samples an estimate starts from would otherwise price it for
# hundreds of rounds. On an H100 (bench/RESULTS.md run 45) one such sample among the 8 lookup rounds calibrating bs 8
# priced a row's round at 0.69 ms against the 0.15 ms it cost, and the batch never moved to lookup (1.11x against
# 1.9-2.0x). A round's time varies little with what it accepts (its tokens vary: the filter looks at seconds, not
# seconds a token) and with the gamma it drafts (about 2x from gamma 1 to 5). A lasting change (longer contexts, other
# traffic) is taken once it is most of the window. The first OUTLIER_MIN samples are not judged; until the window
# is full the estimate is recomputed over it, so a slow first sample is left out too once there are enough.
OUTLIER_FACTOR = 4.0
OUTLIER_WINDOW = 16
OUTLIER_MIN = 4


@dataclasses.dataclass
class _Rate:
    """Seconds per token, as the ratio of two moving averages: of each sample's seconds and of its tokens.
    An average of per-sample ratios would weigh a round that made 1 token like one that made 6, and
    overstate what speculation costs, whose tokens per round vary from 1 to gamma + 1 (the mean of ratios
    exceeds the ratio of means: 2 ms rounds of 1 and 6 tokens average 1.17 ms a token that way, against
    the 0.57 ms they cost). The first 1/alpha samples are plainly averaged (the first sample does not
    dominate a slow average), later ones exponentially. Second moments give the estimate's error."""

    seconds: float = 0.0
    tokens: float = 0.0
    seconds_sq: float = 0.0
    tokens_sq: float = 0.0
    product: float = 0.0
    count: int = 0  # samples in the estimate
    robust: bool = False  # leave out samples far slower than the recent ones (OUTLIER_FACTOR)
    recent: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=OUTLIER_WINDOW))
    samples: int = 0  # samples seen (robust), those left out included
    dropped: int = 0  # samples left out (robust)

    def update(self, seconds: float, tokens: int, alpha: float) -> None:
        if not self.robust:
            self._add(seconds, tokens, alpha)
            return
        self.recent.append((seconds, tokens))
        self.samples += 1
        if self.samples <= OUTLIER_WINDOW:  # every sample so far is at hand: the estimate over those kept
            limit = (OUTLIER_FACTOR * statistics.median(s for s, _ in self.recent) if self.samples >= OUTLIER_MIN
                     else math.inf)
            self.seconds = self.tokens = self.seconds_sq = self.tokens_sq = self.product = 0.0
            self.count = self.dropped = 0
            for s, t in self.recent:
                if s > limit:
                    self.dropped += 1
                else:
                    self._add(s, t, alpha)
            return
        if seconds > OUTLIER_FACTOR * statistics.median(s for s, _ in self.recent):
            self.dropped += 1
            return
        self._add(seconds, tokens, alpha)

    def _add(self, seconds: float, tokens: int, alpha: float) -> None:
        self.count += 1
        a = max(alpha, 1.0 / self.count)
        self.seconds += a * (seconds - self.seconds)
        self.tokens += a * (tokens - self.tokens)
        self.seconds_sq += a * (seconds * seconds - self.seconds_sq)
        self.tokens_sq += a * (tokens * tokens - self.tokens_sq)
        self.product += a * (seconds * tokens - self.product)

    @property
    def value(self) -> float | None:
        return self.seconds / self.tokens if self.count else None

    def relative_error(self, alpha: float) -> float:
        """Standard error of `value`, relative to it: the delta method for a ratio of means, over the samples
        the average spans (all of them up to about 2 / alpha)."""
        if self.count < 2 or self.seconds <= 0:
            return math.inf
        r = self.value
        spread = max(self.seconds_sq - 2 * r * self.product + r * r * self.tokens_sq, 0.0)  # Var(seconds - r * tokens)
        return math.sqrt(spread / min(self.count, 2 / alpha - 1)) / self.seconds


# Rounds of its own a lone request is judged by (`SpeculationGovernor.request_pays`; `SpecStats.recent` keeps them).
# A dropped request does not come back, so its window is long and its margin two standard errors: in simulated
# requests of 256 tokens at gamma 3 (tests/engine/test_governor.py) one whose rounds pay 1.39x was never dropped,
# 1.20x in 2 % of requests, 1.04x in a third, 0.97x in three quarters, and 0.80x always, after 34 rounds on average.
REQUEST_WINDOW = 32
# Replayed rounds a request decoding plainly is judged by for the way (back) to lookup (`returns_to`). Shorter than
# REQUEST_WINDOW: the two mistakes cost unlike amounts. Back too early costs the rounds until the per-request rule
# drops it again, lookup rounds making about one token (0.87 ms against a plain token's 0.72 on the H200); back too
# late costs plain decoding's 0.72 ms for tokens lookup would have made in a quarter of that. Replaying lone
# requests over our own splits' greedy replies with the governor's rules and the H200's costs (bench/RESULTS.md,
# run 39): 8 rounds against 32 +0.43 % over nine split/shape/domain cells (dialog +3 %, code -0.9 % on plain
# requests), 4 rounds +0.86 % (not run on the GPU); on the H200 the service at bs 1 ran 0.7-1.0 % faster with 8 than
# with 32. A request running alone on its draft moves to lookup on the same window of its own and replayed rounds
# (`prefers_alternative`): on REQUEST_WINDOW's it needed 32 replayed rounds, about 100 tokens of a reply, before it
# could move, and at bs 1 a draft's token costs 2-4 times lookup's where the text repeats (H200, run 40: 154 draft
# rounds a pass of 24 requests on 32 against 51 on 8; the service 0.7-1.4 % faster in two processes).
RETURN_WINDOW = 8
# The weight of one round (replayed or run) in a lookup drafter's tokens a round (`observe_tokens`), by default: about
# the last 1,000 rounds, ten or more requests of a domain. What a domain's lookup is priced at decides which drafter its next
# request starts on (`choose`), and replies of one domain differ far more in how much they repeat than domains do: with
# the costs' alpha (0.01, about 100 rounds) the price followed the last request, so a request that did not repeat sent
# the next few to their draft (H200, run 40: 51-154 draft rounds a pass of 24 requests at bs 1; none with 0.001, and
# the service 2.9 % faster). Over our own splits' replies (`python -m bench.lookup_policy --tokens-alphas 0.01,0.001`,
# bench/RESULTS.md run 40) 0.001 made fewer admission choices against what the request's own reply favoured.
TOKENS_ALPHA = 0.001


def _window(tokens: Sequence[int], size: int = REQUEST_WINDOW) -> tuple[float, float] | None:
    """(mean, its relative standard error) of the last `size` rounds' tokens; None with fewer."""
    recent = list(tokens)[-size:]
    n = len(recent)
    if n < size:
        return None
    mean = sum(recent) / n
    spread = sum((t - mean) ** 2 for t in recent) / (n - 1)
    return mean, math.sqrt(spread / n) / mean


def batch_bucket(rows: int) -> int:
    """1, 2, 4, 8, 16, ...: the power of two at or above the batch size."""
    bucket = 1
    while bucket < rows:
        bucket *= 2
    return bucket


class SpeculationGovernor:
    def __init__(self, enabled: bool = True, alpha: float = 0.01, min_samples: int = 8, probe_every: int = 64,
                 tolerance: float = 1.0, probe_seconds: float = 30.0, error_weight: float = 1.0,
                 return_window: int = RETURN_WINDOW, tokens_alpha: float = TOKENS_ALPHA,
                 clock=time.monotonic) -> None:
        """tolerance: speculation stays on while spec_cost <= tolerance * plain_cost * (1 + error_weight * e),
        e the two estimates' combined relative standard error.
        alpha / min_samples: the costs average over about 1/alpha samples (a plain mean until then), and no
        decision is taken on fewer than min_samples of either side. A round's tokens vary widely (1 to
        gamma + 1; with the shipped drafts 2.7 a round, a standard deviation of about 1.7), and a request
        dropped from speculation does not come back: over a short window with no error margin (alpha 0.2,
        4 samples, as before) the estimate of a draft that pays 1.33x dipped below plain decoding within a
        few dozen rounds, and in a simulation of such rounds it speculated 1 % of its tokens. With these
        defaults: 1.33x all of them, 1.15x 83 %, 0.95x 2 %, 0.6x 0.3 % (its first 8 rounds)
        (tests/engine/test_governor.py, test_noisy_rounds_keep_a_paying_draft_on).
        probe_every / probe_seconds: a draft that does not pay still speculates on every probe_every-th
        admission, and on the first admission after probe_seconds without a speculative round of it
        (so its estimate follows the traffic when requests are few); a batch held off lookup by a pool's price
        that took no sample for probe_seconds moves to measure it afresh (`batch_moves`).
        return_window: the rounds a lone request's move to lookup is judged by, from plain decoding (`returns_to`,
        its replayed rounds) and from its draft (`prefers_alternative`, its own rounds and the replayed ones);
        REQUEST_WINDOW's at most, the replay keeps that many.
        tokens_alpha: the moving average's weight of a drafter's tokens a round (`observe_tokens`: one sample a
        round, replayed or run; TOKENS_ALPHA)."""
        if not 2 <= return_window <= REQUEST_WINDOW:
            raise ValueError(f"return_window {return_window}: need 2..{REQUEST_WINDOW} rounds, e.g. {RETURN_WINDOW}")
        self.return_window = return_window
        if not 0 < tokens_alpha <= 1:
            raise ValueError(f"tokens_alpha {tokens_alpha}: need a weight in (0, 1], e.g. {TOKENS_ALPHA}")
        self.tokens_alpha = tokens_alpha
        self.enabled = enabled
        self.alpha = alpha
        self.min_samples = min_samples
        self.probe_every = probe_every
        self.probe_seconds = probe_seconds
        self.tolerance = tolerance
        self.error_weight = error_weight
        self._clock = clock
        self._last_spec: dict[str, float] = {}
        self._buckets = [2**i for i in range(16)]
        self._ar: dict[int, _Rate] = {}
        self._spec: dict[tuple[str, int], _Rate] = {}
        # Drafters priced from a pool (`observe_tokens`): name -> its pool, whose rounds' seconds a row it shares
        # (`observe_pool`, per batch-size bucket), and its own tokens a row's round (as _Rate(tokens, 1)).
        self._pooled: dict[str, str] = {}
        self._pool: dict[tuple[str, int], _Rate] = {}
        self._row_tokens: dict[str, _Rate] = {}
        # A pool's estimate per batch-size bucket: when it last took a sample, and the probes running (`batch_moves`):
        # (pool, bucket) -> (when the probe started, whether its estimate has restarted from the probe's rounds yet).
        self._started = clock()
        self._pool_seen: dict[tuple[str, int], float] = {}
        self._pool_probes: dict[tuple[str, int], tuple[float, bool]] = {}
        self._admissions: dict[str, int] = {}
        # What it decided: admissions that speculate / decode plainly, probes among them, rows turned plain, batches
        # moved to a pool's drafter to measure it (`batch_moves`).
        self.decisions = {"speculate": 0, "plain": 0, "probes": 0, "dropped": 0, "switched": 0, "returned": 0,
                          "batch_probes": 0}
        self._lock = threading.Lock()

    def observe_ar(self, rows: int, seconds: float, tokens: int) -> None:
        if tokens:
            with self._lock:
                self._ar.setdefault(batch_bucket(rows), _Rate(robust=True)).update(seconds, tokens, self.alpha)

    def observe_spec(self, draft: str, rows: int, seconds: float, tokens: int) -> None:
        if tokens:
            with self._lock:
                self._spec.setdefault((draft, batch_bucket(rows)), _Rate(robust=True)).update(seconds, tokens, self.alpha)
                self._last_spec[draft] = self._clock()

    def observe_pool(self, pool: str, rows: int, seconds: float, row_rounds: int) -> None:
        """A round of `row_rounds` rows all of drafters of `pool` (n-gram lookup's, say), charged `seconds`, at
        about `rows` running requests: what a row's round of that pool costs, whatever its text."""
        if row_rounds:
            with self._lock:
                key = (pool, batch_bucket(rows))
                probe = self._pool_probes.get(key)
                if probe is not None and not probe[1]:  # a probe's first round: the estimate restarts from it
                    self._pool[key] = _Rate(robust=True)
                    self._pool_probes[key] = (probe[0], True)
                rate = self._pool.setdefault(key, _Rate(robust=True))
                rate.update(seconds, row_rounds, self.alpha)
                self._pool_seen[key] = self._clock()
                if probe is not None and rate.count >= self.min_samples:
                    del self._pool_probes[key]  # measured afresh: the batch is judged on it from now on

    def observe_tokens(self, name: str, pool: str | None, tokens: Sequence[int]) -> None:
        """Tokens each of some rounds of `name` made for their row (a row makes the same tokens a round whatever
        shares its batch, while the round's seconds depend on that), or would have made (replays over requests
        that ran something else, `engine.lookup.LookupShadow`). With a `pool` (replays), `name` is priced from then
        on as the pool's seconds a row's round over these tokens a round (`_spec_cost`); either way they price a
        batch of lookup rows (`batch_moves`)."""
        with self._lock:
            if pool is not None:
                self._pooled[name] = pool
            rate = self._row_tokens.setdefault(name, _Rate())
            for t in tokens:
                rate.update(t, 1, self.tokens_alpha)

    def spec_step_seconds(self, rows: int, elapsed: float, round_seconds: float, plain_tokens: int) -> float | None:
        """Seconds to charge the speculative tokens of a step of `rows` rows that took `elapsed`, of which
        the speculative round took `round_seconds` and plain rows made `plain_tokens`: the step less
        what its plain tokens cost at plain decoding's rate for this batch size, and at least the round.
        None while that rate is unknown and the step had plain tokens (the sample would be ambiguous)."""
        if not plain_tokens:
            return elapsed
        with self._lock:
            plain = self._plain_cost(batch_bucket(rows))
        if plain is None:
            return None
        return max(elapsed - plain * plain_tokens, round_seconds)

    def draft_step_seconds(self, rows: int, seconds: float, cheaper: Sequence[tuple[str, int]]) -> float | None:
        """Seconds to charge the draft rows of a step whose speculative part took `seconds` and also ran rows of a
        cheaper drafter, `cheaper` (name, tokens) each (n-gram lookup rows beside draft rows): `seconds` less
        what those tokens cost at their drafter's own rate at this batch size, as a step's plain tokens are
        charged (`spec_step_seconds`). Lookup rows ride on the verify pass every row takes, while draft rows
        also pay for the drafting chain: charged one rate, lookup would pass for as dear as the drafts beside
        it (at a batch of 8 on the H200, run 32: 0.22 ms a token, against 0.056 in all-lookup rounds) and never
        be chosen. None while a cheaper rate is unknown or nothing is left (the sample would be ambiguous)."""
        with self._lock:
            charge = 0.0
            for name, tokens in cheaper:
                cost = self._spec_cost(name, batch_bucket(rows))
                if cost is None:
                    return None
                charge += cost[0] * tokens
        left = seconds - charge
        return left if left > 0 else None

    def _cost(self, table: dict, key, bucket: int) -> tuple[float, float] | None:
        """(seconds per token, its relative standard error) at this bucket; an unmeasured bucket is estimated
        from the largest measured smaller one, assuming a batched step costs what a smaller one does (decode
        steps are bound by reading the weights or by launches, not by the rows) until it is measured itself."""
        own = table.get(key(bucket))
        if own is not None and own.count >= self.min_samples:
            return own.value, own.relative_error(self.alpha)
        known = [b for b in self._buckets if b < bucket and (e := table.get(key(b))) is not None and e.count >= self.min_samples]
        if not known:
            return None
        b = max(known)
        rate = table[key(b)]
        return rate.value * b / bucket, rate.relative_error(self.alpha)

    def _spec_cost(self, name: str, bucket: int) -> tuple[float, float] | None:
        """(seconds per token, its relative standard error) of speculating with `name` at this bucket: a pooled
        drafter's pool's seconds a row's round over its tokens a round once both are known (`observe_tokens`),
        else its own measured rounds'."""
        pool = self._pooled.get(name)
        row_tokens = self._row_tokens.get(name)
        if pool is not None and row_tokens is not None and row_tokens.count >= self.min_samples:
            row_round = self._cost(self._pool, lambda b: (pool, b), bucket)
            if row_round is not None:
                tokens = row_tokens.value  # tokens a round (a _Rate of (tokens, 1))
                return row_round[0] / tokens, math.hypot(row_round[1], row_tokens.relative_error(self.tokens_alpha))
        return self._cost(self._spec, lambda b: (name, b), bucket)

    def _plain_cost(self, bucket: int) -> float | None:
        cost = self._cost(self._ar, lambda b: b, bucket)
        return None if cost is None else cost[0]

    def _pays(self, draft: str, rows: int) -> bool | None:
        """True/False once both sides have a cost at this batch size (measured or estimated); None before.
        Speculation is judged to pay unless its cost exceeds plain decoding's by more than the two
        estimates' combined standard error: a few noisy rounds do not turn off a draft that pays (a
        request dropped from speculation does not come back), a clearly slower one goes within a few."""
        bucket = batch_bucket(rows)
        spec = self._spec_cost(draft, bucket)
        ar = self._cost(self._ar, lambda b: b, bucket)
        if spec is None or ar is None:
            return None
        return self._within(spec, ar)

    def _within(self, spec: tuple[float, float], ar: tuple[float, float]) -> bool:
        """Whether a speculative cost (seconds a token, relative error) is at most plain decoding's, within the
        two estimates' combined standard error."""
        return spec[0] <= self.tolerance * ar[0] * (1 + self.error_weight * math.hypot(spec[1], ar[1]))

    def pool_samples(self, pool: str, rows: int) -> int:
        """Rounds of `pool` measured at the batch-size bucket of `rows`."""
        with self._lock:
            rate = self._pool.get((pool, batch_bucket(rows)))
            return rate.count if rate is not None else 0

    def batch_moves(self, pool: str, names: Sequence[str], running: Sequence[str | None]) -> bool:
        """Should a whole batch move to `pool`'s drafter (n-gram lookup), each row judged under its name in `names`
        (the rows on it already included), the rows that would move running `running` now (a draft's name, or
        None: plain decoding)? Yes when a batch of such rows is priced below plain decoding at this batch size by
        more than the estimates' combined error, and below each of those drafts: the pool's seconds a row's round
        times the rows over the sum of the rows' tokens a round (`observe_tokens`: each name's own). The batch is
        the unit: a round is shared, so rows of two kinds cost the batch two passes a step, rows judged one by one
        never reach the batch of one kind that pays (run 34 at bs 8: lookup alone 1.5x plain decoding, the
        service's per-row choices 1.1x), and priced per domain the rows whose own lookup does not pay split the
        batch (run 35: 0.55x).

        A price nothing refreshes is probed: where a batch of rows all decoding plainly (or on lookup) stays off
        lookup on a pool's estimate at this bucket that took no sample for `probe_seconds`, the batch moves anyway
        and the estimate restarts from the next `min_samples` all-lookup rounds at this bucket, during which the
        batch counts as paying (its rows are not dropped one by one); then the fresh estimate decides, as
        `choose` probes a draft that does not pay. Only a batch that no row's draft would leave for good: a row on
        a draft cannot go back to it. Without it, one wrong price (a slow calibration round, run 45; costs that
        moved with the contexts) holds every batch of that size on plain decoding, since only all-lookup rounds
        measure it."""
        with self._lock:
            bucket = batch_bucket(len(names))
            key = (pool, bucket)
            now = self._clock()
            probe = self._pool_probes.get(key)
            plain = all(r is None for r in running)  # no row would leave a draft for good
            if probe is not None:
                if now - probe[0] <= self.probe_seconds:
                    if plain:
                        return True  # measuring: the batch stays until the estimate has restarted
                else:
                    del self._pool_probes[key]  # no batch of this size ran it meanwhile: judged as before
                    probe = None
            ar = self._cost(self._ar, lambda b: b, bucket)
            row_round = self._cost(self._pool, lambda b: (pool, b), bucket)
            tokens = [self._row_tokens.get(name) for name in names]
            if ar is None or row_round is None or any(t is None or t.count < self.min_samples for t in tokens):
                return False
            cost = row_round[0] * len(names) / sum(t.value for t in tokens)
            if cost * (1 + self.error_weight * math.hypot(row_round[1], ar[1])) >= ar[0]:
                if plain and probe is None and now - self._pool_seen.get(key, self._started) > self.probe_seconds:
                    self._pool_probes[key] = (now, False)
                    self.decisions["batch_probes"] += 1
                    return True
                return False
            for name in {r for r in running if r is not None}:
                own = self._spec_cost(name, bucket)
                if own is None or own[0] <= cost:
                    return False
            return True

    def allow(self, draft: str, rows: int = 1) -> bool:
        """Should the next request for `draft` speculate (at about `rows` running requests)?"""
        if not self.enabled:
            return True
        with self._lock:
            n = self._admissions.get(draft, 0) + 1
            self._admissions[draft] = n
            pays = self._pays(draft, rows)
            stale = draft in self._last_spec and self._clock() - self._last_spec[draft] > self.probe_seconds
            probe = n % self.probe_every == 0 or stale
            if stale:
                self._last_spec[draft] = self._clock()  # one probe per period, not every admission until it runs
            if pays is None:
                missing_ar = self._plain_cost(batch_bucket(rows)) is None
                decision = not (missing_ar and probe)  # measure plain decoding now and then
            else:
                decision = pays or probe
                self.decisions["probes"] += bool(probe and not pays)
            self.decisions["speculate" if decision else "plain"] += 1
            return decision

    def choose(self, drafts: Sequence[str], rows: int = 1) -> int | None:
        """Which of `drafts` the next request should speculate with at about `rows` running requests (an index
        into `drafts`), or None for plain decoding. `drafts`: the request's own draft first, then alternatives
        it may run instead (`DecodeEngine.set_alternatives`: the n-gram lookup drafter, say). Each is measured
        and judged as `allow` judges one draft; of those that pay, the cheapest a token wins. A candidate not
        yet measured at this batch size is tried first (in order), so every one gets its estimate; the others
        are probed now and then (every `probe_every`-th admission, taking turns; while none pays, also the first
        admission after `probe_seconds` without a round of one, as `allow` probes a draft that does not pay), so
        the choice follows the traffic. A probe runs a whole request on a worse candidate, so while one pays,
        the clock does not probe: where requests take longer than `probe_seconds` (on a CPU) it would probe
        every other one."""
        if not drafts:
            raise ValueError("choose needs at least one draft")
        if not self.enabled:
            return 0
        if len(drafts) == 1:
            return 0 if self.allow(drafts[0], rows) else None
        with self._lock:
            key = "\x00".join(drafts)
            n = self._admissions.get(key, 0) + 1
            self._admissions[key] = n
            bucket = batch_bucket(rows)
            ar = self._cost(self._ar, lambda b: b, bucket)
            costs = [self._spec_cost(d, bucket) for d in drafts]
            now = self._clock()
            stale = [i for i, d in enumerate(drafts) if d in self._last_spec and now - self._last_spec[d] > self.probe_seconds]
            unmeasured = [i for i, c in enumerate(costs) if c is None]
            if unmeasured:
                pick = unmeasured[0]
                if ar is None and n % self.probe_every == 0:
                    pick = None  # measure plain decoding now and then
            elif ar is None:
                pick = min(range(len(drafts)), key=lambda i: costs[i][0])
            else:
                paying = [i for i, c in enumerate(costs) if self._within(c, ar)]
                pick = min(paying, key=lambda i: costs[i][0]) if paying else None
                others = [i for i in range(len(drafts)) if i != pick]
                # A quiet period probes only while nothing pays (so speculation can come back, as `allow` does);
                # while one candidate pays, a probe costs a request at a worse one: by count alone.
                probe = (stale[0] if stale and pick is None else
                         others[(n // self.probe_every - 1) % len(others)] if n % self.probe_every == 0 else None)
                if probe is not None:
                    pick = probe
                    self.decisions["probes"] += 1
            if pick is not None and drafts[pick] in self._last_spec and now - self._last_spec[drafts[pick]] > self.probe_seconds:
                self._last_spec[drafts[pick]] = now  # one probe per period, not every admission until it runs
            self.decisions["speculate" if pick is not None else "plain"] += 1
            return pick

    def keep_speculating(self, draft: str, rows: int, recent: Sequence[int] = ()) -> bool:
        """Should a running request of `draft` go on speculating? `recent`: the tokens each of its last
        rounds made (`request_pays`, which decides only while the request runs alone)."""
        if not self.enabled:
            return True
        with self._lock:
            keep = self._pays(draft, rows) is not False
            if keep and batch_bucket(rows) == 1:
                keep = self._request_pays(draft, recent) is not False
            self.decisions["dropped"] += not keep
            return keep

    def may_pay(self, draft: str, rows: int = 1) -> bool:
        """Whether `draft` is not known to cost more a token than plain decoding at about `rows` rows (unmeasured
        there counts as may pay): may a running request move to it instead of dropping to plain decoding?"""
        with self._lock:
            return self._pays(draft, rows) is not False

    def note_switch(self) -> None:
        """A running request moved to an alternative instead of dropping to plain decoding (counted apart)."""
        with self._lock:
            self.decisions["switched"] += 1

    def request_pays(self, draft: str, recent: Sequence[int]) -> bool | None:
        """Does speculation pay for one request running alone, whose last rounds made `recent` tokens each?
        None until there are REQUEST_WINDOW of them and both costs at batch 1 are measured."""
        with self._lock:
            return self._request_pays(draft, recent)

    def _request_pays(self, draft: str, recent: Sequence[int]) -> bool | None:
        """Its draft's round at batch 1 (the moving average of a round's seconds) over the request's mean tokens a
        round over its last REQUEST_WINDOW rounds, against plain decoding's seconds a token at batch 1; like
        `_pays`, within the estimates' combined standard error, taken twice (the request's mean is the noisiest
        of the three, and the decision is final)."""
        own = _window(recent)
        round_ = self._round_alone(draft)
        ar = self._ar.get(1)
        if own is None or round_ is None or ar is None or ar.count < self.min_samples:
            return None
        margin = 2 * self.error_weight * math.hypot(own[1], round_[1], ar.relative_error(self.alpha))
        return round_[0] / own[0] <= self.tolerance * ar.value * (1 + margin)

    def _round_alone(self, name: str) -> tuple[float, float] | None:
        """(seconds of `name`'s round at batch 1, its relative error): its pool's where it is pooled
        (`observe_tokens`), else its own rounds' moving average; None below min_samples."""
        if name in self._pooled:
            pool = self._pool.get((self._pooled[name], 1))
            if pool is not None and pool.count >= self.min_samples:
                return pool.value, pool.relative_error(self.alpha)  # a row's round; at batch 1, the round
        own = self._spec.get((name, 1))
        if own is None or own.count < self.min_samples:
            return None
        return own.seconds, own.relative_error(self.alpha)

    def prefers_alternative(self, draft: str, alternative: str, recent: Sequence[int], replayed: Sequence[int]) -> bool:
        """Should a request running alone on `draft`, whose last rounds made `recent` tokens each, go on with
        `alternative`, whose rounds over the same request's tokens would have made `replayed` each
        (`engine.lookup.LookupShadow`)? Yes when the alternative's round at batch 1 over the replayed tokens a
        round costs less a token than the draft's over its own, by more than twice their combined standard
        error (the move is final: the draft's state is not kept), over the last `return_window` rounds of each.
        Per request, where `choose` goes by domain: the same domain holds replies that copy their prompt and
        replies that do not."""
        with self._lock:
            mine, theirs = _window(recent, self.return_window), _window(replayed, self.return_window)
            a, b = self._round_alone(draft), self._round_alone(alternative)
            if mine is None or theirs is None or a is None or b is None:
                return False
            margin = 2 * self.error_weight * math.hypot(mine[1], theirs[1], a[1], b[1])
            return b[0] / theirs[0] * (1 + margin) < a[0] / mine[0]

    def returns_to(self, pool: str, replayed: Sequence[int]) -> bool:
        """Should a request decoding plainly alone go (back) on `pool`'s drafter (n-gram lookup), whose rounds over
        its own last tokens would have made `replayed` tokens each (`engine.lookup.LookupShadow`)? Yes when the
        pool's round at batch 1 over the last `return_window` replayed rounds' tokens a round costs less a token
        than plain decoding at batch 1 by more than twice their combined standard error. Lookup keeps no state but
        the request's tokens, so a request that left it (`keep_speculating`) may come back once its text repeats
        itself, and leave again: a reply that does not repeat early often does later (run 37: lookup alone 2.46x
        plain decoding at bs 1, with the per-request drop and no way back 1.66x)."""
        with self._lock:
            own = _window(replayed, self.return_window)
            round_ = self._pool.get((pool, 1))
            ar = self._ar.get(1)
            if (own is None or round_ is None or round_.count < self.min_samples or ar is None
                    or ar.count < self.min_samples):
                return False
            margin = 2 * self.error_weight * math.hypot(own[1], round_.relative_error(self.alpha),
                                                        ar.relative_error(self.alpha))
            back = round_.value / own[0] * (1 + margin) < ar.value
            self.decisions["returned"] += back
            return back

    def plain_samples(self, rows: int) -> int:
        """Plain-decoding steps measured at the batch-size bucket of `rows`."""
        with self._lock:
            rate = self._ar.get(batch_bucket(rows))
            return rate.count if rate is not None else 0

    def snapshot(self) -> dict:
        with self._lock:
            return {
                "ar_seconds_per_token": {b: e.value for b, e in self._ar.items()},
                "spec_seconds_per_token": {f"{d}@{b}": e.value for (d, b), e in self._spec.items()},
                "ar_samples": {b: e.count for b, e in self._ar.items()},
                "spec_samples": {f"{d}@{b}": e.count for (d, b), e in self._spec.items()},
                "pool_seconds_per_row_round": {f"{p}@{b}": e.value for (p, b), e in self._pool.items()},
                "pooled_tokens_per_round": {d: e.value for d, e in self._row_tokens.items()},
                "pooled_rounds": {d: e.count for d, e in self._row_tokens.items()},
                "samples_left_out": sum(e.dropped for t in (self._ar, self._spec, self._pool) for e in t.values()),
                "decisions": dict(self.decisions),
            }

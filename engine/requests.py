"""Requests in, events out: the records the decode engine and its callers exchange."""

from __future__ import annotations

import collections
import dataclasses
import time

from engine.governor import REQUEST_WINDOW
from engine.sampling import RandomStream, SamplingParams


class RequestError(ValueError):
    """A request the engine cannot take (empty prompt, over the context, ...)."""


@dataclasses.dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    draft: str | None = None  # name of a loaded draft; None = plain autoregressive decoding


def repeats_its_seed(request: Request) -> bool:
    """A seeded sampled request: its tokens must be the same whatever shares its batch and whatever the load, so
    what its rounds draft is fixed (the full gamma, the chain, no early stop: `DecodeEngine._round_spec`) and the
    governor does not switch its speculation (`DecodeEngine._governor_decides`)."""
    return not request.params.greedy and request.params.seed is not None


@dataclasses.dataclass
class SpecStats:
    """Speculation figures for one request."""

    rounds: int = 0  # draft-and-verify rounds (each drafts up to gamma tokens)
    verify_passes: int = 0
    drafted: int = 0
    accepted: int = 0
    accepted_by_position: list[int] = dataclasses.field(default_factory=list)  # accepted count at draft position i
    drafted_by_position: list[int] = dataclasses.field(default_factory=list)
    emitted: int = 0  # tokens produced by rounds (accepted + recovered/bonus)
    # tokens each of its last rounds produced: what the governor judges a request running alone by
    recent: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=REQUEST_WINDOW))
    # rounds and tokens by the drafter that ran them (the name the governor judged it under: "code",
    # "code/lookup"): a request may move between its draft and lookup, and to and from plain decoding
    by_drafter: dict = dataclasses.field(default_factory=dict)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens produced per round (accepted drafts + the recovered or bonus token)."""
        return self.emitted / self.rounds if self.rounds else 0.0

    def count_drafter(self, drafter: str, rounds: int, tokens: int) -> None:
        """Add rounds and the tokens they made to `drafter`'s count (`by_drafter`)."""
        counts = self.by_drafter.setdefault(drafter, [0, 0])
        counts[0] += rounds
        counts[1] += tokens

    def record(self, drafted: int, accepted: int, passes: int, drafter: str | None = None) -> None:
        if drafter is not None:
            self.count_drafter(drafter, 1, accepted + 1)
        self.rounds += 1
        self.verify_passes += passes
        self.drafted += drafted
        self.accepted += accepted
        self.emitted += accepted + 1
        self.recent.append(accepted + 1)
        while len(self.drafted_by_position) < drafted:
            self.drafted_by_position.append(0)
            self.accepted_by_position.append(0)
        for i in range(drafted):
            self.drafted_by_position[i] += 1
            if i < accepted:
                self.accepted_by_position[i] += 1

    def to_dict(self) -> dict:
        return {
            "rounds": self.rounds,
            "verify_passes": self.verify_passes,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "tokens_per_verify_pass": round(self.emitted / self.verify_passes, 4) if self.verify_passes else 0.0,
            "acceptance_by_position": [
                round(a / d, 4) if d else 0.0 for a, d in zip(self.accepted_by_position, self.drafted_by_position)
            ],
            "by_drafter": {name: {"rounds": r, "tokens": t} for name, (r, t) in self.by_drafter.items()},
        }


@dataclasses.dataclass
class RequestOutput:
    """What one engine step produced for one request."""

    request_id: str
    token_ids: list[int]  # new tokens this step
    text: str  # new text this step (may lag tokens: incomplete characters / possible stop strings held back)
    finished: bool = False
    finish_reason: str | None = None  # "stop" (EOS or stop string), "length", "cancelled"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    stats: SpecStats | None = None
    draft: str | None = None  # what its rounds ran: its draft, or "<draft>/<alternative>" (`SlotState.draft_name`)


@dataclasses.dataclass
class SlotState:
    """A running request bound to one cache row."""

    request: Request
    slot: int
    random: RandomStream  # the request's random numbers (sampling, rejection tests)
    text_stream: object
    eos: frozenset[int]
    draft: object | None = None  # the draft object this request started with (kept across hot-swaps)
    # What its speculation is measured and judged under: its request's draft, or "<draft>/<alternative>" when the
    # governor picked an alternative (`DecodeEngine.set_alternatives`); None for plain decoding from the start.
    draft_name: str | None = None
    # Rounds it had run when it last changed drafter (a draft it dropped for its lookup alternative): the governor
    # judges its new drafter from `min_samples` rounds later on, and while `history_refills` > 0 the engine
    # rewrites its lookup history from the host at each commit (a round launched before the change wrote none).
    switched_at: int = 0
    history_refills: int = 0
    # A greedy request whose draft has an n-gram lookup alternative: lookup's rounds replayed over its tokens
    # (`engine.lookup.LookupShadow`), reported to the governor under `shadow_name` (the alternative's governed name).
    shadow: object | None = None
    shadow_name: str | None = None
    # A greedy request decoding plainly that may go (back) on an n-gram lookup drafter: lookup's rounds replayed
    # over its tokens since it went plain (`DecodeEngine._watch_lookup`), and what it would run, (name, drafter).
    comeback: object | None = None
    comeback_to: tuple | None = None
    # A lookup row whose last committed round accepted every token it proposed: its next round may propose more
    # (`engine.lookup.LookupDraft.streak_gammas`).
    lookup_streak: bool = False
    length: int = 0  # tokens whose KV is in the cache (= position of `pending`)
    pending: int = -1  # last produced token, not yet run through the model
    output_ids: list[int] = dataclasses.field(default_factory=list)
    stats: SpecStats = dataclasses.field(default_factory=SpecStats)
    started: float = dataclasses.field(default_factory=time.perf_counter)
    first_token_at: float | None = None

"""The decode engine: a fixed set of cache rows, requests joining and leaving between steps.

`step()` admits waiting requests (one batched prefill), then advances every running request by
one autoregressive step (rows without a draft) or one FlashSpec round (rows with a draft), and
returns what each request produced. The service drives it in a loop; `generate()` drives it to the
end for offline use. Rows are independent: a ragged batch gives each row what it gives alone.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import time
from typing import Callable, Iterable

import torch

from engine.cache import KVCache, WindowedKVCache, row_index, to_device
from engine.cuda_graphs import GraphCache
from engine.fused import compile_events
from engine.gamma import GammaController
from engine.governor import SpeculationGovernor, batch_bucket
from engine.lookup import ALLOT_MAX_GAMMA, LOOKUP_POOL, LookupShadow, allotted_result, is_lookup, launch_lookup_round
from engine.lookup import MAX_GAMMA as LOOKUP_MAX_GAMMA
from engine.model import Transformer
from engine.requests import Request, RequestError, RequestOutput, SlotState, repeats_its_seed
from engine.sampling import (RandomStream, advance, needs_filters, param_tensors, processed_probs, sample, sample_with,
                             stream_state, uniform_at)
from engine.speculative import (Draft, RoundResult, SpecConfig, captured_path, draft_features, feature_layers_of,
                                graph_drafts, launch_round, round_result, spec_round, tree_round)
from engine.text import TextStream
from engine.triton_attention import INLINE_MERGE
from engine.triton_kernels import argmax


SAMPLED = ":sampled"


def prefill_graphs_default() -> bool:
    """Whether a DecodeEngine built without `prefill_graphs` runs admissions' prefills as CUDA graphs (where it
    captures graphs at all): yes, unless FLASHSPEC_PREFILL_GRAPHS=0 in the environment."""
    return os.environ.get("FLASHSPEC_PREFILL_GRAPHS", "1") != "0"


# Stream priorities with side_prefill (lower is higher; each level has its own pool of streams, and the level-0 pool
# holds the stream torch.cuda.graph captures the other graphs on).
MAIN_PRIORITY, SIDE_PRIORITY = -2, -1


def side_prefill_default() -> bool:
    """Whether a DecodeEngine built without `side_prefill` runs admissions' prefills on a second CUDA stream beside
    the running rows (where it captures graphs on CUDA): no, unless FLASHSPEC_SIDE_PREFILL=1 in the environment."""
    return os.environ.get("FLASHSPEC_SIDE_PREFILL", "0") == "1"


def governed(request: Request, name: str | None = None) -> str:
    """The name a request's speculation is measured and judged under (the governor's costs, the gamma
    controller's acceptance): its draft (or `name`: what its row runs, `SlotState.draft_name`), and whether it
    samples. A draft's acceptance, and so whether
    speculating pays, is its own for each: on the H200 the shipped drafts at gamma 5 ran 1.11x plain
    decoding greedy and 0.74x at T=1 (batch 1, bench/RESULTS.md run 20); judged together, greedy traffic
    would keep sampled requests speculating at a loss, or sampled traffic turn it off for greedy ones."""
    name = (name if name is not None else request.draft) or ""
    return name if request.params.greedy else name + SAMPLED


class DecodeEngine:
    # An overlapped plain call's cost for the governor: the time since the host read the call before it (True), or
    # since this step started (False: what it was before; the host's work between reads fell outside every sample,
    # kept for measuring the two side by side, `bench.gpu --plain-timing step`).
    plain_timed_from_read = True
    # A plain row's replay of lookup (`_watch_lookup`, kept to see when it may go back on lookup) also prices lookup
    # for its domain (`SpeculationGovernor.observe_tokens`), as a lone request's replay does (True, unless
    # `lookup_replay` is False); False: it only watches (before; `bench.gpu --comeback-prices off` measures the two
    # side by side). At a batch, where requests are not replayed from admission (`lookup_replay="alone"`), a domain's
    # lookup was otherwise priced from the first rounds of the rows that tried it, before their text repeated, and
    # once every row was plain nothing priced it again: on the H200 (run 41, bs 8) the service's setting stayed plain
    # at 1.07x without these prices and moved to lookup at 1.75x with them, side by side.
    comeback_prices = True

    def __init__(
        self,
        model: Transformer,
        tokenizer=None,
        max_batch_size: int = 8,
        max_seq_len: int = 2048,
        spec: SpecConfig | None = None,
        eos_token_ids: Iterable[int] | None = None,
        governor: SpeculationGovernor | None = None,
        cuda_graphs: bool | str | None = None,
        ar_steps_per_sync: int | None = None,
        mixed_round_graph: bool = True,
        min_admit: int = 1,
        gamma: GammaController | None = None,
        overlap: bool = False,
        prefill_graphs: bool | None = None,
        lookup_replay: bool | str = "alone",
        side_prefill: bool | None = None,
        prefill_ahead: int = 0,
    ) -> None:
        """cuda_graphs: capture fixed-shape steps as CUDA graphs (default: on when the model is on CUDA;
        "emulate": the graph path's fixed shapes and padding without capturing, for tests on CPU).
        ar_steps_per_sync: plain decoding steps run back to back on the device before the host looks at
        the tokens (default 1 on CPU, 4 on CUDA; tokens past a stop condition are discarded).

        With graphs, a batch whose cache rows are not consecutive runs padded to a batch-size bucket
        (1, 2, 4, ... max_batch_size) with its rows as a graph input; padding rows point at one extra
        scratch cache row, so one graph serves every set of rows of that bucket.
        mixed_round_graph: rounds of a batch mixing drafts as one graph too (every loaded draft over all
        rows, whichever drafts and row counts the batch holds; `engine.speculative.launch_round`). False:
        such batches take the general loop, a graph per piece (trunk step, each draft's step, verify pass).
        min_admit: while rows run, admit waiting requests only once this many rows are free (or every
        waiting request fits): fewer, larger prefills, for offline batch generation where rows finish a
        few at a time and each admission is a prefill pass. Serving keeps 1: no request waits for others.
        gamma: picks each round's drafted tokens (1 .. spec.num_speculative_tokens) from measured acceptance
        and round costs (`engine.gamma`); default: every round drafts spec.num_speculative_tokens.
        overlap: with graphs, a batch launches its next graph call (plain decoding steps, or a captured
        speculative round) from this call's outcome, still on the device, before the host reads it, so the
        host's work (the transfer, stop conditions, detokenizing, the scheduler) runs while the GPU decodes
        (`_resolve_ahead`). Same tokens; a row that stops meanwhile has the call's work for it discarded.
        prefill_graphs: with graphs, admissions' prefill passes run as CUDA graphs too, the prompts padded to a
        power-of-two length (`_prefill_target`); default: on, unless FLASHSPEC_PREFILL_GRAPHS=0 in the
        environment (run 31 on the H200: an admission's prefill 2.4-7.0 ms against 18-20 ms eager).
        lookup_replay: replay the n-gram lookup alternative's rounds over greedy requests' tokens on the host
        (`engine.lookup.LookupShadow`, about 10 us a round a request on this CPU) so the governor prices lookup
        per domain from those requests and moves a lone request to lookup where its own text suits lookup better
        (`_shadow`). "alone" (the default): the requests admitted to run alone, where a domain's first few
        lookup requests otherwise decide its price (on the H200 at bs 1, code's first ones made 1.3 tokens a
        round and held code on its draft in four processes of five: 1.85-2.01x; replayed, 2.30-2.36x; run 38);
        True: every greedy request (at bs 8 it cost the service 3-4 %, run 38); False: none. Unless False, a plain
        row's replay (kept to watch for its way back to lookup, `_watch_lookup`) prices lookup too
        (`comeback_prices`).
        side_prefill: admissions' prefills run on a second CUDA stream while the running rows keep decoding (on a
        stream of higher priority); the new rows join the batch at the first step after their prefill has run
        (`_admit`, `_join`). Without it a batch stops for each admission's prefill. Off by default
        (FLASHSPEC_SIDE_PREFILL=1 turns it on where the engine captures graphs on CUDA): on the H200 at bs 8 it did
        not pay (bench/RESULTS.md run 42: the service's setting +1.0 and +2.5 %, lookup alone +1.3 and -1.5 % in two
        processes, -2.3 % in a third): a 512-token prefill's wide kernels slow the rows' small kernels beside it
        about as much as stopping them does (rounds 1.54 against 1.32 ms a step beside it), and each admission
        costs the chain of overlapped calls one more stop. True on CPU (tests) runs the same bookkeeping, the prefill done by the time it
        returns.
        prefill_ahead: cache rows beyond max_batch_size for requests prefilled ahead of a free running row. Where
        rows finish one at a time (speculative rows accept different numbers of tokens; requests want different
        lengths) each admission is otherwise a prefill pass of its own that stops the batch: a 512-token prompt
        costs about as much alone as a group of several does. With `prefill_ahead` k, the first running row
        that frees with no prefilled request to take it prefills a group of up to k + 1 waiting requests
        (at most max_batch_size) in one pass: one takes the row, the others wait prefilled, first token
        sampled, and take the next rows that free without a pass of their own. No request waits longer for
        a row than without (the first of a group waits for the group's pass); the rows cost cache memory
        (`memory_report`). 0 (the default): admit into free running rows only."""
        if min_admit < 1:
            raise ValueError(f"min_admit must be >= 1, got {min_admit}")
        if not isinstance(prefill_ahead, int) or isinstance(prefill_ahead, bool) or prefill_ahead < 0:
            raise ValueError(f"prefill_ahead must be an integer >= 0, got {prefill_ahead!r}")
        if not (isinstance(lookup_replay, bool) or lookup_replay == "alone"):
            raise ValueError(f"lookup_replay {lookup_replay!r}: need True, False or 'alone'")
        self.min_admit = min_admit
        self.model = model
        self.tokenizer = tokenizer
        self.spec = spec or SpecConfig()
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        # Speculative writes past a row's length: gamma tokens, a draft tree's width * gamma nodes, or a lookup
        # round's own gamma (up to engine.lookup.MAX_GAMMA, whatever the engine's gamma).
        self.margin = max(self.spec.num_speculative_tokens * self.spec.tree_width, LOOKUP_MAX_GAMMA) + 4
        model.args.check_context(max_seq_len)
        weight = model.embed_tokens.weight
        use_graphs = weight.device.type == "cuda" if cuda_graphs is None else bool(cuda_graphs)
        self.graphs = GraphCache(enabled=use_graphs, capture=cuda_graphs != "emulate")
        # Cache rows: one per slot, plus the scratch row padded graph batches write into.
        self.prefill_ahead = prefill_ahead
        rows = max_batch_size + prefill_ahead  # running rows, then rows prefilled ahead of a free one
        self.scratch_row = rows if use_graphs else None
        self.cache_rows = rows + (1 if use_graphs else 0)
        self.cache: KVCache = model.new_cache(self.cache_rows, max_seq_len + self.margin)
        self.device = self.cache.k[0].device
        self.dtype = weight.dtype
        self.mixed_round_graph = mixed_round_graph
        self.overlap = overlap
        self._ahead: _Ahead | None = None  # a call launched before its batch's last one was read (`overlap`)
        self._round_clock = 0.0  # when the host last read a speculative round's outcome
        self._plain_clock = 0.0  # when the host last read an overlapped plain call's tokens
        self._scatter_rows = False  # warm-up: run rows 0..b-1 as the scattered rows' graphs do
        # An overlapped batch of greedy lookup rows keeps its chain through its rows' ends: it chains while its rows
        # run (not only while each wants more than the round in flight can make), and where rows have stopped or
        # prefilled requests can join it launches the next round for the batch as it now is, regrouped, before it
        # reads the round in flight (`_regroup_round`). Without side prefills only: the round in flight may still
        # write a stopped row's cache row, which an admission's prefill must follow on the same stream. False:
        # such a batch stops its chain near a row's end and for each change, as before.
        self.regroup_chains = True
        self.regrouped = 0  # rounds launched regrouped (`_regroup_round`)
        self._streak_forced: bool | None = None  # warm-up: lookup rounds at the streak gamma (True) or not (False)
        self.ar_steps_per_sync = ar_steps_per_sync or (4 if self.device.type == "cuda" else 1)
        if prefill_graphs is None:
            prefill_graphs = prefill_graphs_default()
        self.prefill_graphs = prefill_graphs and use_graphs
        if side_prefill is None:
            side_prefill = side_prefill_default() and use_graphs and cuda_graphs != "emulate" and not INLINE_MERGE
        self.side_prefill = side_prefill
        # The stream admissions' prefills run on (`side_prefill` on CUDA), and the admissions launched there whose
        # rows have not joined the batch yet, oldest first. Beside it every step runs on a stream of higher
        # priority (`step`), so that the GPU's block scheduler starts the running rows' small kernels before the
        # prefill's wide ones wherever both wait (on the H200 the rows were still slowed about as much: run 42).
        # The side stream also captures the prefill graphs (`GraphCache.side_stream`): their cuBLAS workspace is
        # then one that nothing on another stream uses.
        self._side_stream = self._main_stream = None
        if side_prefill and self.device.type == "cuda":
            self._side_stream = torch.cuda.Stream(self.device, priority=SIDE_PRIORITY)
            self._main_stream = torch.cuda.Stream(self.device, priority=MAIN_PRIORITY)
            self.graphs.side_stream = self._side_stream
        self._admitting: list[_Admission] = []
        self.lookup_replay = lookup_replay
        self.eos = frozenset(eos_token_ids if eos_token_ids is not None else model.args.eos_token_ids)
        self.drafts: dict[str, Draft] = {}
        self.alternatives: dict[str, tuple[str, ...]] = {}  # draft name -> drafts its requests may run instead
        self.history: torch.Tensor | None = None  # with a LookupDraft: (cache rows, positions) token ids
        self.draft_cache: KVCache | None = None
        # Per cache row: the request running there, or None. At most max_batch_size run; with `prefill_ahead` the
        # other rows hold admissions (`_admitting`) waiting for a running row to free.
        self.slots: list[SlotState | None] = [None] * rows
        self.waiting: collections.deque[Request] = collections.deque()
        self.governor = governor or SpeculationGovernor(enabled=False)
        if gamma is not None and gamma.max_gamma != self.spec.num_speculative_tokens:
            raise ValueError(f"the gamma controller's max_gamma ({gamma.max_gamma}) must be the engine's "
                             f"num_speculative_tokens ({self.spec.num_speculative_tokens})")
        self.gamma = gamma or GammaController(self.spec.num_speculative_tokens, enabled=False)
        if max(self.gamma.widths) > self.spec.tree_width:
            raise ValueError(f"the gamma controller's tree widths {list(self.gamma.widths)} exceed the engine's "
                             f"tree_width ({self.spec.tree_width}; its cache margin is sized for it)")
        if self.spec.tree_width > 1 and self.gamma.widths == (1,):  # each round picks chain or tree too (engine.gamma)
            self.gamma.widths = (1, self.spec.tree_width)
        self._specs = {}  # SpecConfig per (gamma, tree width, draft_confidence) a round runs (`_spec_at`)
        # Deep-feature drafts: the target's final hidden states of the last round, per cache row.
        hidden = model.args.hidden_size
        self._deep_ready = False
        self._hidden = hidden

    # ----- drafts -------------------------------------------------------------------------
    def add_draft(self, name: str, draft: Draft) -> None:
        """Register (or replace) a draft under `name`. Running requests keep the draft they started with. A
        `engine.lookup.LookupDraft` has no weights: requests naming it run lookup rounds."""
        self._wait_ahead()  # an overlapped round in flight may run the graphs replacing a draft drops
        if is_lookup(draft):
            if self.history is None:  # each row's tokens (prompt, then output) at their positions, for lookup
                self.history = torch.zeros(self.cache_rows, self.max_seq_len + self.margin, dtype=torch.long,
                                           device=self.device)
            old = self.drafts.get(name)
            if old is not None and old is not draft:
                self.graphs.discard(id(old))
            self.drafts[name] = draft
            return
        for other_name, other in self.drafts.items():
            if is_lookup(other):
                continue
            if other_name != name and other.shared_layers != draft.shared_layers:
                raise ValueError(
                    f"draft {name!r} shares {draft.shared_layers} target layers but {other_name!r} shares "
                    f"{other.shared_layers}; drafts served together must share the same trunk depth"
                )
        if draft.shared_layers > self.model.args.num_layers:
            raise ValueError(f"draft {name!r} shares {draft.shared_layers} layers; the target has {self.model.args.num_layers}")
        bad = [c for c in getattr(draft, "feature_layers", ()) if not draft.shared_layers < c < self.model.args.num_layers]
        if bad:
            raise ValueError(f"draft {name!r} fuses the states after target layers {bad}; they must lie strictly "
                             f"between its trunk ({draft.shared_layers} layers) and the target's {self.model.args.num_layers}")
        need = draft.adapter_layers
        if self.draft_cache is None or self.draft_cache.num_layers < need:
            held = [*self.slots, *(s for a in self._admitting for s in a.states)]  # running, and prefilled to join
            if self.draft_cache is not None and any(s is not None and s.draft is not None and not is_lookup(s.draft)
                                                    for s in held):
                raise ValueError(f"draft {name!r} needs {need} adapter layers, more than the running drafts' cache holds; "
                                 "load it while no speculative request runs")
            self.draft_cache = self._new_draft_cache(need)
        if draft.feature_input == "deep" and not self._deep_ready:
            b, h, w = self.cache_rows, self._hidden, self.spec.num_speculative_tokens + 2
            self.last_feature = torch.zeros(b, h, device=self.device, dtype=self.dtype)
            self.round_trunk = torch.zeros(b, w, h, device=self.device, dtype=self.dtype)
            self.round_feat = torch.zeros(b, w, h, device=self.device, dtype=self.dtype)
            self.round_start = torch.zeros(b, dtype=torch.long, device=self.device)
            self._deep_ready = True
        old = self.drafts.get(name)
        if old is not None and old is not draft:
            self.graphs.discard(id(old))  # running rows keep the old draft: their graphs are captured again
            for mode in (name, f"{name}{SAMPLED}"):
                self.gamma.forget(mode)  # the new version's acceptance is its own
        self.drafts[name] = draft

    def set_alternatives(self, name: str, alternatives: Iterable[str]) -> None:
        """Requests naming draft `name` may run one of these loaded drafts instead, whichever the governor measures
        cheapest a token at the batch size they run in (`SpeculationGovernor.choose`; each is measured and judged
        apart, as "<name>/<alternative>", and tried now and then). Typically the n-gram lookup drafter
        (`add_draft("lookup", LookupDraft())`): on text that repeats itself it beats a trained draft, elsewhere
        it does not. Without the governor, requests run their own draft. An empty list removes them."""
        alternatives = tuple(alternatives)
        missing = [a for a in alternatives if a not in self.drafts]
        if missing:
            raise ValueError(f"alternatives {missing} of draft {name!r} are not loaded; loaded: {sorted(self.drafts)}")
        if any("/" in a for a in (name, *alternatives)):
            raise ValueError(f"draft names with alternatives cannot contain '/': {name!r}, {list(alternatives)}")
        if alternatives:
            self.alternatives[name] = alternatives
        else:
            self.alternatives.pop(name, None)

    def remove_draft(self, name: str) -> None:
        """Unload draft `name` (running requests keep it to their end) and its alternatives; requests naming it
        are refused from now on. Where it is another draft's alternative, that draft's requests no longer run it."""
        self._wait_ahead()
        self.alternatives.pop(name, None)
        old = self.drafts.pop(name, None)
        if old is not None:
            self.graphs.discard(id(old))

    def _new_draft_cache(self, layers: int) -> KVCache:
        args = self.model.args
        if self.spec.draft_kv_window:
            return WindowedKVCache(layers, self.cache_rows, args.num_kv_heads, self.spec.draft_kv_window,
                                   args.head_dim, self.margin, self.dtype, self.device)
        return KVCache(layers, self.cache_rows, args.num_kv_heads, self.max_seq_len + self.margin, args.head_dim,
                       self.dtype, self.device)

    def draft_kv_len(self, kv_len: int) -> int:
        return kv_len if not isinstance(self.draft_cache, WindowedKVCache) else self.draft_cache.max_seq_len

    def memory_report(self) -> dict:
        """Bytes held by the target cache, the draft cache and the drafts' own weights."""
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        draft_weights = {n: sum(p.numel() * p.element_size() for p in d.trainable_parameters())
                         for n, d in self.drafts.items() if hasattr(d, "trainable_parameters")}
        return {
            "target_weights": weights,
            "target_cache": self.cache.nbytes,
            "target_cache_bytes_per_token": self.cache.bytes_per_token,
            "draft_cache": self.draft_cache.nbytes if self.draft_cache is not None else 0,
            "draft_weights": draft_weights,
        }

    # ----- requests -----------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        n = len(request.prompt_ids)
        if n == 0:
            raise RequestError("the prompt is empty: give at least one token of text")
        if n >= self.max_seq_len:
            raise RequestError(f"prompt has {n} tokens; this engine's context is {self.max_seq_len} "
                               "(prompt plus at least one new token)")
        vocab = self.model.args.vocab_size
        if min(request.prompt_ids) < 0 or max(request.prompt_ids) >= vocab:
            raise RequestError(f"prompt token ids must be in [0, {vocab})")
        if request.draft is not None and request.draft not in self.drafts:
            raise RequestError(f"draft {request.draft!r} is not loaded; loaded: {sorted(self.drafts) or 'none'}")
        self.waiting.append(request)

    def cancel(self, request_id: str) -> bool:
        """Drop a waiting, admitting or running request; its cache row is free for the next step (an admitting
        request's once its prefill has run)."""
        for req in list(self.waiting):
            if req.request_id == request_id:
                self.waiting.remove(req)
                return True
        for a in self._admitting:
            if any(s.request.request_id == request_id for s in a.states) and request_id not in a.dropped:
                a.dropped.add(request_id)
                return True
        for i, s in enumerate(self.slots):
            if s is not None and s.request.request_id == request_id:
                self.slots[i] = None
                return True
        return False

    def calibrate(self, prompt_tokens: int = 32, new_tokens: int | None = None, prompt: list[int] | None = None,
                  batch_sizes: Iterable[int] | None = None, attempts: int = 3) -> dict[int, int]:
        """Seed the governor's plain-decoding cost at each batch size it will judge: `batch_sizes` (default:
        every batch-size bucket up to max_batch_size), with generations of that many copies of `prompt`
        (default: a dummy one of `prompt_tokens`), repeated (at most `attempts` times) until the governor
        holds `min_samples` clean steps there: steps that captured a graph or compiled a kernel are no
        sample, and without a plain cost at a batch size the governor cannot turn speculation off there
        (at batch 8 it once ran every request speculatively at 0.3x plain decoding that way). By default
        each generation is long enough for `min_samples` plain steps and two more that may capture.
        Where the engine runs CUDA graphs and an n-gram lookup drafter is loaded, the same for a lookup round at
        each batch size (the lookup pool's seconds a row's round, `SpeculationGovernor.observe_pool`): lookup is
        priced from it at batch sizes where no batch of lookup rows has run yet (`batch_moves`).
        Returns the governor's plain-step samples per bucket."""
        from engine.generate import generate
        from engine.sampling import SamplingParams

        if new_tokens is None:
            new_tokens = (self.governor.min_samples + 2) * self.ar_steps_per_sync + 1
        if prompt is None:
            prompt = [(i * 7919) % self.model.args.vocab_size for i in range(1, prompt_tokens + 1)]
        params = SamplingParams(max_new_tokens=new_tokens, eos_token_ids=())
        if batch_sizes is None:
            batch_sizes = sorted({self.batch_bucket(n) for n in range(1, self.max_batch_size + 1)})
        for rows in batch_sizes:
            for _ in range(attempts):
                if self.governor.plain_samples(rows) >= self.governor.min_samples:
                    break
                generate(self, [list(prompt)] * rows, params)
        lookup = next((name for name, draft in self.drafts.items() if is_lookup(draft)), None)
        if lookup is not None and self.graphs.enabled:
            enabled, self.governor.enabled = self.governor.enabled, False  # lookup rounds whether or not they pay
            try:
                for rows in batch_sizes:
                    for _ in range(attempts):
                        if self.governor.pool_samples(LOOKUP_POOL, rows) >= self.governor.min_samples:
                            break
                        generate(self, [list(prompt)] * rows, params, lookup)
            finally:
                self.governor.enabled = enabled
        return {rows: self.governor.plain_samples(rows) for rows in batch_sizes}

    def warmup(self, max_len: int = 256, prompt_len: int = 32, sampling: tuple[str, ...] | None = None) -> int:
        """Capture the CUDA graphs serving meets, before any request waits on a capture.

        For every batch-size bucket, with the rows at 0..b-1 (the rows as views) and scattered (the rows a
        graph input, padded to the bucket): plain decoding, each loaded draft, and the drafts mixed in one
        batch (a mix runs every loaded draft: one graph whichever drafts it holds), at every gamma of the
        adaptive controller, for each kind of request in `sampling`: greedy, sampled (temperature > 0),
        filtered (sampled with top-k or top-p). Where the attention backend bounds each row by its position
        (the Triton kernel on CUDA) a graph serves every sequence length: a few rounds per case capture them
        all, every graph the replica runs until a draft is replaced (`warm_draft`); `sampling` defaults to
        all three kinds (on the H200 with three drafts, batch 8, gamma 1-5: 234 graphs in 154 s, 1.2 GiB,
        and no capture in later traffic; bench/RESULTS.md, run 20). Otherwise graphs depend on the KV
        length bucket: sequences run up to `max_len` tokens (each case a whole generation), longer ones
        capture their buckets on first use, and `sampling` defaults to greedy alone (sampled requests
        capture theirs on first use). The governor and the gamma controller learn nothing from it (their
        figures come from real traffic). Returns the graphs captured; without graphs it does nothing.
        """
        names = sorted(self.drafts)
        return self._warm([[None], *([n] for n in names)] + self._mixes(), max_len, prompt_len, sampling)

    def _mixes(self) -> list[list[str]]:
        """The mixes of drafts whose rounds warm-up runs: every loaded draft together (any mix of drafts runs
        them all: one graph), and where the lookup drafter is loaded beside drafts, it first, then the drafts
        (its rows beside draft rows are a graph of their own, which even a batch of two must meet)."""
        names = sorted(self.drafts)
        trained = [n for n in names if not is_lookup(self.drafts[n])]
        looks = [n for n in names if is_lookup(self.drafts[n])]
        mixes = [trained] if len(trained) > 1 else []
        if trained and looks:
            mixes.append([looks[0], *trained])
        return mixes

    def warm_draft(self, name: str, max_len: int = 256, prompt_len: int = 32,
                   sampling: tuple[str, ...] | None = None, stop: Callable[[], bool] | None = None) -> int:
        """After `add_draft(name, ...)` (a replaced draft's graphs, the mixes' included, are dropped): capture
        the graphs of draft `name` and of mixed batches again, as `warmup` does. `stop()`, asked before each
        warm-up generation, ends it early (a request arrived: the rest are captured on first use). Returns
        the graphs captured."""
        if name not in self.drafts:
            raise KeyError(f"no draft named {name!r}")
        return self._warm([[name]] + self._mixes(), max_len, prompt_len, sampling, stop)

    def _warm(self, mixes: list[list[str | None]], max_len: int, prompt_len: int, sampling: tuple[str, ...] | None,
              stop: Callable[[], bool] | None = None) -> int:
        """Generate over every (sampling kind, batch bucket, row layout, mix, gamma): `warmup`."""
        from engine.generate import generate
        from engine.sampling import SamplingParams

        kinds = {"greedy": {}, "sampled": {"temperature": 1.0}, "filtered": {"temperature": 1.0, "top_p": 0.9}}
        if sampling is None:
            sampling = tuple(kinds) if self.length_free_graphs else ("greedy",)
        unknown = sorted(set(sampling) - set(kinds))
        if unknown:
            raise ValueError(f"unknown warm-up sampling {unknown}; choose from {', '.join(kinds)}")
        if not self.graphs.enabled:
            return 0
        if self.has_work():
            raise RuntimeError("warm-up runs on an idle engine (before it takes requests)")
        before = self.graphs.captures
        if self.length_free_graphs:  # a few rounds per case capture everything
            max_len = prompt_len + 3 * (self.spec.num_speculative_tokens + 1) + 2 * self.ar_steps_per_sync
        prompt_len = max(1, min(prompt_len, max_len - 1, self.max_seq_len - 2))
        new_tokens = max(1, min(max_len, self.max_seq_len - 1) - prompt_len)
        vocab = self.model.args.vocab_size
        buckets = sorted({self.batch_bucket(n) for n in range(1, self.max_batch_size + 1)})
        if self.gamma.enabled:
            arms = self.gamma.arms(trees=True)
        else:  # every round runs self.spec; its sampled trees need unseeded requests (below)
            arms = [(None, 1)] + ([(None, self.spec.tree_width)] if self.spec.tree_width > 1 else [])
        governor, self.governor = self.governor, SpeculationGovernor(enabled=False)
        try:
            for kind in sampling:
                params = SamplingParams(max_new_tokens=new_tokens, eos_token_ids=(), seed=0, **kinds[kind])
                for b in buckets:
                    prompts = [[(7 + 31 * i + 17 * j) % vocab for j in range(prompt_len)] for i in range(b)]
                    for scattered in (False, True):
                        self._scatter_rows = scattered
                        for mix in mixes:
                            if len(mix) > 1 and b < 2:
                                continue  # one row holds one draft
                            cases = [(gamma, width, None) for gamma, width in (arms if mix != [None] else [(None, 1)])]
                            if kind == "greedy" and self._streaks_at(mix, b):
                                # Lookup rounds at the streak gamma too, and at the plain one all the way: warm-up's
                                # periodic prompts would run streaks only once matched, and where graphs depend on the
                                # KV length a lone row's plain-gamma rounds then meet later buckets only in traffic.
                                cases += [(None, 1, True), (None, 1, False)]
                            for gamma, width, streak in cases:
                                if width > 1 and (len(mix) > 1 or b > self.spec.tree_max_batch
                                                  or (gamma is None and kind == "greedy")):
                                    continue  # such rounds never take a tree (or took it already)
                                if stop is not None and stop():
                                    return self.graphs.captures - before  # (the finally clause still runs)
                                self.gamma.forced, self.gamma.forced_width = gamma, width
                                self._streak_forced = streak
                                # Seeded sampled rows keep the chain (engine.tree): tree graphs need unseeded ones.
                                run = params if width == 1 or kind == "greedy" else dataclasses.replace(params, seed=None)
                                generate(self, prompts, run, draft=[mix[i % len(mix)] for i in range(b)])
            if self.prefill_graphs:
                self._warm_prefill(mixes, buckets, stop)
        finally:
            self.governor = governor
            self.gamma.forced, self.gamma.forced_width = None, 1
            self._scatter_rows = False
            self._streak_forced = None
            self.waiting.clear()  # after a failure: no warm-up request stays behind (the engine was empty)
            self.slots = [None] * len(self.slots)
            self._wait_ahead()
            self._ahead = None  # nor an overlapped call of one
            for a in self._admitting:  # nor an admission whose prefill was launched
                if a.ready is not None:
                    a.ready.synchronize()
            self._admitting = []
        return self.graphs.captures - before

    def _streaks_at(self, mix: list[str | None], rows: int) -> bool:
        """Whether a batch of `rows` rows of this mix (row i holds mix[i % len(mix)]) has lookup rows whose rounds
        (at their own count's bucket, `_lookup_round`) have a streak gamma of their own."""
        held = [self.drafts[mix[i % len(mix)]] for i in range(rows) if mix[i % len(mix)] is not None]
        looks = [d for d in held if is_lookup(d)]
        n = len(looks)
        return bool(looks) and self.lookup_gamma(looks[0], n, streak=True) != self.lookup_gamma(looks[0], n)

    def _warm_prefill(self, mixes: list[list[str | None]], buckets: list[int], stop: Callable[[], bool] | None) -> None:
        """With prefill graphs: capture the prefill pass of every padded prompt length (16, 32, ... the cache) for
        every batch bucket, rows 0..b-1 and scattered, plain and for the drafts of each mix (their trunk split
        and captured layers), so no admission captures one in traffic. Zero prompts into rows of an idle engine:
        what they write is overwritten before anything reads it. On the side stream, as admissions run them."""
        with self._side():
            self._warm_prefill_graphs(mixes, buckets, stop)
        if self._side_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._side_stream)

    def _warm_prefill_graphs(self, mixes, buckets, stop) -> None:
        variants = {(0, (), False)}
        for mix in mixes:
            drafts = [self.drafts[name] for name in mix if name is not None and not is_lookup(self.drafts[name])]
            if drafts:
                variants.add((drafts[0].shared_layers, feature_layers_of(drafts), True))
        lengths = []  # what _prefill_target pads a prompt of up to max_seq_len tokens to
        while not lengths or lengths[-1] < min(self.max_seq_len, self.cache.max_seq_len):
            lengths.append(min(16 << len(lengths), self.cache.max_seq_len))
        self._scatter_rows = False
        for b in buckets:
            for scattered in (False, True):  # rows as views (0..b-1), or a graph input (`run_graph`)
                rows = torch.arange(b, device=self.device) if scattered else slice(0, b)
                for t in lengths:
                    tokens = torch.zeros(b, t, dtype=torch.long, device=self.device)
                    last = torch.full((b,), t - 1, device=self.device)
                    for n_trunk, capture, drafts in sorted(variants):
                        if stop is not None and stop():
                            return
                        self._prefill_target(tokens, rows, last, n_trunk, capture, drafts)

    @property
    def num_running(self) -> int:
        return sum(s is not None for s in self.slots)

    @property
    def num_admitting(self) -> int:
        """Requests whose prefill has been launched and that have not joined the batch yet (beside it with
        `side_prefill`, or prefilled ahead of a free row with `prefill_ahead`), their rows reserved."""
        return sum(len(a.states) - len(a.dropped) for a in self._admitting)

    def request_ids(self) -> list[str]:
        """Every request the engine holds: running, admitting, waiting."""
        ids = [s.request.request_id for s in self.slots if s is not None]
        ids += [s.request.request_id for a in self._admitting for s in a.states
                if s.request.request_id not in a.dropped]
        return ids + [r.request_id for r in self.waiting]

    def has_work(self) -> bool:
        return bool(self.waiting) or self.num_running > 0 or self._ahead is not None or bool(self._admitting)

    # ----- the step -----------------------------------------------------------------------
    @torch.no_grad()  # decoding never needs autograd, whatever the weights' requires_grad (a draft in training)
    def step(self) -> list[RequestOutput]:
        """Admit, join and advance every running row once (`_step`). With a side stream (`side_prefill` on CUDA)
        on the engine's own stream of higher priority, behind whatever the caller's stream holds, and the
        caller's stream behind it afterwards: to work outside the steps the engine keeps one stream's order."""
        if self._main_stream is None:
            return self._step()
        caller = torch.cuda.current_stream(self.device)
        self._main_stream.wait_stream(caller)
        try:
            with torch.cuda.stream(self._main_stream):
                return self._step()
        finally:
            caller.wait_stream(self._main_stream)

    def _step(self) -> list[RequestOutput]:
        if self._ahead is not None:
            return self._resolve_ahead()
        outputs: list[RequestOutput] = []
        admitted = self._admit()
        outputs.extend(admitted)
        self._batch_to_lookup()
        running = [s for s in self.slots if s is not None and s.request.request_id not in
                   {o.request_id for o in admitted if o.finished}]
        ar_rows = [s for s in running if s.draft is None]
        spec_rows = [s for s in running if s.draft is not None]
        # Cost samples for the governor. Speculative tokens are charged the whole step less what its plain
        # tokens cost at plain decoding's rate (plain rows wait for the round of the same step, so a round
        # cheap for its own rows can still slow the batch down), and at least the round itself: a plain
        # batch with one speculating row does not pass for cheap speculation. A step that captured a
        # CUDA graph or compiled a kernel is not a sample, nor a plain step cut short by a row's limits
        # (its graph ran every step, its rows kept fewer tokens).
        t0, cold, ar_tokens, full = time.perf_counter(), self._cold_events(), 0, True
        if ar_rows:
            new, full = self._ar_step(ar_rows)
            ar_tokens = sum(len(t) for t in new)
        t1 = time.perf_counter()
        if spec_rows:
            result = self._spec_round(spec_rows, t1)
        if running and self._cold_events() == cold:
            now = time.perf_counter()
            if spec_rows:
                self._observe_round(spec_rows, result, len(running),
                                    self.governor.spec_step_seconds(len(running), now - t0, now - t1, ar_tokens))
            elif full:
                self.governor.observe_ar(len(running), now - t0, ar_tokens)
        if ar_rows:
            for s, toks in zip(ar_rows, new):
                s.length += len(toks)
                outputs.append(self._commit(s, toks))
                self._plain_committed(s)
        if spec_rows:
            outputs += self._commit_round(spec_rows, result, len(running))
        return outputs

    def _commit_round(self, spec_rows: list[SlotState], result, running: int) -> list[RequestOutput]:
        """A round's tokens and statistics for its rows still running; the governor may turn a row's speculation
        off from the next step on. Rows of a batch of lookup rows that pays as a batch (`_lookup_batch_pays`) are not
        judged one by one: a round's seconds are the batch's, and a row dropped from it would split it."""
        outputs = []
        batch_pays: list[bool] = []  # `_lookup_batch_pays`, asked at most once a round and only for a row it judges

        def in_paying_lookup_batch(s: SlotState) -> bool:
            if running < 2 or not is_lookup(s.draft):
                return False
            if not batch_pays:
                batch_pays.append(self._lookup_batch_pays())
            return batch_pays[0]

        for i, s in enumerate(spec_rows):
            if self.slots[s.slot] is not s:
                continue  # stopped or cancelled while an overlapped round ran: its tokens are past its end
            s.stats.record(result.drafted[i], result.num_accepted[i], result.verify_passes[i], s.draft_name)
            s.lookup_streak = is_lookup(s.draft) and result.num_accepted[i] == result.drafted[i] > 0
            if is_lookup(s.draft) and s.shadow is None and not s.history_refills and self._governor_decides(s.request):
                # A lookup row's tokens a round, whatever shared its round (replays report them where they run).
                self.governor.observe_tokens(governed(s.request, s.draft_name), None, [result.num_accepted[i] + 1])
            s.length += result.num_accepted[i] + 1
            outputs.append(self._commit(s, result.tokens[i]))
            if (s.draft is not None and self.slots[s.slot] is s
                    and s.stats.rounds - s.switched_at >= self.governor.min_samples
                    and self._governor_decides(s.request) and not in_paying_lookup_batch(s)
                    and not self.governor.keep_speculating(governed(s.request, s.draft_name), running, s.stats.recent)):
                if not self._switch_to_alternative(s, running):
                    s.draft = None  # speculation does not pay here: plain decoding from the next step on
                    self._watch_lookup(s)
            elif (running == 1 and s.shadow is not None and s.draft is not None and s.draft_name == s.request.draft
                  and self.slots[s.slot] is s and s.stats.rounds - s.switched_at >= self.governor.min_samples
                  and self.governor.prefers_alternative(governed(s.request, s.draft_name), s.shadow_name,
                                                        s.stats.recent, s.shadow.recent)):
                self._switch_to_alternative(s, running)  # lookup fits this request's text better than its draft
        return outputs

    def _switch_to_alternative(self, s: SlotState, running: int) -> bool:
        """A greedy row whose own draft stops paying goes on with its draft's n-gram lookup alternative
        (`set_alternatives`) instead of plain decoding, if the governor does not know that one not to pay at this
        batch size: lookup needs no state of its own but the row's tokens, which the host has. At a batch of 8
        this is how the batch gets to all-lookup rounds, the only kind that paid there on the H200 (run 32),
        which rows tried one at a time beside plain rows never show. Sampled rows drop to plain decoding (a
        sampled batch of both kinds runs two rounds a step), as does a row already on an alternative."""
        req = s.request
        if not req.params.greedy or s.draft_name != req.draft:
            return False
        for name, draft in self._candidates(req)[1:]:
            if is_lookup(draft) and self.governor.may_pay(governed(req, name), running):
                self._move_to_lookup(s, name, draft)
                return True
        return False

    def _move_to_lookup(self, s: SlotState, name: str, draft) -> None:
        """A row goes on with a lookup drafter (from its draft, or from plain decoding), judged under `name`."""
        s.draft, s.draft_name, s.switched_at = draft, name, s.stats.rounds
        s.lookup_streak = False  # its first lookup round proposes the bucket's gamma
        s.stats.recent.clear()  # the per-request rule judges lookup by its own rounds
        s.comeback = s.comeback_to = None  # on lookup now: nothing to watch for (`_watch_lookup`)
        # Now, and once more at its next commit (`_commit`) if a call was already launched for it (overlap): that one
        # ran its draft or plain steps and writes no history; what lookup proposes from a stale tail only costs
        # acceptance, never tokens.
        s.history_refills = 1 + (self._ahead is not None and any(r is s for r in self._ahead.batch))
        self._refill_history(s)
        self.governor.note_switch()

    def _refill_history(self, s: SlotState) -> None:
        """Write a row's lookup history (prompt, then output: every token up to its pending one) from the host."""
        ids = list(s.request.prompt_ids) + s.output_ids
        self.history[s.slot, : len(ids)] = to_device(ids, self.device, self.history.dtype)
        s.history_refills -= 1

    def _watch_lookup(self, s: SlotState) -> None:
        """A greedy request decoding plainly whose request names an n-gram lookup drafter, or whose draft has one as
        its alternative, and that the governor judges: replay lookup's rounds over its tokens from here on
        (`LookupShadow`, at its gamma alone), so that running alone it may go (back) on lookup once its text
        repeats itself (`_plain_committed`)."""
        req = s.request
        if not (req.params.greedy and self.governor.enabled and self._governor_decides(req)):
            return
        for name, draft in self._candidates(req) if req.draft in self.drafts else ():
            if is_lookup(draft):
                s.comeback_to = (name, draft)
                if s.shadow is not None:  # `lookup_replay` replays this drafter over its tokens already
                    s.comeback = s.shadow
                    return
                ids = list(req.prompt_ids) + s.output_ids
                s.comeback = self._replay(draft, ids[:-1] if s.output_ids else ids)
                if s.output_ids:
                    s.comeback.extend(ids[-1:])  # the pending token: the next round's history ends with it
                return

    def _plain_committed(self, s: SlotState) -> None:
        """After a plain call's tokens were committed for a row still running alone and watched (`_watch_lookup`):
        the move (back) to lookup where the governor prices lookup's replayed rounds below plain decoding
        (`SpeculationGovernor.returns_to`)."""
        if (s.comeback is not None and s.draft is None and self.slots[s.slot] is s and self.num_running == 1
                and self.governor.returns_to(LOOKUP_POOL, s.comeback.recent)):
            self._move_to_lookup(s, *s.comeback_to)

    def _observe_round(self, spec_rows: list[SlotState], result, running: int, seconds: float | None) -> None:
        """The governor's sample of a round: `seconds` charged to its speculative tokens (None: no sample). A round
        of lookup rows beside draft rows is a sample of the drafts alone, charged what is left after the lookup
        tokens' cost at lookup's own rate (`SpeculationGovernor.draft_step_seconds`): lookup is measured only
        where no draft row shares its rounds."""
        rows = range(len(spec_rows))
        lookup = [is_lookup(s.draft) for s in spec_rows]
        if seconds is not None and any(lookup) and not all(lookup):
            seconds = self.governor.draft_step_seconds(
                running, seconds, [(governed(s.request, s.draft_name), len(tokens))
                                   for s, tokens, looks in zip(spec_rows, result.tokens, lookup) if looks])
            rows = [i for i, looks in enumerate(lookup) if not looks]
        if seconds is None:
            return
        if all(lookup) and len(spec_rows) == running:
            # A row's round of lookup from rounds where every running row is a lookup row: beside plain rows the round
            # is one more pass for the whole batch, and charged to a few rows it would price lookup far above what a
            # batch of lookup rows pays (run 34 at bs 8: 0.79 ms a row's round against 0.14 in a batch of them).
            self.governor.observe_pool(LOOKUP_POOL, running, seconds, len(spec_rows))
        tokens = sum(len(result.tokens[i]) for i in rows)
        for name in {governed(spec_rows[i].request, spec_rows[i].draft_name) for i in rows}:
            self.governor.observe_spec(name, running, seconds, tokens)

    def _round_spec(self, spec_rows: list[SlotState]) -> tuple[SpecConfig, tuple | None]:
        """This round's SpecConfig: gamma (and, where the batch may take a draft tree, its width: chain or tree) at
        the gamma controller's choice when it is on (`engine.gamma`), with what to report back to it, (key, draft
        names, width); else the engine's. A round holding a seeded sampled request drafts what it always drafts
        (`repeats_its_seed`): the full gamma, the chain, no `draft_confidence` stop (a batch's stop, which would
        make its tokens depend on the other rows)."""
        seeded = self.pins_seeded and any(repeats_its_seed(s.request) for s in spec_rows)
        if not self.gamma.enabled:
            return (self._spec_at(self.spec.num_speculative_tokens, 1, pinned=True) if seeded else self.spec), None
        names = [governed(s.request, s.draft_name) for s in spec_rows]
        drafts = [s.draft for s in spec_rows]
        greedy = all(s.request.params.greedy for s in spec_rows)
        # A one-graph mixed round runs every loaded draft (`graph_drafts`): priced as such.
        ran = graph_drafts(self, drafts) if self.graphs.enabled and self.mixed_round_graph else {id(d) for d in drafts}
        key = (batch_bucket(len(spec_rows)), len(ran), greedy)  # what a round's cost depends on
        if seeded:
            gamma, width = self.spec.num_speculative_tokens, 1
        else:
            gamma, width = self.gamma.choose_arm(names, key, tree_round(self, spec_rows, drafts, self.spec, greedy))
        return self._spec_at(gamma, width, pinned=seeded), (key, names, width)

    def _spec_at(self, gamma: int, width: int, pinned: bool = False) -> SpecConfig:
        """The engine's SpecConfig at this gamma and tree width (pinned: without the `draft_confidence` stop), made
        once."""
        confidence = 0.0 if pinned else self.spec.draft_confidence
        spec = self._specs.get((gamma, width, confidence))
        if spec is None:
            spec = self._specs[(gamma, width, confidence)] = dataclasses.replace(
                self.spec, num_speculative_tokens=gamma, tree_width=width, draft_confidence=confidence)
        return spec

    def _governor_decides(self, request: Request) -> bool:
        """Whether the governor may switch this request's speculation: not a seeded sampled request's while seeds
        are pinned (a plain step and a round draw differently: the same seed would give other tokens)."""
        return not (self.pins_seeded and repeats_its_seed(request))

    @property
    def pins_seeded(self) -> bool:
        """Whether seeded sampled requests repeat their tokens whatever their batch and the load
        (`repeats_its_seed`; `GammaController(pin_seeded=False)` lifts it, for benchmarks whose seeds only fix
        their draws)."""
        return self.gamma.pin_seeded

    def _report_round(self, report: tuple | None, gamma: int, seconds: float | None, result) -> None:
        if report is not None:
            key, names, width = report
            self.gamma.observe(key, gamma, seconds, list(zip(names, result.num_accepted, result.drafted)), width)

    def _spec_round(self, spec_rows: list[SlotState], t0: float):
        """One round for the speculating rows: a draft's round, a lookup round (rows holding a LookupDraft), or
        for a batch of both kinds one captured round where greedy with graphs (the lookup rows' proposals in
        place of drafted tokens, one verify pass: `launch_round`), else the two, one after the other, their
        results in the rows' order."""
        lookup = [s for s in spec_rows if is_lookup(s.draft)]
        if not lookup:
            return self._draft_round(spec_rows, t0)
        if len(lookup) == len(spec_rows):
            return self._lookup_round(spec_rows)
        greedy = all(s.request.params.greedy for s in spec_rows)
        if captured_path(self, [s.draft for s in spec_rows], self.spec, spec_rows, greedy):
            return self._draft_round(spec_rows, t0)
        drafting = [s for s in spec_rows if not is_lookup(s.draft)]
        parts = {id(s): (r, i) for rows, r in ((drafting, self._draft_round(drafting, t0)),
                                               (lookup, self._lookup_round(lookup)))
                 for i, s in enumerate(rows)}
        picked = [parts[id(s)] for s in spec_rows]
        return RoundResult([r.tokens[i] for r, i in picked], [r.num_accepted[i] for r, i in picked],
                           [r.drafted[i] for r, i in picked], [r.verify_passes[i] for r, i in picked])

    def lookup_gamma(self, draft, rows: int, greedy: bool = True, streak: bool = False) -> int:
        """The tokens a round of `rows` rows of lookup drafter `draft` proposes: greedy, the drafter's gamma at the
        batch's bucket (`LookupDraft.gammas`; `streak`, after a round that accepted every token it proposed:
        `LookupDraft.streak_gammas`; at most `engine.lookup.MAX_GAMMA`, which the cache margin holds); sampled, the
        engine's gamma."""
        gamma = self.spec.num_speculative_tokens
        return draft.gamma_at(self.batch_bucket(rows), gamma, streak) if greedy else gamma

    def _next_lookup_gamma(self, rows: list[SlotState], greedy: bool) -> int:
        """The gamma of the rows' next lookup round: the streak gamma where every row's last committed round accepted
        every token it proposed (`SlotState.lookup_streak`). A round launched before the one in flight is read
        (overlap) goes by the round before that one."""
        streak = all(s.lookup_streak for s in rows) if self._streak_forced is None else self._streak_forced
        return self.lookup_gamma(rows[0].draft, len(rows), greedy, streak)

    def _next_lookup_round(self, rows: list[SlotState], greedy: bool) -> tuple[int, int | None]:
        """(gamma, allotted) of the rows' next lookup round: `_next_lookup_gamma`, or for a greedy batch (bucket 2
        and up) of a drafter with `LookupDraft.allot`, each row's own gamma up to ALLOT_MAX_GAMMA within the verify
        tokens of that gamma's round (`launch_lookup_round(..., allotted=...)`)."""
        gamma = self._next_lookup_gamma(rows, greedy)
        if greedy and getattr(rows[0].draft, "allot", False) and self.batch_bucket(len(rows)) > 1:
            return max(gamma, ALLOT_MAX_GAMMA), gamma
        return gamma, None

    def _lookup_round(self, rows: list[SlotState]):
        """A lookup round for rows holding a LookupDraft (`engine.lookup.launch_lookup_round`) at `lookup_gamma`
        (or allotted: `_next_lookup_round`); with `overlap`, the batch's next one is launched from its outcome on
        the device first."""
        greedy = all(s.request.params.greedy for s in rows)
        gamma, allotted = self._next_lookup_round(rows, greedy)
        packed, pos0 = launch_lookup_round(self, rows, gamma, max(s.length for s in rows) + gamma + 2, greedy,
                                           allotted=allotted)
        host, ready = _fetch(packed)
        if self._may_overlap_round(rows, gamma):
            self._ahead = self._launch_next_round(rows, packed, pos0, gamma, greedy)
        result = round_result(_read(host, ready), gamma) if allotted is None else allotted_result(_read(host, ready))
        self._round_clock = time.perf_counter()
        return result

    def _draft_round(self, spec_rows: list[SlotState], t0: float):
        """A round of the drafts' (at the gamma controller's choice when it is on). With `overlap` and the
        captured one-graph round, the batch's next round is launched from this one's outcome on the device
        before the host reads this one (`_launch_next_round`)."""
        spec, report = self._round_spec(spec_rows)
        cold = self._cold_events()
        drafts = [s.draft for s in spec_rows]
        gamma = spec.num_speculative_tokens
        greedy = all(s.request.params.greedy for s in spec_rows)
        if self._may_overlap_round(spec_rows, gamma) and captured_path(self, drafts, spec, spec_rows, greedy):
            packed, pos0 = launch_round(self, spec_rows, drafts, gamma, max(s.length for s in spec_rows) + gamma + 2,
                                        greedy, cfg=spec)
            host, ready = _fetch(packed)
            self._ahead = self._launch_next_round(spec_rows, packed, pos0, gamma, greedy)
            result = round_result(_read(host, ready), gamma)
        else:
            result = spec_round(self, spec_rows, drafts, spec)
        self._round_clock = time.perf_counter()
        self._report_round(report, gamma, self._round_clock - t0 if self._cold_events() == cold else None, result)
        return result

    def _may_overlap_round(self, batch: list[SlotState], gamma: int) -> bool:
        """Whether the batch's next round may be launched before the host reads the one in flight, which drafts
        `gamma` (`_may_chain`): every row speculates and wants both rounds' tokens in full. A batch of lookup rows
        chains while every row wants more than the round in flight can make: lookup keeps no state of its own, so
        where the next round makes more than a row wants, its commit keeps what the row wants (as any round's
        near a row's end) and nothing else is lost. A batch whose rows end at different times otherwise stops
        chaining whenever any row is within two rounds of its end (`bench.lookup_policy --batch 8` counts both
        rules' stops). A greedy batch that regroups (`regroup_chains`) chains while every row wants a token: the
        round in flight may end a row, whose share of the next round is then dropped at its commit."""
        if batch and all(is_lookup(s.draft) for s in batch):
            greedy = all(s.request.params.greedy for s in batch)
            following = self._next_lookup_round(batch, greedy)[0]
            wanted = 1 if self._regroups(batch) else gamma + 2
            return self._may_chain(batch, gamma + 1 + following + 1, speculating=True, wanted=wanted)
        return self._may_chain(batch, 2 * (self.spec.num_speculative_tokens + 1), speculating=True)

    def _may_chain(self, batch: list[SlotState], span: int, speculating: bool, wanted: int | None = None) -> bool:
        """Whether to launch the batch's next call before reading the one in flight: overlap is on, the batch is
        every running row, all speculating or all plain as `speculating` says (no request waits for a free row,
        no admission's rows wait to join a free row: `_admit_beside` launches their prefill beside the chain; rows
        prefilled ahead wait while every running row is taken), and every row still wants the `span` tokens of
        both calls (`wanted`, where given: that many) and has the context for them, so the next call is exactly
        what the next step would have run (only a stop token or string met meanwhile can make its work for a row
        unwanted)."""
        if not (self.overlap and self.graphs.enabled) or self.num_running != len(batch):
            return False
        room = self.max_batch_size - self.num_running  # running rows free
        if self.waiting and room > self.num_admitting:
            return False  # admitted at the next step (with `side_prefill`, `_admit_beside` took what it could)
        if self._admitting and room > 0 and self._admitting[0].done():
            return False  # rows whose prefill has run join at the next step (the rest wait: `prefill_ahead`)
        # Last (it asks the governor): a batch about to move to lookup runs its next step unchained (`_batch_to_lookup`).
        return all((s.draft is not None) == speculating and self.slots[s.slot] is s
                   and s.request.params.max_new_tokens - len(s.output_ids) >= (span if wanted is None else wanted)
                   and s.length + span <= self.max_seq_len - 1 for s in batch) and not self._lookup_moves()

    def _launch_next_round(self, batch: list[SlotState], packed: torch.Tensor, pos0: torch.Tensor, gamma: int,
                           greedy: bool) -> "_Ahead | None":
        """Launch the batch's next captured round from the outcome (packed, on the device) of the one in flight,
        which drafted `gamma` from positions pos0 (b,) at the committed lengths; None if this round would not be
        one graph (the gamma controller's pick). A batch of lookup rows chains its next lookup round."""
        if all(is_lookup(s.draft) for s in batch):
            return self._chain_lookup_round(batch, packed[:, 1], pos0 + packed[:, 0] + 1, gamma, greedy)
        spec, report = self._round_spec(batch)
        drafts = [s.draft for s in batch]
        if not captured_path(self, drafts, spec, batch, greedy):
            return None
        g = spec.num_speculative_tokens
        kv_len = max(s.length for s in batch) + gamma + 1 + g + 2  # the longest row accepting everything in flight
        nxt, npos = launch_round(self, batch, drafts, g, kv_len, greedy, pending=packed[:, 1],
                                 pos0=pos0 + packed[:, 0] + 1, cfg=spec)
        return _Ahead(batch, nxt, *_fetch(nxt), npos, None, g, kind="round", report=report, greedy=greedy)

    def _chain_lookup_round(self, rows: list[SlotState], pending: torch.Tensor, pos0: torch.Tensor, gamma: int,
                            greedy: bool) -> "_Ahead":
        """Launch the next lookup round of `rows` from their pending tokens and positions on the device, while a round
        that drafted `gamma` is still in flight (`_launch_next_round`, `_regroup_round`)."""
        g, allotted = self._next_lookup_round(rows, greedy)
        kv_len = max(s.length for s in rows) + gamma + 1 + g + 2  # the longest row accepting everything in flight
        nxt, npos = launch_lookup_round(self, rows, g, kv_len, greedy, pending=pending, pos0=pos0, allotted=allotted)
        return _Ahead(rows, nxt, *_fetch(nxt), npos, None, g, kind="round", report=None, greedy=greedy,
                      allotted=allotted)

    def _cold_events(self) -> int:
        """Graph captures plus kernel compiles so far: a step that changed it was not a steady-state step."""
        return self.graphs.captures + compile_events()

    def _free_rows(self) -> list[int]:
        """Cache rows neither running nor reserved by an admission (`_admitting`)."""
        reserved = {s.slot for a in self._admitting for s in a.states}
        return [i for i, s in enumerate(self.slots) if s is None and i not in reserved]

    def _admit(self) -> list[RequestOutput]:
        """Admissions whose prefill has run join the batch (their first tokens); then waiting requests take the
        free rows, their prefill launched (one pass for the group). With `side_prefill` it runs on the side
        stream and the group joins at the first step after it has run, unless no row runs meanwhile: then the
        step waits for it. Returns the joined requests' first tokens."""
        outputs = self._join(wait=False)
        self._launch_admissions()
        if self._admitting and (not self.side_prefill or self.num_running == 0):
            outputs += self._join(wait=True)  # nothing else to run (or no side stream): wait for the prefill
        return outputs

    def _admit_beside(self) -> None:
        """While a batch's calls run chained (`overlap`): launch waiting requests' prefills on the side stream into
        the free rows, so they run beside the batch's next calls (`side_prefill`)."""
        if self.side_prefill and self.waiting:
            self._launch_admissions()

    def _join(self, wait: bool) -> list[RequestOutput]:
        """The admissions whose prefill has run (all of them, waiting for each, with `wait`), oldest first: their
        rows join the batch with their first token committed, while fewer than max_batch_size rows run (the rest
        wait prefilled: `prefill_ahead`). A request cancelled meanwhile leaves its row free."""
        outputs = []
        running = self.num_running
        while self._admitting and (wait or self._admitting[0].done()):
            a = self._admitting[0]
            if running >= self.max_batch_size and not (a.dropped and a.done()):
                break  # every running row is taken; a cancelled request's row is freed once its prefill has run
            first = a.first_tokens()
            if a.ready is not None:  # the batch's later calls read the rows' cache and history behind the prefill
                torch.cuda.current_stream(self.device).wait_event(a.ready)
            left = []
            for s, tok, n in zip(a.states, first, a.lengths):
                if s.request.request_id in a.dropped:
                    continue
                if left or running >= self.max_batch_size:
                    left.append((s, tok, n))
                    continue
                s.length = n
                self.slots[s.slot] = s
                outputs.append(self._commit(s, [tok]))
                running += self.slots[s.slot] is s  # (its first token may have finished it)
            a.states, a.first, a.lengths = [x[0] for x in left], [x[1] for x in left], [x[2] for x in left]
            a.dropped = set()
            if left:
                break
            self._admitting.pop(0)
        return outputs

    def _launch_admissions(self) -> None:
        """Waiting requests into the free rows (at least `min_admit` of them while rows run, unless every waiting
        request fits), their prefill launched (`_launch_prefill`) and the group added to `_admitting`. Only
        when a running row is free that no admission will take; with `prefill_ahead` the group then fills the
        rows ahead too (at most max_batch_size requests a pass)."""
        free = self._free_rows()
        running = self.num_running + self.num_admitting
        room = self.max_batch_size - running  # running rows no admission will take
        if not self.waiting or room <= 0:
            return
        if running and room < min(self.min_admit, len(self.waiting)):
            return  # wait until a larger group of rows is free (min_admit)
        free = free[: min(len(self.waiting), self.max_batch_size)]
        batch: list[SlotState] = []
        rows = min(self.max_batch_size, running + len(free))  # the batch size these requests will run in
        while free and self.waiting:
            req = self.waiting.popleft()
            slot = free.pop(0)
            draft, name = self._pick_draft(req, rows)
            eos = frozenset(req.params.eos_token_ids) if req.params.eos_token_ids is not None else self.eos
            stream = TextStream(self.tokenizer, req.params.stop) if self.tokenizer is not None else None
            state = SlotState(req, slot, RandomStream(req.params.seed), stream, eos, draft=draft, draft_name=name)
            self._shadow(state, rows)
            if draft is None:
                self._watch_lookup(state)
            batch.append(state)
        if batch:
            self._admitting.append(self._launch_prefill(batch))

    def _batch_to_lookup(self) -> None:
        """Move every row of a batch to its n-gram lookup alternative together where the governor prices lookup
        below plain decoding and each row's draft at this batch size (`SpeculationGovernor.batch_moves`): only when every
        running row is on lookup already or can move (greedy, judged by the governor, its draft has a lookup
        alternative). A round is shared: plain rows beside lookup rows cost the batch a plain step and a round
        each step, and rows judged one by one never reach the batch of lookup rows that pays (run 34, bs 8). A row
        needs nothing but its tokens to run lookup, so plain rows move too (a plain row cannot go back to a draft)."""
        for s, name, draft in self._lookup_moves():
            self._move_to_lookup(s, name, draft)

    def _lookup_batch_pays(self) -> bool:
        """Whether every running row is a lookup row and such a batch is priced below plain decoding
        (`SpeculationGovernor.batch_moves` with no row to move)."""
        rows = [s for s in self.slots if s is not None]
        if not rows or not all(is_lookup(s.draft) for s in rows):
            return False
        return self.governor.batch_moves(LOOKUP_POOL, [governed(s.request, s.draft_name) for s in rows], [])

    def _lookup_moves(self) -> list[tuple[SlotState, str, object]]:
        """(row, the name it would be judged under, the lookup drafter) for each running row not on lookup, where the
        batch moves to lookup (`_batch_to_lookup`); [] where it does not."""
        rows = [s for s in self.slots if s is not None]
        if not self.governor.enabled or len(rows) < 2 or all(is_lookup(s.draft) for s in rows):
            return []  # without the governor every request runs its own draft
        moves, names = [], []
        for s in rows:
            if is_lookup(s.draft):
                names.append(governed(s.request, s.draft_name))
                continue
            req = s.request
            if not (req.params.greedy and self._governor_decides(req) and req.draft in self.drafts):
                return []
            alt = next(((name, d) for name, d in self._candidates(req)[1:] if is_lookup(d)), None)
            if alt is None:
                return []
            moves.append((s, governed(req, alt[0]), alt[1], governed(req, s.draft_name) if s.draft is not None else None))
            names.append(moves[-1][1])
        if not self.governor.batch_moves(LOOKUP_POOL, names, [now for *_, now in moves]):
            return []
        return [(s, name, draft) for s, name, draft, _ in moves]

    def _pick_draft(self, req: Request, rows: int) -> tuple[Draft | None, str | None]:
        """(the drafter a new request runs, the name it is judged under), or (None, None) for plain decoding: its
        own draft, or one of the draft's alternatives (`set_alternatives`), as the governor chooses for a batch
        of about `rows` (`SpeculationGovernor.choose`: the cheapest a token of those that pay). A seeded sampled
        request keeps its own draft (its tokens must not depend on the load)."""
        if req.draft is None or req.draft not in self.drafts:
            return None, None
        if not self._governor_decides(req):
            return self.drafts[req.draft], req.draft
        candidates = self._candidates(req)
        pick = self.governor.choose([governed(req, name) for name, _ in candidates], rows)
        if pick is None:
            return None, None  # speculation does not pay for this draft right now: plain decoding
        name, draft = candidates[pick]
        return draft, name

    def _shadow(self, s: SlotState, rows: int) -> None:
        """Replay lookup over a greedy request's tokens (`LookupShadow`) where its draft has a lookup alternative
        and the governor judges it, and `lookup_replay` asks for it at this admission's batch size (`rows`; "alone":
        only a request admitted to run alone): the governor prices that alternative for the domain from every such
        request (`observe_tokens`), and a request running alone may move to it from its draft (`_commit_round`)."""
        req = s.request
        wanted = self.lookup_replay is True or (self.lookup_replay == "alone" and rows == 1)
        if not (wanted and req.params.greedy and self.governor.enabled and req.draft in self.drafts
                and self._governor_decides(req)):
            return
        for name, draft in self._candidates(req)[1:]:
            if is_lookup(draft):
                s.shadow = self._replay(draft, req.prompt_ids)
                s.shadow_name = governed(req, name)
                return

    def _replay(self, draft, history: list[int]) -> LookupShadow:
        """Lookup drafter `draft`'s rounds replayed from `history` on, as a lone row runs them (its gamma at batch 1,
        its rule)."""
        gamma, streak = self.lookup_gamma(draft, 1), self.lookup_gamma(draft, 1, streak=True)
        return LookupShadow(history, gamma, draft.max_n, draft.min_n, repeat=draft.repeat,
                            streak_gamma=streak if streak != gamma else None,
                            lag=2 if self.overlap and self.graphs.enabled else 1)

    def _candidates(self, req: Request) -> list[tuple[str, Draft]]:
        """(the name it is judged under, the drafter) for a request's own draft, then for each of its draft's loaded
        alternatives (`set_alternatives`), named "<draft>/<alternative>"."""
        return [(req.draft, self.drafts[req.draft])] + [
            (f"{req.draft}/{alt}", self.drafts[alt]) for alt in self.alternatives.get(req.draft, ())
            if alt in self.drafts and alt != req.draft]

    def _reset_row(self, slot: int) -> None:
        if isinstance(self.draft_cache, WindowedKVCache):
            self.draft_cache.reset(to_device([slot], self.device))

    def _side(self):
        """The context an admission's device work runs in: the side stream (`side_prefill` on CUDA), behind
        everything launched so far on the batch's stream (a row's last call, still in flight, writes its cache
        row), or where the batch runs."""
        if self._side_stream is None:
            return contextlib.nullcontext()
        self._side_stream.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(self._side_stream)

    def _launch_prefill(self, batch: list[SlotState]) -> "_Admission":
        """The group's prefill (target, drafts, lookup histories) and first tokens, launched in `_side()`; the
        rows are reserved until `_join` commits the first tokens."""
        with self._side():
            for s in batch:
                self._reset_row(s.slot)
            first, lens = self._prefill(batch)
            host, ready = _fetch(first)
        return _Admission(batch, host, ready, lens)

    def _prefill(self, batch: list[SlotState]) -> tuple[torch.Tensor, list[int]]:
        """-> (the rows' first tokens (b,) on the device, the prompts' lengths)."""
        device = self.device
        lens = [len(s.request.prompt_ids) for s in batch]
        t_max = max(lens)
        # The prompts (zero-padded) and each row's last position in one queued copy from the host.
        staged = to_device([t for s, n in zip(batch, lens) for t in (*s.request.prompt_ids, *[0] * (t_max - n))]
                           + [n - 1 for n in lens], device)
        tokens, last = staged[: len(batch) * t_max].view(len(batch), t_max), staged[len(batch) * t_max:]
        pos = torch.arange(t_max, device=device)[None].expand(len(batch), -1)
        rows = row_index([s.slot for s in batch], device)
        spec = [i for i, s in enumerate(batch) if s.draft is not None and not is_lookup(s.draft)]
        n_trunk = batch[spec[0]].draft.shared_layers if spec else 0
        capture = feature_layers_of(batch[i].draft for i in spec)
        trunk, hidden, logits, captured = self._prefill_target(tokens, rows, last, n_trunk, capture, bool(spec))
        first = self._sample_device(batch, logits[:, 0])
        if spec:
            self._prefill_drafts([batch[i] for i in spec], trunk[spec], hidden[spec], pos[spec], last[spec], t_max,
                                 [c[spec] for c in captured], capture)
        for i, (s, n) in enumerate(zip(batch, lens)):
            if is_lookup(s.draft):  # its history: the prompt, then the first token (lookup rounds write the rest)
                self.history[s.slot, :n] = tokens[i, :n]
                self.history[s.slot, n] = first[i]
        return first, lens

    def _prefill_target(self, tokens, rows, last, n_trunk: int, capture: tuple[int, ...], drafts: bool):
        """The target's pass over prompts (b, T) (zero-padded past each row's length) -> (hidden after the first
        `n_trunk` layers, hidden after all, logits at each row's `last` position (b, 1, V), hidden after each layer
        count in `capture`); the hidden states only where drafts will prefill from them (`drafts`).

        With prefill graphs (`prefill_graphs`), the prompts run padded to a power-of-two length (at least 16)
        as a CUDA graph of that length and batch bucket: an eager prefill is a few hundred small launches, a
        fixed cost per admission. The padding's keys and values land past each row's length, invisible to its
        queries and overwritten later, as a rejected draft's are; the outputs are cut back to T positions."""
        model, cache = self.model, self.cache
        t_max = tokens.shape[1]
        t_run = min(max(16, 1 << (t_max - 1).bit_length()), cache.max_seq_len) if self.prefill_graphs else t_max

        def fn(tokens, last, rows=rows):
            pos = torch.arange(t_run, device=tokens.device)[None].expand(tokens.shape[0], -1)
            ctx = model.context(pos, cache, rows, t_run)
            trunk = model(tokens, pos, layers=range(0, n_trunk), cache=cache, rows=rows, ctx=ctx).hidden
            out = model(None, pos, layers=range(n_trunk, model.args.num_layers), hidden=trunk, cache=cache,
                        rows=rows, logits_index=last, ctx=ctx, capture=capture)
            if not drafts:
                return (out.logits,)
            return out.logits, trunk, out.hidden, *out.captured

        if not self.prefill_graphs:
            outs = fn(tokens, last)
        else:
            padded = torch.nn.functional.pad(tokens, (0, t_run - t_max))
            outs = self.run_graph(("prefill", t_run, n_trunk, capture, drafts), fn, rows,
                                  {"tokens": padded, "last": last}, side=self._side_stream is not None)
        if not drafts:
            return None, None, outs[0], ()
        logits, trunk, hidden, *captured = outs
        return trunk[:, :t_max], hidden[:, :t_max], logits, tuple(c[:, :t_max] for c in captured)

    def _prefill_drafts(self, batch, trunk, hidden, pos, last, t_max, captured=(), capture=()) -> None:
        """Fill the adapters' KV over the prompts (the trunk's is already in the target cache)."""
        model = self.model
        rows = to_device([s.slot for s in batch], self.device)
        final = None
        by_draft: dict[int, list[int]] = {}
        for i, s in enumerate(batch):
            by_draft.setdefault(id(s.draft), []).append(i)
        for idx in by_draft.values():
            draft = batch[idx[0]].draft
            sel = to_device(idx, self.device)
            feats = None
            if draft.feature_input == "deep":
                if final is None:
                    final = model.norm(hidden)  # (b, T, H) the target's final hidden states
                target_feats = draft_features(draft, final[sel], [c[sel] for c in captured], capture)  # (g, T, H)
                # The feature at position q is the target's state at q - 1 (zeros at q = 0).
                feats = torch.cat([torch.zeros_like(target_feats[:, :1]), target_feats[:, :-1]], dim=1)
            if isinstance(self.draft_cache, WindowedKVCache):
                self._prefill_windowed(draft, [batch[i] for i in idx], trunk[sel], feats, last[sel])
            else:
                ctx = model.context(pos[sel], self.draft_cache, rows[sel], self.draft_kv_len(t_max))
                draft.adapters_forward(trunk[sel], feats, ctx)
            if draft.feature_input == "deep":
                g_rows = rows[sel]
                ar = torch.arange(len(idx), device=self.device)
                self.last_feature[g_rows] = target_feats[ar, last[sel]]
                self.round_start[g_rows] = last[sel] + 1
                self.round_feat[g_rows, 0] = self.last_feature[g_rows]

    def _prefill_windowed(self, draft, batch, trunk, feats, last) -> None:
        """Adapter prefill into a ring buffer: each row on its own real positions, in chunks no longer
        than the ring's slack, so no chunk evicts a position its own queries still attend to."""
        cache = self.draft_cache
        chunk = cache.max_seq_len - cache.window
        for i, s in enumerate(batch):
            n = len(s.request.prompt_ids)
            row = to_device([s.slot], self.device)
            for start in range(0, n, chunk):
                stop = min(start + chunk, n)
                pos = torch.arange(start, stop, device=self.device)[None]
                ctx = self.model.context(pos, cache, row, cache.max_seq_len)
                f = feats[i : i + 1, start:stop] if feats is not None else None
                draft.adapters_forward(trunk[i : i + 1, start:stop], f, ctx)

    def _sample_device(self, batch: list[SlotState], logits: torch.Tensor) -> torch.Tensor:
        """One token per row from logits (b, V), each row with its own parameters and generator: (b,) tokens, left
        on the device."""
        if all(s.request.params.greedy for s in batch):
            return argmax(logits)
        params = [s.request.params for s in batch]
        t = param_tensors(params, self.device)
        probs = processed_probs(logits, t["temperature"], t["top_k"], t["top_p"], filtered=needs_filters(params))
        return sample(probs, [s.random for s in batch])

    def _ar_step(self, batch: list[SlotState]) -> tuple[list[list[int]], bool]:
        """`ar_steps_per_sync` plain decoding steps for these rows, tokens fed back on the device;
        one host transfer at the end. Returns each row's new tokens (stop conditions apply later), and
        whether every step run kept its tokens (False: a graph of fixed length ran past a row's limit)."""
        device = self.device
        rows = row_index([s.slot for s in batch], device)
        steps = max(1, min(self.ar_steps_per_sync, *(s.request.params.max_new_tokens - len(s.output_ids) for s in batch),
                           *(self.max_seq_len - 1 - s.length for s in batch)))
        staged = to_device([[s.length for s in batch], [s.pending for s in batch]], device)
        pos, tokens = staged[0, :, None], staged[1, :, None]  # (b, 1) each, contiguous
        graph_steps = min(self.ar_steps_per_sync, self.margin)  # a fixed count: one graph per bucket, not per count
        if self.graphs.enabled:
            out = self._ar_graph(batch, tokens, pos, rows, graph_steps, steps, ahead_by=0)
            if self._may_overlap(batch, graph_steps):
                host, ready = _fetch(out)
                self._ahead = _Ahead(batch, *self._launch_ahead(batch, out, pos, rows, graph_steps), graph_steps)
                new = _read(host, ready)
                self._plain_clock = time.perf_counter()
            else:
                new = out.tolist()
            return [row[:steps] for row in new], steps == graph_steps  # steps past `steps` wrote KV inside the margin
        new = []
        for i in range(steps):
            _, _, logits, _ = self.run_target(tokens, pos, range(self.model.args.num_layers), None, rows,
                                           int(max(s.length for s in batch)) + i + 1)
            tokens = self._sample_device(batch, logits[:, -1])[:, None]
            new.append(tokens)
            pos = pos + 1
        return torch.cat(new, dim=1).tolist(), True

    def _ar_graph(self, batch, tokens, pos, rows, graph_steps: int, kept: int, ahead_by: int) -> torch.Tensor:
        """A plain-decoding graph call of `graph_steps` steps from tokens (b, 1) at positions pos (b, 1), both
        on the device, `ahead_by` positions past the rows' committed lengths -> (b, graph_steps) tokens on the
        device. Sampled rows' streams advance by the `kept` tokens."""
        kv_len = int(max(s.length for s in batch)) + ahead_by + graph_steps
        if all(s.request.params.greedy for s in batch):
            return self._ar_greedy_graph(tokens, pos, rows, graph_steps, kv_len)
        out = self._ar_sampled_graph(batch, tokens, pos, rows, graph_steps, kv_len)
        # Draw i of each row samples its i-th token: count only the kept ones, so the next call draws for the
        # next token exactly what the one-step path would.
        advance([s.random for s in batch], kept)
        return out

    def _may_overlap(self, batch: list[SlotState], graph_steps: int) -> bool:
        """Whether the batch's next plain call (positions graph_steps .. 2 graph_steps - 1 past the committed
        lengths) may be launched before the host reads the one in flight (`_may_chain`)."""
        return self._may_chain(batch, 2 * graph_steps, speculating=False)

    def _launch_ahead(self, batch, out: torch.Tensor, pos: torch.Tensor, rows, graph_steps: int):
        """Launch the batch's next call from the tokens (b, graph_steps) of the one in flight (on the device), which
        started at the committed lengths, pos (b, 1); its tokens' copy to the host is queued behind it.
        -> (tokens, host copy, ready event, its positions, rows)."""
        next_pos = pos + graph_steps
        nxt = self._ar_graph(batch, out[:, -1:], next_pos, rows, graph_steps, graph_steps, ahead_by=graph_steps)
        return (nxt, *_fetch(nxt), next_pos, rows)

    def _resolve_ahead(self) -> list[RequestOutput]:
        """The step after an overlapped call was launched: chain the next call onto it while the batch is
        unchanged (`_may_overlap`), then read its tokens and commit them for the rows still running (a row
        that stopped, or was cancelled, since the call was launched has its tokens dropped)."""
        ahead, self._ahead = self._ahead, None
        self._admit_beside()
        if ahead.kind == "round":
            return self._resolve_round(ahead)
        t0, cold = time.perf_counter(), self._cold_events()
        batch = ahead.batch
        if self._may_overlap(batch, ahead.steps):
            self._ahead = _Ahead(batch, *self._launch_ahead(batch, ahead.tokens, ahead.pos, ahead.rows, ahead.steps),
                                 ahead.steps)
        new = _read(ahead.host, ahead.ready)
        # Calls run back to back on the device: the time since the last one's tokens were read is this one's cost,
        # the host's work between the reads included, as a chained round's (`_resolve_round`). Timed from this
        # step's start instead, the host's work fell outside every sample: on the H200 at batch 1 plain decoding
        # passed for 0.65-0.67 ms a token against 0.73-0.74 timed from the last read (bench/RESULTS.md run 40).
        now = time.perf_counter()
        seconds = now - (self._plain_clock if self.plain_timed_from_read else t0)
        self._plain_clock = now
        outputs, kept = [], 0
        for s, toks in zip(batch, new):
            if self.slots[s.slot] is not s:
                continue  # stopped or cancelled after this call was launched: its tokens are past its end
            s.length += len(toks)
            kept += len(toks)
            outputs.append(self._commit(s, toks))
            self._plain_committed(s)
        if self._cold_events() == cold and len(outputs) == len(batch):
            self.governor.observe_ar(len(batch), seconds, kept)
        return outputs

    def _resolve_round(self, ahead: "_Ahead") -> list[RequestOutput]:
        """The step after an overlapped round was launched: chain the next round onto it while the batch is
        unchanged, then read it and commit it for the rows still running."""
        batch = ahead.batch
        cold = self._cold_events()
        joined: list[RequestOutput] = []
        if self._may_overlap_round(batch, ahead.steps):
            self._ahead = self._launch_next_round(batch, ahead.tokens, ahead.pos, ahead.steps, ahead.greedy)
        elif self._regroups(batch):
            joined = self._regroup_round(ahead)
        host = _read(ahead.host, ahead.ready)
        result = round_result(host, ahead.steps) if ahead.allotted is None else allotted_result(host)
        now = time.perf_counter()
        # Rounds run back to back on the device: the time since the last one's result is this one's cost.
        seconds = now - self._round_clock if self._cold_events() == cold else None
        self._round_clock = now
        self._report_round(ahead.report, ahead.steps, seconds, result)
        running = self.num_running
        self._observe_round(batch, result, running, seconds)
        return joined + self._commit_round(batch, result, running)

    def _regroups(self, batch: list[SlotState]) -> bool:
        """Whether an overlapped batch of greedy lookup rows keeps its chain through its rows' ends
        (`regroup_chains`; not with side prefills)."""
        return (self.regroup_chains and not self.side_prefill and bool(batch)
                and all(is_lookup(s.draft) and s.request.params.greedy for s in batch))

    def _regroup_round(self, ahead: "_Ahead") -> list[RequestOutput]:
        """The chained round of a batch of greedy lookup rows whose rows changed since the round in flight was
        launched: rows that stopped leave it, admissions whose prefill has run join it (`_join`: their first tokens,
        returned), and where the batch is then every running row and may chain (`_may_overlap_round`) its next
        round is launched before the round in flight is read: the rows that stay take their pending tokens and
        positions from that round's outcome on the device, the rows that joined from the host. Where the batch
        cannot chain (requests wait for a prefill of their own, ...) the next step runs unchained, the rows that
        joined running by then; its admissions' prefills go on this stream, behind the round in flight, which may
        still write a stopped row's cache row."""
        batch = ahead.batch
        kept = [i for i, s in enumerate(batch) if self.slots[s.slot] is s]
        if len(kept) == len(batch):
            return []  # the same rows: what stopped the chain was not a change of rows
        outputs = self._join(wait=False)
        ids = {id(s) for s in batch}
        joined = [s for s in self.slots if s is not None and id(s) not in ids]
        rows = [batch[i] for i in kept] + joined
        if not rows or not self._regroups(rows) or not self._may_overlap_round(rows, ahead.steps):
            return outputs
        idx = to_device(kept, self.device)
        host = to_device([[s.pending for s in joined], [s.length for s in joined]], self.device)
        pending = torch.cat([ahead.tokens[idx, 1], host[0]])
        pos0 = torch.cat([(ahead.pos + ahead.tokens[:, 0] + 1)[idx], host[1]])
        self._ahead = self._chain_lookup_round(rows, pending, pos0, ahead.steps, True)
        self.regrouped += 1
        return outputs

    def _wait_ahead(self) -> None:
        """Wait until a call in flight has run (its graph may then be dropped); it is still committed next step."""
        if self._ahead is not None and self._ahead.ready is not None:
            self._ahead.ready.synchronize()

    def settle(self) -> None:
        """Drop an overlapped call none of whose rows still runs (all stopped meanwhile): nothing of it is
        wanted, and the engine then has no work left. `generate` calls it when its requests are done."""
        if self._ahead is not None and not any(self.slots[s.slot] is s for s in self._ahead.batch):
            _read(self._ahead.host, self._ahead.ready)
            self._ahead = None

    def _ar_greedy_graph(self, tokens, pos, rows, steps: int, kv_len: int) -> torch.Tensor:
        """`steps` greedy decoding steps as one CUDA graph (argmax fed back on the device), one transfer.

        Always `ar_steps_per_sync` steps (capped by the cache margin), even when a row needs fewer: the
        extra tokens are dropped by the caller and their KV sits past the row's length, invisible and
        overwritten later, as a rejected draft's does. So the graph is keyed by the batch bucket only (and the
        KV bucket, without a position-bounded attention backend)."""
        kv_len = self.kv_bucket(kv_len)
        model, cache, layers = self.model, self.cache, range(self.model.args.num_layers)

        def fn(tokens, input_pos, rows=rows):
            new = []
            for _ in range(steps):
                logits = model(tokens, input_pos, layers=layers, cache=cache, rows=rows, kv_len=kv_len).logits
                tokens = argmax(logits[:, -1])[:, None]
                new.append(tokens)
                input_pos = input_pos + 1
            return (torch.cat(new, dim=1),)

        (new,) = self.run_graph(("ar-greedy", steps, kv_len), fn, rows, {"tokens": tokens, "input_pos": pos})
        return new

    def _ar_sampled_graph(self, batch, tokens, pos, rows, steps: int, kv_len: int) -> torch.Tensor:
        """`steps` sampled decoding steps as one CUDA graph: each row's temperature, top-k, top-p and random
        stream state are graph inputs, step i draws the row's i-th number (as `_sample_device` would)."""
        kv_len = self.kv_bucket(kv_len)
        model, cache, layers = self.model, self.cache, range(self.model.args.num_layers)
        params = [s.request.params for s in batch]
        filtered = needs_filters(params)
        device = self.device

        def fn(tokens, input_pos, state, temperature, top_k, top_p, rows=rows):
            new = []
            draws = uniform_at(state, 0, (tokens.shape[0], steps))  # all steps' draws in one hash of the counters
            for i in range(steps):
                logits = model(tokens, input_pos, layers=layers, cache=cache, rows=rows, kv_len=kv_len).logits
                probs = processed_probs(logits[:, -1], temperature, top_k, top_p, filtered)
                tokens = sample_with(probs, draws[:, i])[:, None]
                new.append(tokens)
                input_pos = input_pos + 1
            return (torch.cat(new, dim=1),)

        t = param_tensors(params, device)
        inputs = {"tokens": tokens, "input_pos": pos, "state": stream_state([s.random for s in batch], device),
                  "temperature": t["temperature"], "top_k": t["top_k"], "top_p": t["top_p"]}
        (new,) = self.run_graph(("ar-sampled", steps, kv_len, filtered), fn, rows, inputs)
        return new

    # ----- model calls (captured as CUDA graphs on GPU) -------------------------------------
    def kv_bucket(self, kv_len: int) -> int:
        """Slots a step attends: exact without graphs. With graphs, the whole cache where the attention backend
        reads no slot past a row's last position (`bounds_by_position`, the Triton kernel on CUDA): one graph
        then serves every sequence length, and `warmup` captures all a replica will run. Otherwise rounded up
        to a multiple of 64 (fewer shapes to capture; longer sequences capture their buckets on first use)."""
        if not self.graphs.enabled:
            return kv_len
        if self.length_free_graphs:
            return self.cache.max_seq_len
        return min(-(-kv_len // 64) * 64, self.cache.max_seq_len)

    @property
    def length_free_graphs(self) -> bool:
        """Graphs attend the whole cache and serve every sequence length (`kv_bucket`)."""
        return self.graphs.enabled and getattr(self.model.backend, "bounds_by_position", False)

    def batch_bucket(self, n: int) -> int:
        """The padded batch size a graph of n rows with scattered cache rows runs at: 1, 2, 4, ..., max."""
        return min(batch_bucket(n), self.max_batch_size)

    def padded_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """(n,) cache rows -> (bucket,) with the padding pointing at the scratch row."""
        pad = self.batch_bucket(len(rows)) - len(rows)
        if pad == 0:
            return rows
        return torch.cat([rows, torch.full((pad,), self.scratch_row, dtype=rows.dtype, device=rows.device)])

    def run_graph(self, key: tuple, fn, rows, inputs: dict, owners: tuple = (), side: bool = False) -> tuple:
        """fn(**inputs, rows=...) as a CUDA graph for these cache rows; outputs cut back to the real rows.

        Rows 0..n-1 with n a bucket size stay the constant slice `fn` was given (views, no gather). Any
        other rows run padded to the next bucket (inputs padded with zeros), with the rows as a graph
        input whose padding points at the scratch row: their graph depends only on the bucket, not on
        which rows they are (a bounded set of graphs that `warmup` can capture ahead of traffic).
        `owners`: ids of the drafts the graph runs (`GraphCache.discard` drops it with them); `side`: a graph
        replayed on the side stream (`GraphCache.run`).
        """
        if isinstance(rows, slice):
            n = rows.stop - rows.start
            if rows.start == 0 and n == self.batch_bucket(n) and not self._scatter_rows:
                return self.graphs.run(key + ("rows", n), fn, inputs, owners, side)
            rows = torch.arange(rows.start, rows.stop, device=self.device)
        n = len(rows)
        padded = self.padded_rows(rows)
        pad = len(padded) - n
        inputs = {k: (torch.cat([v, v.new_zeros((pad, *v.shape[1:]))]) if pad else v) for k, v in inputs.items()}
        outs = self.graphs.run(key + ("bucket",), fn, {**inputs, "rows": padded}, owners, side)
        return tuple(o[:n] if o is not None else None for o in outs)

    def run_target(self, tokens, input_pos, layers: range, hidden, rows, kv_len: int, capture: tuple[int, ...] = ()):
        """Target layers `layers` on tokens (b, T) or hidden (b, T, H) -> (hidden, final_hidden, logits,
        captured): `captured` holds the (b, T, H) states after each layer count in `capture`."""
        kv_len = self.kv_bucket(kv_len)
        model, cache = self.model, self.cache

        def fn(input_pos, tokens=None, hidden=None, rows=rows):
            out = model(tokens, input_pos, layers=layers, hidden=hidden, cache=cache, rows=rows, kv_len=kv_len,
                        capture=capture)
            return out.hidden, out.final_hidden, out.logits, *out.captured

        inputs = {"input_pos": input_pos}
        inputs["tokens" if hidden is None else "hidden"] = tokens if hidden is None else hidden
        if not self.graphs.enabled:
            outs = fn(**inputs)
        else:
            outs = self.run_graph(("target", layers.start, layers.stop, kv_len, capture), fn, rows, inputs)
        return (*outs[:3], tuple(outs[3:]))

    def run_draft(self, draft, trunk_hidden, features, input_pos, rows, kv_len: int, pick=None, with_head: bool = True,
                  greedy: bool = False):
        """Adapters (+ head) of one draft -> (out (g, H), its greedy tokens (g,) if greedy else its logits (g, V),
        or None without the head, proxy feature (g, H) or None).

        trunk_hidden/features (g, T, H) at input_pos (g, T); `pick` (g,) selects one position per row
        for the head (None: T must be 1).
        """
        kv_len = self.draft_kv_len(self.kv_bucket(kv_len))
        model, cache = self.model, self.draft_cache

        def fn(trunk_hidden, input_pos, features=None, pick=None, rows=rows):
            ctx = model.context(input_pos, cache, rows, kv_len)
            out = draft.adapters_forward(trunk_hidden, features, ctx)  # (g, T, H)
            if pick is None:
                out = out[:, 0]
            else:
                out = out[torch.arange(out.shape[0], device=out.device), pick]
            if not with_head:
                return out, None, None
            return out, *draft.predict(out, greedy)

        inputs = {"trunk_hidden": trunk_hidden, "input_pos": input_pos}
        if features is not None:
            inputs["features"] = features
        if pick is not None:
            inputs["pick"] = pick
        if not self.graphs.enabled:
            return fn(**inputs)
        return self.run_graph(("draft", kv_len, with_head, greedy), fn, rows, inputs, owners=(id(draft),))

    # ----- deep-feature bookkeeping (used by spec_round) -----------------------------------
    def deep_window(self, rows: torch.Tensor, trunk_t0: torch.Tensor, pos0: torch.Tensor):
        """Adapter inputs re-covering last round's verified positions with the target's true features.

        Returns window (g, W, H) trunk states at positions round_start .. round_start + W - 1 with the
        pending token's trunk state placed at its position, features (g, W, H) (the target's hidden
        state one position earlier), the pending token's index in the window (g,), positions (g, W).
        """
        start = self.round_start[rows]  # (g,)
        # (g,) in [0, W-1] for every real row; the clamp only keeps a graph's padding rows in bounds.
        index = (pos0 - start).clamp(0, self.round_trunk.shape[1] - 1)
        window = self.round_trunk[rows].clone()
        ar = torch.arange(len(rows), device=self.device)
        window[ar, index] = trunk_t0.to(window.dtype)
        feats = self.round_feat[rows]
        positions = start[:, None] + torch.arange(window.shape[1], device=self.device)[None]
        return window, feats, index, positions

    def store_deep_round(self, rows, pos0, trunk_seq, feat_seq, num_accepted) -> None:
        """Remember a round's verified trunk states and target features (`draft_features` for each row's
        draft, (b, n, H)) for the next round's window."""
        n = min(trunk_seq.shape[1], self.round_trunk.shape[1] - 1)
        ar = torch.arange(len(rows), device=self.device)
        self.round_trunk[rows, :n] = trunk_seq[:, :n].to(self.dtype)
        # Features for positions pos0 .. pos0 + n: the target's state one position earlier.
        self.round_feat[rows, 0] = self.last_feature[rows]
        self.round_feat[rows, 1 : n + 1] = feat_seq[:, :n].to(self.dtype)
        self.round_start[rows] = pos0
        self.last_feature[rows] = feat_seq[ar, num_accepted].to(self.dtype)

    # ----- results ------------------------------------------------------------------------
    def _commit(self, s: SlotState, new_tokens: list[int]) -> RequestOutput:
        """Append produced tokens, apply stop conditions, free the row when finished.

        Tokens are taken one at a time, so a stop condition inside a speculative round (EOS, a stop
        string, max_new_tokens, the context) ends the output exactly where plain decoding would.
        """
        params = s.request.params
        kept: list[int] = []
        reason = None
        text = ""
        prompt_len = len(s.request.prompt_ids)
        for tok in new_tokens:
            if tok in s.eos:
                reason = "stop"
                break
            kept.append(tok)
            if len(s.output_ids) + len(kept) >= params.max_new_tokens:
                reason = "length"
                break
            if prompt_len + len(s.output_ids) + len(kept) >= self.max_seq_len:
                reason = "length"
                break
        if s.text_stream is not None:
            if params.stop:
                # A stop string may end inside these tokens: find the token after which it appears.
                for i, tok in enumerate(kept):
                    text += s.text_stream.push([tok])
                    if s.text_stream.stopped:
                        kept, reason = kept[: i + 1], "stop"
                        break
            else:
                text = s.text_stream.push(kept)
        if s.first_token_at is None:
            s.first_token_at = time.perf_counter()
        s.output_ids.extend(kept)
        if s.shadow is not None and kept:
            replayed = s.shadow.extend(kept)
            if replayed:
                self.governor.observe_tokens(s.shadow_name, LOOKUP_POOL, replayed)
        if s.comeback is not None and s.comeback is not s.shadow and kept:
            replayed = s.comeback.extend(kept)
            if replayed and self.comeback_prices and self.lookup_replay is not False:
                self.governor.observe_tokens(governed(s.request, s.comeback_to[0]), LOOKUP_POOL, replayed)
        if new_tokens:
            s.pending = new_tokens[-1]
        finished = reason is not None
        if finished and s.text_stream is not None:
            text += s.text_stream.flush()
        if finished:
            self.slots[s.slot] = None
        elif s.history_refills:
            self._refill_history(s)  # a row moved to lookup (`_move_to_lookup`): its history from the host
        return RequestOutput(
            request_id=s.request.request_id,
            token_ids=kept,
            text=text,
            finished=finished,
            finish_reason=reason,
            prompt_tokens=len(s.request.prompt_ids),
            completion_tokens=len(s.output_ids),
            stats=s.stats if s.stats.rounds else None,
            draft=s.draft_name if s.stats.rounds else None,
        )


@dataclasses.dataclass
class _Ahead:
    """A graph call launched before the host read its batch's previous one (`overlap`): plain decoding steps,
    or a captured speculative round."""

    batch: list  # the SlotStates it decodes, in row order
    tokens: torch.Tensor  # (b, steps) its tokens, on the device
    host: torch.Tensor  # their copy in host memory, complete once `ready` is
    ready: object  # CUDA event recorded after the copy (None when the copy was synchronous)
    pos: torch.Tensor  # (b, 1) the position of its first step; a round: (b,) its rows' pending positions
    rows: object  # the batch's cache rows
    steps: int  # plain steps in the call; a round: its gamma
    kind: str = "plain"  # or "round": a captured speculative round, `tokens` its packed outcome
    report: tuple | None = None  # a round: what to report to the gamma controller (`_round_spec`)
    greedy: bool = True
    allotted: int | None = None  # an allotted lookup round: its gamma's verify tokens a row (`_next_lookup_round`)


@dataclasses.dataclass
class _Admission:
    """Requests admitted together whose prefill was launched (`DecodeEngine._launch_prefill`): their rows are
    reserved until the prefill has run, then they join the batch (`DecodeEngine._join`)."""

    states: list  # their SlotStates, rows assigned (those that have joined are taken out)
    host: torch.Tensor  # their first tokens in host memory, complete once `ready` is
    ready: object  # CUDA event recorded after the prefill and the copy (None: done when launched)
    lengths: list[int]  # their prompts' lengths
    dropped: set = dataclasses.field(default_factory=set)  # ids of the requests cancelled meanwhile
    first: list | None = None  # their first tokens, once read

    def done(self) -> bool:
        return self.ready is None or self.ready.query()

    def first_tokens(self) -> list[int]:
        """The states' first tokens (waiting for the prefill the first time)."""
        if self.first is None:
            self.first = _read(self.host, self.ready)
        return self.first


def _fetch(tokens: torch.Tensor):
    """Queue tokens' copy to the host behind the work that makes them -> (host tensor, event); on CUDA the copy
    lands in pinned memory without stopping the host, whose later launches then run behind it."""
    if not tokens.is_cuda:
        return tokens.clone(), None
    host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
    host.copy_(tokens, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return host, ready


def _read(host: torch.Tensor, ready) -> list:
    if ready is not None:
        ready.synchronize()
    return host.tolist()

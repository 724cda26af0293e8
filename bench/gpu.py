"""The GPU benchmark: every decoding path on the embedded default, side by side in one run.

    python -m bench.gpu --drafts DIR [--seed-draft DIR] [--quick] [--fused [compiled|hand]]

Rows: transformers generate (eager, static cache, prompt lookup), engine AR (CUDA graphs), FlashSpec
with the seed-default draft shape (block 2 and block gamma), FlashSpec with the best configuration
(and with the speculation governor). Settings: batch 1 and 8; 512->256 and 32->20 tokens; greedy and
T=1. Held-out prompts: bench/data/gpu_prompts.json (test splits of the three domains; each row
drafts with its own domain's draft; 6 long and 24 short requests per cell by default, `--long-prompts`,
`--short-prompts`; the engine runs them bs at a time with continuous batching, transformers in static
batches of bs). Then a cost-model table on a 7B-shaped random-weight Llama,
labelled as a projection. Tokens/s count new tokens over wall time, prefill included.

--fused: after all the rows above (fusing is in place), the target is fused for inference
(`Transformer.fuse_for_inference`: q/k/v and gate/up GEMMs, plus compiled RMSNorm/RoPE/SiLU unless
`--fused hand`), the drafts' adapter layers too, and the engine AR and best-draft FlashSpec rows run
again as "... (fused)" rows, each with its ratio to the same row unfused; plus the one-token decode
step of the default model (CUDA graph ms, CUDA kernels per eager step) before and after fusing.

--lookup 5,8 adds rows whose requests name an n-gram lookup drafter (`engine.lookup`; no
weights: each request's own earlier tokens propose its next ones) at those gammas, alone and overlapped, and
at the largest with the governor; plus the service's setting with the lookup drafter as each best draft's
alternative, the governor picking which one a request runs (`DecodeEngine.set_alternatives`);
`--return-window 32` adds the service's setting again with the governor's return window at each of those,
`--governor-rows "tokens_alpha=0.001;return_window=4"` with each of those governor settings (`SpeculationGovernor`'s
keywords);
`--plain-timing step` adds lookup under the governor and the service's setting again with an overlapped plain call
priced from its step's start (the host's work between reads left out, as before);
`--lookup-lone 12,15` adds the service's setting again with a lone greedy row's lookup gamma at each of those;
`--comeback-prices off` adds the service's setting again with plain rows' replays of lookup not pricing it;
`--side-prefill` adds plain decoding (fused, alone and overlapped), lookup at the largest gamma overlapped and the
service's setting again with each admission's prefill on a second stream beside the running rows
(`DecodeEngine(side_prefill=True)`);
`--prefill-ahead 7` adds overlapped plain decoding, lookup at the largest gamma overlapped and the service's setting
again with 7 cache rows for requests prefilled ahead of a free running row, a group a prefill pass
(`DecodeEngine(prefill_ahead=7)`; the service's setting holds the service's default on CUDA, bs - 1 rows up to 7:
`--prefill-ahead 0` adds it without);
`--lookup-streaks 15` adds lookup alone at the largest gamma with a lone row's rounds at 15 after a round that
accepted everything (`LookupDraft.streak_gammas`; the alone rows run without), and the service's setting again
without a streak gamma (and at each streak gamma other than its default);
`--no-regroup` adds lookup at the largest gamma overlapped and the service's setting again with an overlapped lookup
batch's chain stopped near a row's end and for each change of rows (`DecodeEngine.regroup_chains = False`), side by
side;
`--lookup-before-repeat` adds the largest gamma's rows again with the rule before the repeat (n 3 else 2, only the
tokens that followed the match), side by side.
`--vocab-config t=0` adds lookup at the largest gamma overlapped and the service's setting again with the vocabulary
projection's launch setting overridden by that (FLASHSPEC_VOCAB_CONFIG's syntax) while the row builds, warms up and
runs its passes (its CUDA graphs are captured with it), side by side.
--trees 2,4 adds best-draft rows with draft trees of those widths (gamma 5 and each of --gammas, those overlapped
with --gammas-overlapped, and in the service's setting).
--gammas 3 adds best-draft rows at fixed gammas (one verify a round; `--gammas-overlapped` each again
overlapped); --adaptive-gamma adds rows with
`engine.gamma`'s controller, alone and with the governor, each also overlapped (`DecodeEngine(overlap=True)`;
each prints the controller's choices and estimates in its log line); the fused rows include plain decoding
overlapped; --unfused-rows ar leaves only plain decoding unfused (with --fused, the
FlashSpec rows then run on the fused path alone). --rows "overlapped;governor's choice" runs only the engine rows
whose names hold one of those parts (each cell's first row, what its ratios are against, always runs). Each
engine row's log line says where its last pass's tokens came from (`paths`: draft and lookup rounds and their
tokens, plain decoding's tokens, requests that moved), and a governed row's what the governor decided in that pass
(`pass_decisions`). Six long
requests (two a domain) are few for the bs 1 cell: a reply's repeats decide lookup's rounds, and a numerics change
that turns one reply into another moved its lookup rows by 5-15 % (run 37); `--long-prompts 24` runs eight a domain.

The engine rows of a cell run side by side: each is built and warmed up, then their timed passes take
turns (pass p starts at row p), so a drift of the machine during the cell moves every row alike; the
plain engine AR row of the unfused table runs first and alone (its outputs are the reference). The
table's last column is a row's slowest and fastest pass and, in brackets, the CUDA graphs it still
captured inside its timed passes (a capture stalls the batch, as a warmed-up server's would not be): a
pass that captured is run again, at most twice, and the column says how many were. Each row's log line
(JSON) carries `host_split`: its last timed pass's wall time split into the engine's steps, its
speculative rounds and the time outside any step (`HostSplit`).

--attention NAME runs every row with that attention backend (default sdpa); --attention-compare
triton[,flex] then runs engine AR and the block-5 rows again with each other backend (on the fused
path with --fused) and prints a table of the ratios and each backend's decode step.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from bench.ar import setup_line
from engine import triton_attention, triton_kernels, triton_layer
from engine.attention import BACKENDS
from engine.scheduler import prefill_graphs_default


DOMAINS = ("code", "general", "dialog")


def cuda_ms(fn, iters: int = 50) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1000


def per_call_us(fn, reps: int = 20) -> float:
    """us a call of fn, from a CUDA graph of `reps` calls replayed 50 times (one call alone is mostly launch)."""
    graph = capture_graph(lambda: [fn() for _ in range(reps)])
    return cuda_ms(graph.replay, 50) / reps * 1e3


def capture_graph(fn, warmup: int = 3, debug: bool = False) -> torch.cuda.CUDAGraph:
    """fn captured as a CUDA graph, after `warmup` eager runs on a side stream (they compile the fused
    and Triton kernels for these shapes). `debug`: keep the graph's nodes for `graph_kernels`."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    if debug:  # keep the captured graph (not only its executable) for cudaGraphDebugDotPrint
        try:
            g = torch.cuda.CUDAGraph(keep_graph=True)
        except TypeError:  # torch before keep_graph: debug mode keeps it
            g.enable_debug_mode()
    with torch.cuda.graph(g):
        fn()
    return g


def graph_kernels(graph: torch.cuda.CUDAGraph) -> int:
    """CUDA kernels (and copies, memsets) one replay of a graph captured with `capture_graph(debug=True)` runs,
    counted from the graph's own nodes (cudaGraphDebugDotPrint).

    Not torch.profiler: a profiler session leaves CUPTI attached to the process, and afterwards every graph
    launch costs the host about 0.45 us per kernel node and the kernels run up to 20 % slower (measured on the
    H200: an 800-kernel graph's launch went from 0.03 to 0.38 ms). A benchmark that counted kernels that way
    before its timed rows slowed every row after it (bench/RESULTS.md, run 18)."""
    import os
    import re
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "graph.dot")
        graph.debug_dump(path)
        dot = open(path).read()
    # A node's record label starts with its type: label="{KERNEL\n| {ID | ...
    return len(re.findall(r'label="\{(?:KERNEL|MEMCPY|MEMSET)\b', dot))


def count_kernels(fn) -> int:
    """CUDA kernels (and copies) one run of fn launches, from its captured graph (`graph_kernels`)."""
    return graph_kernels(capture_graph(fn, debug=True))


def step_profile(model, kv_len: int = 512) -> dict:
    """One decode step of the whole model (batch 1, one token at position kv_len - 1, logits included):
    ms per CUDA-graph replay, and the CUDA kernels (and copies) one eager step runs."""
    cache = model.new_cache(1, kv_len)
    tokens = torch.zeros(1, 1, dtype=torch.long, device="cuda")
    pos = torch.full((1, 1), kv_len - 1, dtype=torch.long, device="cuda")

    def fn():
        return model(tokens, pos, cache=cache, kv_len=kv_len).logits

    g = capture_graph(fn)
    out = {"ms": cuda_ms(g.replay, 200), "kernels": None}
    try:
        out["kernels"] = count_kernels(fn)
    except Exception as exc:  # noqa: BLE001 - the count is informative only
        print(f"kernel count unavailable: {exc}", flush=True)
    del g, cache
    return out


@torch.no_grad()
def fp32_agreement(model, prompts: list[list[int]], outs: list[list[int]]) -> dict:
    """Each emitted greedy token against the fp32 model's argmax *given the same prefix* (one pass over
    prompt + output). Sequence agreement with AR stops counting at the first divergence, after which
    the two outputs continue different texts; this counts every token, and gives the fp32 logit gap
    (top token minus the emitted one) where they differ: a near-tie when it is small."""
    device = model.embed_tokens.weight.device
    agree = total = 0
    gaps: list[float] = []
    for p, o in zip(prompts, outs):
        if not o:
            continue
        x = torch.tensor([p + o[:-1]], device=device)
        logits = model(x, torch.arange(x.shape[1], device=device)[None]).logits[0, len(p) - 1 :].float()
        chosen = torch.tensor(o, device=device)
        miss = logits.argmax(-1) != chosen
        gap = logits.max(-1).values - logits.gather(-1, chosen[:, None])[:, 0]
        agree += int((~miss).sum())
        total += len(o)
        gaps += gap[miss].tolist()
    return {"fp32_agreement": agree / total if total else None, "fp32_misses": len(gaps),
            "fp32_gap_median": statistics.median(gaps) if gaps else None, "fp32_gap_max": max(gaps, default=None)}


class GcPauses:
    """Python's garbage-collector pauses while active (gc.callbacks): seconds and collections of generation 2,
    reported per row (a short cell's pass is under a second, so a pause there would show; on the H200 they
    were 0-1 ms a pass, bench/RESULTS.md runs 13-14)."""

    def __init__(self) -> None:
        self.seconds, self.full, self._start = 0.0, 0, None

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.seconds += time.perf_counter() - self._start
            self.full += info.get("generation") == 2
            self._start = None

    def __enter__(self) -> "GcPauses":
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self)


def fused_long_workload(prompts: int = 32, path: str = "bench/data/gpu_prompts.json"):
    """(the default model on the GPU, bf16, Triton attention, fused and compiled; the benchmark's first `prompts`
    long prompts, bs 8's order): the probes' shared setting."""
    from engine.loading import load_model

    loaded = load_model("default", device="cuda", dtype="bfloat16")
    loaded.model.set_attention_backend("triton")
    loaded.model.fuse_for_inference(compile=True)
    with open(path) as f:
        chosen, _ = pick_prompts(json.load(f), "long", 8, 24, prompts)
    return loaded, chosen


def pick_prompts(data: dict, kind: str, bs: int, short_prompts: int = 24, long_prompts: int = 6
                 ) -> tuple[list[list[int]], list[str]]:
    """Prompts cycling over the domains, run in batches of bs: max(bs, long_prompts) long ones, max(bs,
    short_prompts) short ones. 3 requests of 20 new tokens are 0.15 s of work on an H200, where a few
    milliseconds of host jitter move a pass by several percent; and over 3 long prompts a draft's mean
    accepted length is a property of the 3 texts: a bf16 near-tie flipped elsewhere moved it from 2.95 to
    2.40 between two runs of the same drafts (bench/RESULTS.md, runs 13-14)."""
    ids, domains = [], []
    n = max(bs, long_prompts if kind == "long" else short_prompts)
    per_domain = len(data[DOMAINS[0]][kind])
    if n > 3 * per_domain:
        raise SystemExit(f"{n} {kind} prompts asked for, the prompt file has {per_domain} per domain; "
                         f"lower --{kind}-prompts or add prompts (python -m bench.export_prompts)")
    for i in range(n):
        d = DOMAINS[i % 3]
        ids.append(data[d][kind][i // 3])
        domains.append(d)
    return ids, domains


class Bench:
    def __init__(self, args) -> None:
        from engine.loading import load_model

        self.args = args
        self.loaded = load_model("default", device="cuda", dtype="bfloat16")
        self.tok = self.loaded.tokenizer
        self.prompts = json.loads(Path(args.prompts).read_text())
        self.rows: list[dict] = []
        self.hf = None
        self.fp32 = None
        self._cell_base: int | None = None  # memory allocated when the interleaved cell began

    def base_bytes(self) -> int:
        """Memory allocated before a row's engine: at the start of its interleaved cell, else now."""
        return self._cell_base if self._cell_base is not None else _allocated()

    def cell(self, bs: int, kind: str, new: int, greedy: bool) -> tuple[str, list[list[int]], list[str]]:
        """A table cell's label ("bs 1, 512->256, greedy"), its prompts and their domains."""
        setting = f"bs {bs}, {'512' if kind == 'long' else '32'}->{new}, {'greedy' if greedy else 'T=1'}"
        return setting, *pick_prompts(self.prompts, kind, bs, self.args.short_prompts, self.args.long_prompts)

    def fp32_check(self, prompts: list[list[int]], outs: list[list[int]]) -> dict:
        from engine.loading import load_model

        if self.fp32 is None:
            self.fp32 = load_model("default", device="cuda", dtype="float32").model
        return fp32_agreement(self.fp32, prompts, outs)

    # ----- transformers --------------------------------------------------------------------
    def hf_model(self):
        if self.hf is None:
            from transformers import AutoModelForCausalLM

            self.hf = AutoModelForCausalLM.from_pretrained(str(self.loaded.path), dtype=torch.bfloat16).cuda().eval()
        return self.hf

    def run_hf(self, prompts, new, greedy, mode, bs):
        hf = self.hf_model()
        kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=not greedy, pad_token_id=self.tok.eos_token_id)
        if not greedy:
            kw.update(temperature=1.0, top_p=1.0, top_k=0)
        if mode == "static":
            kw["cache_implementation"] = "static"
        if mode == "lookup":
            if bs != 1:
                return None
            kw["prompt_lookup_num_tokens"] = 5
        batches = [prompts[i : i + bs] for i in range(0, len(prompts), bs)] if bs > 1 else [[p] for p in prompts]
        if mode == "eager":
            batches = batches[:1]  # about 25 tokens/s: one batch is enough to measure it

        def once():
            total = 0
            for batch in batches:
                width = max(len(p) for p in batch)
                ids = torch.tensor([[self.tok.eos_token_id] * (width - len(p)) + p for p in batch], device="cuda")
                mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device="cuda")
                out = hf.generate(input_ids=ids, attention_mask=mask, **kw)
                total += (out.shape[1] - width) * len(batch)
            return total

        once()  # warm-up (static cache compiles/allocates on first use)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        tokens = once()
        torch.cuda.synchronize()
        return {"tps": tokens / (time.perf_counter() - t0)}

    # ----- engine ---------------------------------------------------------------------------
    def engine_row(self, prompts, domains, new, greedy, bs, drafts: dict | None, block=2, gamma=5, governor=False,
                   reference=None, mixed_round_graph=True, adaptive=False, overlap=False, tree=1,
                   lookup_alternative=False, lookup_replay=None, governor_kw: dict | None = None,
                   engine_attrs: dict | None = None, engine_kw: dict | None = None,
                   vocab_config: dict | None = None) -> "EngineRow":
        """An engine row built and warmed up, ready for its timed passes (`EngineRow.timed_pass`); `tree`: the
        draft trees' width (greedy rounds of batch 1, `engine.tree`); `lookup_alternative`: each draft has the
        n-gram lookup drafter as an alternative the governor may pick (`DecodeEngine.set_alternatives`; a
        `LookupDraft` here: that one), priced from replays of it over greedy requests as `lookup_replay` says
        (`DecodeEngine(lookup_replay=...)`; None: the engine's default); `governor_kw`: the governor's other
        settings (`SpeculationGovernor`'s keywords); `engine_attrs`: engine attributes set after it is built
        (`DecodeEngine.plain_timed_from_read`); `engine_kw`: more `DecodeEngine` keywords (`side_prefill`);
        `vocab_config`: the vocabulary projection's launch setting over `triton_kernels.VOCAB_CONFIG` for this row's
        calls (`EngineRow.settings`)."""
        row = EngineRow(self, prompts, domains, new, greedy, bs, drafts, block, gamma, governor, reference,
                        mixed_round_graph, adaptive, overlap, tree, lookup_alternative, lookup_replay, governor_kw,
                        engine_attrs, engine_kw, vocab_config)
        row.warm()
        return row

    def run_engine(self, *args, **kwargs) -> dict:
        """One engine row alone: built, warmed up, its --passes timed back to back."""
        row = self.engine_row(*args, **kwargs)
        for _ in range(self.passes(row.new)):
            row.timed_pass()
        return row.result()

    def passes(self, new: int) -> int:
        """Measured passes of a cell's rows: --short-passes for the short cells (20 new tokens: a pass is a few
        tens of milliseconds, where host jitter moves one pass by 10-30 %), else --passes."""
        return self.args.short_passes if self.args.short_passes and new <= 20 else self.args.passes

    def measure_engines(self, setting: str, rows: list[tuple[str, Callable[[], "EngineRow"]]]) -> None:
        """A cell's engine rows side by side: each built and warmed up in turn, then their timed passes
        interleaved (pass p runs every row, starting at row p), so a slow drift of the machine (clocks,
        another process) moves every row of the cell alike instead of the rows measured during it. A row that
        fails, building or in a pass, is kept as failed with its error and the others go on."""
        wanted = getattr(self.args, "rows", None)
        if wanted:  # --rows: the cell's first row (what the ratios are against) and the rows named
            rows = [r for i, r in enumerate(rows) if i == 0 or any(w in r[0] for w in wanted)]
        live: list[tuple[str, EngineRow]] = []
        failed: dict[str, str] = {}
        self._cell_base = _allocated()
        try:
            for name, build in rows:
                try:
                    live.append((name, build()))
                except Exception as exc:  # noqa: BLE001 - reported in the row; the cell goes on
                    traceback.print_exc()
                    failed[name] = _error(exc)
        finally:
            self._cell_base = None
        for p in range(max((self.passes(row.new) for _, row in live), default=0)):
            for name, row in live[p % len(live):] + live[: p % len(live)]:
                if name in failed:
                    continue
                try:
                    row.timed_pass()
                except Exception as exc:  # noqa: BLE001
                    traceback.print_exc()
                    failed[name] = _error(exc)
        by_name = dict(live)
        for name, _ in rows:
            if name in failed:
                self.add(setting, name, {"tps": None, "error": failed[name]})
            else:
                self.add(setting, name, by_name[name].result())

    def add(self, setting, name, row):
        if row is None:
            return
        row = {k: v for k, v in row.items() if k != "outs"}
        row.update(setting=setting, name=name)
        self.rows.append(row)
        print(json.dumps(row), flush=True)

    def measure(self, setting, name, run) -> dict | None:
        """Run one row (`run()` -> row or None) and add it. A row that raises is kept as failed, with its error,
        and the table goes on: one broken row must not lose the rest of a GPU run. Returns the row."""
        try:
            row = run()
        except Exception as exc:  # noqa: BLE001 - whatever broke, it is reported in the row and in the log
            traceback.print_exc()
            row = {"tps": None, "error": _error(exc)}
        self.add(setting, name, row)
        return row


def _error(exc: Exception) -> str:
    """A failed row's error: the exception's type and the first line of its message."""
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ''}"


RERUNS = 2  # times a timed pass that captured a graph runs again (EngineRow.timed_pass)


class HostSplit:
    """Where a timed pass's wall time goes, from the engine's own calls: in `DecodeEngine.step` (and, of that,
    in its speculative rounds, `_spec_round`: choosing gamma, launching the round, waiting for its result)
    or outside any step (the generation loop: queuing requests, collecting outputs). The methods are
    wrapped on the instance for the pass and restored after it."""

    def __init__(self, eng) -> None:
        self.eng = eng
        self.seconds = {"step": 0.0, "_spec_round": 0.0}
        self.calls = {"step": 0, "_spec_round": 0}

    def __enter__(self) -> "HostSplit":
        self.regrouped = getattr(self.eng, "regrouped", 0)
        for name in self.seconds:
            real = getattr(self.eng, name)

            def timed(*args, _real=real, _name=name, **kwargs):
                t0 = time.perf_counter()
                try:
                    return _real(*args, **kwargs)
                finally:
                    self.seconds[_name] += time.perf_counter() - t0
                    self.calls[_name] += 1

            setattr(self.eng, name, timed)
        return self

    def __exit__(self, *exc) -> None:
        for name in self.seconds:
            delattr(self.eng, name)  # the class's method again

    def report(self, wall: float) -> dict:
        """ms: the pass, in steps, in rounds, in steps but not rounds, outside steps; and per call. Rounds launched
        regrouped (`DecodeEngine._regroup_round`) in the pass."""
        step, rnd = self.seconds["step"], self.seconds["_spec_round"]
        n_step, n_round = self.calls["step"], self.calls["_spec_round"]
        return {"pass_ms": round(wall * 1e3, 1), "steps": n_step, "step_ms": round(step * 1e3, 1),
                "rounds": n_round, "round_ms": round(rnd * 1e3, 1),
                "step_not_round_ms": round((step - rnd) * 1e3, 1), "outside_steps_ms": round((wall - step) * 1e3, 1),
                "ms_per_round": round(rnd * 1e3 / n_round, 3) if n_round else None,
                "ms_per_step_outside_round": round((step - rnd) * 1e3 / n_step, 3) if n_step else None,
                "rounds_regrouped": getattr(self.eng, "regrouped", 0) - self.regrouped}


class EngineRow:
    """One engine row of a cell (`Bench.engine_row`): the engine with its drafts, governor and gamma controller,
    warmed up; `timed_pass` times one pass over the cell's requests; `result` is the table row.

    Peak memory is this row's own: the most allocated while it was built and warmed up, less what was
    allocated before it (other rows' engines alive in an interleaved cell), plus what the cell started with
    (weights, the transformers model if loaded)."""

    def __init__(self, bench: Bench, prompts, domains, new, greedy, bs, drafts, block, gamma, governor, reference,
                 mixed_round_graph, adaptive, overlap=False, tree=1, lookup_alternative=False, lookup_replay=None,
                 governor_kw: dict | None = None, engine_attrs: dict | None = None,
                 engine_kw: dict | None = None, vocab_config: dict | None = None) -> None:
        from engine.gamma import GammaController
        from engine.governor import SpeculationGovernor
        from engine.sampling import SamplingParams
        from engine.scheduler import DecodeEngine
        from engine.speculative import SpecConfig

        self.bench, self.prompts, self.greedy, self.reference, self.new = bench, prompts, greedy, reference, new
        self.vocab_config = dict(vocab_config or {})
        self.governor_on, self.adaptive = governor, adaptive
        self.base_bytes = bench.base_bytes()
        self.before_bytes = _allocated()
        _reset_peak()
        max_len = max(len(p) for p in prompts) + new + 16
        self.gov = SpeculationGovernor(enabled=governor, **(governor_kw or {})) if governor else None
        # The T=1 rows are seeded only to fix their draws: no pinning (full gamma, no governor exemption) for them.
        self.controller = GammaController(gamma, enabled=adaptive, pin_seeded=False)
        self.eng = DecodeEngine(bench.loaded.model, bench.tok, max_batch_size=bs, max_seq_len=max_len,
                                spec=SpecConfig(gamma, block, tree_width=tree, tree_seeded=True), governor=self.gov, mixed_round_graph=mixed_round_graph,
                                gamma=self.controller, overlap=overlap,
                                **({} if lookup_replay is None else {"lookup_replay": lookup_replay}),
                                **(engine_kw or {}))
        for name, value in (engine_attrs or {}).items():  # an engine switch measured side by side
            if not hasattr(self.eng, name):
                raise AttributeError(f"DecodeEngine has no attribute {name!r} to set")
            setattr(self.eng, name, value)
        if drafts:
            for d, draft in drafts.items():
                self.eng.add_draft(d, draft)
            if lookup_alternative:
                from engine.lookup import LookupDraft, add_lookup_alternative

                add_lookup_alternative(self.eng, drafts, draft=lookup_alternative
                                       if isinstance(lookup_alternative, LookupDraft) else None)
        self.names = [d if drafts else None for d in domains]
        self.params = [SamplingParams(max_new_tokens=new, temperature=0.0 if greedy else 1.0,
                                      seed=None if greedy else 1000 + i, eos_token_ids=()) for i in range(len(prompts))]
        self.rates: list[float] = []
        self.outs: list = []
        self.pauses = GcPauses()
        self.splits: list[dict] = []
        self.captures = 0
        self.reruns = 0  # timed passes run again because they captured a graph

    def once(self) -> list:
        """Every request of the cell, at most bs at a time; a finished request's row takes the next waiting one
        (continuous batching, as the server runs: rows of a speculative batch finish at different rounds)."""
        from engine.generate import generate

        return generate(self.eng, self.prompts, self.params, self.names)

    @contextlib.contextmanager
    def settings(self):
        """This row's kernel launch settings in force for the block (`vocab_config` over
        `triton_kernels.VOCAB_CONFIG`, restored after it): its eager calls and the CUDA graphs it captures use them."""
        from engine import triton_kernels

        saved = dict(triton_kernels.VOCAB_CONFIG)
        triton_kernels.VOCAB_CONFIG.update(self.vocab_config)
        try:
            yield
        finally:
            triton_kernels.VOCAB_CONFIG.clear()
            triton_kernels.VOCAB_CONFIG.update(saved)

    def warm(self) -> None:
        with self.settings():
            self._warm()

    def _warm(self) -> None:
        if self.governor_on:  # seed the governor's plain-decoding estimate, as a warmed-up server would have it
            self.eng.calibrate(prompt=self.prompts[0])
        self.once()  # warm-up: captures the CUDA graphs of every shape this workload meets (and trains the controllers)
        for _ in range(2):
            # Run 10's bs 8 rows captured 4-5 graphs inside their measured passes although the warm-up pass
            # ran the same requests (likely: a graph's first call runs its step eagerly, a bf16 near-tie
            # came out differently there, and later passes took other lengths). Warm up until a pass
            # captures nothing, at most twice more.
            before = self.eng.graphs.captures
            self.once()
            if self.eng.graphs.captures == before:
                break
        _sync()
        self.peak_bytes = _max_allocated() - self.before_bytes + self.base_bytes
        self.captures = self.eng.graphs.captures

    def timed_pass(self) -> float:
        """One timed pass over every request (a short cell's pass is a fraction of a second: rows take the
        median of several), with where its wall time went (`HostSplit`). A pass that captured a CUDA graph
        (its requests met a batch bucket, gamma or mix of drafts the warm-up passes had not: the capture stalls
        the batch, once, as it would a server's first such step) is not a steady-state sample: it runs again,
        at most `RERUNS` times, and the row counts the passes rerun."""
        for attempt in range(RERUNS + 1):
            before = self.eng.graphs.captures
            decided = dict(self.gov.decisions) if self.gov is not None else None
            _sync()
            with self.settings(), self.pauses, HostSplit(self.eng) as split:
                t0 = time.perf_counter()
                self.outs = self.once()
                _sync()
                wall = time.perf_counter() - t0
            if self.eng.graphs.captures == before or attempt == RERUNS:
                break
            self.reruns += 1
        rate = sum(len(o.token_ids) for o in self.outs) / wall
        if decided is not None:  # what the governor decided in this pass alone
            self.pass_decisions = {k: v - decided.get(k, 0) for k, v in self.gov.decisions.items()}
        self.rates.append(rate)
        self.splits.append(split.report(wall))
        return rate

    def result(self) -> dict:
        outs, passes = self.outs, len(self.rates)
        rounds = sum(o.stats.rounds for o in outs if o.stats)
        emitted = sum(o.stats.emitted for o in outs if o.stats)
        drafted = sum(o.stats.drafted for o in outs if o.stats)
        accepted = sum(o.stats.accepted for o in outs if o.stats)
        row = {"tps": statistics.median(self.rates), "tps_passes": [round(r, 1) for r in self.rates],
               "mal": emitted / rounds if rounds else None,
               "acc": accepted / drafted if drafted else None, "peak_gb": self.peak_bytes / 2**30,
               "outs": [o.token_ids for o in outs], "graphs": len(self.eng.graphs),
               "graphs_in_passes": self.eng.graphs.captures - self.captures,  # captured inside the measured passes
               "passes_rerun": self.reruns,
               "gc_ms_per_pass": round(self.pauses.seconds * 1000 / max(passes, 1), 2), "gc_full": self.pauses.full,
               "host_split": self.splits[-1] if self.splits else None}
        row["paths"] = paths(outs, self.eng.drafts)
        if self.governor_on:  # what it measured and decided from: seconds per token and sample counts per bucket
            row["governor"] = self.gov.snapshot()
            row["pass_decisions"] = getattr(self, "pass_decisions", None)  # the last measured pass's
        if self.adaptive:  # rounds per gamma, acceptance survival per draft, round ms per key and gamma
            row["gamma"] = self.controller.snapshot()
        if self.reference is not None and self.greedy:
            agree = total = 0
            for a, b in zip(row["outs"], self.reference):
                n = min(len(a), len(b))
                first_diff = next((i for i in range(n) if a[i] != b[i]), n)
                agree += first_diff
                total += n
            row["agreement"] = agree / total if total else None
        if self.greedy and self.bench.args.fp32_check:
            row.update(self.bench.fp32_check(self.prompts, row["outs"]))
        return row


def int_list(text: str) -> tuple[int, ...]:
    """'5,8' -> (5, 8): a flag's comma-separated integers."""
    return tuple(int(v) for v in text.split(",") if v)


def vocab_setting(text: str) -> dict[str, int]:
    """'t=0' -> {'t': 0}: `--vocab-config`'s overrides of `triton_kernels.VOCAB_CONFIG`, checked as
    FLASHSPEC_VOCAB_CONFIG is (an unknown key or a bad value is an argparse error)."""
    from engine.triton_kernels import VOCAB_CONFIG, vocab_config

    try:
        full = vocab_config("--vocab-config", text, VOCAB_CONFIG)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    keys = {item.partition("=")[0] for item in text.replace(" ", "").split(",") if item}
    if not keys:
        raise argparse.ArgumentTypeError("--vocab-config: name a setting, e.g. t=0")
    return {k: full[k] for k in full if k in keys}


def governor_settings(text: str) -> tuple[dict, ...]:
    """'a=1,b=0.5;c=2' -> ({'a': 1, 'b': 0.5}, {'c': 2}): `--governor-rows`' keywords of SpeculationGovernor, a
    row each."""
    import inspect

    from engine.governor import SpeculationGovernor

    known = set(inspect.signature(SpeculationGovernor).parameters) - {"clock", "enabled"}
    rows = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        kw = {}
        for item in filter(None, (i.strip() for i in part.split(","))):
            name, sep, value = item.partition("=")
            if not sep or name.strip() not in known:
                raise argparse.ArgumentTypeError(f"{item!r}: need name=value with a name among {sorted(known)}")
            number = float(value)
            kw[name.strip()] = int(number) if number.is_integer() and "." not in value else number
        rows.append(kw)
    return tuple(rows)


def paths(outs, drafts: dict) -> dict:
    """Where a pass's tokens came from, summed over its requests: rounds and tokens of draft rounds and of lookup
    rounds (by the drafter each ran, `SpecStats.by_drafter`; a request may move between them), and tokens of plain
    decoding (the rest of each request's tokens, its prefill's first token included). Tokens a round made past a
    request's end count as its round made them. `drafts`: the engine's, by name (an alternative's name is
    "<draft>/<its name>")."""
    from engine.lookup import is_lookup

    out = {"draft": [0, 0], "lookup": [0, 0], "plain_tokens": 0, "requests_moved": 0}
    for o in outs:
        made = 0
        by = o.stats.by_drafter if o.stats is not None else {}
        for name, (rounds, tokens) in by.items():
            kind = out["lookup" if is_lookup(drafts.get(name.split("/")[-1])) else "draft"]
            kind[0] += rounds
            kind[1] += tokens
            made += tokens
        out["plain_tokens"] += max(len(o.token_ids) - made, 0)
        out["requests_moved"] += len(by) > 1 or (bool(by) and made < len(o.token_ids) - 1)
    return {"draft_rounds": out["draft"][0], "draft_tokens": out["draft"][1], "lookup_rounds": out["lookup"][0],
            "lookup_tokens": out["lookup"][1], "plain_tokens": out["plain_tokens"],
            "requests_moved": out["requests_moved"]}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _allocated() -> int:
    return torch.cuda.memory_allocated() if torch.cuda.is_available() else 0


def _max_allocated() -> int:
    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0


def _reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def load_drafts(folder: str | None, target) -> dict:
    from drafts.checkpoint import load_draft

    if not folder:
        return {}
    out = {}
    for d in DOMAINS:
        path = Path(folder) / d
        if path.exists():
            versions = sorted(p for p in path.iterdir() if (p / "manifest.json").exists())
            if (path / "manifest.json").exists():
                versions = [path]
            if versions:
                out[d] = load_draft(versions[-1], target, name=d)
    return out


def seed_default_drafts(folder: str | None, target) -> dict:
    """The seed-default shape (N = round(L/4), A = 2, mlp_tied head): trained if given, else initialized from the target."""
    from drafts.config import DraftConfig
    from drafts.model import DraftModel

    loaded = load_drafts(folder, target)
    if loaded:
        return loaded
    draft = DraftModel(target, DraftConfig(adapter_layers=2, head="mlp_tied"), name="seed")
    draft.init_from_target()
    return {d: draft for d in DOMAINS}


def cost_model(gamma: int = 5, acceptance: list[float] | None = None, fused: str | None = None) -> list[str]:
    """Measured step costs of a 7B-shaped random-weight Llama; projected FlashSpec speedup (a projection).

    fused ("compiled" / "hand"): also the full step with the model fused for inference (measured last)."""
    from engine.config import ModelArgs
    from engine.model import Transformer

    args = ModelArgs(model_type="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32,
                     num_heads=32, num_kv_heads=32, head_dim=128, max_position_embeddings=4096)
    with torch.device("cuda"):
        model = Transformer(args, max_seq_len=2048).to(torch.bfloat16)
    model.requires_grad_(False)
    cache = model.new_cache(1, 2048)
    pos_len = 1024
    results = {}

    def graph_ms(layers, k, hidden_in):
        tokens = torch.zeros(1, k, dtype=torch.long, device="cuda")
        pos = (pos_len + torch.arange(k, device="cuda"))[None]
        hidden = torch.zeros(1, k, 4096, dtype=torch.bfloat16, device="cuda")

        def fn():
            return model(None if hidden_in else tokens, pos, layers=layers, hidden=hidden if hidden_in else None,
                         cache=cache, kv_len=pos_len + 64).hidden

        return cuda_ms(capture_graph(fn, warmup=1).replay, 30)

    L, N, A = 32, 8, 2
    results["full step, 1 token"] = graph_ms(range(0, L), 1, False)
    results[f"trunk (layers 0-{N - 1}), 1 token"] = graph_ms(range(0, N), 1, False)
    results["one layer (adapter), 1 token"] = graph_ms(range(N, N + 1), 1, True)
    for k in (1, 3, 6):
        results[f"deep layers {N}-{L - 1} + head, {k} tokens"] = graph_ms(range(N, L), k, True)
    if fused:
        model.fuse_for_inference(compile=fused == "compiled")
        results[f"full step, 1 token, fused ({model.fused})"] = graph_ms(range(0, L), 1, False)
    lines = ["| 7B-shaped step (bf16, CUDA graph, 1k context) | ms |", "|---|---|"]
    lines += [f"| {k} | {v:.3f} |" for k, v in results.items()]
    full = results["full step, 1 token"]
    draft_tok = results[f"trunk (layers 0-{N - 1}), 1 token"] + A * results["one layer (adapter), 1 token"]
    acc = acceptance or [0.8, 0.7, 0.6, 0.5, 0.45]
    # Expected tokens per round with position-wise acceptance rates a_i: 1 + sum_j prod_{i<=j} a_i.
    tau, p = 1.0, 1.0
    expected_blocks = {}
    for j in range(gamma):
        p *= acc[min(j, len(acc) - 1)]
        tau += p
    for block in (2, gamma):
        # A verify pass per block reached; block b is reached when all earlier drafts were accepted.
        passes, reach = 0.0, 1.0
        for start in range(0, gamma, block):
            passes += reach
            for j in range(start, min(start + block, gamma)):
                reach *= acc[min(j, len(acc) - 1)]
        verify = results[f"deep layers {N}-{L - 1} + head, {block + 1} tokens"]  # block 2: 3 tokens, block 5: 6
        cost = (gamma + 1) * draft_tok + passes * verify
        expected_blocks[block] = (tau, cost, tau * full / cost)
    lines += ["", f"Projection (not a measurement): N={N}, A={A}, gamma {gamma}, acceptance by position {acc}",
              "| block | tokens per round | ms per round | projected speedup vs AR |", "|---|---|---|---|"]
    lines += [f"| {b} | {t:.2f} | {c:.2f} | {s:.2f}x |" for b, (t, c, s) in expected_blocks.items()]
    del model, cache
    torch.cuda.empty_cache()
    return lines


def best_rows(bench: Bench, workload: tuple, best: dict, ref, suffix: str = "", blocks=(5, 2)) -> list[tuple]:
    """(name, build) for the best drafts at each block size (gamma 5), at each of --gammas (one verify a round),
    with the adaptive gamma controller (--adaptive-gamma, with and without the governor), mixed batches in the
    general loop (batches of several drafts), and block 5 under the governor; workload = (prompts, domains,
    new, greedy, bs). `Bench.measure_engines` runs them."""
    rows = [(f"FlashSpec best drafts, block {block}{suffix}",
             lambda block=block: bench.engine_row(*workload, best, block=block, reference=ref)) for block in blocks]
    rows += [(f"FlashSpec best drafts, gamma {gamma}{suffix}",
              lambda gamma=gamma: bench.engine_row(*workload, best, block=gamma, gamma=gamma, reference=ref))
             for gamma in bench.args.gammas]
    if getattr(bench.args, "gammas_overlapped", False):
        rows += [(f"FlashSpec best drafts, gamma {gamma}, overlapped{suffix}",
                  lambda gamma=gamma: bench.engine_row(*workload, best, block=gamma, gamma=gamma, reference=ref,
                                                       overlap=True))
                 for gamma in bench.args.gammas]
    for width in getattr(bench.args, "trees", ()):
        rows += [(f"FlashSpec best drafts, gamma {gamma}, tree width {width}{suffix}",
                  lambda width=width, gamma=gamma: bench.engine_row(*workload, best, block=gamma, gamma=gamma,
                                                                    reference=ref, tree=width))
                 for gamma in dict.fromkeys((5, *bench.args.gammas))]
        if getattr(bench.args, "gammas_overlapped", False):
            rows += [(f"FlashSpec best drafts, gamma {gamma}, tree width {width}, overlapped{suffix}",
                      lambda width=width, gamma=gamma: bench.engine_row(*workload, best, block=gamma, gamma=gamma,
                                                                        reference=ref, overlap=True, tree=width))
                     for gamma in bench.args.gammas]
        rows += [(f"FlashSpec best drafts, tree width {width}, adaptive gamma, governor, overlapped{suffix}",
                  lambda width=width: bench.engine_row(*workload, best, block=5, adaptive=True, governor=True,
                                                       reference=ref, overlap=True, tree=width))]
    if bench.args.adaptive_gamma:
        rows += [(f"FlashSpec best drafts, adaptive gamma{suffix}",
                  lambda: bench.engine_row(*workload, best, block=5, adaptive=True, reference=ref)),
                 (f"FlashSpec best drafts, adaptive gamma, governor{suffix}",
                  lambda: bench.engine_row(*workload, best, block=5, adaptive=True, governor=True, reference=ref)),
                 (f"FlashSpec best drafts, adaptive gamma, overlapped{suffix}",
                  lambda: bench.engine_row(*workload, best, block=5, adaptive=True, reference=ref, overlap=True)),
                 (f"FlashSpec best drafts, adaptive gamma, governor, overlapped{suffix}",
                  lambda: bench.engine_row(*workload, best, block=5, adaptive=True, governor=True, reference=ref,
                                           overlap=True))]
    if workload[4] > 1 and len({id(d) for d in best.values()}) > 1:  # batches mixing drafts: a graph per piece
        rows.append((f"FlashSpec best drafts, block 5, mixed batches in the general loop{suffix}",
                     lambda: bench.engine_row(*workload, best, block=5, reference=ref, mixed_round_graph=False)))
    rows.append((f"FlashSpec best drafts, block 5, governor{suffix}",
                 lambda: bench.engine_row(*workload, best, block=5, governor=True, reference=ref)))
    return rows + lookup_rows(bench, workload, ref, suffix, best)



BESIDE = ", prefills beside the running rows"  # the rows of --side-prefill (DecodeEngine(side_prefill=True))


def ahead_label(k: int) -> str:
    """The rows of --prefill-ahead k (DecodeEngine(prefill_ahead=k))."""
    return f", {k} rows prefilled ahead"


def lookup_rows(bench: Bench, workload: tuple, ref, suffix: str = "", best: dict | None = None) -> list[tuple]:
    """(name, build) for rows whose requests name an n-gram lookup drafter (--lookup gammas): at each gamma alone
    and overlapped, and at the largest in the service's setting (governor, overlapped); with `best` (the best
    drafts), also the service's setting where each draft has the lookup drafter as an alternative and the governor
    picks per domain and batch size, from measured costs, which one a request runs."""
    from engine.lookup import DEFAULT_STREAK_GAMMAS, LookupDraft
    from services.config import AppArgs

    gammas = getattr(bench.args, "lookup", ())
    if not gammas:
        return []
    top = max(gammas)
    service_ahead = AppArgs(device="cuda", max_batch_size=workload[4]).engine_prefill_ahead()  # the service's default

    def alone(lookup: LookupDraft, gamma: int, label: str, **kw) -> tuple:
        """Every request names `lookup` (under its domain) at `gamma` at every batch size."""
        drafts = {domain: lookup for domain in DOMAINS}
        return (f"FlashSpec lookup, gamma {gamma}{label}{suffix}",
                lambda: bench.engine_row(*workload, drafts, block=gamma, gamma=gamma, reference=ref, **kw))

    def service(label: str = "", after: str = "", alternative=True, engine_kw: dict | None = None, **kw) -> tuple:
        """The service's setting: the best drafts with the lookup drafter (`alternative`) as each one's alternative,
        and its rows for requests prefilled ahead on CUDA (`service_ahead`)."""
        engine_kw = {"prefill_ahead": service_ahead, **(engine_kw or {})}
        return (f"FlashSpec best drafts or lookup (governor's choice), {label}adaptive gamma, governor, overlapped"
                f"{after}{suffix}",
                lambda: bench.engine_row(*workload, best, block=5, adaptive=True, governor=True, reference=ref,
                                         overlap=True, lookup_alternative=alternative, engine_kw=engine_kw, **kw))

    lookup = LookupDraft(gammas={}, streak_gammas={})  # each row's gamma at every batch size, every round
    rows = []
    for gamma in gammas:
        rows += [alone(lookup, gamma, ""), alone(lookup, gamma, ", overlapped", overlap=True)]
    rows.append(alone(lookup, top, ", governor, overlapped", governor=True, overlap=True))
    if best:
        rows.append(service())
        if getattr(bench.args, "lookup_replay", False):  # the same with lookup priced from replays, or not at all
            rows += [service("replayed at every batch size, ", lookup_replay=True),
                     service("not replayed, ", lookup_replay=False)]
    settings = [(f", return window {w}", {"return_window": w}) for w in getattr(bench.args, "return_window", ())]
    settings += [(", governor " + ", ".join(f"{k}={v}" for k, v in kw.items()), kw)
                 for kw in getattr(bench.args, "governor_rows", ())]
    if getattr(bench.args, "side_prefill", False):  # admissions' prefills beside the running rows
        beside = {"side_prefill": True}
        rows.append(alone(lookup, top, ", overlapped" + BESIDE, overlap=True, engine_kw=beside))
        if best:
            rows.append(service(after=BESIDE, engine_kw=beside))
    for k in getattr(bench.args, "prefill_ahead", ()):  # admissions prefilled in groups ahead of a free row
        ahead = {"prefill_ahead": k}
        rows.append(alone(lookup, top, ", overlapped" + ahead_label(k), overlap=True, engine_kw=ahead))
        if best:
            rows.append(service(after=ahead_label(k), engine_kw=ahead))
    if best and getattr(bench.args, "comeback_prices", "on") == "off":  # plain rows' replays not pricing lookup
        rows.append(service(after=", plain rows' replays not pricing lookup", engine_attrs={"comeback_prices": False}))
    if getattr(bench.args, "plain_timing", None) == "step":  # plain calls priced as before, side by side
        step = {"plain_timed_from_read": False}
        rows.append(alone(lookup, top, ", governor, overlapped, plain calls timed from the step", governor=True,
                          overlap=True, engine_attrs=step))
        if best:
            rows.append(service(after=", plain calls timed from the step", engine_attrs=step))
    for after, kw in settings if best else ():  # the governor's settings (the way back's window, ...), side by side
        rows.append(service(after=after, governor_kw=kw))
    for lone in getattr(bench.args, "lookup_lone", ()) if best else ():  # a lone row's lookup gamma, side by side
        rows.append(service(after=f", lone lookup gamma {lone}", alternative=LookupDraft(gammas={1: lone})))
    streaks = getattr(bench.args, "lookup_streaks", ())
    for streak in streaks:  # a lone row's gamma after a round that accepted everything, side by side
        after = f", {streak} after a full round"
        rows.append(alone(LookupDraft(gammas={}, streak_gammas={1: streak}), top, ", overlapped" + after, overlap=True))
        if best and {1: streak} != DEFAULT_STREAK_GAMMAS:
            rows.append(service(after=", lone lookup" + after, alternative=LookupDraft(streak_gammas={1: streak})))
    if streaks and best:
        rows.append(service(after=", no streak gamma", alternative=LookupDraft(streak_gammas={})))
    for max_n in getattr(bench.args, "lookup_max_n", ()):  # the longest n-gram looked up, side by side
        after = f", n up to {max_n}"
        rows.append(alone(LookupDraft(max_n=max_n, gammas={}, streak_gammas={}), top, ", overlapped" + after,
                          overlap=True))
        if best:
            rows.append(service(after=after, alternative=LookupDraft(max_n=max_n)))
    if getattr(bench.args, "no_regroup", False):  # chains stopped near rows' ends and for each change, side by side
        after = ", chains not regrouped"
        rows.append(alone(lookup, top, ", overlapped" + after, overlap=True, engine_attrs={"regroup_chains": False}))
        if best:
            rows.append(service(after=after, engine_attrs={"regroup_chains": False}))
    if getattr(bench.args, "lookup_allot", False):  # each row its own gamma within the batch's verify tokens
        after = ", allotted"
        rows.append(alone(LookupDraft(gammas={}, streak_gammas={}, allot=True), top, ", overlapped" + after,
                          overlap=True))
        if best:
            rows.append(service(after=after, alternative=LookupDraft(allot=True)))
    vocab = getattr(bench.args, "vocab_config", None)
    if vocab:  # the vocabulary projection's launch setting, side by side
        after = ", vocabulary " + ",".join(f"{k}={v}" for k, v in vocab.items())
        rows.append(alone(lookup, top, ", overlapped" + after, overlap=True, vocab_config=vocab))
        if best:
            rows.append(service(after=after, vocab_config=vocab))
    if getattr(bench.args, "lookup_before_repeat", False):  # the rule before the repeat (n 3 else 2), side by side
        before = ", rule before the repeat"
        old = LookupDraft(max_n=3, min_n=2, gammas={}, repeat=False)
        rows += [alone(old, top, ", overlapped" + before, overlap=True),
                 alone(old, top, ", governor, overlapped" + before, governor=True, overlap=True)]
        if best:
            rows.append(service(after=before, alternative=LookupDraft(max_n=3, min_n=2, repeat=False)))
    return rows


def fused_settings(args, settings: list) -> list:
    """The settings the fused rows run in (--fused-batch-sizes, --fused-greedy-only)."""
    sizes = {int(b) for b in args.fused_batch_sizes.split(",")} if args.fused_batch_sizes else None
    return [s for s in settings if (sizes is None or s[0] in sizes) and (s[3] or not args.fused_greedy_only)]


def run_fused(bench: Bench, args, settings, refs: dict, best: dict, seed: dict) -> list[str]:
    """Fuse the target (and the drafts' adapters) in place, then the fused rows; returns the comparison table."""
    from engine.fused import fuse_for_inference

    target = bench.loaded.model
    compile = args.fused == "compiled"
    before = step_profile(target)
    target.fuse_for_inference(compile=compile)
    drafts = best or seed
    for draft in {id(d): d for d in drafts.values()}.values():
        fuse_for_inference(draft, compile=compile)  # the draft's own adapter layers (its trunk is the target's)
    after = step_profile(target)
    mode = target.fused  # "hand" when compiling failed and the kernels fell back to eager
    print(json.dumps({"fused": mode, "step_unfused": before, "step_fused": after}), flush=True)
    kind_name = "best drafts" if best else "seed-default shape"
    settings = fused_settings(args, settings)
    for bs, kind, new, greedy in settings:
        setting, prompts, domains = bench.cell(bs, kind, new, greedy)
        ref = refs[setting]
        workload = (prompts, domains, new, greedy, bs)
        rows = [("engine AR (fused)", lambda: bench.engine_row(*workload, None, reference=ref)),
                ("engine AR (fused, overlapped)", lambda: bench.engine_row(*workload, None, reference=ref, overlap=True))]
        if args.side_prefill:  # plain decoding with admissions' prefills beside the running rows
            rows += [(f"engine AR (fused{more}){BESIDE}",
                      lambda overlap=overlap: bench.engine_row(*workload, None, reference=ref, overlap=overlap,
                                                               engine_kw={"side_prefill": True}))
                     for more, overlap in (("", False), (", overlapped", True))]
        rows += [(f"engine AR (fused, overlapped){ahead_label(k)}",
                  lambda k=k: bench.engine_row(*workload, None, reference=ref, overlap=True,
                                               engine_kw={"prefill_ahead": k}))
                 for k in args.prefill_ahead]  # plain decoding with admissions prefilled ahead
        if best:
            rows += best_rows(bench, workload, best, ref, " (fused)", args.blocks)
        else:
            rows += [(f"FlashSpec {kind_name}, {label} (fused)",
                      lambda block=block: bench.engine_row(*workload, seed, block=block, reference=ref))
                     for block, label in ((2, "block 2"), (5, "block gamma"))]
        bench.measure_engines(setting, rows)
    layers = target.args.num_layers
    fmt = lambda v, f="{:.2f}": f.format(v) if v is not None else "-"  # noqa: E731
    per_layer = lambda k: k / layers if k is not None else None  # noqa: E731
    lines = ["", f"Fused inference path ({mode}; Transformer.fuse_for_inference) against the same rows unfused, "
                 "same run. Greedy agreement is with the unfused engine AR.",
             "| decode step, bs 1, 1 token, 512 context | unfused | fused | fused / unfused |", "|---|---|---|---|",
             f"| CUDA graph replay, ms | {before['ms']:.3f} | {after['ms']:.3f} | {after['ms'] / before['ms']:.2f}x |",
             f"| CUDA kernels per eager step (per layer) | {fmt(before['kernels'], '{}')} "
             f"({fmt(per_layer(before['kernels']), '{:.1f}')}) | {fmt(after['kernels'], '{}')} "
             f"({fmt(per_layer(after['kernels']), '{:.1f}')}) | - |", "",
             "| setting | path | unfused tokens/s | fused tokens/s | fused / unfused | greedy agreement with AR |",
             "|---|---|---|---|---|---|"]
    for r in bench.rows:
        if not r["name"].endswith(" (fused)"):
            continue
        base = next((x for x in bench.rows if x["setting"] == r["setting"] and x["name"] == r["name"][: -len(" (fused)")]),
                    None)
        if base is not None and base["tps"] is None:
            base = None  # the unfused row failed
        if r["tps"] is None:
            lines.append(f"| {r['setting']} | {r['name']} | {fmt(base['tps'] if base else None, '{:.1f}')} | "
                         f"failed: {r['error']} | - | - |")
            continue
        ratio = r["tps"] / base["tps"] if base else None
        lines.append(f"| {r['setting']} | {r['name']} | {fmt(base['tps'] if base else None, '{:.1f}')} | {r['tps']:.1f} | "
                     f"{fmt(ratio)}x | {fmt(r.get('agreement'), '{:.3f}')} |")
    return lines


def run_attention(bench: Bench, args, settings, refs: dict, best: dict) -> list[str]:
    """Rows again with each backend of --attention-compare (on the fused path when --fused ran): engine AR
    and the best drafts at block 5, with and without the governor; returns the comparison table."""
    target = bench.loaded.model
    base_suffix = " (fused)" if args.fused else ""
    if args.fused:  # the rows compared with are the fused ones: the same settings
        settings = fused_settings(args, settings)
    steps = {target.backend.name: step_profile(target)}
    names = []
    for name in args.attention_compare.split(","):
        target.set_attention_backend(name)
        if target.backend.name != name:
            print(f"attention backend {name} unavailable here; its rows are left out", flush=True)
            continue
        steps[name] = step_profile(target)
        names.append(name)
        suffix = f" (fused, {name} attention)" if args.fused else f" ({name} attention)"
        for bs, kind, new, greedy in settings:
            setting, prompts, domains = bench.cell(bs, kind, new, greedy)
            ref = refs[setting]
            workload = (prompts, domains, new, greedy, bs)
            rows = [(f"engine AR{suffix}", lambda: bench.engine_row(*workload, None, reference=ref))]
            if best:
                rows += best_rows(bench, workload, best, ref, suffix, (5,))
            bench.measure_engines(setting, rows)
    target.set_attention_backend(args.attention)
    fmt = lambda v, f="{:.2f}": f.format(v) if v is not None else "-"  # noqa: E731
    lines = ["", f"Attention backends (model.set_attention_backend) against {args.attention}, same run"
                 f"{' on the fused path' if args.fused else ''}. Greedy agreement is with the first engine AR row.",
             "| decode step, bs 1, 1 token, 512 context | CUDA graph replay, ms | CUDA kernels per eager step |", "|---|---|---|"]
    lines += [f"| {n} | {st['ms']:.3f} | {fmt(st['kernels'], '{}')} |" for n, st in steps.items()]
    lines += ["", f"| setting | path | {args.attention} tokens/s | tokens/s | ratio | mean accepted length | "
                  "greedy agreement with AR |", "|---|---|---|---|---|---|---|"]
    for name in names:
        suffix = f" (fused, {name} attention)" if args.fused else f" ({name} attention)"
        for r in bench.rows:
            if not r["name"].endswith(suffix):
                continue
            base_name = r["name"][: -len(suffix)] + base_suffix
            base = next((x for x in bench.rows if x["setting"] == r["setting"] and x["name"] == base_name), None)
            bt = base["tps"] if base is not None else None
            if r["tps"] is None:
                lines.append(f"| {r['setting']} | {r['name']} | {fmt(bt, '{:.1f}')} | failed: {r['error']} | - | - | - |")
                continue
            lines.append(f"| {r['setting']} | {r['name']} | {fmt(bt, '{:.1f}')} | {r['tps']:.1f} | "
                         f"{fmt(r['tps'] / bt if bt else None)}x | {fmt(r.get('mal'))} | {fmt(r.get('agreement'), '{:.3f}')} |")
    return lines


def main_table(bench: Bench, args) -> list[str]:
    """The setup line and one row per measured path, with ratios to engine AR (and, for rows of the fused path,
    to engine AR fused: what a fused row's speed-up is) and transformers static."""
    lines = [f"setup: {setup_line('cuda', 0)}; {torch.cuda.get_device_name()}; SmolLM2-135M-Instruct bf16; "
             f"prompts {args.prompts} (long cells max(bs, {args.long_prompts}) requests, short cells max(bs, {args.short_prompts}))" + (f"; engine rows: median of {args.passes} measured passes" if args.passes > 1 else "")
             + (f" ({args.short_passes} in the short cells)" if args.short_passes else "")
             + (f"; layer kernels on, up to {triton_layer.MAX_ROWS} rows a step (FLASHSPEC_LAYER_ROWS)"
                if triton_layer.ENABLED else "; layer kernels off (FLASHSPEC_LAYER_KERNELS=0)")
             + f"; sampling kernels {'on' if triton_kernels.SAMPLING else 'off (FLASHSPEC_SAMPLING_KERNELS=0)'}"
             + f"; vocabulary projection {'16-bit weight kernel' if triton_kernels.VOCAB else 'fp32 copy (FLASHSPEC_VOCAB_KERNEL=0)'}"
             + f"; final norm {'in the projection' if triton_kernels.VOCAB_NORM else 'torch ops (FLASHSPEC_VOCAB_NORM=0)'}"
             + f"; programmatic dependent launch {'on' if triton_kernels.PDL else 'off (FLASHSPEC_PDL=0)'}"
             + f"; output/down projections {'Triton kernel' if triton_layer.PROJ else 'cuBLAS (FLASHSPEC_PROJ_KERNEL=0)'}"
             + f"; attention splits merged {'by their last program (FLASHSPEC_ATTN_INLINE_MERGE=1)' if triton_attention.INLINE_MERGE else 'by a merge kernel'}"
             + f"; prefill {'as CUDA graphs' if prefill_graphs_default() else 'eager (FLASHSPEC_PREFILL_GRAPHS=0)'}"
             + f"; a pass's cos, sin and mask {'in one launch (FLASHSPEC_CONTEXT_KERNEL=1)' if triton_kernels.CONTEXT else 'as torch ops'}",
             "",
             "| setting | path | tokens/s | vs engine AR | vs engine AR (fused) | vs transformers static | "
             "mean accepted length | acceptance | greedy agreement with AR | peak GiB | "
             "passes (graphs captured in timed passes, passes rerun) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    return lines + table_rows(bench.rows)


def table_rows(rows: list[dict]) -> list[str]:
    """The main table's rows; a failed row shows its error and no figures."""
    fmt = lambda v, f="{:.2f}": f.format(v) if v is not None else "-"  # noqa: E731
    lines = []
    for r in rows:
        if r["tps"] is None:
            lines.append(f"| {r['setting']} | {r['name']} | failed: {r['error']} | - | - | - | - | - | - | - | - |")
            continue
        same = [x for x in rows if x["setting"] == r["setting"]]
        ar_tps = next((x["tps"] for x in same if x["name"] == "engine AR"), None)
        st_tps = next((x["tps"] for x in same if x["name"] == "transformers generate (static)"), None)
        fused_tps = next((x["tps"] for x in same if x["name"] == "engine AR (fused)"), None) if "(fused" in r["name"] else None
        lines.append(f"| {r['setting']} | {r['name']} | {r['tps']:.1f} | {fmt(r['tps'] / ar_tps if ar_tps else None)}x | "
                     f"{fmt(r['tps'] / fused_tps if fused_tps else None)}x | {fmt(r['tps'] / st_tps if st_tps else None)}x | {fmt(r.get('mal'))} | {fmt(r.get('acc'))} | "
                     f"{fmt(r.get('agreement'), '{:.3f}')} | {fmt(r.get('peak_gb'))} | {spread(r)} |")
    return lines


def spread(row: dict) -> str:
    """A row's slowest and fastest measured pass, and the CUDA graphs captured inside its timed passes with how
    many passes ran again for it (each capture stalls the batch for 0.2-2 s on the H200; a pass that captured
    runs again, `EngineRow.timed_pass`, so only a pass that captured on its last try counts one)."""
    passes = row.get("tps_passes") or []
    if len(passes) < 2:
        return "-"
    captured, rerun = row.get("graphs_in_passes"), row.get("passes_rerun") or 0
    note = f"{captured} captured, {rerun} passes rerun" if captured else ""
    return f"{min(passes):.0f}-{max(passes):.0f}" + (f" ({note})" if note else "")


def fp32_table(bench: Bench) -> list[str]:
    """Greedy rows: agreement with AR up to the first divergence, and every token against the fp32 target."""
    rows = [r for r in bench.rows if r.get("fp32_agreement") is not None]
    if not rows:
        return []
    fmt = lambda v, f="{:.3f}": f.format(v) if v is not None else "-"  # noqa: E731
    lines = ["", "bf16 greedy tokens against the fp32 target's argmax given the same prefix (every token), and "
                 "agreement with engine AR up to the first divergence. Gap: fp32 logit of the argmax minus that of "
                 "the token emitted, where they differ.",
             "| setting | path | agreement with AR (to first divergence) | fp32 argmax agreement | tokens differing | "
             "median gap | max gap |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['setting']} | {r['name']} | {fmt(r.get('agreement'))} | {fmt(r['fp32_agreement'])} | "
                     f"{r['fp32_misses']} | {fmt(r['fp32_gap_median'])} | {fmt(r['fp32_gap_max'])} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", default="bench/data/gpu_prompts.json")
    parser.add_argument("--drafts", default=None, help="folder with <domain>/ trained drafts (best configuration)")
    parser.add_argument("--seed-drafts", default=None, help="folder with <domain>/ trained seed-default-shape drafts")
    parser.add_argument("--quick", action="store_true", help="bs 1 only, greedy only")
    parser.add_argument("--batch-sizes", default="1,8", help="comma list of batch sizes to run")
    parser.add_argument("--lengths", default="long,short", help="long (512->256) and/or short (32->20)")
    parser.add_argument("--sampling", default="greedy,t1", help="greedy and/or t1 (T=1)")
    parser.add_argument("--skip-seed", action="store_true", help="leave out the seed-default-shape rows")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--skip-cost", action="store_true")
    parser.add_argument("--rows", default=None, type=lambda v: tuple(w for w in v.split(";") if w),
                        help="engine rows to run, as ';'-separated parts of their names (each cell's first row, "
                             "what its ratios are against, always runs), e.g. 'overlapped' or 'lookup;governor'")
    parser.add_argument("--hf-modes", default="eager,static,lookup", help="transformers generate rows to run")
    parser.add_argument("--blocks", default="5,2", type=int_list,
                        help="block sizes of the best-draft rows (the governor row always uses 5)")
    parser.add_argument("--gammas", default=(), type=int_list,
                        help="best-draft rows at these fixed gammas too (block = gamma: one verify a round), e.g. 3")
    parser.add_argument("--gammas-overlapped", action="store_true",
                        help="each --gammas row again with overlapped calls (DecodeEngine(overlap=True))")
    parser.add_argument("--trees", default=(), type=int_list,
                        help="best-draft rows with draft trees of these widths (engine.tree; greedy rounds at batch 1), "
                             "at gamma 5 and in the service's setting (adaptive gamma, governor, overlapped), e.g. 2,3,4")
    parser.add_argument("--lookup", default=(), type=int_list,
                        help="rows whose requests name an n-gram lookup drafter (engine.lookup.LookupDraft) at these "
                             "gammas, alone and overlapped, and at the largest with the governor, e.g. 5,8")
    parser.add_argument("--lookup-before-repeat", action="store_true",
                        help="with --lookup: also lookup's rows (alone and in the service's setting) with the rule "
                             "before the repeat (n 3 else 2, only the tokens that followed; LookupDraft(max_n=3, min_n=2, "
                             "repeat=False)), side by side")
    parser.add_argument("--lookup-max-n", default=(), type=int_list,
                        help="with --lookup: also lookup alone at the largest gamma (overlapped) and the service's "
                             "setting with the longest n-gram looked up at each of these (LookupDraft(max_n=N); the "
                             "default is engine.lookup.DEFAULT_MAX_N, 6), side by side, e.g. 3")
    parser.add_argument("--no-regroup", action="store_true",
                        help="with --lookup: add lookup at the largest gamma overlapped and the service's setting again "
                             "with an overlapped lookup batch's chain stopped near a row's end and for each change of "
                             "rows, as before regrouped chains (DecodeEngine.regroup_chains = False), side by side")
    parser.add_argument("--lookup-allot", action="store_true",
                        help="with --lookup: also lookup alone at the largest gamma (overlapped) and the service's "
                             "setting with allotted rounds (LookupDraft(allot=True): at batch sizes 2 and up each row "
                             "its own gamma by its match's n, within the verify tokens of the batch's gamma), side by "
                             "side")
    parser.add_argument("--vocab-config", default=None, type=vocab_setting,
                        help="with --lookup: also lookup alone at the largest gamma (overlapped) and the service's "
                             "setting with the vocabulary projection's launch setting overridden by this "
                             "(FLASHSPEC_VOCAB_CONFIG's syntax), side by side, e.g. t=0")
    parser.add_argument("--return-window", default=(), type=int_list,
                        help="with --lookup: also the service's setting with the governor's return window (replayed "
                             "rounds the way back to lookup is judged by; engine.governor.RETURN_WINDOW) at each of "
                             "these, e.g. 32")
    parser.add_argument("--comeback-prices", choices=("on", "off"), default="on",
                        help="with --lookup, off: also the service's setting with a plain row's replay of lookup only "
                             "watching for its way back, not pricing lookup for its domain "
                             "(DecodeEngine.comeback_prices False, as before), side by side")
    parser.add_argument("--side-prefill", action="store_true",
                        help="also plain decoding (fused, alone and overlapped) and, with --lookup, lookup at the "
                             "largest gamma overlapped and the service's setting with each admission's prefill on a "
                             "second CUDA stream beside the running rows (DecodeEngine(side_prefill=True)), side by "
                             "side")
    parser.add_argument("--prefill-ahead", default=(), type=int_list,
                        help="also overlapped plain decoding (fused) and, with --lookup, lookup at the largest gamma "
                             "overlapped and the service's setting with this many cache rows for requests prefilled "
                             "ahead of a free running row, a group a pass (DecodeEngine(prefill_ahead=K)), side by "
                             "side; e.g. 7, or 0 for the service's setting without (it holds the service's default "
                             "on CUDA: bs - 1, at most 7)")
    parser.add_argument("--plain-timing", choices=("read", "step"), default="read",
                        help="with --lookup, step: also lookup under the governor and the service's setting with an "
                             "overlapped plain call priced from its step's start, as before "
                             "(DecodeEngine.plain_timed_from_read = False), side by side")
    parser.add_argument("--governor-rows", default=(), type=governor_settings,
                        help="with --lookup: also the service's setting with each of these governor settings "
                             "(SpeculationGovernor's keywords; ';' between rows, ',' between keywords), e.g. "
                             "'tokens_alpha=0.001;return_window=4'")
    parser.add_argument("--lookup-lone", default=(), type=int_list,
                        help="with --lookup: also the service's setting with a lone greedy row's lookup gamma at each "
                             "of these (LookupDraft(gammas={1: G}); the default is engine.lookup.DEFAULT_GAMMAS), "
                             "e.g. 12,15")
    parser.add_argument("--lookup-streaks", default=(), type=int_list,
                        help="with --lookup: also lookup alone at the largest gamma with a lone row's rounds at each of "
                             "these after a round that accepted everything (LookupDraft(streak_gammas={1: S}); the "
                             "alone rows run without), and the service's setting without a streak gamma, e.g. 15")
    parser.add_argument("--lookup-replay", action="store_true",
                        help="with --lookup: also the service's setting with lookup priced from replays of every "
                             "greedy request (DecodeEngine(lookup_replay=True)) and from none (False), beside the "
                             "default (requests admitted to run alone)")
    parser.add_argument("--adaptive-gamma", action="store_true",
                        help="best-draft rows with engine.gamma's adaptive gamma (at most 5), alone and with the governor")
    parser.add_argument("--unfused-rows", default="all", choices=("all", "ar"),
                        help="'ar': of the engine's unfused rows only plain decoding (the FlashSpec rows then run on "
                             "the fused path alone, with --fused)")
    parser.add_argument("--fused-batch-sizes", default=None, help="fused rows only at these batch sizes (default: all)")
    parser.add_argument("--fused-greedy-only", action="store_true", help="fused rows only for the greedy settings")
    parser.add_argument("--short-prompts", type=int, default=24, help="requests per short (32->20) cell (at least the batch size)")
    parser.add_argument("--long-prompts", type=int, default=6, help="requests per long (512->256) cell (at least the batch size)")
    parser.add_argument("--passes", type=int, default=1,
                        help="measured passes per row after the warm-up one; tokens/s is their median")
    parser.add_argument("--short-passes", type=int, default=None,
                        help="measured passes per row of the short (32->20) cells (default: --passes); a pass there "
                             "is tens of milliseconds and host jitter moves one by 10-30 %%")
    parser.add_argument("--no-fp32-check", dest="fp32_check", action="store_false",
                        help="leave out the check of greedy rows' tokens against the fp32 target")
    parser.add_argument("--attention", default="sdpa", choices=BACKENDS, help="attention backend of every row")
    parser.add_argument("--attention-compare", default=None,
                        help="comma list of other backends (e.g. triton): engine AR and block-5 rows again with each, "
                             "after the other rows (on the fused path with --fused), and a comparison table")
    parser.add_argument("--out", default=None)
    parser.add_argument("--fused", nargs="?", const="compiled", choices=("compiled", "hand"), default=None,
                        help="also run the fused inference path after the unfused rows: 'compiled' (the default "
                             "when the flag is given: fused GEMMs + compiled RMSNorm/RoPE/SiLU) or 'hand' (fused "
                             "GEMMs only)")
    args = parser.parse_args()
    bench = Bench(args)
    target = bench.loaded.model
    target.set_attention_backend(args.attention)
    best = load_drafts(args.drafts, target)
    seed = seed_default_drafts(args.seed_drafts, target)
    sizes = [1] if args.quick else [int(b) for b in args.batch_sizes.split(",")]
    greedies = [True] if args.quick else [m == "greedy" for m in args.sampling.split(",")]
    lengths = [(k, {"long": 256, "short": 20}[k]) for k in args.lengths.split(",")]
    settings = [(bs, kind, new, greedy) for bs in sizes for kind, new in lengths for greedy in greedies]
    refs: dict[str, list] = {}  # setting -> the unfused engine AR outputs
    for bs, kind, new, greedy in settings:
        setting, prompts, domains = bench.cell(bs, kind, new, greedy)
        if not args.skip_hf:
            for mode in args.hf_modes.split(","):
                bench.measure(setting, f"transformers generate ({mode})",
                              lambda: bench.run_hf(prompts, new, greedy, mode, bs))
        ar = bench.measure(setting, "engine AR", lambda: bench.run_engine(prompts, domains, new, greedy, bs, None))
        ref = ar.get("outs")  # None when the AR row failed: the other rows then go unchecked against it
        refs[setting] = ref
        workload = (prompts, domains, new, greedy, bs)
        rows = []  # interleaved with each other (engine AR ran first: its outputs are what they are checked against)
        if not args.skip_seed:
            rows += [(f"FlashSpec seed-default shape, {label}",
                      lambda block=block: bench.engine_row(*workload, seed, block=block, reference=ref))
                     for block, label in ((2, "block 2"), (5, "block gamma"))]
        if best and args.unfused_rows == "all":
            rows += best_rows(bench, workload, best, ref, blocks=args.blocks)
        if rows:
            bench.measure_engines(setting, rows)
        if args.out:  # the table so far, so a run stopped by a time limit still leaves one
            Path(args.out).write_text("\n".join(main_table(bench, args)) + "\n(partial: the run goes on)\n")
    fused_lines = run_fused(bench, args, settings, refs, best, seed) if args.fused else []
    attention_lines = run_attention(bench, args, settings, refs, best) if args.attention_compare else []
    lines = main_table(bench, args) + fused_lines + attention_lines + fp32_table(bench)
    if not args.skip_cost:
        lines += [""] + cost_model(fused=args.fused)
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()

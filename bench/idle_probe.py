"""Where the GPU waits for the host in a bs 8 pass, and what an admission's prefill costs.

    python -m bench.idle_probe [--passes 1] [--engines plain,plain-overlapped,lookup]   # on the GPU machine

Engines as `bench.side_prefill_probe` builds them (the default model, bf16, fused and compiled, Triton attention,
bs 8, warmed up): fused plain decoding, the same overlapped, lookup rows at gamma 5 overlapped. Each runs the
benchmark's 32 long prompts (512 -> 256): a warm pass, a timed pass, then a pass under torch.profiler with the
engine's methods marked (admission, prefill, plain call, round launch, resolving a chained call, commit). From the
profile's kernels (those replayed by CUDA graphs included) the GPU's busy time is their union; every microsecond of
the pass the GPU runs no kernel is charged to the innermost marked method the host is in at that moment. A line per
engine: the pass's wall time, GPU busy and idle time, idle time by method, and the prefills' GPU time against
their wall time. The profiler slows the host (and CUPTI the graphs' launches), so its idle times are an upper
bound; the timed pass's wall time is the one without it. Between them a pass without the profiler splits the host's
time in the steps: waiting for the GPU (the event waits of `engine.scheduler._read`) and the rest.

Then one admission alone, the GPU idle before it: `_prefill` for one 512-token prompt (host wall, synchronized),
against its CUDA graph's replay alone.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import numpy as np
import torch

LABELS = ("step", "admit", "prefill", "plain", "round", "resolve", "commit")
METHODS = {"step": "step", "admit": "_admit", "prefill": "_prefill", "plain": "_ar_step", "round": "_spec_round",
           "resolve": "_resolve_ahead", "commit": "_commit_round"}


def mark(eng) -> None:
    """Wrap the engine's methods in profiler ranges named by LABELS."""
    for label, name in METHODS.items():
        real = getattr(eng, name)

        @functools.wraps(real)
        def wrapped(*args, _real=real, _label=label, **kwargs):
            with torch.profiler.record_function(_label):
                return _real(*args, **kwargs)

        setattr(eng, name, wrapped)


def host_split(eng, run) -> dict:
    """One pass (`run()`) without the profiler, the host's time split: in the engine's steps, of that waiting for the
    GPU (`engine.scheduler._read`'s event waits), and the steps that found their GPU work already done (a wait under
    20 us: the host, not the GPU, was the slower one there)."""
    from engine import scheduler

    real_read, real_step = scheduler._read, eng.step
    waits, steps = [], []

    def read(host, ready):
        t = time.perf_counter()
        if ready is not None:
            ready.synchronize()
        waits.append(time.perf_counter() - t)
        return real_read(host, None)

    def step():
        t = time.perf_counter()
        try:
            return real_step()
        finally:
            steps.append(time.perf_counter() - t)

    scheduler._read, eng.step = read, step
    try:
        torch.cuda.synchronize()
        t = time.perf_counter()
        run()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    finally:
        scheduler._read = real_read
        del eng.step
    return {"split_pass_ms": round(wall * 1000, 1), "steps": len(steps), "step_ms": round(sum(steps) * 1000, 1),
            "wait_ms": round(sum(waits) * 1000, 1), "host_ms_per_step": round((sum(steps) - sum(waits)) * 1000 / len(steps), 3),
            "reads": len(waits), "reads_not_waiting": sum(w < 20e-6 for w in waits)}


def idle_by_label(events, t0: float, t1: float) -> dict:
    """From profiler events: GPU busy/idle in [t0, t1] (us) and the idle time by the innermost label then."""
    n = int(t1 - t0) + 1
    busy = np.zeros(n, dtype=bool)
    kernels = 0
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.elapsed_us() > 0:
            a, b = int(e.time_range.start - t0), int(e.time_range.end - t0)
            if b > 0 and a < n:
                busy[max(a, 0):min(b, n)] = True
                kernels += 1
    label_at = np.full(n, -1, dtype=np.int8)
    ranges = sorted(((e.time_range.start, e.time_range.end, LABELS.index(e.name)) for e in events
                     if e.device_type == torch.autograd.DeviceType.CPU and e.name in LABELS),
                    key=lambda r: r[0] - r[1])  # longest first: inner ranges paint over outer ones
    wall = {label: 0.0 for label in LABELS}
    for a, b, i in ranges:
        label_at[max(int(a - t0), 0):min(int(b - t0), n)] = i
    for a, b, i in ranges:
        wall[LABELS[i]] += (b - a) / 1000
    idle = ~busy
    out = {"kernels": kernels, "busy_ms": round(busy.sum() / 1000, 1), "idle_ms": round(idle.sum() / 1000, 1),
           "idle_ms_by": {"caller": round(float((idle & (label_at == -1)).sum()) / 1000, 1)}}
    for i, label in enumerate(LABELS):
        out["idle_ms_by"][label] = round(float((idle & (label_at == i)).sum()) / 1000, 1)
    pre = label_at == LABELS.index("prefill")
    out["prefill_wall_ms"] = round(wall["prefill"], 1)
    out["prefill_busy_ms"] = round(float((busy & pre).sum()) / 1000, 1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", default="plain,plain-overlapped,lookup")
    parser.add_argument("--prompts", type=int, default=32)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.idle_probe needs a CUDA GPU; run it on the GPU machine")
    from bench.gpu import fused_long_workload
    from engine.generate import generate
    from engine.lookup import LookupDraft
    from engine.sampling import SamplingParams
    from engine.scheduler import DecodeEngine
    from engine.speculative import SpecConfig

    loaded, prompts = fused_long_workload(args.prompts)
    m = loaded.model
    params = SamplingParams(max_new_tokens=256, eos_token_ids=())
    max_len = max(len(p) for p in prompts) + 272

    for kind in args.engines.split(","):
        eng = DecodeEngine(m, loaded.tokenizer, max_batch_size=8, max_seq_len=max_len, spec=SpecConfig(5, 5),
                           overlap=kind != "plain")
        drafter = None
        if kind == "lookup":
            eng.add_draft("lookup", LookupDraft(gammas={}, streak_gammas={}))
            drafter = "lookup"
        eng.warmup()
        generate(eng, prompts, params, drafter)  # a warm pass
        torch.cuda.synchronize()
        t = time.perf_counter()
        outs = generate(eng, prompts, params, drafter)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t) * 1000
        tokens = sum(len(o.token_ids) for o in outs)
        split = host_split(eng, lambda: generate(eng, prompts, params, drafter))
        mark(eng)
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            with torch.profiler.record_function("pass"):
                generate(eng, prompts, params, drafter)
            torch.cuda.synchronize()
        events = prof.events()
        span = [e for e in events if e.name == "pass"][0].time_range
        line = {"engine": kind, "pass_ms": round(wall, 1), "tokens_per_s": round(tokens / wall * 1000, 1),
                "profiled_pass_ms": round(span.elapsed_us() / 1000, 1)}
        line.update(split)
        line.update(idle_by_label(events, span.start, span.end))
        print(json.dumps(line), flush=True)

        # One admission alone: a 512-token prompt's prefill, the GPU idle before it.
        from engine.requests import Request, SlotState
        from engine.sampling import RandomStream

        walls, replays = [], []
        for i in range(20):
            req = Request(f"probe-{kind}-{i}", list(prompts[0]), params, drafter)
            s = SlotState(req, 0, RandomStream(None), None, frozenset(),
                          draft=eng.drafts[drafter] if drafter else None, draft_name=drafter)
            torch.cuda.synchronize()
            t = time.perf_counter()
            eng._prefill([s])
            torch.cuda.synchronize()
            walls.append((time.perf_counter() - t) * 1000)
        t_run = 1 << (len(prompts[0]) - 1).bit_length()
        graphs = [g for key, g in eng.graphs.graphs.items() if key[:2] == ("prefill", t_run) and g.graph is not None]
        for g in graphs[:1]:
            for _ in range(20):
                torch.cuda.synchronize()
                t = time.perf_counter()
                g.graph.replay()
                torch.cuda.synchronize()
                replays.append((time.perf_counter() - t) * 1000)
        print(json.dumps({"engine": kind, "prefill_1x512_wall_ms": round(statistics.median(walls), 3),
                          "prefill_graph_replay_ms": round(statistics.median(replays), 3) if replays else None}),
              flush=True)
        del eng
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

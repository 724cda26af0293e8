"""Where an admission's prefill goes at bs 8, with and without side prefill (`DecodeEngine(side_prefill=...)`).

    python -m bench.side_prefill_probe      # on the GPU machine (the default model, bf16, ~2.5 minutes)

Four engines (plain decoding and lookup rows at gamma 5, each with side prefill off and on; bs 8, overlapped,
fused and compiled, Triton attention, warmed up), each timed over the benchmark's 32 long prompts (512 -> 256) twice,
interleaved. A line per pass: its time and tokens/s, the prefills it ran (and their rows), each prefill's GPU time
(CUDA events around it on its stream: beside the running rows it shares the GPU with them), the host time from an
admission's launch to its join, and the steps taken while an admission was pending (rows running beside it).
"""
import json
import statistics
import time

import torch

from bench.gpu import fused_long_workload
from engine.generate import generate
from engine.lookup import LookupDraft
from engine.sampling import SamplingParams
from engine.scheduler import DecodeEngine
from engine.speculative import SpecConfig

if not torch.cuda.is_available():
    raise SystemExit("bench.side_prefill_probe needs a CUDA GPU; run it on the GPU machine")
loaded, prompts = fused_long_workload(32)
m = loaded.model
print("prompt lengths", sorted(len(p) for p in prompts)[:3], sorted(len(p) for p in prompts)[-3:])
params = SamplingParams(max_new_tokens=256, eos_token_ids=())

def build(side, kind):
    eng = DecodeEngine(m, loaded.tokenizer, max_batch_size=8, max_seq_len=max(len(p) for p in prompts) + 272,
                       spec=SpecConfig(5, 5), overlap=True, side_prefill=side)
    if kind == "lookup":
        eng.add_draft("lookup", LookupDraft(gammas={}, streak_gammas={}))
    eng.warmup()
    return eng

def instrument(eng):
    rec = {"pre": [], "launch": {}, "join": [], "steps_pending": 0}
    real_prefill, real_join, real_launch = eng._prefill, eng._join, eng._launch_prefill
    def prefill(batch):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record(); out = real_prefill(batch); e1.record()
        rec["pre"].append((e0, e1, len(batch)))
        return out
    def launch(batch):
        a = real_launch(batch)
        rec["launch"][id(a)] = time.perf_counter()
        return a
    def join(wait):
        pend = list(eng._admitting)
        out = real_join(wait)
        now = time.perf_counter()
        for a in pend:
            if a not in eng._admitting:
                rec["join"].append((now - rec["launch"].get(id(a), now)) * 1000)
        return out
    eng._prefill, eng._join, eng._launch_prefill = prefill, join, launch
    real_step = eng.step
    def step():
        rec["steps_pending"] += bool(eng._admitting)
        return real_step()
    eng.step = step
    return rec

engines = {}
for kind in ("ar", "lookup"):
    for side in (False, True):
        t = time.perf_counter()
        eng = build(side, kind)
        generate(eng, prompts[:8], params, "lookup" if kind == "lookup" else None)  # a warm pass
        print("built", kind, side, round(time.perf_counter() - t, 1), flush=True)
        engines[(kind, side)] = (eng, instrument(eng))
for rep in range(2):
    for (kind, side), (eng, rec) in engines.items():
        rec["pre"].clear(); rec["join"].clear(); rec["steps_pending"] = 0
        torch.cuda.synchronize(); t0 = time.perf_counter()
        outs = generate(eng, prompts, params, "lookup" if kind == "lookup" else None)
        torch.cuda.synchronize(); dt = time.perf_counter() - t0
        pre = [e0.elapsed_time(e1) for e0, e1, n in rec["pre"]]
        n_tok = sum(len(o.token_ids) for o in outs)
        print(json.dumps({"kind": kind, "side": side, "pass_ms": round(dt * 1000, 1), "tps": round(n_tok / dt, 1),
                          "prefills": len(pre), "rows": sum(n for *_, n in rec["pre"]),
                          "prefill_gpu_ms_mean": round(statistics.mean(pre), 3),
                          "prefill_gpu_ms_sum": round(sum(pre), 1),
                          "launch_to_join_ms_mean": round(statistics.mean(rec["join"]), 3) if rec["join"] else None,
                          "steps_pending": rec["steps_pending"]}), flush=True)

"""Where a bs-1 greedy FlashSpec round's GPU time goes, piece by piece, and one attention call per backend.

    python -m bench.round_profile [--domain code] [--attention sdpa|triton] [--unfused] [--no-small-kernels]
    python -m bench.round_profile --attention-calls        # SDPA against the Triton kernel, per split count
    python -m bench.round_profile --sampling-calls         # sampling kernels against torch ops, per call
    python -m bench.round_profile --vocab-calls            # the vocabulary projection kernel's settings, per call
    python -m bench.round_profile --proj-calls [OUT]       # the output/down projection kernel against cuBLAS
    python -m bench.round_profile --prefill-calls [--attention triton]  # an admission's prefill, eager and as a graph
    python -m bench.round_profile --kernel-table [--attention triton]   # decode/verify steps' kernels by type
    python -m bench.round_profile --engine-graphs long [--attention triton]  # a generation's graphs, bs 8 and 1
    python -m bench.round_profile --layer-sweep [OUT]  # engine/triton_layer.py's launch settings
    python -m bench.round_profile --profiler-effect    # graph launches before and after torch.profiler runs
    python -m bench.round_profile --warmup [--attention triton] [--overlap]  # a replica's warm-up and its traffic

Round pieces: the target fused for inference (unless --unfused) and the shipped draft of --domain, each
piece (plain decoding step, trunk step, draft step, the drafting chain, verify passes of 1-6 tokens, the
whole round's pieces in sequence, 4 plain steps as one graph) captured as one CUDA graph and replayed 200
times; ms per replay (`graph_ms`, back to back), ms per replay waited for one at a time as the engine does
(`synced_ms`) and the host's time inside `replay()` (`launch_ms`), and the CUDA kernels one eager run launches. Plus the drafting chain and the verify pass on two CUDA streams
(independent here, so an upper bound on what overlapping them could give). Needs CUDA.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path

import torch

from bench.gpu import capture_graph, count_kernels, cuda_ms, per_call_us
from engine import triton_kernels, triton_layer


@torch.no_grad()
def round_pieces(domain: str, attention: str, fused: bool, position: int = 600) -> None:
    from bench.gpu import load_drafts
    from engine.fused import fuse_for_inference
    from engine.loading import load_model
    from engine.scheduler import DecodeEngine
    from engine.speculative import SpecConfig
    from engine.triton_kernels import argmax
    from engine.verify import verify_greedy

    loaded = load_model("default", device="cuda", dtype="bfloat16")
    model = loaded.model
    draft = load_drafts("drafts/demo", model)[domain]
    if fused:
        model.fuse_for_inference(compile=True)
        fuse_for_inference(draft, compile=True)
    model.set_attention_backend(attention)
    eng = DecodeEngine(model, loaded.tokenizer, max_batch_size=1, max_seq_len=1000, spec=SpecConfig(5, 5))
    eng.add_draft(domain, draft)
    kv = eng.kv_bucket(position + 100)
    draft_kv = eng.draft_kv_len(kv)
    layers, trunk_layers, hidden = model.args.num_layers, draft.shared_layers, model.args.hidden_size
    rows, dev, dtype = slice(0, 1), "cuda", eng.dtype
    capture = tuple(draft.feature_layers)
    token = torch.zeros(1, 1, dtype=torch.long, device=dev)
    at = lambda j=0: torch.full((1,), position + j, device=dev)  # noqa: E731
    print(json.dumps({"domain": domain, "attention": model.backend.name, "fused": model.fused, "kv_slots": kv,
                      "small_kernels": triton_kernels.ENABLED, "layer_kernels": triton_layer.ENABLED,
                      "trunk_layers": trunk_layers, "feature_layers": capture}), flush=True)

    def full(t):
        def fn():
            pos = position + torch.arange(t, device=dev)[None]
            return argmax(model(token.expand(1, t), pos, cache=eng.cache, rows=rows, kv_len=kv).logits)
        return fn

    def trunk(tok, p):
        return model(tok[:, None], p[:, None], layers=range(0, trunk_layers), cache=eng.cache, rows=rows, kv_len=kv).hidden

    def draft_step(tr, proxy, p):
        ctx = model.context(p[:, None], eng.draft_cache, rows, draft_kv)
        out = draft.adapters_forward(tr, proxy[:, None], ctx)[:, 0]
        return draft.predict(out, greedy=True)

    def chain():
        tok, proxy, trunks = token[:, 0], torch.zeros(1, hidden, device=dev, dtype=dtype), []
        for j in range(6):
            tr = trunk(tok, at(j))
            trunks.append(tr)
            if j < 5:
                tok, proxy = draft_step(tr, proxy, at(j))
        return torch.cat(trunks, 1)

    zeros6 = torch.zeros(1, 6, hidden, device=dev, dtype=dtype)
    drafted = torch.zeros(1, 5, dtype=torch.long, device=dev)

    def verify(t, cap=()):
        def fn(hid=None):
            pos = position + torch.arange(t, device=dev)[None]
            out = model(None, pos, layers=range(trunk_layers, layers), hidden=zeros6[:, :t] if hid is None else hid,
                        cache=eng.cache, rows=rows, kv_len=kv, capture=cap)
            return verify_greedy(drafted, out.logits).num_accepted if t == 6 else argmax(out.logits)
        return fn

    side = torch.cuda.Stream()

    def two_streams():
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            verify(6, capture)()
        chain()
        main.wait_stream(side)

    pieces = {
        "plain decoding step (full model, 1 token, argmax)": full(1),
        "full model, 2 tokens": full(2),
        "full model, 6 tokens": full(6),
        f"trunk (layers 0-{trunk_layers}), 1 token": lambda: trunk(token[:, 0], at()),
        "draft step (adapters + head + argmax + proxy), 1 token":
            lambda: draft_step(torch.zeros(1, 1, hidden, device=dev, dtype=dtype), torch.zeros(1, hidden, device=dev, dtype=dtype), at()),
        "drafting chain (6 trunk + 5 draft steps)": chain,
        **{f"verify (layers {trunk_layers}-{layers}), {t} token{'s' * (t > 1)}": verify(t) for t in (1, 2, 3)},
        f"verify (layers {trunk_layers}-{layers}), 6 tokens, + captures and acceptance": verify(6, capture),
        "the round's pieces in sequence (chain, then verify)": lambda: verify(6, capture)(chain()),
        "chain and verify on two streams in one graph (timing only: independent)": two_streams,
    }
    def four_steps():
        tok = token
        for j in range(4):
            tok = argmax(model(tok, position + j + torch.zeros(1, 1, dtype=torch.long, device=dev), cache=eng.cache,
                               rows=rows, kv_len=kv).logits[:, -1])[:, None]
        return tok

    pieces["plain decoding, 4 steps in one graph (ar_steps_per_sync)"] = four_steps
    for name, fn in pieces.items():
        try:
            graph = capture_graph(fn)
            synced, launch = synced_ms(graph)
            row = {"piece": name, "graph_ms": round(cuda_ms(graph.replay, 200), 4), "synced_ms": round(synced, 4),
                   "launch_ms": round(launch, 4), "kernels": count_kernels(fn)}
        except Exception as exc:  # noqa: BLE001 - one failing piece should not hide the others
            row = {"piece": name, "error": repr(exc)[:300]}
        print(json.dumps(row), flush=True)


def timed_generate(eng, prompts, params, drafts) -> tuple[list, float]:
    """`engine.generate.generate` between two device syncs: (its results, wall seconds)."""
    from engine.generate import generate

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = generate(eng, prompts, params, drafts)
    torch.cuda.synchronize()
    return outs, time.perf_counter() - t0


def synced_ms(graph, iters: int = 100) -> tuple[float, float]:
    """ms per replay the engine's way (replay, then wait for it before the next: nothing overlaps the launch),
    and ms the host spends inside `replay()` itself. `graph_ms` replays back to back, the host launching the
    next replay while the GPU runs the last one; the difference is what a step or round pays for the launch."""

    torch.cuda.synchronize()
    total = launch = 0.0
    for _ in range(iters):
        t0 = time.perf_counter()
        graph.replay()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        total += time.perf_counter() - t0
        launch += t1 - t0
    return total / iters * 1000, launch / iters * 1000


@torch.no_grad()
def attention_calls() -> None:
    import torch.nn.functional as F

    from engine import triton_attention as ta
    from engine.triton_attention import triton_attention

    shapes = ((1, 1, 704), (1, 6, 704), (1, 1, 2048), (1, 6, 2048), (8, 1, 768), (8, 6, 768), (8, 6, 2048), (64, 1, 1024))
    for b, t, s in shapes:
        q = torch.randn(b, 9, t, 64, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, 3, s, 64, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        pos = torch.full((b, 1), s - t - 5, device="cuda") + torch.arange(t, device="cuda")
        mask = torch.arange(s, device="cuda")[None, None, None, :] <= pos[:, None, :, None]
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=True)
        row = {"batch": b, "new_tokens": t, "slots": s,
               "sdpa_us": round(per_call_us(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)), 2)}
        for splits in (None, 1, 2, 4, 8, 16):
            label = splits or "auto"
            row[f"triton_{label}_us"] = round(per_call_us(lambda: triton_attention(q, k, v, mask, splits=splits)), 2)
            row[f"triton_{label}_max_error"] = round((triton_attention(q, k, v, mask, splits=splits).float() - ref).abs().max().item(), 4)
        with overridden(ta, INLINE_MERGE=True):  # the splits merged by their last program (FLASHSPEC_ATTN_INLINE_MERGE=1)
            row["triton_auto_inline_merge_us"] = round(per_call_us(lambda: triton_attention(q, k, v, mask, positions=pos)), 2)
            row["triton_auto_inline_merge_max_error"] = round(
                (triton_attention(q, k, v, mask, positions=pos).float() - ref).abs().max().item(), 4)
        row["triton_auto_positions_us"] = round(per_call_us(lambda: triton_attention(q, k, v, mask, positions=pos)), 2)
        print(json.dumps(row), flush=True)


@torch.no_grad()
def sampling_calls() -> None:
    """One sampling call in a CUDA graph of 20, us: `processed_probs` (no filters) and `sample_with` through
    engine.triton_kernels' one-launch kernels and as torch ops, on a round's shapes (the draft's 8,192-token
    sub-vocabulary, the verifier's 6 positions of 49,152, the residual over the whole vocabulary)."""
    from engine.sampling import processed_probs, sample_with

    for what, shape, dtype in (("draft draw", (1, 8192), torch.bfloat16), ("draft draw", (8, 8192), torch.bfloat16),
                               ("verifier probs", (1, 6, 49152), torch.float32),
                               ("verifier probs", (8, 6, 49152), torch.float32),
                               ("residual draw", (1, 49152), torch.float32), ("residual draw", (8, 49152), torch.float32)):
        logits = 3 * torch.randn(shape, device="cuda").to(dtype)
        temp = torch.ones(shape[0], device="cuda")
        none, ones = torch.zeros(shape[0], dtype=torch.long, device="cuda"), torch.ones(shape[0], device="cuda")
        u = torch.rand(shape[0], device="cuda")
        probs = processed_probs(logits, temp, none, ones, filtered=False)
        if what == "verifier probs":
            fn = lambda: processed_probs(logits, temp, none, ones, filtered=False)  # noqa: E731
        elif what == "draft draw":
            fn = lambda: sample_with(processed_probs(logits, temp, none, ones, filtered=False), u)  # noqa: E731
        else:
            fn = lambda: sample_with(probs, u)  # noqa: E731
        row = {"call": what, "shape": list(shape)}
        for fast in (False, True):
            triton_kernels.SAMPLING = fast
            row["kernels_us" if fast else "torch_us"] = round(per_call_us(fn), 2)
        print(json.dumps(row), flush=True)


@contextlib.contextmanager
def overridden(module, **values):
    """Module-level switches set to `values` for the block (a sweep's or a comparison's setting), then restored."""
    saved = {name: getattr(module, name) for name in values}
    for name, value in values.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def setting_us(call, ref: torch.Tensor) -> list[float] | str:
    """One launch setting of a swept kernel: [us a call (`per_call_us`), its largest difference from `ref`], or why
    it has no time: "declined" (the call returned None, launching nothing) or the error's name (a setting that
    does not compile: shared memory, registers)."""
    try:
        out = call()
        if out is None:
            return "declined"
        return [round(per_call_us(call), 2), float(f"{(out.float() - ref.float()).abs().max().item():.2g}")]
    except Exception as exc:  # noqa: BLE001 - the sweep goes on, and says which setting failed
        return type(exc).__name__


@torch.no_grad()
def vocab_calls(rows: tuple[int, ...] = (1, 6, 8, 48)) -> None:
    """The target's vocabulary projection (49,152 x 576, fp32 rows) in a CUDA graph of 20 calls, us a call: F.linear
    over the fp32 copy of the weight (what the model ran before) against `triton_kernels.vocab_projection` over the
    bf16 weight in each launch setting swept, with its largest difference from F.linear; then the final RMSNorm in
    torch ops before the kernel against `norm_vocab_projection` (both in one launch)."""
    import itertools

    import torch.nn.functional as F

    w = (0.05 * torch.randn(49152, 576, device="cuda")).to(torch.bfloat16)
    w32 = w.float()
    for n in rows:
        x = 3 * torch.randn(n, 576, device="cuda")
        ref = F.linear(x, w32)
        row = {"rows": n, "fp32_linear_us": round(per_call_us(lambda: F.linear(x, w32)), 2)}
        # fp32 products once (4-6x slower than cuBLAS in run 28), the bf16 split around run 28's best (v=128, w=4),
        # each with a block's tiles launched one after another (t=0) and side by side (t=1; the same at 16 rows or less)
        settings = [(0, 64, 4, 0), *itertools.product((3,), (64, 128, 256), (2, 4, 8), (0, 1) if n > 16 else (0,))]
        for split, v, warps, t in settings:
            cfg = {"split": split, "v": v, "w": warps, "t": t}
            row[f"split={split},v={v},w={warps},t={t}"] = setting_us(
                lambda: triton_kernels.vocab_projection(x, w, cfg), ref)
        # the model's final step: its fp32 RMSNorm in torch ops then the kernel, against both in one launch
        hidden, norm_w = (3 * torch.randn(n, 576, device="cuda")).bfloat16(), torch.ones(576, device="cuda").bfloat16()

        def torch_norm_then_kernel():
            x = hidden.float()
            x = norm_w.float() * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
            return triton_kernels.vocab_projection(x, w), x.to(hidden.dtype)

        with overridden(triton_kernels, VOCAB_NORM=True):
            row["norm_then_projection_us"] = round(per_call_us(torch_norm_then_kernel), 2)
            for t in (0, 1) if n > 16 else (triton_kernels.VOCAB_CONFIG["t"],):
                row[f"norm_in_projection_us,t={t}"] = round(per_call_us(
                    lambda: triton_kernels.norm_vocab_projection(hidden, norm_w, 1e-5, w, {"t": t})), 2)
        print(json.dumps(row), flush=True)


@torch.no_grad()
def proj_calls(rows: tuple[int, ...] = (1, 6, 16), out: str | None = None) -> str | None:
    """A layer's output projection (576 -> 576) and down projection (1,536 -> 576) of a short step, bf16, in a CUDA
    graph of 20 calls, us a call: cuBLAS (F.linear, what the fused path runs) against `triton_layer.project` in
    each launch setting swept, with its largest difference from F.linear. A graph of 20 kernel calls chains them
    with programmatic dependent launch where that is on (FLASHSPEC_PDL), as a layer's kernels chain. Prints the
    setting with the least time summed over both projections at 1 and 6 rows (bs 1 decode and verify steps);
    `out` gets it as FLASHSPEC_PROJ_CONFIG's value."""
    import itertools

    import torch.nn.functional as F

    totals: dict[str, list[float]] = {}
    cases = 0
    with overridden(triton_layer, PROJ=True):
        for k_in, n in itertools.product((576, 1536), rows):
            x = torch.randn(n, k_in, device="cuda").bfloat16()
            w = (torch.randn(576, k_in, device="cuda") * k_in ** -0.5).bfloat16()
            ref = F.linear(x, w)
            row = {"in": k_in, "rows": n, "cublas_us": round(per_call_us(lambda: F.linear(x, w)), 2)}
            for cols, step, warps in itertools.product((16, 32, 64), (256, 1024, 2048), (4, 8)):
                cfg = {"n": cols, "k": step, "w": warps}
                row[f"n={cols},k={step},w={warps}"] = setting_us(lambda: triton_layer.project(x, w, cfg), ref)
            timed = {key: value[0] for key, value in row.items() if isinstance(value, list)}
            row["best"] = min(timed, key=timed.get) if timed else None
            print(json.dumps(row), flush=True)
            if n <= 6:
                cases += 1
                for key, us in timed.items():
                    totals.setdefault(key, []).append(us)
    complete = {key: sum(times) for key, times in totals.items() if len(times) == cases}  # timed at every size
    if not complete:
        return None
    best = min(complete, key=complete.get)
    print(json.dumps({"best": best, "sum_to_6_us": round(complete[best], 2)}), flush=True)
    if out:
        Path(out).write_text(best + "\n")
    return best


@torch.no_grad()
def kernel_table(attention: str, tokens: tuple[int, ...] = (1, 6, 48), top: int = 10) -> None:
    """One fused decode step (and verify-sized passes: 6 tokens of one row, 6 of 8 rows as 48) of the default
    model by CUDA kernel: count, GPU time each kernel type took in one eager run (torch.profiler), against
    the step's CUDA-graph replay time, with neither engine.triton_kernels nor engine.triton_layer, with the
    small kernels only, and with both (the default; the layer kernels serve batch-1 steps only, so the
    48-token pass of 8 rows runs the small kernels in both of the last two). Every replay time is taken before the profiler's first
    run: it leaves CUPTI attached, which slows every graph launch after it (bench.gpu.graph_kernels)."""
    from engine.loading import load_model
    from engine.triton_kernels import argmax

    model = load_model("default", device="cuda", dtype="bfloat16").model
    model.fuse_for_inference(compile=True)
    model.set_attention_backend(attention)
    cache, kv = model.new_cache(8, 1024), 704
    settings = (("none", False, False), ("small kernels", True, False), ("small + layer kernels", True, True))
    runs = []
    for label, small, layer in settings:  # every graph timed before the profiler first runs (it slows later launches)
        triton_kernels.ENABLED, triton_layer.ENABLED = small, layer
        for t in tokens:
            rows, per_row = (8, t // 8) if t > 16 else (1, t)
            tok = torch.zeros(rows, per_row, dtype=torch.long, device="cuda")
            pos = (600 + torch.arange(per_row, device="cuda")[None]).expand(rows, -1)

            def fn(tok=tok, pos=pos):
                return argmax(model(tok, pos, cache=cache, kv_len=kv).logits)

            runs.append((label, small, layer, t, fn, cuda_ms(capture_graph(fn).replay, 300)))
    for label, small, layer, t, fn, ms in runs:
        triton_kernels.ENABLED, triton_layer.ENABLED = small, layer
        by = kernels_by_name(fn)
        print(json.dumps({"attention": model.backend.name, "kernels_on": label, "tokens": t,
                          "graph_ms": round(ms, 3), "kernels": sum(c for c, _ in by.values()),
                          "kernel_busy_ms": round(sum(d for _, d in by.values()) / 1000, 3)}), flush=True)
        print_kernels(by, top, "  ")
    triton_kernels.ENABLED = triton_layer.ENABLED = True


@torch.no_grad()
def layer_sweep(rows: tuple[int, ...] = (1, 6, 48), out: str | None = None) -> dict[str, int]:
    """engine/triton_layer.py's launch settings, swept: each setting's two kernels (the default model's layer
    shape, bf16, random inputs) timed as CUDA graphs of 20 calls at each row count, beside the separate
    kernels they replace (add_rms_norm, the GEMM, rope_kv_write / silu_mul, as the fused path runs them).
    Prints one JSON line per setting and the best one (least time summed over the row counts up to 6:
    decode and bs 1 draft and verify steps); `out` gets it as FLASHSPEC_LAYER_CONFIG's value."""
    import itertools

    from engine import fused
    from engine.triton_kernels import rope_kv_write

    h, hq, hkv, d, inter, dt = 576, 9, 3, 64, 1536, torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(0)
    rnd = lambda *shape: torch.randn(*shape, device="cuda", generator=g).to(dt)  # noqa: E731
    w, wg, nw = rnd((hq + 2 * hkv) * d, h) * h ** -0.5, rnd(2 * inter, h) * h ** -0.5, 1 + rnd(h) * 0.1
    kc, vc = torch.zeros(8, hkv, 1024, d, device="cuda", dtype=dt), torch.zeros(8, hkv, 1024, d, device="cuda", dtype=dt)
    ops = fused.make_ops(True)
    kern = ops.select(1)

    def served_call_us(fn) -> float:
        if fn() is None:  # a declined call launches nothing: its time would be the host's check alone
            raise RuntimeError("engine.triton_layer declined a sweep call (the GPU, dtype or shapes)")
        return per_call_us(fn)

    inputs = {}
    for n in rows:
        b, t = (8, n // 8) if n > 16 else (1, n)
        pos = (600 + torch.arange(t, device="cuda"))[None].expand(b, -1).contiguous()
        inputs[n] = (rnd(n, h), rnd(n, h), rnd(n, d), rnd(n, d), pos)
    base = {}
    for n, (x, delta, cos, sin, pos) in inputs.items():
        def qkv_sep(x=x, delta=delta, cos=cos, sin=sin, pos=pos):
            _, hn = kern.add_rms_norm(x, delta, nw, 1e-5)
            return rope_kv_write(torch.nn.functional.linear(hn, w), cos, sin, kc, vc, None, pos, hq, hkv)

        def gate_sep(x=x, delta=delta):
            _, hn = kern.add_rms_norm(x, delta, nw, 1e-5)
            return kern.silu_mul(torch.nn.functional.linear(hn, wg), inter)

        base[n] = (served_call_us(qkv_sep), served_call_us(gate_sep))
    print(json.dumps({"separate_kernels_us": {n: [round(a, 2), round(b, 2)] for n, (a, b) in base.items()}}), flush=True)
    best, best_us = None, float("inf")
    saved, saved_rows = dict(triton_layer.CONFIG), triton_layer.MAX_ROWS
    triton_layer.MAX_ROWS = max(rows)  # the sweep times the kernels past the rows they serve too (that set MAX_ROWS)
    for k, c, gb, warps, stages in itertools.product((128, 256, 1024), (16, 32), (16, 32), (4, 8), (1, 3)):
        triton_layer.CONFIG.update(k=k, c=c, g=gb, w=warps, s=stages)
        times, errors = {}, {}
        for n, (x, delta, cos, sin, pos) in inputs.items():
            try:
                times[n] = (served_call_us(lambda: triton_layer.norm_qkv_rope_write(x, delta, nw, 1e-5, w, cos, sin, kc, vc,
                                                                                None, pos, hq, hkv)),
                            served_call_us(lambda: triton_layer.norm_gate_up_silu(x, delta, nw, 1e-5, wg, inter)))
            except Exception as exc:  # noqa: BLE001 - a setting the compiler refuses (registers, shared memory)
                errors[n] = f"{type(exc).__name__}: {exc}"[:200]
        if errors:  # said; a setting that fails past the rows it serves (48) still counts for 1 and 6
            print(json.dumps({"config": dict(triton_layer.CONFIG), "errors": errors}))
        if any(n <= 6 for n in errors):
            continue
        total = sum(a + b for n, (a, b) in times.items() if n <= 6)
        print(json.dumps({"config": dict(triton_layer.CONFIG), "us": {n: [round(a, 2), round(b, 2)] for n, (a, b) in times.items()},
                          "sum_to_6": round(total, 2)}), flush=True)
        if total < best_us:
            best, best_us = dict(triton_layer.CONFIG), total
    triton_layer.CONFIG.update(saved)
    triton_layer.MAX_ROWS = saved_rows
    if best is None:
        raise SystemExit("bench.round_profile --layer-sweep: no launch setting ran (see the errors above)")
    line = ",".join(f"{key}={value}" for key, value in best.items())
    print(json.dumps({"best": line, "prefetch": triton_layer.PREFETCH, "sum_to_6_us": round(best_us, 2),
                      "separate_sum_to_6_us": round(sum(a + b for n, (a, b) in base.items() if n <= 6), 2)}), flush=True)
    if out:
        Path(out).write_text(line + "\n")
    return best


def kernels_by_name(fn) -> dict:
    """CUDA kernel name -> [count, GPU us] over one eager run of fn (torch.profiler: run it only after every
    timing, it slows later graph launches; bench.gpu.graph_kernels)."""
    from collections import defaultdict

    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    by = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            by[e.name[:80]][0] += 1
            by[e.name[:80]][1] += e.time_range.elapsed_us()
    return by


def print_kernels(by: dict, top: int, indent: str) -> None:
    for name, (count, us) in sorted(by.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"{indent}{count:4d} x {us / count:6.2f} us = {us:7.1f} us  {name}", flush=True)


def kernel_diff(by: dict, base: dict) -> dict:
    """name -> [count, GPU us] of `by` less `base` (two `kernels_by_name` tables), names that differ only."""
    out = {}
    for name in by.keys() | base.keys():
        (c, us), (c0, us0) = by.get(name, (0, 0.0)), base.get(name, (0, 0.0))
        if c != c0 or abs(us - us0) >= 0.05:
            out[name] = [c - c0, us - us0]
    return out


def print_kernel_diff(by: dict, base: dict, top: int, indent: str) -> None:
    diff = kernel_diff(by, base)
    count, us = sum(c for c, _ in diff.values()), sum(u for _, u in diff.values())
    print(f"{indent}{count:+d} kernels, {us / 1000:+.3f} ms of kernel time in all", flush=True)
    for name, (c, u) in sorted(diff.items(), key=lambda kv: -abs(kv[1][1]))[:top]:
        print(f"{indent}{c:+4d} kernels {u:+8.1f} us  {name}", flush=True)


def fused_default(attention: str):
    """The embedded default target on the GPU in bf16, fused for inference, with `attention`, and the shipped
    drafts, fused: (loaded model, {domain: draft})."""
    from bench.gpu import load_drafts
    from engine.fused import fuse_for_inference
    from engine.loading import load_model

    loaded = load_model("default", device="cuda", dtype="bfloat16")
    loaded.model.fuse_for_inference(compile=True)
    drafts = load_drafts("drafts/demo", loaded.model)
    for draft in drafts.values():
        fuse_for_inference(draft, compile=True)
    loaded.model.set_attention_backend(attention)
    return loaded, drafts


@torch.no_grad()
def prefill_calls(attention: str, reps: int = 20) -> None:
    """One admission's target prefill pass (`DecodeEngine._prefill_target`, the fused default target) at batch 1
    and 8 and prompts of 32-2,047 tokens, plain and for the code draft (its trunk split and captured layers):
    ms from the call to the device having finished (median of `reps`, synchronized), eager and as a CUDA graph
    over the prompts padded to a power-of-two length (`prefill_graphs`), the graph with the elementwise kernels
    eager and compiled (`FusedOps.long_compiled`); the time before a request's first token that does not depend
    on decoding."""
    from engine.scheduler import DecodeEngine
    from engine.speculative import feature_layers_of

    loaded, drafts = fused_default(attention)
    model = loaded.model
    code = drafts["code"]
    ops = model._fused_ops
    default_long = ops.long_compiled
    for graphs, long_compiled in ((False, False), (True, False), (True, True)):
        ops.long_compiled = long_compiled  # the elementwise kernels of long steps compiled (`FusedOps.long`) or eager
        eng = DecodeEngine(model, None, max_batch_size=8, max_seq_len=2048, prefill_graphs=graphs)
        for b in (1, 8):
            for t in (32, 100, 512, 2047):
                tokens = torch.randint(2, model.args.vocab_size, (b, t), device="cuda")
                last = torch.full((b,), t - 1, device="cuda")
                for name, args in (("plain", (0, (), False)),
                                   ("code draft", (code.shared_layers, feature_layers_of([code]), True))):
                    def call():
                        eng._prefill_target(tokens, slice(0, b), last, *args)
                        torch.cuda.synchronize()

                    call()  # a graph's capture, or the eager path's first run
                    times = []
                    for _ in range(reps):
                        start = time.perf_counter()
                        call()
                        times.append((time.perf_counter() - start) * 1e3)
                    print(json.dumps({"prefill": "graph" if graphs else "eager", "compiled": long_compiled, "batch": b,
                                      "tokens": t, "for": name, "ms": round(statistics.median(times), 3)}), flush=True)
    ops.long_compiled = default_long


@torch.no_grad()
def engine_graphs(attention: str, kind: str = "long", top: int = 8, only: list[str] | None = None,
                  temperatures: tuple[float, ...] = (0.0,), sub_vocab_draws: bool = True,
                  sampling_compare: bool = False) -> None:
    """Where a whole generation's time goes in the engine, graph by graph: the fused target and the shipped
    drafts, greedy, one batch of held-out prompts per case (bs 8 mixing the three drafts, one-graph rounds and
    the general loop; bs 8 of one draft; bs 1; plain decoding at bs 8 and 1; bs 1 and plain bs 8 overlapped,
    `DecodeEngine(overlap=True)`; bs 1 draft trees of width 2 and 3, `SpecConfig.tree_width`; n-gram lookup rounds,
    `engine.lookup`, at bs 1 and 8, sequential and overlapped, and at bs 8 overlapped through the scattered rows'
    graphs and with allotted rounds, `LookupDraft(allot=True)`). After a warm-up pass, a timed
    pass counts each CUDA graph's replays; each graph is then timed alone (back to back and waited for), so
    `graphs_ms` (replays x synced ms) against the pass's wall time is the host's share. The two costliest
    graphs of each case get a kernel table from one eager run of their step, after every case is timed; a tree
    case's round also gets its kernels less those of the chain's round at the same gamma (`kernel_diff`), and a
    lookup case's round its kernels less the plain case's step with the same rows and overlap, where both ran.
    `only`: the cases whose labels are listed; `temperatures`: each case at each (T > 0 samples, seeded);
    `sub_vocab_draws`: `SpecConfig.sub_vocab_draws` (False: sampled rounds draw over the whole vocabulary);
    `sampling_compare`: each sampled case also with `engine.triton_kernels.SAMPLING` off (", torch sampling":
    softmax and inverse-CDF draws as torch ops), and its round's kernels less the kernels-on round's."""
    from bench.gpu import pick_prompts
    from engine.generate import generate
    from engine.lookup import LookupDraft
    from engine.sampling import SamplingParams
    from engine.scheduler import DecodeEngine
    from engine.speculative import SpecConfig

    loaded, drafts = fused_default(attention)
    model = loaded.model
    data = json.loads(Path("bench/data/gpu_prompts.json").read_text())
    new = 256 if kind == "long" else 20
    cases = [("bs 8, three drafts, one-graph rounds", 8, "mixed", True, False, 1),
             ("bs 8, three drafts, general loop", 8, "mixed", False, False, 1),
             ("bs 8, code draft", 8, "code", True, False, 1), ("bs 1, code draft", 1, "code", True, False, 1),
             ("bs 8, plain", 8, None, True, False, 1), ("bs 1, plain", 1, None, True, False, 1),
             ("bs 1, code draft, overlapped", 1, "code", True, True, 1),
             ("bs 1, plain, overlapped", 1, None, True, True, 1), ("bs 8, plain, overlapped", 8, None, True, True, 1),
             ("bs 1, code draft, tree 2", 1, "code", True, False, 2),
             ("bs 1, code draft, tree 3", 1, "code", True, False, 3),
             ("bs 1, lookup", 1, "lookup", True, False, 1), ("bs 1, lookup, overlapped", 1, "lookup", True, True, 1),
             ("bs 8, lookup", 8, "lookup", True, False, 1), ("bs 8, lookup, overlapped", 8, "lookup", True, True, 1),
             ("bs 8, lookup, overlapped, rows scattered", 8, "lookup", True, True, 1),
             ("bs 8, lookup, overlapped, allotted", 8, "lookup-allot", True, True, 1)]
    if only:
        unknown = set(only) - {c[0] for c in cases}
        if unknown:
            raise SystemExit(f"unknown --cases {sorted(unknown)}; choose from {[c[0] for c in cases]}")
        cases = [c for c in cases if c[0] in only]
    cases = [(label if t == 0 else f"{label}, T={t:g}{'' if fast else ', torch sampling'}", bs, which, one_graph,
              overlap, width, t, fast)
             for label, bs, which, one_graph, overlap, width in cases for t in temperatures
             for fast in ((False, True) if t > 0 and sampling_compare else (triton_kernels.SAMPLING,))]
    tables = []  # (case, graph, step, sampling kernels): kernel tables after every case is timed (the profiler
    # slows later launches)
    default_sampling = triton_kernels.SAMPLING
    for label, bs, which, one_graph, overlap, width, temperature, fast in cases:
        triton_kernels.SAMPLING = fast
        if which == "mixed":
            prompts, names = pick_prompts(data, kind, bs, short_prompts=bs, long_prompts=bs)
        else:
            prompts, names = data["code"][kind][:bs], [which] * bs
        eng = DecodeEngine(model, loaded.tokenizer, max_batch_size=bs, max_seq_len=max(map(len, prompts)) + new + 16,
                           spec=SpecConfig(5, 5, sub_vocab_draws=sub_vocab_draws, tree_width=width, tree_seeded=True),
                           mixed_round_graph=one_graph,
                           overlap=overlap)
        for name, draft in drafts.items():
            eng.add_draft(name, draft)
        eng.add_draft("lookup", LookupDraft())
        eng.add_draft("lookup-allot", LookupDraft(allot=True))  # each row its own gamma (`launch_lookup_round`)
        # Rows 0..b-1 through the graphs scattered rows take (the rows a graph input, gathered by index), as rows
        # admitted into rows freed out of order run (`DecodeEngine.run_graph`): what that path costs, same rounds.
        eng._scatter_rows = label.endswith(", rows scattered")
        params = [SamplingParams(max_new_tokens=new, temperature=temperature, eos_token_ids=(), seed=i)
                  for i in range(len(prompts))]
        generate(eng, prompts, params, names)  # warm-up: captures every graph the pass needs
        for step in eng.graphs.graphs.values():
            step.calls = 0
        captured = eng.graphs.captures
        outs, wall = timed_generate(eng, prompts, params, names)
        rows = []
        for key, step in eng.graphs.graphs.items():
            if not step.calls or step.graph is None:
                continue
            synced, launch = synced_ms(step.graph, 30)
            rows.append({"graph": repr(key)[:150], "calls": step.calls, "graph_ms": round(cuda_ms(step.graph.replay, 30), 4),
                         "synced_ms": round(synced, 4), "launch_ms": round(launch, 4),
                         "total_ms": round(step.calls * synced, 2), "step": step})
        rows.sort(key=lambda r: -r["total_ms"])
        tokens = sum(len(o.token_ids) for o in outs)
        rounds = sum(o.stats.rounds for o in outs if o.stats)
        print(json.dumps({"case": label, "kind": kind, "attention": model.backend.name, "tokens": tokens,
                          "wall_ms": round(wall * 1000, 1), "tps": round(tokens / wall, 1), "rounds": rounds,
                          "graphs_ms": round(sum(r["total_ms"] for r in rows), 1), "sampling_kernels": fast,
                          "graphs_in_pass": eng.graphs.captures - captured}), flush=True)
        for i, r in enumerate(rows):
            step = r.pop("step")
            print("  " + json.dumps(r), flush=True)
            if i < 2:
                tables.append((label, r["graph"], step, fast))
    costliest = {}  # case -> kernel table of its costliest graph (a round, for the speculative cases)
    for label, graph, step, fast in tables:
        triton_kernels.SAMPLING = fast
        by = kernels_by_name(lambda step=step: step.fn(**step.static))
        costliest.setdefault(label, by)
        print(f"{label}: {graph}\n  eager run: {sum(c for c, _ in by.values())} kernels, "
              f"{sum(d for _, d in by.values()) / 1000:.3f} ms of kernel time", flush=True)
        print_kernels(by, top, "    ")
    for label, by in costliest.items():  # where a tree round's extra time goes: its kernels less the chain's
        chain = costliest.get(label.replace(", tree 2", "").replace(", tree 3", ""))
        if ", tree " in label and chain is not None:
            print(f"{label}, round less the chain's (same gamma):", flush=True)
            print_kernel_diff(by, chain, top, "    ")
        plain = costliest.get(label.replace(", rows scattered", "").replace(", allotted", "").replace("lookup", "plain"))
        if ", lookup" in label and plain is not None:  # where a lookup round's time over a plain step goes
            print(f"{label}, round less the plain step's (same rows):", flush=True)
            print_kernel_diff(by, plain, top, "    ")
        with_kernels = costliest.get(label.replace(", torch sampling", ""))
        if label.endswith(", torch sampling") and with_kernels is not None:
            print(f"{label}, round less the same round with the sampling kernels:", flush=True)
            print_kernel_diff(by, with_kernels, top, "    ")
    triton_kernels.SAMPLING = default_sampling


@torch.no_grad()
def warmup_probe(attention: str, max_batch: int = 8, overlap: bool = False, lookup_alternative: bool = True) -> None:
    """What a serving replica's warm-up costs and whether it covers its traffic: the fused target with the
    three shipped drafts, adaptive gamma, `max_batch` rows, the service's 2,048-token context. Times
    `DecodeEngine.warmup` (every sampling kind) and the GPU memory its graphs hold; then runs greedy, T=1 and
    top-p traffic (long prompts of the three domains, twice as many requests as rows, so rows finish and
    refill at scattered slots, and one-draft batches) and counts the graphs it still captures. With
    `lookup_alternative` (the service's default) the lookup drafter is loaded as every draft's alternative, and
    the traffic includes batches of lookup rows beside draft rows."""
    from bench.gpu import pick_prompts
    from engine.gamma import GammaController
    from engine.sampling import SamplingParams
    from engine.scheduler import DecodeEngine
    from engine.speculative import SpecConfig

    loaded, drafts = fused_default(attention)
    model = loaded.model
    eng = DecodeEngine(model, loaded.tokenizer, max_batch_size=max_batch, max_seq_len=2048, spec=SpecConfig(5, 5),
                       gamma=GammaController(5), overlap=overlap)
    for name, draft in drafts.items():
        eng.add_draft(name, draft)
    if lookup_alternative:  # as the service sets it up (`lookup_alternative`)
        from engine.lookup import add_lookup_alternative

        add_lookup_alternative(eng, drafts)
    torch.cuda.synchronize()
    alloc0, reserved0 = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    t0 = time.perf_counter()
    n = eng.warmup()
    torch.cuda.synchronize()
    print(json.dumps({"warmup_s": round(time.perf_counter() - t0, 1), "graphs": n, "attention": model.backend.name,
                      "kv_bucket_fixed": eng.kv_bucket(1) == eng.kv_bucket(2048), "max_batch": max_batch,
                      "overlap": overlap, "graphs_allocated_gib": round((torch.cuda.memory_allocated() - alloc0) / 2**30, 3),
                      "graphs_reserved_gib": round((torch.cuda.memory_reserved() - reserved0) / 2**30, 3),
                      "compiled_shapes": model._fused_ops.shape_counts()}), flush=True)
    data = json.loads(Path("bench/data/gpu_prompts.json").read_text())
    prompts, names = pick_prompts(data, "long", 2 * max_batch, long_prompts=2 * max_batch)
    for label, kind in (("greedy", {}), ("T=1", {"temperature": 1.0}), ("top-p 0.9", {"temperature": 1.0, "top_p": 0.9})):
        mixes = [("three drafts", names), ("code draft", ["code"] * len(prompts)), ("plain", None)]
        if lookup_alternative:  # the rows run what they name: lookup rows beside each domain's draft rows
            mixes.append(("drafts and lookup", [n if i % 2 else "lookup" for i, n in enumerate(names)]))
        for mix, rows in mixes:
            params = [SamplingParams(max_new_tokens=128 + 16 * (i % 5), eos_token_ids=(), seed=i, **kind)
                      for i in range(len(prompts))]
            before = eng.graphs.captures
            outs, wall = timed_generate(eng, prompts, params, rows)
            tokens = sum(len(o.token_ids) for o in outs)
            print(json.dumps({"traffic": f"{label}, {mix}", "requests": len(prompts), "tokens": tokens,
                              "tps": round(tokens / wall, 1), "captured": eng.graphs.captures - before}), flush=True)
    print(json.dumps({"compiled_shapes_after_traffic": model._fused_ops.shape_counts()}), flush=True)


def profiler_effect(ops: int = 400) -> None:
    """Why no graph here is timed after torch.profiler has run in the process: a toy graph of 2 x `ops`
    elementwise kernels, timed before a profiler session, then the same graph and one captured afterwards
    (run it with TEARDOWN_CUPTI=1 to see the launch cost come back down). Also checks
    `bench.gpu.graph_kernels` against the known kernel count."""
    from bench.gpu import graph_kernels
    from torch.profiler import ProfilerActivity, profile

    x = torch.randn(64, 64, device="cuda")

    def fn():
        y = x
        for _ in range(ops):
            y = y * 1.0001 + 0.0001
        return y

    def timing(graph) -> dict:
        synced, launch = synced_ms(graph, 100)
        return {"graph_ms": round(cuda_ms(graph.replay, 100), 4), "synced_ms": round(synced, 4),
                "launch_ms": round(launch, 4)}

    before = capture_graph(fn)
    print(json.dumps({"graph": "captured before any profiler session", "kernels": graph_kernels(
        capture_graph(fn, debug=True)), "expected": 2 * ops, **timing(before)}), flush=True)
    with profile(activities=[ProfilerActivity.CUDA]):
        fn()
        torch.cuda.synchronize()
    print(json.dumps({"graph": "the same, after one profiler session", **timing(before)}), flush=True)
    print(json.dumps({"graph": "captured after it", **timing(capture_graph(fn))}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--domain", default="code", help="which shipped draft (drafts/demo/<domain>)")
    parser.add_argument("--attention", default="sdpa", help="attention backend of the round pieces")
    parser.add_argument("--unfused", action="store_true", help="leave the target and draft unfused")
    parser.add_argument("--attention-calls", action="store_true", help="only the attention-call comparison")
    parser.add_argument("--sampling-calls", action="store_true",
                        help="only the sampling calls (softmax, inverse-CDF draw), the Triton kernels against torch")
    parser.add_argument("--vocab-calls", action="store_true",
                        help="only the vocabulary projection, the Triton kernel's launch settings against F.linear in fp32")
    parser.add_argument("--proj-calls", default=None, metavar="OUT", nargs="?", const="",
                        help="only the output and down projections, the Triton kernel's launch settings against cuBLAS "
                             "(the best written to OUT)")
    parser.add_argument("--kernel-table", action="store_true",
                        help="only the decode step's CUDA kernels by type, engine.triton_kernels off and on")
    parser.add_argument("--engine-graphs", choices=("long", "short"), default=None,
                        help="only the engine's graphs over whole generations (bs 8 three drafts / one draft, bs 1, "
                             "plain), 512->256 or 32->20 prompts")
    parser.add_argument("--cases", default=None,
                        help="--engine-graphs: only these cases, by label, separated by ';' (e.g. 'bs 1, code draft')")
    parser.add_argument("--temperatures", default="0",
                        help="--engine-graphs: comma list of temperatures each case runs at (0: greedy)")
    parser.add_argument("--full-vocab-draws", action="store_true",
                        help="--engine-graphs: sampled rounds draw the draft's tokens over the whole vocabulary")
    parser.add_argument("--profiler-effect", action="store_true",
                        help="only a toy graph's launch and replay times before and after a torch.profiler session")
    parser.add_argument("--warmup", action="store_true",
                        help="only a serving engine's warm-up (time, graphs, memory) and the captures its traffic still needs")
    parser.add_argument("--overlap", action="store_true", help="--warmup with DecodeEngine(overlap=True)")
    parser.add_argument("--no-lookup-alternative", action="store_true",
                        help="--warmup without the lookup drafter as the drafts' alternative (the service's default)")
    parser.add_argument("--no-small-kernels", action="store_true",
                        help="without engine.triton_kernels (KV-cache write and argmax by indexing and torch.argmax)")
    parser.add_argument("--no-sampling-kernels", action="store_true",
                        help="without engine.triton_kernels' tempered softmax and inverse-CDF draw (torch ops instead)")
    parser.add_argument("--sampling-compare", action="store_true",
                        help="--engine-graphs: each sampled case also without the sampling kernels, and the kernel diff")
    parser.add_argument("--no-vocab-kernel", action="store_true",
                        help="without engine.triton_kernels' vocabulary projection (F.linear over an fp32 copy instead)")
    parser.add_argument("--no-layer-kernels", action="store_true",
                        help="without engine.triton_layer (separate norm, projection, RoPE and SiLU kernels)")
    parser.add_argument("--prefill-calls", action="store_true",
                        help="only one admission's prefill pass, eager and as a CUDA graph, at batch 1 and 8")
    parser.add_argument("--layer-sweep", default=None, metavar="OUT", nargs="?", const="",
                        help="only engine/triton_layer.py's launch settings swept (the best written to OUT)")
    args = parser.parse_args()
    triton_kernels.ENABLED = not args.no_small_kernels
    triton_layer.ENABLED = not args.no_layer_kernels
    if args.no_sampling_kernels:  # otherwise as the environment says (FLASHSPEC_SAMPLING_KERNELS, FLASHSPEC_VOCAB_KERNEL)
        triton_kernels.SAMPLING = False
    if args.no_vocab_kernel:
        triton_kernels.VOCAB = False
    if not torch.cuda.is_available():
        raise SystemExit("bench.round_profile needs a CUDA GPU (it times CUDA graphs); run it on the GPU machine")
    if args.layer_sweep is not None:
        layer_sweep(out=args.layer_sweep or None)
    elif args.prefill_calls:
        prefill_calls(args.attention)
    elif args.attention_calls:
        attention_calls()
    elif args.sampling_calls:
        sampling_calls()
    elif args.vocab_calls:
        vocab_calls()
    elif args.proj_calls is not None:
        proj_calls(out=args.proj_calls or None)
    elif args.kernel_table:
        kernel_table(args.attention)
    elif args.profiler_effect:
        profiler_effect()
    elif args.warmup:
        warmup_probe(args.attention, overlap=args.overlap, lookup_alternative=not args.no_lookup_alternative)
    elif args.engine_graphs:
        engine_graphs(args.attention, args.engine_graphs,
                      only=args.cases.split(";") if args.cases else None,
                      temperatures=tuple(float(t) for t in args.temperatures.split(",")),
                      sub_vocab_draws=not args.full_vocab_draws, sampling_compare=args.sampling_compare)
    else:
        round_pieces(args.domain, args.attention, not args.unfused)


if __name__ == "__main__":
    main()

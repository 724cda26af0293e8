"""Autoregressive vs FlashSpec decoding on the default model, side by side in one run.

    flashspec bench spec --device cpu --draft code --domain code
    flashspec bench spec --draft untrained:8,2,mlp_tied,none     (the seed-default shape, untrained)
    flashspec bench spec --draft code --draft lookup --draft code+lookup   (the governor picks the draft or lookup)
"""

from __future__ import annotations

import dataclasses
import time

import torch

from bench.ar import setup_line


def load_bench_draft(spec: str, target):
    """A domain name, a draft folder (a version, or a store's domain folder: its ACTIVE version),
    'untrained:N,A,HEAD,FEATURE[,K]' (initialized from the target), or 'lookup' (the n-gram lookup drafter,
    `engine.lookup.LookupDraft`)."""
    from drafts.config import DraftConfig
    from drafts.model import DraftModel
    from engine.lookup import LookupDraft

    if spec == "lookup":
        return LookupDraft()

    if spec.startswith("untrained:"):
        fields = spec.split(":", 1)[1].split(",")
        n, a, head, feature = int(fields[0]), int(fields[1]), fields[2], fields[3]
        k = int(fields[4]) if len(fields) > 4 else None
        draft = DraftModel(target, DraftConfig(shared_layers=n, adapter_layers=a, head=head, feature_input=feature,
                                               head_vocab=k), name=spec)
        draft.init_from_target()
        return draft
    from pathlib import Path

    from drafts.checkpoint import DraftLoadError, load_draft
    from drafts.store import DOMAINS, resolve_draft

    path = resolve_draft(spec) if spec in DOMAINS else Path(spec)
    if path is None:
        raise SystemExit(f"error: no active draft for domain {spec!r}; train one or pass a folder")
    try:
        return load_draft(path, target, name=spec)
    except DraftLoadError as exc:
        raise SystemExit(f"error: --draft {spec}: {exc}") from None


def measure(engine, prompts, params, draft_name):
    from engine.generate import generate

    tokens, seconds, drafted, accepted, rounds, emitted, outs = 0, 0.0, 0, 0, 0, 0, []
    for ids in prompts:
        t0 = time.perf_counter()
        res = generate(engine, [ids], params, draft=draft_name)[0]
        seconds += time.perf_counter() - t0
        tokens += len(res.token_ids)
        outs.append(res.token_ids)
        if res.stats is not None:
            drafted += res.stats.drafted
            accepted += res.stats.accepted
            rounds += res.stats.rounds
            emitted += res.stats.emitted
    return {
        "tps": tokens / seconds,
        "mal": emitted / rounds if rounds else None,
        "acc": accepted / drafted if drafted else None,
        "outs": outs,
    }


def run(device: str = "cpu", drafts: list[str] = ("code",), domain: str = "code", n_prompts: int = 4,
        max_new_tokens: int = 256, gamma: int | tuple[int, ...] = 5, threads: int = 0, split: str = "test",
        blocks: tuple[int, ...] | None = None, confidences: tuple[float, ...] = (0.0,), repeats: int = 1,
        temperature: float = 0.0, draft_temperatures: tuple[float | None, ...] = (None,),
        full_vocab_draws: bool = False, trees: tuple[int, ...] = (1,), shape: str = "request") -> list[dict]:
    """Engine AR, then each draft at each block size and draft_confidence, side by side in one run.

    The passes interleave: AR, every FlashSpec row, AR, every FlashSpec row, ..., AR. Each FlashSpec
    pass is compared with the mean of the AR passes just before and after it, so a machine whose speed
    drifts (shared cores) moves both sides of a ratio alike; with `repeats` > 1 the reported speedup is
    the median of the per-pass ratios, with their range. temperature > 0 samples (every path from the
    same distribution, so outputs are not compared with AR's); `draft_temperatures` (sampled runs): the
    temperature the draft samples its tokens at, each value a row (None = the request's temperature).
    Verification uses the distribution the draft sampled from, so every value is lossless; what changes
    is how often the target accepts. `full_vocab_draws` (sampled runs) adds each sampled row again with the
    draft's tokens drawn over the whole vocabulary instead of its sub-vocabulary (`SpecConfig.sub_vocab_draws`).
    `trees`: draft-tree widths, each a row (1: the chain; wider trees apply to greedy rounds, `engine.tree`).
    `shape`: "request" (the split's plain requests) or "long" (the GPU benchmark's long shape: each request with
    the next rows' documents appended to 512 tokens, `bench.export_prompts.shaped_prompts`)."""
    import statistics

    from bench.prompts import held_out_prompts
    from engine.governor import SpeculationGovernor
    from engine.loading import load_model
    from engine.lookup import add_lookup_alternative
    from engine.sampling import SamplingParams
    from engine.scheduler import DecodeEngine
    from engine.speculative import SpecConfig

    if repeats < 1:
        raise SystemExit(f"error: --repeats must be at least 1, got {repeats}")
    for spec in drafts:
        base, plus, alt = spec.partition("+")
        if plus and alt != "lookup":
            raise SystemExit(f"error: --draft {spec}: the only alternative is lookup ('{base}+lookup')")
    if temperature == 0 and full_vocab_draws:
        raise SystemExit("error: --full-vocab-draws compares how sampled rounds draw; add --temperature T (T > 0)")
    if temperature == 0 and any(t is not None for t in draft_temperatures):
        raise SystemExit("error: --draft-temperature applies to sampled runs; add --temperature T (T > 0)")
    if threads:
        torch.set_num_threads(threads)
    loaded = load_model("default", device=device)
    tok = loaded.tokenizer
    if shape == "long":
        from bench.ngram_headroom import prompts_of

        prompts = prompts_of("long", domain, tok, n_prompts, split)
        source = f"{domain} {split} split in the GPU benchmark's long shape ({len(prompts)} prompts of 512 tokens)"
    elif shape == "request":
        prompts, source = held_out_prompts(tok, domain, n_prompts, split)
    else:
        raise SystemExit(f"error: --shape {shape!r}: use request or long")
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature)
    max_len = max(len(p) for p in prompts) + max_new_tokens + 8
    ar_engine = DecodeEngine(loaded.model, tok, max_batch_size=1, max_seq_len=max_len)
    measure(ar_engine, [prompts[0][:8]], SamplingParams(max_new_tokens=4), None)  # warm-up
    gammas = (gamma,) if isinstance(gamma, int) else tuple(gamma)
    configs = []
    for spec in drafts:
        # 'D+lookup': draft D with the lookup drafter as its alternative, the governor choosing (the service's way)
        base, plus, _ = spec.partition("+")
        draft = load_bench_draft(base, loaded.model)
        for g in gammas:
            # a block longer than gamma is one verify per round: block = gamma
            for block, conf, dtemp, sub, width in dict.fromkeys(
                    (min(b, g), c, t, s, w) for b in (blocks or (2, g)) for c in confidences for t in draft_temperatures
                    for s in ((True, False) if full_vocab_draws else (True,)) for w in trees):
                governor = SpeculationGovernor() if plus else None
                engine = DecodeEngine(loaded.model, tok, max_batch_size=1, max_seq_len=max_len, governor=governor,
                                      spec=SpecConfig(g, block, draft_confidence=conf, sub_vocab_draws=sub,
                                                      tree_width=width))
                engine.add_draft("d", draft)
                if plus:
                    add_lookup_alternative(engine, ["d"])
                    engine.calibrate(prompt=prompts[0])
                shape = ("n-gram lookup" if not hasattr(draft, "config") else
                         f"N={draft.shared_layers}, A={draft.adapter_layers}, {draft.config.head}, "
                         f"{draft.feature_input}{list(draft.feature_layers) if draft.feature_layers else ''}, "
                         f"K={draft.config.head_vocab or 'full'}")
                name = (f"FlashSpec {base} ({shape}){' or lookup (governor)' if plus else ''} gamma {g} block {block}"
                        + (f" confidence {conf:g}" if conf else "") + (f" draft T={dtemp:g}" if dtemp is not None else "")
                        + ("" if sub else " draws over the whole vocabulary") + (f" tree width {width}" if width > 1 else ""))
                row_params = params if dtemp is None else dataclasses.replace(params, draft_temperature=dtemp)
                configs.append((name, engine, row_params))
    ar_passes = [measure(ar_engine, prompts, params, None)]
    spec_passes: list[list[dict]] = [[] for _ in configs]
    for _ in range(repeats):
        for i, (_, engine, row_params) in enumerate(configs):
            spec_passes[i].append(measure(engine, prompts, row_params, "d"))
        # Plain decoding again after every pass over the rows: the ratios use the AR passes around them.
        ar_passes.append(measure(ar_engine, prompts, params, None))
    ar_tps = [p["tps"] for p in ar_passes]
    ref = ar_passes[0]["outs"]
    rows = [{"name": "engine AR", "tps": statistics.mean(ar_tps), "speedup": 1.0, "range": None, "mal": None,
             "acc": None, "same": len(prompts)}]
    for (name, _, _), passes in zip(configs, spec_passes):
        ratios = [p["tps"] / ((ar_tps[k] + ar_tps[k + 1]) / 2) for k, p in enumerate(passes)]
        last = passes[-1]
        rows.append({"name": name, "tps": statistics.mean(p["tps"] for p in passes), "speedup": statistics.median(ratios),
                     "range": (min(ratios), max(ratios)) if repeats > 1 else None, "mal": last["mal"],
                     "acc": last["acc"], "same": min(sum(a == b for a, b in zip(p["outs"], ref)) for p in passes)})
    passes_note = (f"engine AR measured first and last ({ar_tps[0]:.2f} / {ar_tps[-1]:.2f} tok/s), ratios against the mean"
                   if repeats == 1 else
                   f"{repeats} interleaved passes (AR between them: {' / '.join(f'{t:.2f}' for t in ar_tps)} tok/s), "
                   "each FlashSpec pass against the mean of the AR passes around it; speedup = median of the passes [range]")
    print(f"setup: {setup_line(device, threads)}; SmolLM2-135M-Instruct; {source}; {max_new_tokens} new tokens, "
          f"{'greedy' if temperature == 0 else f'T={temperature:g}'}, batch 1 (prefill included); {passes_note}")
    print("| path | tokens/s | speedup vs AR | mean accepted length | acceptance rate | outputs identical to AR |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        mal = f"{r['mal']:.2f}" if r["mal"] is not None else "-"
        acc = f"{r['acc']:.2f}" if r["acc"] is not None else "-"
        spread = f" [{r['range'][0]:.2f}-{r['range'][1]:.2f}]" if r["range"] else ""
        same = f"{r['same']}/{len(prompts)}" if temperature == 0 else "- (sampled)"
        print(f"| {r['name']} | {r['tps']:.2f} | {r['speedup']:.2f}x{spread} | {mal} | {acc} | {same} |")
    return rows

"""Engine autoregressive decoding vs transformers `generate`, same prompts, same run.

    flashspec bench ar --device cpu
"""

from __future__ import annotations

import datetime
import platform
import subprocess
import time
from pathlib import Path

import torch


def git_commit() -> str:
    """The checkout's short commit, marked when tracked files differ from it; 'unknown' without git."""
    root = Path(__file__).resolve().parents[1]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10, cwd=root)
        if out.returncode == 0 and out.stdout.strip():
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                   text=True, timeout=10, cwd=root).stdout.strip()
            return out.stdout.strip() + (" (with uncommitted changes)" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


def setup_line(device: str, threads: int) -> str:
    return (f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, commit {git_commit()}, "
            f"torch {torch.__version__}, {platform.processor() or platform.machine()}, device {device}, "
            f"threads {torch.get_num_threads() if not threads else threads}")


def run(device: str = "cpu", n_prompts: int = 4, max_new_tokens: int = 64, threads: int = 0) -> dict:
    from transformers import AutoModelForCausalLM

    from bench.prompts import held_out_prompts
    from engine.generate import generate
    from engine.loading import load_model
    from engine.sampling import SamplingParams
    from engine.scheduler import DecodeEngine

    if threads:
        torch.set_num_threads(threads)
    loaded = load_model("default", device=device)
    tok = loaded.tokenizer
    prompts, source = held_out_prompts(tok, "general", n_prompts)
    hf = AutoModelForCausalLM.from_pretrained(str(loaded.path), dtype=loaded.model.embed_tokens.weight.dtype).to(device).eval()
    params = SamplingParams(max_new_tokens=max_new_tokens, eos_token_ids=())  # fixed length: no early EOS
    engine = DecodeEngine(loaded.model, tok, max_batch_size=1, max_seq_len=max(len(p) for p in prompts) + max_new_tokens + 8)

    def engine_one(ids):
        return generate(engine, [ids], params)[0].token_ids

    def hf_one(ids):
        out = hf.generate(torch.tensor([ids], device=device), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                          do_sample=False, pad_token_id=tok.eos_token_id)
        return out[0, len(ids):].tolist()

    engine_one(prompts[0][:8]), hf_one(prompts[0][:8])  # warm-up
    rows = {}
    same = 0
    for name, fn in (("engine AR", engine_one), ("transformers generate", hf_one)):
        total_tokens, total_s, outs = 0, 0.0, []
        for ids in prompts:
            t0 = time.perf_counter()
            out = fn(ids)
            total_s += time.perf_counter() - t0
            total_tokens += len(out)
            outs.append(out)
        rows[name] = (total_tokens / total_s, outs)
    same = sum(a == b for a, b in zip(rows["engine AR"][1], rows["transformers generate"][1]))
    ratio = rows["engine AR"][0] / rows["transformers generate"][0]
    print(f"setup: {setup_line(device, threads)}; default model fp32/bf16 by device; {source}; "
          f"{max_new_tokens} new tokens, greedy, batch 1 (prefill included)")
    print("| path | tokens/s |")
    print("|---|---|")
    for name, (tps, _) in rows.items():
        print(f"| {name} | {tps:.2f} |")
    print(f"engine / transformers: {ratio:.2f}x; identical outputs: {same}/{len(prompts)}")
    return {"ratio": ratio, "engine_tps": rows["engine AR"][0], "hf_tps": rows["transformers generate"][0]}

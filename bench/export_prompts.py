"""Write the held-out benchmark prompts (token ids) the GPU benchmark uses, from the built corpora.

    python -m bench.export_prompts --out bench/data/gpu_prompts.json

Per domain, from the test split: `long` prompts of exactly 512 tokens (the request with its document
text appended until long enough) and `short` prompts of exactly 32 tokens (the request cut short),
both rendered with the target's chat template.
"""

from __future__ import annotations

import argparse
import json


def build(tokenizer, n: int, long_len: int = 512, short_len: int = 32, split: str = "test") -> dict:
    from training.corpora import load_domain

    out = {}
    for domain in ("code", "general", "dialog"):
        ds = load_domain(domain, split)
        longs, shorts = shaped_prompts(tokenizer, list(ds.select(range(min(len(ds), 8 * n)))), n, long_len, short_len)
        out[domain] = {"long": longs, "short": shorts}
    return out


def shaped_prompts(tokenizer, rows: list[dict], n: int, long_len: int = 512,
                   short_len: int = 32) -> tuple[list[list[int]], list[list[int]]]:
    """Up to n prompts of each benchmark shape from corpus rows (`messages`, `text`): long = the request with
    the next rows' documents appended, cut to exactly long_len tokens; short = the request cut to short_len."""
    longs, shorts = [], []
    for i, row in enumerate(rows):
        if len(longs) < n:
            content = row["messages"][-1]["content"]
            j = i
            while len(tokenizer(content, add_special_tokens=False).input_ids) < long_len and j < i + 20:
                j += 1
                content += "\n\n" + rows[j % len(rows)]["text"]
            ids = _render_cut(tokenizer, row["messages"][:-1], content, long_len)
            if ids is not None:
                longs.append(ids)
        if len(shorts) < n:
            ids = _render_cut(tokenizer, row["messages"][:-1], row["messages"][-1]["content"], short_len)
            if ids is not None:
                shorts.append(ids)
    return longs, shorts


def _render_cut(tokenizer, history, content, total):
    """Render history + a user turn whose content is cut so the whole prompt is exactly `total` tokens."""
    content_ids = tokenizer(content, add_special_tokens=False).input_ids
    lo, hi = 0, len(content_ids)
    best = None
    while lo <= hi:  # longest content cut that fits
        mid = (lo + hi) // 2
        text = tokenizer.decode(content_ids[:mid])
        ids = tokenizer.apply_chat_template(history + [{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=False)
        ids = tokenizer(ids, add_special_tokens=False).input_ids
        if len(ids) <= total:
            best, lo = ids, mid + 1
        else:
            hi = mid - 1
    if best is None or len(best) < total - 4:
        return None
    return best[:total] if len(best) >= total else best


def main() -> None:
    from engine.loading import load_tokenizer

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="bench/data/gpu_prompts.json")
    parser.add_argument("--n", type=int, default=16)
    args = parser.parse_args()
    data = build(load_tokenizer("default"), args.n)
    with open(args.out, "w") as f:
        json.dump(data, f)
    for d, v in data.items():
        print(d, {k: (len(x), sorted({len(p) for p in x})) for k, x in v.items()})


if __name__ == "__main__":
    main()

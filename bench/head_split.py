"""The fp32 vocabulary projection two ways, on the GPU: an fp32 copy of the bf16 weight (what the engine's
head does) against x split into bf16 parts and one bf16 GEMM with fp32 output.

    python -m bench.head_split [--rows 1,4,6,8,32,48]

x is fp32 (rows x 576), W is bf16 (49,152 x 576), SmolLM2-135M's shape with random weights. Three bf16
parts hold x's 24-bit mantissa and bf16 x bf16 products are exact in fp32, so three parts keep fp32's
error without an fp32 copy of W. Each variant is one CUDA graph, replayed 200 times (mean); the error is
against the product in fp64, and `argmax_eq` says whether every row's argmax matches it.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

VOCAB, HIDDEN = 49152, 576


def split(x: torch.Tensor, parts: int) -> list[torch.Tensor]:
    """x = sum of the parts up to fp32 rounding (each part the bf16 rounding of what the earlier ones left)."""
    out, rest = [], x
    for _ in range(parts):
        part = rest.to(torch.bfloat16)
        out.append(part)
        rest = rest - part.float()
    return out


def parts_head(w: torch.Tensor, parts: int):
    def head(x: torch.Tensor) -> torch.Tensor:
        y = torch.mm(torch.cat(split(x, parts)), w.t(), out_dtype=torch.float32)
        return y.view(parts, x.shape[0], -1).sum(0) if parts > 1 else y
    return head


def replay_us(fn, x: torch.Tensor, n: int = 200) -> tuple[float, torch.Tensor]:
    """fn(x) as one CUDA graph (`bench.gpu.capture_graph`: three warm-up runs, then the capture): mean us a
    replay over n, by CUDA events, and the graph's output."""
    from bench.gpu import capture_graph

    held = {}
    graph = capture_graph(lambda: held.__setitem__("out", fn(x)))
    out = held["out"]
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n * 1000, out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,4,6,8,32,48")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("error: bench.head_split times CUDA graphs; run it on a machine with a CUDA GPU")
    torch.manual_seed(0)
    w = (torch.randn(VOCAB, HIDDEN, device="cuda") * 0.05).to(torch.bfloat16)
    w32 = w.float()
    variants = {"fp32 copy": lambda x: F.linear(x, w32), "bf16 x3": parts_head(w, 3), "bf16 x2": parts_head(w, 2),
                "bf16 x1": parts_head(w, 1)}
    print(f"setup: {torch.cuda.get_device_name()}, torch {torch.__version__}, W bf16 {VOCAB}x{HIDDEN}, x fp32 (normal, sd 3)")
    for rows in (int(r) for r in args.rows.split(",")):
        x = torch.randn(rows, HIDDEN, device="cuda") * 3
        ref = x.double() @ w.double().t()
        line = {"rows": rows}
        for name, fn in variants.items():
            us, out = replay_us(fn, x)
            line[name] = {"us": round(us, 2), "max_err": float((out.double() - ref).abs().max()),
                          "argmax_eq": bool((out.argmax(-1) == ref.argmax(-1)).all())}
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()

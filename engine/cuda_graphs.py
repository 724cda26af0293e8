"""CUDA graphs for fixed-shape steps: capture once per shape, then replay.

On a small model an eager step is bound by kernel launches, not by the GPU: a captured step
replays all its kernels with one launch. Each distinct (function, shapes, constants) key gets its
own graph with static input buffers; a call copies its inputs in, replays, and returns clones of
the outputs (a later replay of the same graph overwrites its output buffers).
"""

from __future__ import annotations

from typing import Callable

import torch


class CapturedStep:
    def __init__(self, fn: Callable[..., tuple], inputs: dict[str, torch.Tensor], warmup: int = 2) -> None:
        self.fn = fn
        self.static = {k: v.clone() for k, v in inputs.items()}
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(warmup):  # warm-up runs do the real (idempotent) work: same inputs, same cache writes
                fn(**self.static)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.outputs = fn(**self.static)

    def __call__(self, inputs: dict[str, torch.Tensor]) -> tuple:
        for name, value in inputs.items():
            self.static[name].copy_(value)
        self.graph.replay()
        return tuple(o.clone() if isinstance(o, torch.Tensor) else o for o in self.outputs)


class GraphCache:
    """Graphs keyed by shape and constants; `enabled=False` (CPU) just calls the function."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.graphs: dict[tuple, CapturedStep] = {}

    def run(self, key: tuple, fn: Callable[..., tuple], inputs: dict[str, torch.Tensor]) -> tuple:
        if not self.enabled:
            return fn(**inputs)
        full_key = key + tuple((k, tuple(v.shape), v.dtype) for k, v in inputs.items())
        step = self.graphs.get(full_key)
        if step is None:
            step = self.graphs[full_key] = CapturedStep(fn, inputs)
            # The capture's warm-up already did this call's work; replaying once more is harmless
            # (same inputs, same cache writes) and gives the outputs from the graph's buffers.
        return step(inputs)

    def __len__(self) -> int:
        return len(self.graphs)

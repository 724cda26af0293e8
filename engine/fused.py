"""The opt-in fused inference path: fewer, larger kernels per decoder layer.

A decode step of a small model is bound by kernel launches (captured as a CUDA graph, by the
number of kernels and their fixed costs): each layer runs ~25 small kernels. Two independent
reductions, both switched on by `Transformer.fuse_for_inference()` (off by default):

* Hand fusion (always, CPU or GPU). q/k/v become one GEMM and gate/up one GEMM: each group's weights
  (and biases) are concatenated into one tensor, and the modules' own `.weight` / `.bias` parameters
  become views into it. Module structure, parameter objects, `state_dict()` keys and values are
  unchanged, memory is not doubled, and whatever references the parameters (a draft's trunk, the
  target fingerprint, `load_state_dict`, an optimizer) sees the fused storage. The residual add after
  each block is folded into the next RMSNorm (`add_rms_norm`).
* Compiled elementwise pieces (default on CUDA only). RMSNorm (with the residual add), RoPE on q and k
  together, and SiLU(gate) * up are each `torch.compile`d (fullgraph, dynamic=False, inductor's
  default mode: no `reduce-overhead`, the engine captures its steps as CUDA graphs itself and inductor's
  triton kernels capture like any other kernel). They are plain functions of tensors (weights are
  arguments, not module attributes), so 30 layers share one compiled graph per input shape instead of
  one per layer. Compiled kernels serve steps of at most `max_compiled_tokens` tokens per row (decode,
  draft and verify steps) and at most `MAX_SHAPES` distinct input shapes per function (later shapes run
  eagerly rather than recompile), so recompiles are bounded. Longer steps (a prefill) take the same
  functions compiled once more with the row count dynamic (`FusedOps.long`): a prefill captured as a CUDA
  graph is bound by its launches too (run 31: 2.4 ms at 32 tokens, 2.9 at 512), and one compiled graph
  then serves every prompt length. If compiling fails, the run goes on eagerly after one warning.

Everything here is inference-only: the fused weights carry no gradient to the parameters, so layers
take the unfused path whenever autograd would need one (grad enabled and the weights require grad).
"""

from __future__ import annotations

import inspect
import logging
import os
from typing import Callable, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from engine.rope import apply_rope_qk

log = logging.getLogger(__name__)

MAX_COMPILED_TOKENS = 16  # tokens per row up to which the compiled kernels run (decode/verify/draft steps)
MAX_SHAPES = 48  # distinct input shapes compiled per function; later ones run eagerly


# ----- the elementwise pieces (eager definitions; the compiled kernels are built from these) ---------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm exactly as `engine.model.RMSNorm` computes it (fp32 statistics, weight in x's dtype)."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the next norm: (x + delta, rms_norm(x + delta))."""
    x = x + delta
    return x, rms_norm(x, weight, eps)


def rope_qk(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    return apply_rope_qk(qkv, cos, sin, heads, head_dim)


def silu_mul(gate_up: torch.Tensor, inter: int) -> torch.Tensor:
    """SiLU(gate) * up from the fused gate|up projection (N, 2I) -> (N, I)."""
    return F.silu(gate_up[:, :inter]) * gate_up[:, inter:]


class Kernels(NamedTuple):
    rms_norm: Callable
    add_rms_norm: Callable
    rope_qk: Callable
    silu_mul: Callable


EAGER = Kernels(rms_norm, add_rms_norm, rope_qk, silu_mul)


class _CompiledKernel:
    """One compiled function with a bounded set of shapes and an eager fallback. `rows_dynamic`: compiled with
    the leading (row) dimension dynamic, so shapes that differ only there share one compiled graph."""

    def __init__(self, ops: "FusedOps", eager: Callable, compiled: Callable, rows_dynamic: bool = False) -> None:
        self.ops, self.eager, self.compiled = ops, eager, compiled
        self.rows_dynamic = rows_dynamic
        self.shapes: set[tuple] = set()  # what dynamo specializes on: one compiled graph each
        self.eager_keys: set[tuple] = set()

    def _layout(self, a: torch.Tensor) -> tuple:
        if self.rows_dynamic and a.dim() > 1:
            return (a.dim(), a.shape[1:], a.stride()[1:], a.is_contiguous())
        return (a.shape, a.stride())

    def __call__(self, *args):
        if self.ops.failed:
            return self.eager(*args)
        key = (torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
               *((self._layout(a), a.dtype, a.device, a.requires_grad) if isinstance(a, torch.Tensor) else a
                 for a in args))
        if key not in self.shapes:
            if len(self.shapes) >= MAX_SHAPES or key in self.eager_keys:
                self.eager_keys.add(key)
                return self.eager(*args)  # bounded recompiles: a rare shape runs eagerly
            self.shapes.add(key)
            global _COMPILES
            _COMPILES += 1
        try:
            return self.compiled(*args)
        except Exception as exc:  # noqa: BLE001 - any compile failure means "run eagerly", never a crashed run
            if "RecompileLimit" in type(exc).__name__ or "CacheLimit" in type(exc).__name__:
                self.shapes.discard(key)  # dynamo's own limit: this shape runs eagerly, the compiled ones stay
                self.eager_keys.add(key)
            else:
                self.ops.fail(exc)
            return self.eager(*args)


class FusedOps:
    """The elementwise kernels fused layers call: compiled for small steps, eager otherwise.

    One instance per (compile, backend) is shared by every model and draft (`make_ops`), so the
    compiled functions and their shape bookkeeping are shared too. `long`: the kernels of steps longer than
    `max_compiled_tokens` tokens per row (a prefill), compiled with the row count dynamic where `long_compiled`
    (default on; FLASHSPEC_PREFILL_COMPILE=0 in the environment: eager), which is read when a step runs (or
    is captured).
    """

    def __init__(self, compile: bool, backend: str | Callable = "inductor",
                 max_compiled_tokens: int = MAX_COMPILED_TOKENS) -> None:
        self.compile = compile
        self.backend = backend
        self.max_compiled_tokens = max_compiled_tokens
        self.failed = False
        self.compiled = None
        self.long = EAGER
        self.long_compiled = os.environ.get("FLASHSPEC_PREFILL_COMPILE", "1") != "0"
        if compile:
            try:
                self.compiled = Kernels(*(_CompiledKernel(self, fn, _compile(fn, backend)) for fn in EAGER))
                self.long = Kernels(*(_CompiledKernel(self, fn, _compile(fn, backend, dynamic=True), rows_dynamic=True)
                                      for fn in EAGER))
            except Exception as exc:  # noqa: BLE001 - torch.compile unavailable here: eager, one warning
                self.compiled = self.long = EAGER
                self.fail(exc)

    @property
    def compiling(self) -> bool:
        return self.compiled is not None and not self.failed

    def select(self, tokens_per_row: int) -> Kernels:
        if self.compiled is None or self.failed:
            return EAGER
        if tokens_per_row <= self.max_compiled_tokens:
            return self.compiled
        return self.long if self.long_compiled else EAGER

    def shape_counts(self) -> dict[str, dict[str, int]]:
        """Per compiled function: how many input shapes it compiled and how many run eagerly because a
        limit was reached (ours, `MAX_SHAPES`, or dynamo's). Empty when nothing is compiled."""
        if not isinstance(self.compiled, Kernels) or self.compiled is EAGER:
            return {}
        sets = [("", self.compiled)] + ([(" (long steps)", self.long)] if self.long is not EAGER else [])
        return {name + label: {"compiled": len(k.shapes), "eager": len(k.eager_keys), "cap": MAX_SHAPES}
                for label, kernels in sets for name, k in zip(Kernels._fields, kernels)}

    def fail(self, exc: Exception) -> None:
        if not self.failed:
            self.failed = True
            root = exc
            while root.__cause__ is not None:
                root = root.__cause__
            lines = [line.strip() for line in str(root).splitlines() if line.strip()]
            log.warning("torch.compile of the fused elementwise kernels failed (%s: %s); running them eagerly "
                        "from now on (the fused GEMMs stay on)", type(root).__name__, " ".join(lines[:2]))


def _compile(fn: Callable, backend: str | Callable, dynamic: bool = False) -> Callable:
    kwargs = dict(fullgraph=True, dynamic=dynamic, backend=backend)
    if backend == "inductor":
        import torch._inductor.config as inductor_config

        # Round where eager rounds (bf16 products, the residual sum): closer to the unfused path's numbers.
        if hasattr(inductor_config, "emulate_precision_casts"):
            kwargs["options"] = {"emulate_precision_casts": True}
    limit = MAX_SHAPES + 16
    if "recompile_limit" in inspect.signature(torch.compile).parameters:  # newer torch: per compile call
        kwargs["recompile_limit"] = limit
    else:  # older torch: the global limit (per code object; only raised, never lowered)
        import torch._dynamo.config as dynamo_config

        name = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
        setattr(dynamo_config, name, max(getattr(dynamo_config, name), limit))
    return torch.compile(fn, **kwargs)


_OPS: dict[tuple, FusedOps] = {}
_COMPILES = 0  # new shapes handed to torch.compile so far (each one compiles: seconds, not a step's cost)


def compile_events() -> int:
    """How many times a compiled kernel met a new shape (and compiled) in this process."""
    return _COMPILES


def make_ops(compile: bool, backend: str | Callable = "inductor", max_compiled_tokens: int = MAX_COMPILED_TOKENS) -> FusedOps:
    key = (compile, backend if compile else None, max_compiled_tokens if compile else None)
    if key not in _OPS:
        _OPS[key] = FusedOps(compile, backend, max_compiled_tokens)
    return _OPS[key]


# ----- hand fusion of linear layers -------------------------------------------------------------------
class FusedLinear:
    """Several nn.Linear's over the same input as one GEMM; their parameters become views into it.

    Not a module: nothing is registered, so `state_dict()` and `.to()` see only the original
    parameters. `intact()` says whether the parameters still alias the fused tensors (a parameter
    replaced or moved after fusing no longer does: callers then take the unfused path).
    """

    def __init__(self, linears: list[nn.Linear]) -> None:
        self.linears = linears
        has_bias = [lin.bias is not None for lin in linears]
        if any(has_bias) and not all(has_bias):
            raise ValueError("cannot fuse linear layers where only some have a bias")
        sizes = [lin.out_features for lin in linears]
        with torch.no_grad():
            self.weight = torch.cat([lin.weight.detach() for lin in linears], dim=0)
            for lin, part in zip(linears, self.weight.split(sizes, dim=0)):
                lin.weight.data = part
            self.bias = None
            if all(has_bias):
                self.bias = torch.cat([lin.bias.detach() for lin in linears], dim=0)
                for lin, part in zip(linears, self.bias.split(sizes, dim=0)):
                    lin.bias.data = part
        self._ptrs = self._current()

    def _current(self) -> list:
        # Called on every forward (it guards the fused path): plain loops over the modules' parameter dicts.
        ptrs = []
        for lin in self.linears:
            for p in lin._parameters.values():
                ptrs.append(p.data_ptr() if p is not None else None)
        return ptrs

    def intact(self) -> bool:
        return self._current() == self._ptrs

    def needs_grad(self) -> bool:
        for lin in self.linears:
            for p in lin._parameters.values():
                if p is not None and p.requires_grad:
                    return True
        return False

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def release(self) -> None:
        """Give every parameter its own storage again (when it still aliases the fused tensor)."""
        if self.intact():
            with torch.no_grad():
                for lin in self.linears:
                    for p in lin.parameters(recurse=False):
                        p.data = p.detach().clone()
        self.weight = self.bias = None


# ----- fusing modules ----------------------------------------------------------------------------------
def fuse_for_inference(module: nn.Module, compile: bool | None = None, *, backend: str | Callable = "inductor",
                       max_compiled_tokens: int = MAX_COMPILED_TOKENS) -> FusedOps:
    """Fuse every DecoderLayer inside `module` (a Transformer, or a draft: its own adapter layers; the
    target's layers it references are not its submodules). compile=None: on when the weights are on CUDA.

    Idempotent: fusing again only switches the elementwise kernels (compiled or eager).
    Fuse before building a DecodeEngine on the model: CUDA graphs captured earlier point at the
    parameters' previous storage.
    """
    from engine.model import DecoderLayer, Transformer

    if compile is None:
        first = next(module.parameters(), None)
        compile = first is not None and first.device.type == "cuda"
    ops = make_ops(bool(compile), backend, max_compiled_tokens)
    for m in module.modules():
        if isinstance(m, DecoderLayer):
            m.fuse(ops)
    if isinstance(module, Transformer):
        module._fused_ops = ops  # its forward defers each layer's last residual add into the next norm
    elif hasattr(module, "_fused_ops"):
        module._fused_ops = ops  # a draft: its output norm
    return ops


def unfuse(module: nn.Module) -> None:
    """Undo `fuse_for_inference`: unfused forward, every parameter in its own storage again."""
    from engine.model import DecoderLayer, Transformer

    for m in module.modules():
        if isinstance(m, DecoderLayer):
            m.unfuse()
    if isinstance(module, Transformer) or hasattr(module, "_fused_ops"):
        module._fused_ops = None

"""Faster fp32 linear layers on the CPU: oneDNN with weights prepacked once.

On the CPU, `F.linear` goes to MKL's sgemm, which is slow for the few rows a decode step or a
verify pass carries: on a 2-core x86 machine the 49k-row vocabulary projection takes 9.9 ms for
1 row and 22 ms for 6. oneDNN with the weight reordered once into its blocked layout (for
`PACK_ROWS` = 8 rows) takes 4.6 / 3.3 ms, and a decode step of the default model drops from 59 to
42 ms, a 6-token pass from 84 to 43 ms (`python -m bench.cpu_costs` measures these, and the 1-row
layout beside them).

`pack_linears(module)` switches every `nn.Linear` below `module` to `PackedLinear` (same class
otherwise, same parameters and state dict) holding a packed copy of its weight. The packed path runs
only when it can give the same answer as `F.linear` up to rounding: fp32 on the CPU, no gradient
wanted, and the weight unchanged since packing (its storage and version counter are checked, so a
training step or a loaded state dict falls back to `F.linear` until `repack` runs). The packed copy
costs as much memory again as the weights it packs. Off with FLASHSPEC_CPU_PACKED=0.
"""

from __future__ import annotations

import functools
import logging
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=1)
def _works() -> bool:
    """Pack and run a small projection once: builds (or CPUs) where the oneDNN ops are missing or fail
    keep plain F.linear instead of failing at load."""
    try:
        if not torch.backends.mkldnn.is_available():
            return False
        w, x = torch.randn(8, 16), torch.randn(3, 16)
        out = torch.ops.mkldnn._linear_pointwise(x, _pack(w), None, "none", [], "")
        return bool(torch.allclose(out, F.linear(x, w), rtol=1e-4, atol=1e-4))
    except Exception as exc:  # an op missing from this build, or refused by this CPU
        log.info("oneDNN-packed projections unavailable (%s); using F.linear", exc)
        return False


def available() -> bool:
    """oneDNN packing works here and is not switched off by FLASHSPEC_CPU_PACKED=0."""
    if os.environ.get("FLASHSPEC_CPU_PACKED", "1") == "0":
        return False
    return _works()


# The row count oneDNN lays a packed weight out for. The engine runs 1 row (a decode or draft step)
# and 2-7 rows (a verify pass); a layout for 8 rows is as fast as the 1-row layout for one row, and
# about 1.6x faster for 4-6 rows (the 1-row layout reads the whole vocabulary projection twice as
# slowly for 6 rows as the 8-row one): `python -m bench.cpu_costs` measures both.
PACK_ROWS = 8


def _pack(weight: torch.Tensor, rows: int = PACK_ROWS) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (..., in) @ W.T + b with W prepacked by `_pack`; any number of rows."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedWeight:
    """A packed copy of one weight tensor, valid while the tensor is the one (and as it was) when packed:
    same storage and shape, same version counter (inference tensors, made under torch.inference_mode,
    have none; they are never trained)."""

    def __init__(self, weight: torch.Tensor, rows: int = PACK_ROWS) -> None:
        self.ptr, self.shape = weight.data_ptr(), weight.shape
        self.version = None if weight.is_inference() else weight._version
        self.packed = _pack(weight, rows)

    def usable(self, weight: torch.Tensor, x: torch.Tensor) -> bool:
        # On every projection of a CPU decode step: cheapest tests first, no allocation.
        return (weight.data_ptr() == self.ptr and x.dtype == torch.float32 and weight.dtype == torch.float32
                and x.device.type == "cpu" and weight.shape == self.shape
                and (self.version is None or weight._version == self.version)
                and not (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad)))


class PackedLinear(nn.Linear):
    """nn.Linear with a oneDNN-packed weight for inference on the CPU (see the module docstring)."""

    _packed: PackedWeight | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = getattr(self, "_packed", None)
        if packed is not None and packed.usable(self.weight, x):
            return packed_linear(x, packed.packed, self.bias)
        return F.linear(x, self.weight, self.bias)

    def repack(self) -> None:
        self._packed = PackedWeight(self.weight) if self.weight.device.type == "cpu" else None


def pack_linears(module: nn.Module) -> int:
    """Switch the fp32 CPU `nn.Linear`s below `module` to PackedLinear; returns how many. No-op when unavailable."""
    if not available():
        return 0
    count = 0
    for sub in module.modules():
        if type(sub) is nn.Linear and sub.weight.device.type == "cpu" and sub.weight.dtype == torch.float32:
            sub.__class__ = PackedLinear
            sub.repack()
            count += 1
        elif isinstance(sub, PackedLinear):
            sub.repack()
            count += 1
    return count


def linear(x: torch.Tensor, weight: torch.Tensor, cache: dict, key: str) -> torch.Tensor:
    """F.linear(x, weight) through a packed copy kept in `cache[key]` when the packed path applies."""
    if available() and x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32 \
            and not (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad)):
        packed = cache.get(key)
        if packed is None or not packed.usable(weight, x):
            packed = cache[key] = PackedWeight(weight)
        return packed_linear(x, packed.packed, None)
    return F.linear(x, weight)

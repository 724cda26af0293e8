"""The engine's small Triton kernels (engine/triton_kernels.py) under Triton's CPU interpreter, where
triton is installed; the GPU runs are in tests/gpu/test_triton_kernels_gpu.py."""

import torch

from engine.cache import KVCache
from engine.triton_kernels import kv_write


def test_kv_write_declines_cpu_tensors_outside_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cache = KVCache(1, 2, 2, 8, 16)
    k = torch.randn(2, 2, 1, 16)
    assert not kv_write(cache.k[0], cache.v[0], None, torch.zeros(2, 1, dtype=torch.long), k, k)


KV_WRITE = """
import torch
from engine.triton_kernels import kv_write
torch.manual_seed(0)
R, H, S, D = 5, 3, 40, 16
for rows, b in ((None, 2), (slice(1, 4), 3), (torch.tensor([4, 0]), 2)):
    for t in (1, 6):
        kc, vc = torch.randn(R, H, S, D), torch.randn(R, H, S, D)
        k, v = torch.randn(b, H, t, D), torch.randn(b, H, t, D)
        pos = torch.randint(0, S - t, (b, 1)) + torch.arange(t)
        ref_k, ref_v = kc.clone(), vc.clone()
        r = torch.arange(b) if rows is None else (torch.arange(rows.start, rows.stop) if isinstance(rows, slice) else rows)
        ref_k[r[:, None], :, pos] = k.transpose(1, 2)
        ref_v[r[:, None], :, pos] = v.transpose(1, 2)
        assert kv_write(kc, vc, rows, pos, k, v)
        assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v), (rows, t)
# strided inputs (views of a fused projection) and a strided cache view
kc, vc = torch.zeros(2, H, S, 2 * D)[..., :D], torch.zeros(2, H, S, D)
big = torch.randn(1, 2 * H, 3, D)
k, v = big[:, :H], big[:, H:]
pos = torch.tensor([[7, 8, 9]])
assert kv_write(kc, vc, slice(1, 2), pos, k, v)
assert torch.equal(kc[1, :, 7:10], k[0]) and torch.equal(vc[1, :, 7:10], v[0]) and not kc[0].any()
print("ok")
"""


def test_kv_write_matches_indexing_in_the_interpreter(triton_interpreter):
    triton_interpreter(KV_WRITE)


ARGMAX = """
import torch
from engine.triton_kernels import argmax
torch.manual_seed(0)
for shape, dtype in (((3, 10000), torch.float32), ((2, 4, 5000), torch.bfloat16), ((1, 49152), torch.float32)):
    x = torch.randn(shape).to(dtype)
    assert torch.equal(argmax(x), x.argmax(-1)), shape
x = torch.zeros(2, 9000)
x[0, 7000] = x[0, 8000] = 5.0  # equal maxima in two chunks: the first
x[1, 100] = x[1, 101] = 5.0  # and within one chunk
x[1, 3] = float("nan")  # NaN counts as largest, as in torch
assert torch.equal(argmax(x), x.argmax(-1)), (argmax(x), x.argmax(-1))
assert torch.equal(argmax(torch.full((2, 9000), float("-inf"))), torch.zeros(2, dtype=torch.long))
small = torch.randn(2, 100)
assert torch.equal(argmax(small), small.argmax(-1))  # short rows: torch's own
print("ok")
"""


def test_argmax_matches_torch_in_the_interpreter(triton_interpreter):
    triton_interpreter(ARGMAX)


def test_argmax_is_torch_s_on_cpu(monkeypatch):
    from engine.triton_kernels import argmax

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x = torch.randn(3, 9000)
    assert torch.equal(argmax(x), x.argmax(-1))

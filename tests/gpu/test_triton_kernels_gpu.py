"""engine/triton_kernels.py on the GPU: the one-launch KV-cache write is the indexing write bit for bit,
and the two-pass argmax is torch.argmax. Skipped without CUDA."""

import pytest
import torch

from engine import triton_kernels
from engine.cache import KVCache

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
if not triton_kernels.available():
    pytestmark.append(pytest.mark.skip(reason="needs the triton package"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,b", [(None, 2), (slice(1, 4), 3), ("tensor", 2)])
@pytest.mark.parametrize("t", [1, 6, 37])
def test_cache_write_kernel_equals_indexing(monkeypatch, dtype, rows, b, t):
    g = torch.Generator(device="cuda").manual_seed(t * 10 + b)
    if rows == "tensor":
        rows = torch.tensor([4, 0], device="cuda")
    caches = [KVCache(2, 5, 3, 128, 64, dtype, "cuda") for _ in range(2)]
    k = torch.randn(b, 3, t, 64, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(b, 3, t, 64, device="cuda", dtype=dtype, generator=g)
    pos = torch.randint(0, 128 - t, (b, 1), device="cuda", generator=g) + torch.arange(t, device="cuda")
    for cache, fast in zip(caches, (True, False)):
        monkeypatch.setattr(triton_kernels, "ENABLED", fast)
        cache.write(1, rows, pos, k, v)
    assert torch.equal(caches[0].k[1], caches[1].k[1]) and torch.equal(caches[0].v[1], caches[1].v[1])
    assert caches[0].k[1].any() and not caches[0].k[0].any()


@pytest.mark.parametrize("shape", [(1, 49152), (6, 49152), (8, 6, 49152), (3, 5000)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_equals_torch(shape, dtype):
    x = torch.randn(shape, device="cuda").to(dtype)
    x[..., 123] = x.max()  # equal maxima: the first wins in both
    assert torch.equal(triton_kernels.argmax(x), x.argmax(-1))


def test_argmax_inside_a_cuda_graph():
    x = torch.randn(4, 49152, device="cuda")
    out = triton_kernels.argmax(x)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_kernels.argmax(x)
    x.copy_(torch.randn(4, 49152, device="cuda"))
    graph.replay()
    assert torch.equal(out, x.argmax(-1))

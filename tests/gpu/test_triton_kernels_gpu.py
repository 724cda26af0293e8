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


@pytest.mark.parametrize("m", [1, 6, 16])
@pytest.mark.parametrize("k,n", [(576, 960), (576, 576), (576, 3072), (1536, 576)])
def test_linear_and_its_prologues_match_the_eager_ops(m, k, n):
    import torch.nn.functional as F

    from engine.fused import rms_norm, silu_mul
    from engine.triton_kernels import ADD_RMS_NORM, RMS_NORM, SILU_MUL, linear

    g = torch.Generator(device="cuda").manual_seed(m * 7 + n)
    rnd = lambda *s: torch.randn(*s, device="cuda", generator=g)  # noqa: E731
    x, d, gu = rnd(m, k).bfloat16(), rnd(m, k).bfloat16(), rnd(m, 2 * k).bfloat16()
    w, b, nw = (rnd(n, k) * 0.05).bfloat16(), rnd(n).bfloat16(), (1 + 0.1 * rnd(k)).bfloat16()
    close = lambda a, ref: torch.testing.assert_close(a.float(), ref.float(), atol=3e-2, rtol=2e-2)  # noqa: E731
    close(linear(x, w, b), F.linear(x, w, b))
    close(linear(x, w, prologue=RMS_NORM, norm_weight=nw, eps=1e-5), F.linear(rms_norm(x, nw, 1e-5), w))
    res, y = linear(x, w, prologue=ADD_RMS_NORM, delta=d, norm_weight=nw, eps=1e-5)
    assert torch.equal(res, x + d)
    close(y, F.linear(rms_norm(x + d, nw, 1e-5), w))
    close(linear(gu, w, prologue=SILU_MUL), F.linear(silu_mul(gu, k), w))
    # A verify pass's rows equal a decode step's, bit for bit: the tile and reduction order do not depend on M.
    assert torch.equal(linear(x[:1], w, b), linear(x, w, b)[:1])


def test_fused_model_steps_on_the_kernels_match_without_them():
    from tests.gpu.test_cuda_graphs import tiny_target

    model = tiny_target(torch.bfloat16)
    model.fuse_for_inference(compile=True)
    prompt = torch.randint(0, 256, (2, 20), device="cuda")
    outs = {}
    try:
        for enabled in (False, True):
            triton_kernels.ENABLED = enabled
            cache = model.new_cache(2, 64)
            model(prompt, torch.arange(20, device="cuda")[None].expand(2, -1), cache=cache)
            step = torch.arange(6, device="cuda").view(2, 3) * 7
            out = model(step, 20 + torch.arange(3, device="cuda")[None].expand(2, -1), cache=cache, kv_len=23)
            outs[enabled] = (out.hidden.float(), out.logits.float(), cache.k[3][:, :, :23].float())
    finally:
        triton_kernels.ENABLED = True
    for a, b in zip(outs[False], outs[True]):
        torch.testing.assert_close(b, a, atol=5e-2, rtol=5e-2)

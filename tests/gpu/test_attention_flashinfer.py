"""The flashinfer attention backend (engine/attention.py) against SDPA on the GPU, where flashinfer-python is
installed (`SET=flashinfer bench/stage_wheels.sh` stages it for an offline machine). Skipped otherwise."""

import importlib.util

import pytest
import torch

from engine.attention import FlashInferBackend, SdpaBackend, make_backend

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
if importlib.util.find_spec("flashinfer") is None:
    pytestmark.append(pytest.mark.skip(reason="needs the flashinfer-python package"))


@pytest.mark.parametrize("t", [1, 6])
@pytest.mark.parametrize("kind", ["causal", "random"])
def test_flashinfer_backend_matches_sdpa(t, kind):
    g = torch.Generator(device="cuda").manual_seed(t)
    backend = make_backend("flashinfer")
    assert isinstance(backend, FlashInferBackend)
    cache_k = torch.randn(3, 3, 512, 64, device="cuda", generator=g).bfloat16()
    cache_v = torch.randn(3, 3, 512, 64, device="cuda", generator=g).bfloat16()
    k, v = cache_k[:2, :, :300], cache_v[:2, :, :300]  # two rows' filled slots of a bigger cache: strided
    q = torch.randn(2, 9, t, 64, device="cuda", generator=g).bfloat16()
    if kind == "causal":  # the new tokens are the last t slots
        pos = torch.arange(300 - t, 300, device="cuda")
        mask = (torch.arange(300, device="cuda")[None, :] <= pos[:, None])[None, None].expand(2, 1, t, 300).contiguous()
    else:  # any mask (deep-draft windows, trees)
        mask = torch.rand(2, 1, t, 300, device="cuda", generator=g) < 0.5
        mask[..., 0] = True
    ref = SdpaBackend()(q.float(), k.float(), v.float(), mask)
    torch.testing.assert_close(backend(q, k, v, mask).float(), ref, atol=2e-2, rtol=2e-2)


def test_flashinfer_backend_inside_a_cuda_graph():
    backend = make_backend("flashinfer")
    q = torch.randn(1, 9, 6, 64, device="cuda").bfloat16()
    k, v = torch.randn(1, 3, 256, 64, device="cuda").bfloat16(), torch.randn(1, 3, 256, 64, device="cuda").bfloat16()
    mask = torch.ones(1, 1, 6, 256, dtype=torch.bool, device="cuda")
    backend(q, k, v, mask)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend(q, k, v, mask)
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.testing.assert_close(out.float(), SdpaBackend()(q.float(), k.float(), v.float(), mask), atol=2e-2, rtol=2e-2)

"""engine/triton_kernels.py on the GPU: the one-launch KV-cache write is the indexing write bit for bit,
and the two-pass argmax is torch.argmax; the sampling kernels give torch's distribution and tokens. Skipped without CUDA."""

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


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("rows", [None, "slice", "index"])
@pytest.mark.parametrize("b,t", [(1, 1), (8, 1), (8, 6)])
def test_rope_kv_write_equals_rope_then_write(dtype, tol, rows, b, t):
    from engine.rope import apply_rope_qk
    from engine.triton_kernels import kv_write, rope_kv_write

    hq, hkv, s, d = 9, 3, 256, 64
    g = torch.Generator(device="cuda").manual_seed(b * 10 + t)
    qkv = torch.randn(b * t, (hq + 2 * hkv) * d, device="cuda", generator=g).to(dtype)
    cos, sin = (torch.randn(b * t, d, device="cuda", generator=g).to(dtype) for _ in range(2))
    pos = torch.randint(0, s - t, (b, 1), device="cuda", generator=g) + torch.arange(t, device="cuda")
    r = {None: None, "slice": slice(1, 1 + b), "index": torch.randperm(10, device="cuda", generator=g)[:b]}[rows]
    kc, vc = torch.zeros(10, hkv, s, d, device="cuda", dtype=dtype), torch.zeros(10, hkv, s, d, device="cuda", dtype=dtype)
    ref_kc, ref_vc = kc.clone(), vc.clone()
    qk = apply_rope_qk(qkv.float(), cos.float(), sin.float(), hq + hkv, d)  # fp32, rounded once
    k = qk[:, hq:].to(dtype).view(b, t, hkv, d).transpose(1, 2)
    v = qkv[:, (hq + hkv) * d:].view(b, t, hkv, d).transpose(1, 2)
    assert kv_write(ref_kc, ref_vc, r, pos, k, v)
    q = rope_kv_write(qkv, cos, sin, kc, vc, r, pos, hq, hkv)
    torch.testing.assert_close(q.float(), qk[:, :hq], atol=tol, rtol=tol)
    torch.testing.assert_close(kc, ref_kc, atol=tol, rtol=tol)
    assert torch.equal(vc, ref_vc)


def test_uniform_draws_equal_the_torch_hash(monkeypatch):
    from engine.sampling import uniform_at

    g = torch.Generator(device="cuda").manual_seed(1)
    state = torch.stack([torch.randint(0, 2**32, (8,), device="cuda", generator=g),
                         torch.randint(0, 2**32, (8,), device="cuda", generator=g)], 1)
    for offset, shape in ((0, (8,)), (5, (8, 11)), (2**32 - 2, (8, 4))):
        fast = uniform_at(state, offset, shape)
        monkeypatch.setattr(triton_kernels, "ENABLED", False)
        ref = uniform_at(state, offset, shape)
        monkeypatch.setattr(triton_kernels, "ENABLED", True)
        assert torch.equal(fast, ref)
    assert triton_kernels.uniform(state, 0, 8, 3) is not None


def _torch_path(monkeypatch, fn, *args, **kwargs):
    monkeypatch.setattr(triton_kernels, "SAMPLING", False)
    try:
        return fn(*args, **kwargs)
    finally:
        monkeypatch.setattr(triton_kernels, "SAMPLING", True)


@pytest.mark.parametrize("shape", [(1, 8192), (8, 8192), (1, 6, 49152), (8, 6, 49152), (3, 5000)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tempered_softmax_equals_torch(monkeypatch, shape, dtype):
    from engine.sampling import processed_probs

    g = torch.Generator(device="cuda").manual_seed(shape[0])
    x = (3 * torch.randn(shape, device="cuda", generator=g)).to(dtype)
    x[..., 77] = x[..., 99] = x.amax(-1)  # equal maxima: a greedy row's one-hot at the first, as torch.argmax
    t = torch.tensor([0.0, 1.0, 0.6, 1.7, 1.0, 0.0, 2.5, 1.0][: shape[0]], device="cuda")
    none, ones = torch.zeros(shape[0], dtype=torch.long, device="cuda"), torch.ones(shape[0], device="cuda")
    fast = triton_kernels.tempered_softmax(x, t)
    ref = _torch_path(monkeypatch, processed_probs, x, t, none, ones, filtered=False)
    torch.testing.assert_close(fast, ref, rtol=2e-5, atol=1e-7)
    greedy = (t == 0).view(-1, *([1] * (len(shape) - 1)))
    assert torch.equal(torch.where(greedy, fast, 0), torch.where(greedy, ref, 0))  # one-hot rows exactly


@pytest.mark.parametrize("v", [8192, 49152, 5000])
def test_inverse_cdf_equals_the_float64_search(monkeypatch, v):
    from engine.sampling import sample_with

    g = torch.Generator(device="cuda").manual_seed(v)
    p = torch.rand(8, v, device="cuda", generator=g) ** 6
    p[:3, v // 3:] = 0  # zero tails are never drawn
    u = torch.rand(256, 8, device="cuda", generator=g)
    u[0] = 1 - 2**-24
    for i in range(u.shape[0]):
        fast = triton_kernels.inverse_cdf(p, u[i])
        assert torch.equal(fast, _torch_path(monkeypatch, sample_with, p, u[i])), i
    assert (p.gather(1, fast[:, None]) > 0).all()


def test_sampling_kernels_inside_a_cuda_graph():
    x = torch.randn(4, 8192, device="cuda")
    t = torch.tensor([1.0, 0.0, 0.7, 1.0], device="cuda")
    u = torch.rand(4, device="cuda")

    def fn():
        probs = triton_kernels.tempered_softmax(x, t)
        return probs, triton_kernels.inverse_cdf(probs, u)

    fn()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        probs, token = fn()
    x.copy_(torch.randn(4, 8192, device="cuda"))
    u.copy_(torch.rand(4, device="cuda"))
    graph.replay()
    want_probs, want_token = fn()
    assert torch.equal(probs, want_probs) and torch.equal(token, want_token)
    assert token[1] == x[1].argmax()


@pytest.mark.parametrize("split", [0, 3])
@pytest.mark.parametrize("n", [1, 6, 8, 48])
def test_vocab_projection_equals_fp32_linear(split, n):
    import torch.nn.functional as F

    g = torch.Generator(device="cuda").manual_seed(n)
    w = (0.05 * torch.randn(49152, 576, device="cuda", generator=g)).to(torch.bfloat16)
    x = 3 * torch.randn(n, 576, device="cuda", generator=g)
    out = triton_kernels.vocab_projection(x, w, {"split": split})
    ref = F.linear(x, w.float())
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)  # fp32 rounding of sums of 576 products
    alone = torch.cat([triton_kernels.vocab_projection(x[i : i + 1], w, {"split": split}) for i in range(n)])
    assert torch.equal(alone, out)  # a row's logits do not depend on the rows sharing its call
    for t in (0, 1):  # nor on the order the tiles' programs are launched in
        assert torch.equal(triton_kernels.vocab_projection(x, w, {"split": split, "t": t}), out), t


def test_vocab_projection_inside_a_cuda_graph_and_in_the_model():
    from engine.config import ModelArgs
    from engine.model import Transformer

    torch.manual_seed(0)
    args = ModelArgs(model_type="llama", vocab_size=5000, hidden_size=64, intermediate_size=128, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=64, tie_word_embeddings=True)
    with torch.device("cuda"):
        model = Transformer(args, max_seq_len=64).to(torch.bfloat16).eval().requires_grad_(False)  # as served
    x = torch.randn(6, 64, device="cuda")
    out = model._project_vocab(x)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = model._project_vocab(x)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(out, x @ model.lm_head.weight.float().T, rtol=1e-5, atol=1e-4)
    assert getattr(model, "_lm_head_f32", None) is None  # the kernel served the call, not F.linear over a copy
    tokens = torch.randint(0, 5000, (1, 7), device="cuda")
    with torch.no_grad():
        model(tokens, torch.arange(7, device="cuda")[None])
    assert getattr(model, "_lm_head_f32", None) is None  # the fp32 copy of the weight is never made


@pytest.mark.parametrize("n", [1, 6, 48])
def test_norm_vocab_projection_equals_the_torch_norm_then_projection(monkeypatch, n):
    import torch.nn.functional as F

    monkeypatch.setattr(triton_kernels, "VOCAB_NORM", True)
    g = torch.Generator(device="cuda").manual_seed(n)
    w = (0.05 * torch.randn(49152, 576, device="cuda", generator=g)).to(torch.bfloat16)
    norm_w = (1 + 0.1 * torch.randn(576, device="cuda", generator=g)).to(torch.bfloat16)
    hidden = (3 * torch.randn(n, 576, device="cuda", generator=g)).to(torch.bfloat16)
    logits, normed = triton_kernels.norm_vocab_projection(hidden, norm_w, 1e-5, w)
    x = hidden.float()
    x = norm_w.float() * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    torch.testing.assert_close(logits, F.linear(x, w.float()), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(normed.float(), x.to(torch.bfloat16).float(), rtol=2**-7, atol=1e-6)  # one bf16 unit
    alone = torch.cat([triton_kernels.norm_vocab_projection(hidden[i : i + 1], norm_w, 1e-5, w)[0] for i in range(n)])
    assert torch.equal(alone, logits)  # a row's logits do not depend on the rows sharing its call
    for t in (0, 1):  # nor on the order the tiles' programs are launched in
        again = triton_kernels.norm_vocab_projection(hidden, norm_w, 1e-5, w, {"t": t})
        assert torch.equal(again[0], logits) and torch.equal(again[1], normed), t
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = triton_kernels.norm_vocab_projection(hidden, norm_w, 1e-5, w)
    graph.replay()
    assert torch.equal(replayed[0], logits) and torch.equal(replayed[1], normed)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_step_context_equals_the_torch_path_inside_a_cuda_graph(monkeypatch, dtype):
    """FLASHSPEC_CONTEXT_KERNEL=1: cos, sin and the visibility mask of a pass in one launch, bit for bit the torch
    path's, also replayed in a CUDA graph at new positions; and a fused model's engine gives the same tokens."""
    from engine.cache import visibility_mask

    monkeypatch.setattr(triton_kernels, "CONTEXT", True)
    table_cos, table_sin = torch.randn(4096, 64, device="cuda"), torch.randn(4096, 64, device="cuda")
    pos = torch.tensor([[700, 701, 702, 703, 704, 705], [9, 10, 11, 12, 13, 14]], device="cuda")
    triton_kernels.step_context(table_cos, table_sin, pos, dtype, 2057)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cos, sin, mask = triton_kernels.step_context(table_cos, table_sin, pos, dtype, 2057)
    for shift in (0, 1000, 2040):
        pos.add_(shift)
        graph.replay()
        assert torch.equal(cos, table_cos[pos].to(dtype)[:, None]) and torch.equal(sin, table_sin[pos].to(dtype)[:, None])
        assert torch.equal(mask, visibility_mask(pos, 2057))

    from engine.generate import generate
    from engine.sampling import SamplingParams
    from engine.scheduler import DecodeEngine
    from tests.gpu.test_cuda_graphs import tiny_target

    model = tiny_target(dtype)
    model.fuse_for_inference(compile=True)
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16]]
    outs = []
    for on in (True, False):
        monkeypatch.setattr(triton_kernels, "CONTEXT", on)
        eng = DecodeEngine(model, None, max_batch_size=2, max_seq_len=128)
        outs.append([r.token_ids for r in generate(eng, prompts, SamplingParams(max_new_tokens=24, eos_token_ids=()))])
    assert outs[0] == outs[1]


@pytest.mark.parametrize("b,s,vocab", [(1, 2048, 3), (8, 2048, 5), (16, 600, 2), (3, 9, 2)])
def test_lookup_propose_equals_torch_inside_a_cuda_graph(monkeypatch, b, s, vocab):
    from engine import lookup

    g = torch.Generator(device="cuda").manual_seed(b * s)
    history = torch.randint(0, vocab, (b, s), device="cuda", generator=g)
    lengths = torch.randint(0, s + 1, (b,), device="cuda", generator=g)
    for gamma, max_n, min_n in ((5, 3, 2), (8, 3, 2), (1, 1, 1), (6, 4, 1)):
        monkeypatch.setattr(triton_kernels, "ENABLED", False)
        ref = lookup.propose(history, lengths, gamma, max_n, min_n)
        monkeypatch.setattr(triton_kernels, "ENABLED", True)
        assert all(torch.equal(f, r) for f, r in zip(triton_kernels.lookup_propose(history, lengths, gamma, max_n,
                                                                                   min_n), ref))
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            out = lookup.propose(history, lengths, gamma, max_n, min_n)
        history.copy_(torch.randint(0, vocab, (b, s), device="cuda", generator=g))  # new inputs, replayed
        graph.replay()
        monkeypatch.setattr(triton_kernels, "ENABLED", False)
        ref = lookup.propose(history, lengths, gamma, max_n, min_n)
        assert all(torch.equal(f, r) for f, r in zip(out, ref)), (gamma, max_n)
        assert ref[1].any() or b * s < 100  # rows did find earlier occurrences

"""The Triton attention kernel against PyTorch SDPA, and the engine on it (greedy FlashSpec == plain
decoding, token for token, in fp32). Skipped without CUDA."""

import pytest
import torch
import torch.nn.functional as F

from drafts.config import DraftConfig
from drafts.model import DraftModel
from engine.generate import generate
from engine.sampling import SamplingParams
from engine.scheduler import DecodeEngine
from engine.speculative import SpecConfig
from tests.gpu.test_cuda_graphs import tiny_target

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
triton_attention = pytest.importorskip("engine.triton_attention").triton_attention


def inputs(b, hq, hkv, t, s, d, dtype, window=None):
    g = torch.Generator(device="cuda").manual_seed(b * 1000 + t * 10 + s)
    q = torch.randn(b, hq, t, d, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(b, hkv, s, d, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(b, hkv, s, d, device="cuda", dtype=dtype, generator=g)
    pos = torch.randint(t, s - t, (b, 1), device="cuda", generator=g) + torch.arange(t, device="cuda")
    keys = torch.arange(s, device="cuda")[None, None, None, :]
    mask = keys <= pos[:, None, :, None]
    if window is not None:  # a draft's ring-buffer window: only the last `window` positions
        mask &= keys > pos[:, None, :, None] - window
    return q, k, v, mask


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("b,hq,hkv,t,s,d", [(1, 9, 3, 1, 704, 64), (1, 9, 3, 6, 704, 64), (8, 9, 3, 6, 2048, 64),
                                            (3, 4, 2, 16, 130, 32), (2, 8, 8, 1, 4096, 128)])
@pytest.mark.parametrize("splits", [None, 1, 3])
def test_kernel_matches_sdpa(dtype, tol, b, hq, hkv, t, s, d, splits):
    q, k, v, mask = inputs(b, hq, hkv, t, s, d, dtype)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=hq != hkv)
    out = triton_attention(q, k, v, mask, splits=splits)
    assert out is not None and out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


def test_views_of_the_cache_windows_and_empty_rows():
    q, k, v, mask = inputs(2, 9, 3, 3, 600, 64, torch.float32, window=50)
    big_k = torch.zeros(2, 3, 900, 64, device="cuda")
    big_k[:, :, :600] = k  # a slice of a longer cache, as KVCache.read returns it
    mask[1, :, 0] = False  # a query that sees nothing gets zeros, not NaN
    out = triton_attention(q, big_k[:, :, :600], v, mask)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(out[0], ref[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[1, :, 1:], ref[1, :, 1:], atol=1e-5, rtol=1e-5)
    assert torch.equal(out[1, :, 0], torch.zeros_like(out[1, :, 0]))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("t", [1, 6])
def test_scattered_cache_rows_read_in_place(dtype, tol, t):
    q, k, v, mask = inputs(3, 9, 3, t, 704, 64, dtype)
    cache_k = torch.randn(8, 3, 1024, 64, device="cuda", dtype=dtype)
    cache_v = torch.randn(8, 3, 1024, 64, device="cuda", dtype=dtype)
    rows = torch.tensor([5, 0, 7], device="cuda")
    cache_k[rows, :, :704], cache_v[rows, :, :704] = k, v
    out = triton_attention(q, cache_k, cache_v, mask, rows=rows, kv_len=704)
    torch.testing.assert_close(out.float(), triton_attention(q, k, v, mask).float(), atol=tol, rtol=tol)


def test_calls_the_kernel_does_not_serve_are_declined():
    q, k, v, mask = inputs(1, 9, 3, 32, 600, 64, torch.float32)  # 3 x 32 query rows: more than one tile
    assert triton_attention(q, k, v, mask) is None
    q, k, v, mask = inputs(1, 9, 3, 2, 600, 64, torch.float32)
    assert triton_attention(q, k, v, mask) is not None
    assert triton_attention(q.cpu(), k.cpu(), v.cpu(), mask.cpu()) is None  # CPU tensors: SDPA's


@pytest.mark.parametrize("block", [2, 5])
def test_engine_on_triton_attention_is_lossless(block):
    target = tiny_target(torch.float32)
    draft = DraftModel(target, DraftConfig(shared_layers=1, adapter_layers=2, head="mlp_tied", feature_input="deep"))
    draft.init_from_target()
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16]]
    params = SamplingParams(max_new_tokens=40, eos_token_ids=())
    outs = {}
    for backend in ("sdpa", "triton"):
        target.set_attention_backend(backend)
        for name, d in (("ar", None), ("spec", "d")):
            eng = DecodeEngine(target, None, max_batch_size=4, max_seq_len=128, spec=SpecConfig(5, block))
            eng.add_draft("d", draft)
            outs[(backend, name)] = [r.token_ids for r in generate(eng, prompts, params, d)]
    target.set_attention_backend("sdpa")
    assert outs[("triton", "spec")] == outs[("triton", "ar")]
    assert outs[("triton", "ar")] == outs[("sdpa", "ar")]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("b,t", [(1, 1), (1, 6), (8, 6)])
@pytest.mark.parametrize("splits", [None, 1, 3])
@pytest.mark.parametrize("in_place", [False, True])
def test_positions_bound_the_slots_read(dtype, tol, b, t, splits, in_place):
    """Over a whole 2,048-slot cache, each row reads only up to its last position: NaN past it stays unread."""
    s = 2048
    q, k, v, _ = inputs(b, 9, 3, t, s, 64, dtype)
    g = torch.Generator(device="cuda").manual_seed(b + t)
    pos = torch.randint(0, 700, (b, 1), device="cuda", generator=g) + torch.arange(t, device="cuda")
    mask = torch.arange(s, device="cuda")[None, None, None, :] <= pos[:, None, :, None]
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=True)
    for i in range(b):
        k[i, :, pos[i, -1] + 1:], v[i, :, pos[i, -1] + 1:] = float("nan"), float("nan")
    if in_place:
        rows = torch.arange(b, device="cuda").flip(0)
        out = triton_attention(q, k.flip(0), v.flip(0), mask, splits=splits, rows=rows, kv_len=s, positions=pos)
    else:
        out = triton_attention(q, k, v, mask, splits=splits, positions=pos)
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


def test_warmup_on_triton_attention_captures_every_graph_traffic_runs():
    """Graphs over the whole cache, bounded by position: warm-up captures all of them; greedy, sampled and top-p
    requests of mixed drafts and lengths, more than the rows, capture nothing more; greedy tokens as eager."""
    from engine.gamma import GammaController
    from tests.gpu.test_cuda_graphs import _drafts

    target = tiny_target(torch.float32)
    target.set_attention_backend("triton")
    try:
        drafts = _drafts(target)
        lengths, news = (5, 17, 2, 30, 9, 12, 7), (40, 90, 9, 120, 3, 60, 150)
        prompts = [[(11 * i + 3 * j) % 250 + 2 for j in range(n)] for i, n in enumerate(lengths)]
        names = ["d0", "d1", None, "d2", "d1", "d0", "d2"]
        outs = {}
        for graphs in (False, True):
            eng = DecodeEngine(target, None, max_batch_size=4, max_seq_len=256, spec=SpecConfig(3, 3),
                               cuda_graphs=graphs, gamma=GammaController(3))
            for d in drafts:
                eng.add_draft(d.name, d)
            if graphs:
                assert eng.kv_bucket(1) == eng.cache.max_seq_len
                assert eng.warmup(prompt_len=8) > 0
                warmed = eng.graphs.captures
            for kind in ({}, {"temperature": 1.0}, {"temperature": 0.7, "top_p": 0.9}):
                params = [SamplingParams(max_new_tokens=n, eos_token_ids=(), seed=i, **kind) for i, n in enumerate(news)]
                got = generate(eng, prompts, params, names)
                outs.setdefault(graphs, []).append([r.token_ids for r in got])
            if graphs:
                assert eng.graphs.captures == warmed
        assert outs[True][0] == outs[False][0]  # greedy: fp32, exact
        assert [list(map(len, o)) for o in outs[True]] == [list(news)] * 3
    finally:
        target.set_attention_backend("sdpa")


@pytest.mark.parametrize("b,t", [(1, 1), (1, 6), (8, 6)])
def test_inline_merge_matches_the_merge_kernel_replay_after_replay(monkeypatch, b, t):
    """FLASHSPEC_ATTN_INLINE_MERGE=1: each (row, KV head)'s last split program merges the splits. Against the merge
    kernel and SDPA, then 100 replays of a CUDA graph with new queries each time (a merge that read a split before
    it was stored would show as a wrong row), and every count back at 0 after."""
    import engine.triton_attention as ta

    s = 2048
    q, k, v, _ = inputs(b, 9, 3, t, s, 64, torch.bfloat16)
    pos = 600 + torch.arange(t, device="cuda")[None].repeat(b, 1) + torch.arange(b, device="cuda")[:, None] * 13
    mask = torch.arange(s, device="cuda")[None, None, None, :] <= pos[:, None, :, None]

    def call(inline):
        monkeypatch.setattr(ta, "INLINE_MERGE", inline)
        return triton_attention(q, k, v, mask, positions=pos)

    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=True)
    merged = call(True)
    torch.testing.assert_close(merged.float(), call(False).float(), atol=1e-2, rtol=1e-2)  # a bf16 unit at most
    torch.testing.assert_close(merged.float(), ref, atol=2e-2, rtol=2e-2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call(True)
    g = torch.Generator(device="cuda").manual_seed(1)
    for _ in range(100):
        q.copy_(torch.randn(q.shape, device="cuda", generator=g).to(q.dtype))
        graph.replay()
        torch.testing.assert_close(out.float(), call(False).float(), atol=1e-2, rtol=1e-2)
    torch.cuda.synchronize()
    assert int(ta._COUNTS[q.device].abs().sum()) == 0


@pytest.mark.parametrize("batch,t", [(1, 6), (8, 6), (1, 13), (1, 16), (8, 16)])
def test_a_query_in_a_wide_call_gives_its_bits_alone_but_for_near_ties(batch, t):
    """A query of a t-token call against the same query alone (the same cache, visible slots and splits): equal but
    for a few elements (an H100 showed 0-18 of 18k-147k, bench.tile_bits, bench/RESULTS.md run 48), each at most two
    bf16 steps apart: a score's last fp32 bit can round its bf16 probability (the P @ V operand) the other way, and
    the output rounds once more."""
    from bench.tile_bits import measure

    for seed in range(3):
        row = measure(batch, 3, t, 4, seed=seed, timed=False)
        assert row["max_units"] <= 2.0 and row["elements_differing"] <= row["elements"] // 1000, row

"""engine/triton_layer.py on the GPU, in bf16: the layer kernels against the separate kernels they replace,
inside a CUDA graph, and in the engine (graphs and eager give the same tokens with them). The SmolLM2
shapes (576 features, 9 query and 3 key/value heads of 64, 1,536 intermediate). Skipped without CUDA."""

import pytest
import torch
import torch.nn.functional as F

from engine import triton_kernels, triton_layer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
if not triton_kernels.available():
    pytestmark.append(pytest.mark.skip(reason="needs the triton package"))

H, HQ, HKV, D, I, S = 576, 9, 3, 64, 1536, 256


def _inputs(n, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    rnd = lambda *shape, scale=1.0: (torch.randn(*shape, device="cuda", generator=g) * scale).to(dtype)  # noqa: E731
    ang = torch.rand(n, D // 2, device="cuda", generator=g) * 6
    ang = torch.cat([ang, ang], -1)
    return dict(x=rnd(n, H), delta=rnd(n, H), nw=1 + rnd(H, scale=0.1), w=rnd((HQ + 2 * HKV) * D, H, scale=H ** -0.5),
                wg=rnd(2 * I, H, scale=H ** -0.5), cos=ang.cos().to(dtype), sin=ang.sin().to(dtype))


def _separate(t, rows, pos, kc, vc):
    """What the fused path ran before the layer kernels: add_rms_norm, the GEMMs, rope_kv_write, silu_mul."""
    from engine.fused import add_rms_norm, silu_mul

    res, h = add_rms_norm(t["x"], t["delta"], t["nw"], 1e-5)
    q = triton_kernels.rope_kv_write(F.linear(h, t["w"]), t["cos"], t["sin"], kc, vc, rows, pos, HQ, HKV)
    return res, q, silu_mul(F.linear(h, t["wg"]), I)


@pytest.mark.parametrize("rows", [None, "slice", "index"])
@pytest.mark.parametrize("b,t", [(1, 1), (1, 6), (8, 1), (8, 2)])
def test_layer_kernels_equal_the_separate_kernels_in_bf16(rows, b, t):
    n, dtype = b * t, torch.bfloat16
    inp = _inputs(n, dtype, b * 10 + t)
    rows = {None: None, "slice": slice(2, 2 + b), "index": torch.randperm(10, device="cuda")[:b]}[rows]
    pos = torch.randint(0, S - t, (b, 1), device="cuda") + torch.arange(t, device="cuda")
    caches = [(torch.zeros(10, HKV, S, D, device="cuda", dtype=dtype), torch.zeros(10, HKV, S, D, device="cuda", dtype=dtype))
              for _ in range(2)]
    want_res, want_q, want_act = _separate(inp, rows, pos, *caches[0])
    res, q = triton_layer.norm_qkv_rope_write(inp["x"], inp["delta"], inp["nw"], 1e-5, inp["w"], inp["cos"], inp["sin"],
                                              *caches[1], rows, pos, HQ, HKV)
    res2, act = triton_layer.norm_gate_up_silu(inp["x"], inp["delta"], inp["nw"], 1e-5, inp["wg"], I)
    assert torch.equal(res, want_res) and torch.equal(res2, want_res)  # the residual sum: the same rounding
    # The projections: fp32 sums in another order, rounded to bf16 -> at most a few units in the last place.
    for got, want in ((q, want_q), (caches[1][0], caches[0][0]), (caches[1][1], caches[0][1]), (act, want_act)):
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
        assert (got == want).float().mean() > 0.9, (got == want).float().mean()


@pytest.mark.parametrize("step", [128, 1024])  # five steps of the reduction, or one
def test_weight_read_before_the_wait_gives_the_same_bits(monkeypatch, step):
    """FLASHSPEC_LAYER_PREFETCH=1: the layer kernels read their weight's first features before waiting for the
    kernel before them (programmatic dependent launch, on by default on Hopper): the same sums in the same order."""
    inp = _inputs(6, torch.bfloat16, 11)
    pos = torch.arange(10, 16, device="cuda")[None]
    monkeypatch.setitem(triton_layer.CONFIG, "k", step)
    outs = []
    for prefetch in (False, True):
        monkeypatch.setattr(triton_layer, "PREFETCH", prefetch)
        kc = torch.zeros(1, HKV, S, D, device="cuda", dtype=torch.bfloat16)
        vc = torch.zeros_like(kc)
        res, q = triton_layer.norm_qkv_rope_write(inp["x"], inp["delta"], inp["nw"], 1e-5, inp["w"], inp["cos"],
                                                  inp["sin"], kc, vc, None, pos, HQ, HKV)
        outs.append((res, q, kc, vc, *triton_layer.norm_gate_up_silu(inp["x"], inp["delta"], inp["nw"], 1e-5, inp["wg"], I)))
    assert all(torch.equal(a, b) for a, b in zip(*outs))


def test_rows_past_max_rows_take_the_separate_kernels(monkeypatch):
    """More rows than MAX_ROWS (FLASHSPEC_LAYER_ROWS=16, batch 1 only): the caller's separate kernels."""
    monkeypatch.setattr(triton_layer, "MAX_ROWS", 16)
    inp = _inputs(48, torch.bfloat16, 3)
    assert triton_layer.norm_gate_up_silu(inp["x"], inp["delta"], inp["nw"], 1e-5, inp["wg"], I) is None


def test_layer_kernels_inside_a_cuda_graph():
    inp = _inputs(6, torch.bfloat16, 7)
    kc, vc = torch.zeros(1, HKV, S, D, device="cuda", dtype=torch.bfloat16), torch.zeros(1, HKV, S, D, device="cuda", dtype=torch.bfloat16)
    pos = torch.arange(10, 16, device="cuda")[None]

    def fn():
        res, q = triton_layer.norm_qkv_rope_write(inp["x"], inp["delta"], inp["nw"], 1e-5, inp["w"], inp["cos"],
                                                  inp["sin"], kc, vc, None, pos, HQ, HKV)
        return res, q, triton_layer.norm_gate_up_silu(res, q.new_zeros(res.shape), inp["nw"], 1e-5, inp["wg"], I)[1]

    fn()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    for key in ("x", "delta"):
        inp[key].copy_(torch.randn_like(inp[key]))
    pos.add_(50)
    graph.replay()
    want = fn()
    for got, ref in zip(out, want):
        assert torch.equal(got, ref)
    assert kc[0, :, 60:66].any()


@pytest.mark.parametrize("n", [1, 6, 16])
@pytest.mark.parametrize("k_in", [H, I])  # the output projection (576 -> 576) and the down projection (1,536 -> 576)
def test_projection_kernel_against_cublas_in_bf16(monkeypatch, n, k_in):
    monkeypatch.setattr(triton_layer, "PROJ", True)
    g = torch.Generator(device="cuda").manual_seed(n + k_in)
    x = torch.randn(n, k_in, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(H, k_in, device="cuda", generator=g) * k_in ** -0.5).to(torch.bfloat16)
    want = F.linear(x, w)
    for cfg in (None, {"k": 256, "n": 32, "w": 8}):
        got = triton_layer.project(x, w, cfg)
        assert got.dtype == torch.bfloat16 and got.shape == (n, H)
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=1e-2)  # a bf16 unit or so: the sums' order
        for i in range(n):  # a row's output does not depend on the rows sharing its call
            assert torch.equal(triton_layer.project(x[i : i + 1], w, cfg), got[i : i + 1]), (i, cfg)
    past = torch.randn(triton_layer.MAX_ROWS + 1, k_in, device="cuda").bfloat16()
    assert triton_layer.project(past, w) is None  # past MAX_ROWS


def test_projection_kernel_inside_a_cuda_graph(monkeypatch):
    monkeypatch.setattr(triton_layer, "PROJ", True)
    x = torch.randn(6, I, device="cuda").bfloat16()
    w = (torch.randn(H, I, device="cuda") * I ** -0.5).bfloat16()
    triton_layer.project(x, w)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_layer.project(x, w)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert torch.equal(out, triton_layer.project(x, w))


def test_a_row_s_bits_do_not_depend_on_the_tiles_beside_it(monkeypatch):
    """48 rows (a bs 8 verify pass; FLASHSPEC_LAYER_ROWS=128): three tiles of 16 rows, each row's bits those of
    the same row alone in its call, for the q|k|v, gate|up and projection kernels."""
    monkeypatch.setattr(triton_layer, "MAX_ROWS", 128)
    monkeypatch.setattr(triton_layer, "PROJ", True)
    b, t = 8, 6
    n = b * t
    t_in = _inputs(n, torch.bfloat16, 7)
    pos = (100 + torch.arange(t, device="cuda"))[None].repeat(b, 1)
    rows = torch.arange(b, device="cuda")
    kc, vc = (torch.zeros(b, HKV, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    x, delta, nw = t_in["x"], t_in["delta"], t_in["nw"]
    _, q = triton_layer.norm_qkv_rope_write(x, delta, nw, 1e-5, t_in["w"], t_in["cos"], t_in["sin"], kc, vc, rows, pos, HQ, HKV)
    _, act = triton_layer.norm_gate_up_silu(x, delta, nw, 1e-5, t_in["wg"], I)
    wd = (torch.randn(H, I, device="cuda") * I ** -0.5).bfloat16()
    y = triton_layer.project(act, wd)
    for i in (0, 17, 40, n - 1):
        one = slice(i, i + 1)
        _, q1 = triton_layer.norm_qkv_rope_write(x[one], delta[one], nw, 1e-5, t_in["w"], t_in["cos"][one], t_in["sin"][one],
                                                 kc.clone(), vc.clone(), rows[i // t : i // t + 1], pos[:1, i % t : i % t + 1],
                                                 HQ, HKV)
        assert torch.equal(q1, q[one]), i
        assert torch.equal(triton_layer.norm_gate_up_silu(x[one], delta[one], nw, 1e-5, t_in["wg"], I)[1], act[one]), i
        assert torch.equal(triton_layer.project(act[one], wd), y[one]), i


def _tiny_target():
    """A 4-layer bf16 model of SmolLM2's layer shape, fused, without gradients (as served)."""
    from engine.config import ModelArgs
    from engine.model import Transformer

    torch.manual_seed(0)
    args = ModelArgs(model_type="llama", vocab_size=512, hidden_size=H, intermediate_size=I, num_layers=4,
                     num_heads=HQ, num_kv_heads=HKV, head_dim=D, max_position_embeddings=512)
    with torch.device("cuda"):
        model = Transformer(args, max_seq_len=512)
    model = model.to(torch.bfloat16).eval().requires_grad_(False)
    model.fuse_for_inference(compile=True)
    return model


def _tiny_draft(model):
    from drafts.config import DraftConfig
    from drafts.model import DraftModel
    from engine.fused import fuse_for_inference

    draft = DraftModel(model, DraftConfig(shared_layers=1, adapter_layers=1, head="mlp_tied", feature_input="deep"))
    draft.init_from_target()
    draft = draft.to(torch.bfloat16)
    fuse_for_inference(draft, compile=True)
    return draft


def _generations(model, draft, prompts, max_batch_size, check=None) -> dict:
    """Greedy tokens of plain decoding ("ar") and speculation ("spec", gamma 5), eager and with CUDA graphs:
    {(graphs, name): each prompt's tokens}. `check(graphs)` runs after each generation."""
    from engine.generate import generate
    from engine.sampling import SamplingParams
    from engine.scheduler import DecodeEngine
    from engine.speculative import SpecConfig

    params = SamplingParams(max_new_tokens=24, eos_token_ids=())
    outs = {}
    for graphs in (False, True):
        for name, d in (("ar", None), ("spec", "d")):
            eng = DecodeEngine(model, None, max_batch_size=max_batch_size, max_seq_len=128, spec=SpecConfig(5, 5),
                               cuda_graphs=graphs)
            eng.add_draft("d", draft)
            outs[(graphs, name)] = [r.token_ids for r in generate(eng, prompts, params, d)]
            if check is not None:
                check(graphs)
    return outs


def test_a_batch_takes_them_where_all_its_steps_fit_and_speculation_gives_plain_decoding_s_tokens(monkeypatch):
    """FLASHSPEC_LAYER_ROWS=128: a batch of 4 runs its decode steps (4 rows) and its verify passes (24 rows) on the
    layer and projection kernels, so in bf16 its greedy speculative tokens are plain decoding's, with graphs and
    without."""
    monkeypatch.setattr(triton_layer, "MAX_ROWS", 128)
    model = _tiny_target()
    draft = _tiny_draft(model)
    served = []
    real = triton_layer.norm_gate_up_silu
    monkeypatch.setattr(triton_layer, "norm_gate_up_silu",
                        lambda x, *a: (lambda out: served.append((x.shape[0], out is not None)) or out)(real(x, *a)))

    def check(graphs):
        if not graphs:  # eager: every call is seen (a graph replays what it captured)
            assert any(n > 1 and ok for n, ok in served), served
            assert all(ok for n, ok in served if n <= 64), served  # every short step served; prefills are not
        served.clear()

    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16], [20, 21], [30, 31, 32, 33]]
    outs = _generations(model, draft, prompts, 4, check)
    assert outs[(True, "ar")] == outs[(False, "ar")] == outs[(False, "spec")] == outs[(True, "spec")]


@pytest.mark.parametrize("proj", [False, True])
def test_fused_model_takes_them_and_graphs_give_eager_s_tokens(monkeypatch, proj):
    """A 4-layer bf16 model of SmolLM2's layer shape, fused: every short batch-1 step takes both kernels on
    each layer (and, with FLASHSPEC_PROJ_KERNEL=1, the projection kernel for the output and down projections),
    the logits stay those of the separate kernels up to bf16 rounding, and the engine's CUDA graphs give
    eager's tokens, plain decoding and speculative rounds alike."""
    model = _tiny_target()
    calls = []
    monkeypatch.setattr(triton_layer, "PROJ", proj)
    for name in ("norm_qkv_rope_write", "norm_gate_up_silu", "project"):
        real = getattr(triton_layer, name)
        monkeypatch.setattr(triton_layer, name,
                            lambda *a, real=real, name=name: (lambda out: calls.append(out is not None) or out)(real(*a)))
    cache = model.new_cache(1, 512)
    tokens, pos = torch.tensor([[5, 6, 7, 8, 9, 10]], device="cuda"), torch.arange(40, 46, device="cuda")[None]
    with torch.no_grad():
        got = model(tokens, pos, cache=cache, kv_len=64).logits.float()
        assert calls == ([True] * 16 if proj else [True, False, True, False] * 4), calls
        monkeypatch.setattr(triton_layer, "ENABLED", False)
        want = model(tokens, pos, cache=model.new_cache(1, 512), kv_len=64).logits.float()
        monkeypatch.setattr(triton_layer, "ENABLED", True)
    assert (got - want).abs().max() < 0.05 * want.abs().max()

    draft = _tiny_draft(model)
    # Batch 1: by default the layer kernels serve batch-1 steps only (engine/model.py).
    outs = _generations(model, draft, [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16]], 1)
    assert outs[(True, "ar")] == outs[(False, "ar")]
    assert outs[(True, "spec")] == outs[(False, "spec")]

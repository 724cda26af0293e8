"""CUDA-graph fast path == eager path (token for token), on a tiny random Llama. Skipped without CUDA."""

import pytest
import torch

from drafts.config import DraftConfig
from drafts.model import DraftModel
from engine.config import ModelArgs
from engine.generate import generate
from engine.model import Transformer
from engine.sampling import SamplingParams
from engine.scheduler import DecodeEngine
from engine.speculative import SpecConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def tiny_target(dtype):
    torch.manual_seed(0)
    args = ModelArgs(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=4,
                     num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512)
    with torch.device("cuda"):
        model = Transformer(args, max_seq_len=512)
    return model.to(dtype).eval().requires_grad_(False)


@pytest.mark.parametrize("feature", ["none", "deep"])
@pytest.mark.parametrize("block", [2, 5])
def test_graphs_match_eager(feature, block):
    target = tiny_target(torch.float32)
    draft = DraftModel(target, DraftConfig(shared_layers=1, adapter_layers=3, head="mlp_tied", feature_input=feature))
    draft.init_from_target()
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16], [3, 3, 3, 3]]
    params = SamplingParams(max_new_tokens=40, eos_token_ids=())
    outs = {}
    for graphs in (False, True):
        for name, d in (("ar", None), ("spec", "d")):
            eng = DecodeEngine(target, None, max_batch_size=4, max_seq_len=128, spec=SpecConfig(5, block), cuda_graphs=graphs)
            eng.add_draft("d", draft)
            outs[(graphs, name)] = [r.token_ids for r in generate(eng, prompts, params, d)]
            if graphs:
                assert len(eng.graphs) > 0
    assert outs[(True, "ar")] == outs[(False, "ar")]
    assert outs[(True, "spec")] == outs[(False, "spec")] == outs[(False, "ar")]


@pytest.mark.parametrize("head_vocab", [None, 64])
def test_adaptive_gamma_graphs_match_plain_decoding(head_vocab):
    """Captured rounds of every gamma (one graph each), fused and compiled: greedy output is plain decoding's."""
    from engine.gamma import GammaController

    target = tiny_target(torch.float32)
    draft = DraftModel(target, DraftConfig(shared_layers=1, adapter_layers=2, head="mlp_tied", feature_input="deep",
                                           head_vocab=head_vocab))
    draft.init_from_target()
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16]]
    params = SamplingParams(max_new_tokens=40, eos_token_ids=())
    target.fuse_for_inference(compile=True)
    try:
        from engine.fused import fuse_for_inference

        fuse_for_inference(draft, compile=True)
        ar = DecodeEngine(target, None, max_batch_size=3, max_seq_len=128, cuda_graphs=False)
        expected = [r.token_ids for r in generate(ar, prompts, params)]
        ctl = GammaController(5, min_rounds=1, explore_every=2)
        eng = DecodeEngine(target, None, max_batch_size=3, max_seq_len=128, spec=SpecConfig(5, 5), gamma=ctl)
        eng.add_draft("d", draft)
        got = [r.token_ids for r in generate(eng, prompts, params, "d")]
    finally:
        target.unfuse_for_inference()
    assert got == expected
    assert len(ctl.chosen) == 5, ctl.chosen
    assert len({k[3] for k in eng.graphs.graphs if k[0] == "greedy-round"}) == 5


@pytest.mark.parametrize("filtered", [True, False], ids=["top-p rows", "plain T=1"])
@pytest.mark.parametrize("feature", ["none", "deep", "deep, sub-vocabulary"])
def test_sampled_graphs_match_eager(feature, filtered):
    """T=1 rows: the one-graph sampled round (block == gamma) and the multi-step sampled plain decoding
    draw the same numbers as the eager loop: same seeded tokens, with real CUDA graphs, in fp32; a draft
    scoring a sub-vocabulary draws over it in both. Without top-p rows the probabilities come from the
    tempered-softmax kernel in both (with them, from the sort)."""
    target = tiny_target(torch.float32)
    sub = feature.endswith("sub-vocabulary")
    draft = DraftModel(target, DraftConfig(shared_layers=1, adapter_layers=2, head="mlp_tied",
                                           feature_input=feature.split(",")[0], head_vocab=64 if sub else None))
    draft.init_from_target()
    if sub:
        draft.set_vocab(torch.randperm(target.args.vocab_size, generator=torch.Generator().manual_seed(3))[:64])
    with torch.no_grad():
        for p in draft.adapters.parameters():
            p.add_(0.2 * torch.randn_like(p))  # some rejections
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16], [3, 3, 3, 3]]
    params = [SamplingParams(max_new_tokens=n, eos_token_ids=(), temperature=1.0, top_p=p, seed=i)
              for i, (n, p) in enumerate(((40, 1.0), (23, 0.9 if filtered else 1.0), (31, 1.0), (40, 0.8 if filtered else 1.0)))]
    outs = {}
    for graphs in (False, True):
        for name, d in (("ar", None), ("spec", "d")):
            eng = DecodeEngine(target, None, max_batch_size=4, max_seq_len=128, spec=SpecConfig(5, 5), cuda_graphs=graphs)
            eng.add_draft("d", draft)
            outs[(graphs, name)] = [r.token_ids for r in generate(eng, prompts, params, d)]
            if graphs:
                assert any(k[0] in ("ar-sampled", ("sampled-round", True), ("sampled-round", False)) for k in eng.graphs.graphs)
    assert outs[(True, "ar")] == outs[(False, "ar")]
    assert outs[(True, "spec")] == outs[(False, "spec")]


def _drafts(target):
    out = []
    for i, (feature, adapters) in enumerate((("none", 3), ("deep", 3), ("none", 1))):
        d = DraftModel(target, DraftConfig(shared_layers=1, adapter_layers=adapters, head="mlp_tied",
                                           feature_input=feature), name=f"d{i}")
        d.init_from_target()
        if i == 2:
            with torch.no_grad():
                for p in d.adapters.parameters():
                    p.add_(0.3 * torch.randn_like(p))
        out.append(d)
    return out


@pytest.mark.parametrize("block, mixed, prefill", [(2, False, False), (5, False, False), (5, True, False), (5, True, True)])
def test_scattered_rows_and_mixed_drafts_match_eager(block, mixed, prefill):
    """Requests of three drafts (and plain ones) finishing at different times, new ones filling the gaps:
    padded bucket graphs with rows as an input, one drafting graph over several drafts; `prefill`: the
    admissions' prefill passes as graphs too, padded to power-of-two lengths. fp32: exact."""
    target = tiny_target(torch.float32)
    drafts = _drafts(target)
    lengths = (5, 17, 2, 30, 9, 12, 7, 21, 3, 14)
    news = (4, 30, 9, 25, 3, 18, 22, 6, 15, 11)
    prompts = [[(11 * i + 3 * j) % 250 + 2 for j in range(n)] for i, n in enumerate(lengths)]
    names = ["d0", "d1", "d2", None]
    outs = {}
    for graphs in (False, True):
        eng = DecodeEngine(target, None, max_batch_size=6, max_seq_len=128, spec=SpecConfig(5, block), cuda_graphs=graphs,
                           mixed_round_graph=mixed, prefill_graphs=prefill)
        for d in drafts:
            eng.add_draft(d.name, d)
        if graphs:
            assert eng.warmup(max_len=64, prompt_len=8) > 0
        got = {i: [] for i in range(len(lengths))}
        queue = list(range(len(lengths)))
        from engine.requests import Request

        def submit(i):
            eng.add_request(Request(str(i), prompts[i], SamplingParams(max_new_tokens=news[i], eos_token_ids=()),
                                    names[i % 4]))

        for i in queue[:6]:
            submit(i)
        queue = queue[6:]
        while eng.has_work():
            for out in eng.step():
                got[int(out.request_id)].extend(out.token_ids)
                if out.finished and queue:
                    submit(queue.pop(0))
        outs[graphs] = got
        assert any(key[0] == "prefill" for key in eng.graphs.graphs) == (graphs and prefill)
    assert outs[True] == outs[False]


def test_a_collection_inside_a_capture_does_not_free_another_graph():
    """Garbage holding a captured graph (an engine dropped in a reference cycle) must not be collected while
    another graph captures: CUDA refuses to destroy a graph then, and the capture fails."""
    import gc

    from engine.cuda_graphs import CapturedStep

    x = torch.ones(4, device="cuda")
    threshold = gc.get_threshold()
    gc.collect()
    gc.set_threshold(100_000, 10, 10)  # no automatic collection until many new container objects
    try:
        old = CapturedStep(lambda x: (x * 2,), {"x": x})
        cycle = [old]
        cycle.append(cycle)
        del old, cycle  # unreachable now: only the cyclic collector frees it, and its graph with it

        def fn(x):
            if torch.cuda.is_current_stream_capturing():
                junk = [[] for _ in range(150_000)]  # enough new objects to start a collection mid-capture
                del junk
            return (x + 1,)

        step = CapturedStep(fn, {"x": x})
        assert torch.equal(step({"x": x})[0], x + 1)
    finally:
        gc.set_threshold(*threshold)
        gc.collect()


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_overlapped_plain_decoding_matches_one_call_at_a_time(temperature):
    """DecodeEngine(overlap=True): the next 4-step graph launched from the last one's tokens on the device, their
    copy to pinned memory read behind it; an EOS mid-way drops a row's work in the call in flight."""
    target = tiny_target(torch.float32)
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16]]
    base = [SamplingParams(max_new_tokens=n, eos_token_ids=(), temperature=temperature, seed=i)
            for i, n in enumerate((40, 29, 52))]
    plain = DecodeEngine(target, None, max_batch_size=3, max_seq_len=128)
    eos = generate(plain, prompts, base)[1].token_ids[17]
    params = [base[0], SamplingParams(max_new_tokens=29, eos_token_ids=(eos,), temperature=temperature, seed=1), base[2]]
    want = [r.token_ids for r in generate(DecodeEngine(target, None, max_batch_size=3, max_seq_len=128), prompts, params)]
    eng = DecodeEngine(target, None, max_batch_size=3, max_seq_len=128, overlap=True)
    launched = []
    real = eng._launch_ahead
    eng._launch_ahead = lambda *a: launched.append(1) or real(*a)
    assert [r.token_ids for r in generate(eng, prompts, params)] == want
    assert len(launched) >= 3 and not eng.has_work()


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_overlapped_rounds_match_one_round_at_a_time(temperature):
    """DecodeEngine(overlap=True) on the one-graph round: each round launched from the last one's outcome on the
    device, read from pinned memory behind it; the same tokens as one round at a time."""
    target = tiny_target(torch.float32)
    drafts = [DraftModel(target, DraftConfig(shared_layers=1, adapter_layers=2, head="mlp_tied", feature_input=f))
              for f in ("deep", "none")]
    for d in drafts:
        d.init_from_target()
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16]]
    params = [SamplingParams(max_new_tokens=n, eos_token_ids=(), temperature=temperature, seed=i)
              for i, n in enumerate((40, 33, 52))]
    names = ["a", "b", "a"]
    outs = {}
    for overlap in (False, True):
        eng = DecodeEngine(target, None, max_batch_size=3, max_seq_len=128, spec=SpecConfig(5, 5), overlap=overlap)
        eng.add_draft("a", drafts[0])
        eng.add_draft("b", drafts[1])
        outs[overlap] = [r.token_ids for r in generate(eng, prompts, params, names)]
        assert not eng.has_work()
    assert outs[True] == outs[False]


@pytest.mark.parametrize("overlap", [False, True], ids=["one call at a time", "overlapped"])
def test_prefills_on_the_side_stream_or_ahead_match_a_stopped_batch(overlap):
    """DecodeEngine(side_prefill=True) on a second CUDA stream: admissions' prefills (graphs of their own pool,
    captured on a stream of their own) run while the other rows decode; lookup, draft and plain rows, greedy and
    seeded sampled, give the same tokens as with every admission stopping the batch. So do requests prefilled in
    groups ahead of a free row (prefill_ahead), in fewer prefill passes, never more than max_batch_size running."""
    from engine.lookup import LookupDraft
    from engine.requests import Request

    target = tiny_target(torch.float32)
    draft = DraftModel(target, DraftConfig(shared_layers=1, adapter_layers=2, head="mlp_tied", feature_input="deep"))
    draft.init_from_target()
    lengths = (5, 170, 2, 300, 9, 120, 7, 210, 3, 140, 60, 11)
    news = (4, 30, 9, 25, 3, 18, 22, 6, 15, 11, 1, 20)
    names = ["lookup", "d", None, "lookup"]
    outs, beside, passes = {}, {}, {}
    for side, ahead in ((False, 0), (True, 0), (False, 3)):
        eng = DecodeEngine(target, None, max_batch_size=4, max_seq_len=512, spec=SpecConfig(5, 5), overlap=overlap,
                           side_prefill=side, prefill_ahead=ahead)
        eng.add_draft("lookup", LookupDraft())
        eng.add_draft("d", draft)
        assert (eng._side_stream is not None) == side
        launched, real = [], eng._launch_prefill
        eng._launch_prefill = lambda batch: launched.append(eng.num_running) or real(batch)
        for i, n in enumerate(lengths):
            prompt = [(7 + 13 * i + 5 * j) % 200 + 2 for j in range(n)]
            eng.add_request(Request(f"r{i}", prompt, SamplingParams(max_new_tokens=news[i], eos_token_ids=(),
                                                                    temperature=1.0 if i == 5 else 0.0, seed=i),
                                    names[i % 4]))
        got = {f"r{i}": [] for i in range(len(lengths))}
        while eng.has_work():
            for out in eng.step():
                got[out.request_id].extend(out.token_ids)
            assert eng.num_running <= eng.max_batch_size
        eng.settle()
        outs[side, ahead] = got
        beside[side, ahead], passes[side, ahead] = sum(n > 0 for n in launched), len(launched)
        assert not eng.has_work() and all(len(got[f"r{i}"]) == n for i, n in enumerate(news))
        assert any(k[0] == "prefill" for k in eng.graphs.graphs)
        assert all(("side" in k) == side for k in eng.graphs.graphs if k[0] == "prefill")
    assert outs[True, 0] == outs[False, 0] == outs[False, 3]
    assert beside[True, 0] >= 4  # admitted while other rows ran
    assert passes[False, 3] < passes[False, 0], passes


def test_graph_kernels_counts_a_graphs_kernel_nodes():
    """bench.gpu counts kernels from the captured graph (no profiler: it would slow every later launch)."""
    from bench.gpu import count_kernels

    x = torch.randn(16, 16, device="cuda")

    def fn():
        y = x
        for _ in range(25):
            y = y * 1.5 + 1.0  # two elementwise kernels
        return y

    assert count_kernels(fn) == 50

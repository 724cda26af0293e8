"""engine.lookup on the GPU: the proposer inside a captured CUDA graph gives what it gives eagerly; lookup rounds as
captured (and chained) graphs give plain decoding's greedy tokens and the eager rounds' sampled ones. Skipped
without CUDA."""

import pytest
import torch

from engine.lookup import propose

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_the_one_launch_proposer_gives_the_torch_rule_s_proposals_on_the_gpu():
    """triton_kernels.lookup_propose against `propose`'s torch rule (proposals, counts, the n matched), both rules
    (repeat or not), n 3..1, 3..2, 6..1."""
    from engine import triton_kernels

    gen = torch.Generator(device="cuda").manual_seed(1)
    for vocab in (3, 6):
        history = torch.randint(0, vocab, (8, 1500), device="cuda", generator=gen)
        lengths = torch.randint(0, 1501, (8,), device="cuda", generator=gen)
        for gamma, max_n, min_n in ((8, 3, 1), (5, 3, 2), (15, 3, 1), (8, 6, 1)):
            for repeat in (True, False):
                fast = triton_kernels.lookup_propose(history, lengths, gamma, max_n, min_n, repeat)
                triton_kernels.ENABLED = False
                try:
                    ref = propose(history, lengths, gamma, max_n, min_n, repeat, with_match=True)
                finally:
                    triton_kernels.ENABLED = True
                assert fast is not None and all(torch.equal(f, r) for f, r in zip(fast, ref, strict=True))


def test_proposals_from_a_graph_replay_equal_eager_ones_for_new_histories():
    gen = torch.Generator(device="cuda").manual_seed(0)
    history = torch.randint(0, 5, (8, 2048), device="cuda", generator=gen)
    lengths = torch.randint(1, 2048, (8,), device="cuda", generator=gen)
    propose(history, lengths, 5)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = propose(history, lengths, 5)
    for seed in range(1, 6):
        gen.manual_seed(seed)
        history.copy_(torch.randint(0, 5, (8, 2048), device="cuda", generator=gen))
        lengths.copy_(torch.randint(1, 2048, (8,), device="cuda", generator=gen))
        graph.replay()
        want = propose(history, lengths, 5)
        assert torch.equal(out[1], want[1])
        for i in range(8):
            assert torch.equal(out[0][i, :want[1][i]], want[0][i, :want[1][i]])


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("gammas", [None, {1: 15, 2: 15, 4: 15}])
def test_lookup_rounds_as_captured_graphs_give_plain_decoding_s_tokens(overlap, gammas):
    """Rows naming a LookupDraft, their rounds captured (and chained with overlap, regrouped as rows end and the
    next request joins), scattered rows included (a row finishing early frees its slot for the next request): plain
    decoding's tokens, and repeats taken in rounds of several tokens; at the default gammas and at
    engine.lookup.MAX_GAMMA (past the engine's 5)."""
    from engine.config import ModelArgs
    from engine.generate import generate
    from engine.lookup import LookupDraft
    from engine.model import Transformer
    from engine.sampling import SamplingParams
    from engine.scheduler import DecodeEngine
    from engine.speculative import SpecConfig

    torch.manual_seed(0)
    args = ModelArgs(model_type="llama", vocab_size=8, hidden_size=64, intermediate_size=128, num_layers=4,
                     num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512)
    with torch.device("cuda"):
        target = Transformer(args, max_seq_len=512).eval().requires_grad_(False)
    prompts = [[1, 2, 3, 4, 5], [7, 0, 6], [2, 2, 5, 1, 0, 3, 4], [3, 3, 3, 3], [6, 1]]
    params = [SamplingParams(max_new_tokens=n, eos_token_ids=()) for n in (60, 23, 47, 60, 31)]
    plain = generate(DecodeEngine(target, None, max_batch_size=4, max_seq_len=128), prompts, params)
    eng = DecodeEngine(target, None, max_batch_size=4, max_seq_len=128, spec=SpecConfig(5, 5), overlap=overlap)
    eng.add_draft("lookup", LookupDraft(gammas=gammas))
    got = generate(eng, prompts, params, "lookup")
    assert [o.token_ids for o in got] == [o.token_ids for o in plain]
    # The rounds' gammas: 8 for a row left alone (with side_prefill also while the others' prefills run beside it),
    # 15 after it accepted a whole round.
    ran = {k[3] for k in eng.graphs.graphs if k[0] == "lookup-round"}
    assert (5 in ran and ran <= {5, 8, 15}) if gammas is None else ran == {15}, ran
    assert sum(o.stats.emitted for o in got) / sum(o.stats.rounds for o in got) > 1.5
    # Overlapped, the chain regrouped as rows ended and the fifth request joined (`regroup_chains`).
    assert (eng.regrouped > 0) == (overlap and not eng.side_prefill), eng.regrouped


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("attention", ["sdpa", "triton"])
def test_allotted_lookup_rounds_as_captured_graphs_give_plain_decoding_s_tokens(overlap, attention):
    """LookupDraft(allot=True): each row's own gamma within its batch's tokens, the rows' chains packed one token a
    pass row; captured (and chained with overlap), scattered rows included; on the Triton backend a row's chain
    attends as one tile (packed queries). Plain decoding's tokens (fp32: exact)."""
    from engine.config import ModelArgs
    from engine.generate import generate
    from engine.lookup import LookupDraft
    from engine.model import Transformer
    from engine.sampling import SamplingParams
    from engine.scheduler import DecodeEngine
    from engine.speculative import SpecConfig

    torch.manual_seed(0)
    args = ModelArgs(model_type="llama", vocab_size=8, hidden_size=64, intermediate_size=128, num_layers=4,
                     num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512)
    prompts = [[1, 2, 3, 4, 5], [7, 0, 6], [2, 2, 5, 1, 0, 3, 4], [3, 3, 3, 3], [6, 1]]
    params = [SamplingParams(max_new_tokens=n, eos_token_ids=()) for n in (60, 23, 47, 60, 31)]
    with torch.device("cuda"):
        target = Transformer(args, max_seq_len=512).eval().requires_grad_(False)
    target.set_attention_backend(attention)
    plain = generate(DecodeEngine(target, None, max_batch_size=4, max_seq_len=128), prompts, params)
    packed = []
    if attention == "triton":
        kernel = target.backend._kernel
        target.backend._kernel = lambda *a, **kw: packed.append(kw.get("qidx") is not None) or kernel(*a, **kw)
    eng = DecodeEngine(target, None, max_batch_size=4, max_seq_len=128, spec=SpecConfig(5, 5), overlap=overlap)
    eng.add_draft("lookup", LookupDraft(allot=True))
    got = generate(eng, prompts, params, "lookup")
    assert [o.token_ids for o in got] == [o.token_ids for o in plain]
    kinds = {k[1] for k in eng.graphs.graphs if k[0] == "lookup-round"}
    assert ("allotted", 5) in kinds, kinds
    assert any(packed) == (attention == "triton")
    assert sum(o.stats.emitted for o in got) / sum(o.stats.rounds for o in got) > 1.5


def test_sampled_lookup_rounds_as_graphs_give_the_eager_rounds_tokens():
    """Seeded sampled rows naming a LookupDraft: the captured (and chained) rounds draw what the eager ones do."""
    from engine.config import ModelArgs
    from engine.generate import generate
    from engine.lookup import LookupDraft
    from engine.model import Transformer
    from engine.sampling import SamplingParams
    from engine.scheduler import DecodeEngine
    from engine.speculative import SpecConfig

    torch.manual_seed(0)
    args = ModelArgs(model_type="llama", vocab_size=8, hidden_size=64, intermediate_size=128, num_layers=4,
                     num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512)
    with torch.device("cuda"):
        target = Transformer(args, max_seq_len=512).eval().requires_grad_(False)
    prompts = [[1, 2, 3, 1, 2, 3], [7, 0, 6, 7, 0], [2, 2, 5, 1, 0, 3, 4]]
    params = [SamplingParams(max_new_tokens=40, eos_token_ids=(), temperature=0.8, top_p=0.9 if i == 1 else 1.0, seed=i)
              for i in range(3)]
    outs = {}
    for graphs, overlap in ((False, False), (True, False), (True, True)):
        eng = DecodeEngine(target, None, max_batch_size=3, max_seq_len=128, spec=SpecConfig(4, 4), cuda_graphs=graphs,
                           overlap=overlap)
        eng.add_draft("lookup", LookupDraft())
        outs[(graphs, overlap)] = [o.token_ids for o in generate(eng, prompts, params, "lookup")]
    assert outs[(True, False)] == outs[(False, False)] == outs[(True, True)]


@pytest.mark.parametrize("overlap", [False, True])
def test_lookup_rows_beside_draft_rows_share_one_captured_round_with_plain_decoding_s_tokens(overlap):
    """Greedy rows naming the lookup drafter batched with rows of a draft (and, as the governor picks it, the
    draft's own requests split between the two): one captured round for both kinds (the lookup rows' proposals in
    place of drafted tokens, one verify pass), chained with overlap; plain decoding's tokens."""
    from drafts.config import DraftConfig
    from drafts.model import DraftModel
    from engine.config import ModelArgs
    from engine.generate import generate
    from engine.governor import SpeculationGovernor
    from engine.lookup import LookupDraft
    from engine.model import Transformer
    from engine.sampling import SamplingParams
    from engine.scheduler import DecodeEngine
    from engine.speculative import SpecConfig

    torch.manual_seed(0)
    args = ModelArgs(model_type="llama", vocab_size=8, hidden_size=64, intermediate_size=128, num_layers=4,
                     num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512)
    with torch.device("cuda"):
        target = Transformer(args, max_seq_len=512).eval().requires_grad_(False)
        draft = DraftModel(target, DraftConfig(shared_layers=1, adapter_layers=1, head="mlp_tied"))
    draft.init_from_target()
    draft.eval().requires_grad_(False)
    prompts = [[1, 2, 3, 4, 5], [7, 0, 6], [2, 2, 5, 1, 0, 3, 4], [3, 3, 3, 3], [6, 1], [5, 4, 5, 4]]
    params = [SamplingParams(max_new_tokens=n, eos_token_ids=()) for n in (60, 23, 47, 60, 31, 40)]
    plain = generate(DecodeEngine(target, None, max_batch_size=4, max_seq_len=128), prompts, params)
    eng = DecodeEngine(target, None, max_batch_size=4, max_seq_len=128, spec=SpecConfig(5, 5), overlap=overlap,
                       governor=SpeculationGovernor(min_samples=2, probe_every=2))
    eng.add_draft("d", draft)
    eng.add_draft("lookup", LookupDraft())
    eng.set_alternatives("d", ["lookup"])
    eng.calibrate(prompt_tokens=4)
    got = generate(eng, prompts, params, ["lookup", "d", "lookup", "d", "d", "d"])
    assert [o.token_ids for o in got] == [o.token_ids for o in plain]
    assert any(k[0] == "greedy-round" and ("lookup", *LookupDraft().rule) in k for k in eng.graphs.graphs)

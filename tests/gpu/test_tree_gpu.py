"""Draft trees on the GPU (engine/tree.py): captured as CUDA graphs, on the fused path with the Triton attention
kernel and the layer kernels, greedy output equal to plain decoding (fp32, where it must be exact)."""

import pytest
import torch

from drafts.config import DraftConfig
from drafts.model import DraftModel
from engine.generate import generate
from engine.sampling import SamplingParams
from engine.scheduler import DecodeEngine
from engine.speculative import SpecConfig
from tests.gpu.test_cuda_graphs import tiny_target

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16]]


def noisy_draft(target, feature: str, scale: float = 0.6) -> DraftModel:
    """The target's own layers as adapters (an oracle), with noise: often right, not always."""
    draft = DraftModel(target, DraftConfig(shared_layers=1, adapter_layers=3, head="mlp_tied", feature_input=feature))
    draft.init_from_target()
    gen = torch.Generator(device="cuda").manual_seed(5)
    with torch.no_grad():
        for p in draft.adapters.parameters():
            if p.dim() == 2:
                p.add_(scale * torch.randn(p.shape, generator=gen, device="cuda", dtype=p.dtype) / p.shape[-1] ** 0.5)
    return draft


@pytest.mark.parametrize("fused", [False, True], ids=["unfused-sdpa", "fused-triton"])
@pytest.mark.parametrize("feature", ["none", "deep"])
@pytest.mark.parametrize("width", [2, 4])
def test_captured_tree_rounds_equal_plain_decoding(fused, feature, width):
    target = tiny_target(torch.float32)
    draft = noisy_draft(target, feature)
    params = SamplingParams(max_new_tokens=48, eos_token_ids=())
    if fused:
        from engine.fused import fuse_for_inference

        target.fuse_for_inference(compile=True)
        fuse_for_inference(draft, compile=True)
        target.set_attention_backend("triton")
    ar = DecodeEngine(target, None, max_batch_size=3, max_seq_len=160, cuda_graphs=False)
    expected = [r.token_ids for r in generate(ar, PROMPTS, params)]
    stats = {}
    for w in (1, width):
        for overlap in (False, True):
            eng = DecodeEngine(target, None, max_batch_size=3, max_seq_len=160, overlap=overlap,
                               spec=SpecConfig(5, 5, tree_width=w, tree_max_batch=3))
            eng.add_draft("d", draft)
            out = generate(eng, PROMPTS, params, "d")
            assert [r.token_ids for r in out] == expected, (w, overlap)
            if w > 1:
                assert any(k[0] == "greedy-tree" for k in eng.graphs.graphs)
            stats[w] = sum(r.stats.accepted for r in out) / sum(r.stats.rounds for r in out)
    assert stats[width] > stats[1], stats


@pytest.mark.parametrize("head_vocab", [None, 64])
def test_captured_sampled_tree_rounds_draw_what_the_eager_ones_draw(head_vocab):
    """Sampled trees (unseeded requests; torch's seed fixes their streams) captured as CUDA graphs give the tokens
    the same rounds give without graphs (fp32): the draws come from the streams on the device either way."""
    target = tiny_target(torch.float32)
    draft = DraftModel(target, DraftConfig(shared_layers=1, adapter_layers=3, head="mlp_tied", head_vocab=head_vocab))
    draft.init_from_target()
    params = SamplingParams(max_new_tokens=40, temperature=1.0, top_p=0.95, eos_token_ids=())
    outs = []
    for graphs in (False, True):
        torch.manual_seed(3)
        eng = DecodeEngine(target, None, max_batch_size=3, max_seq_len=160, cuda_graphs=graphs,
                           spec=SpecConfig(4, 4, tree_width=3, tree_max_batch=3))
        eng.add_draft("d", draft)
        outs.append([r.token_ids for r in generate(eng, PROMPTS, params, "d")])
        if graphs:
            assert any(isinstance(k[0], tuple) and k[0][0] == "sampled-tree" for k in eng.graphs.graphs)
    assert outs[0] == outs[1]

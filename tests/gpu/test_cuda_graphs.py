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

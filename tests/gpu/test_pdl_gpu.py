"""Programmatic dependent launch (engine.triton_kernels.pdl; on by default, FLASHSPEC_PDL=0 turns it off) on the GPU: every engine kernel gives
the same bits with it as without, alone and inside CUDA graphs, and a fused bf16 engine the same tokens, plain and
speculative, greedy and sampled. Skipped without CUDA, triton or a Hopper-or-later GPU."""

import pytest
import torch

from drafts.config import DraftConfig
from drafts.model import DraftModel
from engine import triton_kernels
from engine.config import ModelArgs
from engine.generate import generate
from engine.model import Transformer
from engine.sampling import SamplingParams
from engine.scheduler import DecodeEngine
from engine.speculative import SpecConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
if not triton_kernels.available():
    pytestmark.append(pytest.mark.skip(reason="needs the triton package"))
elif torch.cuda.is_available() and torch.cuda.get_device_capability() < (9, 0):
    pytestmark.append(pytest.mark.skip(reason="programmatic dependent launch needs a Hopper or later GPU"))


def _both(monkeypatch, fn):
    """fn() with PDL off, then on."""
    out = []
    for on in (False, True):
        monkeypatch.setattr(triton_kernels, "PDL", on)
        out.append(fn())
    return out


def test_kernels_give_the_same_bits_with_and_without_pdl(monkeypatch):
    from engine.triton_attention import triton_attention

    g = torch.Generator(device="cuda").manual_seed(0)
    w = (0.05 * torch.randn(49152, 576, device="cuda", generator=g)).bfloat16()
    x = torch.randn(6, 576, device="cuda", generator=g)
    q = torch.randn(1, 9, 6, 64, device="cuda", generator=g).bfloat16()
    k, v = torch.randn(1, 3, 704, 64, device="cuda", generator=g).bfloat16(), torch.randn(1, 3, 704, 64, device="cuda").bfloat16()
    pos = torch.arange(698, 704, device="cuda")[None]
    mask = (torch.arange(704, device="cuda")[None, :] <= pos[0][:, None])[None, None]

    def run():
        logits = triton_kernels.vocab_projection(x, w)
        return logits, triton_kernels.argmax(logits), triton_attention(q, k, v, mask, positions=pos)

    def graphed():
        run()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = run()
        graph.replay()
        torch.cuda.synchronize()
        return [o.clone() for o in outs]

    for off, on in (_both(monkeypatch, run), _both(monkeypatch, graphed)):
        assert all(torch.equal(a, b) for a, b in zip(off, on))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_fused_bf16_engine_gives_the_same_tokens_with_and_without_pdl(monkeypatch, temperature):
    torch.manual_seed(0)
    args = ModelArgs(model_type="llama", vocab_size=5000, hidden_size=128, intermediate_size=256, num_layers=4,
                     num_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=512, tie_word_embeddings=True)
    with torch.device("cuda"):
        target = Transformer(args, max_seq_len=512)
    target = target.to(torch.bfloat16).eval().requires_grad_(False).set_attention_backend("triton")
    draft = DraftModel(target, DraftConfig(shared_layers=1, adapter_layers=1, head="mlp_tied", feature_input="deep"))
    draft.init_from_target()
    draft = draft.to(device="cuda", dtype=torch.bfloat16)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11]]
    params = SamplingParams(max_new_tokens=32, eos_token_ids=(), temperature=temperature, seed=7)
    target.fuse_for_inference(compile=True)
    try:
        from engine.fused import fuse_for_inference

        fuse_for_inference(draft, compile=True)

        def run():
            outs = []
            for d in (None, "d"):
                eng = DecodeEngine(target, None, max_batch_size=1, max_seq_len=128, spec=SpecConfig(4, 4))
                eng.add_draft("d", draft)
                outs.append([r.token_ids for r in generate(eng, prompts, params, d)])
            return outs

        off, on = _both(monkeypatch, run)
    finally:
        target.unfuse_for_inference()
    assert off == on

"""oneDNN-packed CPU projections (engine/cpu_linear.py): same results up to rounding, exact fallbacks, same tokens."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from drafts.checkpoint import load_draft, save_draft
from drafts.config import DraftConfig
from drafts.model import DraftModel
from engine import cpu_linear
from engine.generate import generate
from engine.loading import load_model
from engine.sampling import SamplingParams
from engine.scheduler import DecodeEngine
from engine.speculative import SpecConfig

pytestmark = pytest.mark.skipif(not cpu_linear.available(), reason="this torch build has no oneDNN")


def _linear(out_features=96, in_features=64, bias=True, seed=0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(in_features, out_features, bias=bias).requires_grad_(False)


@pytest.mark.parametrize("shape", [(1, 64), (6, 64), (2, 3, 64), (64, 64)])
@pytest.mark.parametrize("bias", [True, False])
def test_packed_linear_matches_f_linear(shape, bias):
    layer = _linear(bias=bias)
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    x = torch.randn(*shape)
    expected = F.linear(x, layer.weight, layer.bias)
    assert cpu_linear.pack_linears(layer) == 1
    assert isinstance(layer, cpu_linear.PackedLinear) and isinstance(layer, nn.Linear)
    got = layer(x)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert layer._packed.usable(layer.weight, x)  # the packed path ran, not the fallback
    assert all(torch.equal(layer.state_dict()[k], v) for k, v in state.items())  # parameters untouched


def test_gradients_and_changed_weights_fall_back_to_f_linear_exactly():
    layer = _linear()
    cpu_linear.pack_linears(layer)
    x = torch.randn(4, 64)
    # Training: the weight wants a gradient -> F.linear, bit for bit, and the gradient arrives.
    layer.weight.requires_grad_(True)
    out = layer(x)
    assert torch.equal(out, F.linear(x, layer.weight, layer.bias))
    out.sum().backward()
    assert layer.weight.grad is not None
    layer.weight.requires_grad_(False)
    # A weight changed in place (an optimizer step, load_state_dict) -> the stale packed copy is not used.
    with torch.no_grad():
        layer.weight.mul_(2.0)
    assert not layer._packed.usable(layer.weight, x)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    layer.repack()
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    # Not fp32 -> F.linear.
    assert not layer._packed.usable(layer.weight, x.double())


def test_layers_made_under_inference_mode_pack_and_run_in_and_out_of_it():
    """The service loads drafts under torch.inference_mode: their weights have no version counter."""
    with torch.inference_mode():
        layer = _linear()
        assert cpu_linear.pack_linears(layer) == 1
        x = torch.randn(3, 64)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        x = torch.randn(3, 64)
        assert layer._packed.usable(layer.weight, x)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("FLASHSPEC_CPU_PACKED", "0")
    layer = _linear()
    assert cpu_linear.pack_linears(layer) == 0 and type(layer) is nn.Linear


def test_loaded_models_and_drafts_are_packed_and_speculation_stays_lossless(hf_models, tmp_path):
    """load_model / load_draft pack on the CPU; logits stay within rounding of F.linear and greedy
    FlashSpec output still equals plain decoding token for token."""
    model = load_model(str(hf_models["llama_untied"][0]), dtype="float32").model
    packed = [m for m in model.modules() if isinstance(m, cpu_linear.PackedLinear)]
    assert len(packed) == 7 * model.args.num_layers + 1  # q, k, v, o, gate, up, down per layer + lm_head
    tokens = torch.randint(0, model.args.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(9)[None].expand(2, 9)
    with torch.no_grad():
        fast = model(tokens, pos).logits
        for m in packed:
            m._packed = None  # plain F.linear
        slow = model(tokens, pos).logits
        for m in packed:
            m.repack()
    torch.testing.assert_close(fast, slow, rtol=1e-4, atol=1e-4)

    draft = DraftModel(model, DraftConfig(shared_layers=1, adapter_layers=1, head="mlp_tied", feature_input="deep",
                                          head_vocab=64))
    draft.init_from_target()
    folder = save_draft(draft, tmp_path / "d" / "v1", "code", "v1")
    draft = load_draft(folder, model, name="code")
    assert all(isinstance(m, cpu_linear.PackedLinear) for m in draft.modules() if isinstance(m, nn.Linear))
    from services.drafts import check_draft

    check_draft(draft, model, "code", "v1")  # the service's smoke test runs it under torch.inference_mode
    prompts = [torch.randint(0, model.args.vocab_size, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (5, 11, 17)]
    params = SamplingParams(max_new_tokens=24, eos_token_ids=())
    ar = [r.token_ids for r in generate(DecodeEngine(model, None, max_batch_size=3, max_seq_len=64), prompts, params)]
    eng = DecodeEngine(model, None, max_batch_size=3, max_seq_len=64, spec=SpecConfig(5, 5))
    eng.add_draft("code", draft)
    spec = generate(eng, prompts, params, ["code"] * 3)
    assert [r.token_ids for r in spec] == ar
    assert sum(r.stats.rounds for r in spec) > 0

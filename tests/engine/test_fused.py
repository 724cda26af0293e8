"""The opt-in fused inference path (engine/fused.py): the same numbers, parameters and tokens as unfused.

Hand fusion (q/k/v and gate/up as one GEMM over views of the same parameters, the residual add folded
into the next norm) runs on the CPU here. The compiled elementwise kernels are checked with a counting
dynamo backend (one compiled graph per input shape, shared by all layers) and, marked slow, with inductor.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn

from drafts.checkpoint import load_draft, save_draft, target_fingerprint
from drafts.config import DraftConfig
from drafts.model import DraftModel
from engine.fused import fuse_for_inference
from engine.generate import generate
from engine.loading import load_model
from engine.sampling import SamplingParams
from engine.scheduler import DecodeEngine
from engine.speculative import SpecConfig

TOL = 1e-5
NAMES = ["llama_untied", "qwen2_qkv_bias"]  # conftest.PARITY_MODELS: GQA (4 q heads, 2 kv heads); qwen2 has q/k/v bias


@pytest.fixture(autouse=True)
def _plain_cpu_linears(monkeypatch):
    """These tests compare fusion against no fusion, so both sides use F.linear (not the oneDNN-packed
    CPU projections of engine/cpu_linear.py, which round differently)."""
    monkeypatch.setenv("FLASHSPEC_CPU_PACKED", "0")


def _load(hf_models, name: str):
    return load_model(str(hf_models[name][0]), dtype="float32").model


def _tokens(batch: int, n: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(2, vocab, (batch, n), generator=torch.Generator().manual_seed(seed))


def _prompts(vocab: int, lengths, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=gen).tolist() for n in lengths]


def _passes(model, tokens: torch.Tensor) -> list[torch.Tensor]:
    """Logits of a full pass, a layer-range split pass, and a cached prefill + 4 single-token steps."""
    b, t = tokens.shape
    pos = torch.arange(t)[None].expand(b, -1)
    n = model.args.num_layers // 2
    with torch.no_grad():
        out = [model(tokens, pos).logits]
        trunk = model(tokens, pos, layers=range(0, n)).hidden
        out.append(model(None, pos, layers=range(n, model.args.num_layers), hidden=trunk).logits)
        cache = model.new_cache(b, 64)
        prefill = t - 4
        out.append(model(tokens[:, :prefill], pos[:, :prefill], cache=cache, kv_len=prefill,
                         logits_index=torch.full((b,), prefill - 1)).logits)
        for i in range(prefill, t):
            out.append(model(tokens[:, i : i + 1], pos[:, i : i + 1], cache=cache, kv_len=i + 1).logits)
    return out


def _generate(model, prompts, params, batch: int = 4, drafts: dict | None = None, names=None, spec=None):
    eng = DecodeEngine(model, None, max_batch_size=batch, max_seq_len=96, spec=spec)
    for name, draft in (drafts or {}).items():
        eng.add_draft(name, draft)
    return [r.token_ids for r in generate(eng, prompts, params, names)]


@pytest.mark.parametrize("name", NAMES)
def test_fused_logits_equal_unfused(hf_models, name):
    model = _load(hf_models, name)
    tokens = _tokens(2, 24, model.args.vocab_size)
    expected = _passes(model, tokens)
    model.fuse_for_inference(compile=False)
    assert model.fused == "hand"
    assert all(layer.fusion_active() for layer in model.layers)
    attn = model.layers[0].self_attn
    assert (attn.qkv.bias is not None) == model.args.qkv_bias == (name == "qwen2_qkv_bias")
    got = _passes(model, tokens)
    assert expected[0].std() > 0.5
    for e, g in zip(expected, got):
        diff = (g - e).abs().max().item()
        assert diff <= TOL, f"{name}: max |fused - unfused| = {diff:.2e}"


@pytest.mark.parametrize("name", NAMES)
def test_parameters_and_state_dict_unchanged_and_memory_not_doubled(hf_models, name):
    model = _load(hf_models, name)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = {n: p for n, p in model.named_parameters()}
    param_bytes = sum(p.numel() * p.element_size() for p in params.values())
    fingerprint = target_fingerprint(model)
    model.fuse_for_inference(compile=False)
    after = model.state_dict()
    assert list(after) == list(before)
    for key, value in before.items():
        assert after[key].shape == value.shape and torch.equal(after[key], value), key
    assert {n: p for n, p in model.named_parameters()} == params  # the same Parameter objects
    assert target_fingerprint(model) == fingerprint
    # The fused weights are the parameters' storage: every parameter byte is held once.
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    assert sum(storages.values()) == param_bytes
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        fused_ptr = attn.qkv.weight.untyped_storage().data_ptr()
        assert all(p.weight.untyped_storage().data_ptr() == fused_ptr for p in (attn.q_proj, attn.k_proj, attn.v_proj))
        assert attn.q_proj.weight.data_ptr() == attn.qkv.weight.data_ptr()
        fused_ptr = mlp.gate_up.weight.untyped_storage().data_ptr()
        assert all(p.weight.untyped_storage().data_ptr() == fused_ptr for p in (mlp.gate_proj, mlp.up_proj))
        if model.args.qkv_bias:
            assert attn.k_proj.bias.untyped_storage().data_ptr() == attn.qkv.bias.untyped_storage().data_ptr()


def test_load_state_dict_writes_through_the_fused_weights(hf_models):
    """New values loaded into a fused model (in place) are what its fused GEMMs use."""
    model = _load(hf_models, "qwen2_qkv_bias")
    model.fuse_for_inference(compile=False)
    gen = torch.Generator().manual_seed(3)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in model.state_dict().items()}
    model.load_state_dict(new)
    assert all(layer.fusion_active() for layer in model.layers)
    reference = _load(hf_models, "qwen2_qkv_bias")
    reference.load_state_dict(new)
    tokens = _tokens(2, 16, model.args.vocab_size, seed=4)
    for e, g in zip(_passes(reference, tokens), _passes(model, tokens)):
        assert (g - e).abs().max().item() <= TOL


@pytest.mark.parametrize("name", NAMES)
def test_generation_identical_through_the_engine(hf_models, name):
    model = _load(hf_models, name)
    prompts = _prompts(model.args.vocab_size, (3, 11, 1, 25))
    greedy = SamplingParams(max_new_tokens=16, eos_token_ids=())
    sampled = [SamplingParams(max_new_tokens=16, temperature=0.9, top_p=0.95, seed=s, eos_token_ids=()) for s in range(4)]
    expected = [_generate(model, prompts, greedy), _generate(model, prompts, sampled)]
    model.fuse_for_inference(compile=False)
    assert [_generate(model, prompts, greedy), _generate(model, prompts, sampled)] == expected


def test_drafts_sharing_the_target_layers_still_work(hf_models, tmp_path):
    """A draft built on the target before fusing runs its trunk (the target's own, now fused, layers)
    unchanged; fusing the draft's own adapters too changes nothing either; its checkpoint still loads."""
    target = _load(hf_models, "llama_untied")
    oracle = DraftModel(target, DraftConfig(shared_layers=1, adapter_layers=3, head="mlp_tied"), name="oracle")
    oracle.init_from_target()  # adapters = target layers [1, 4): every drafted token is accepted
    deep = DraftModel(target, DraftConfig(shared_layers=1, adapter_layers=2, head="mlp_tied", feature_input="deep"),
                      name="deep")
    deep.init_from_target()
    drafts = {"oracle": oracle, "deep": deep}
    prompts = _prompts(target.args.vocab_size, (5, 17, 2, 30))
    params = SamplingParams(max_new_tokens=20, eos_token_ids=())
    names = ["oracle", "deep", "oracle", "deep"]
    spec = SpecConfig(5, 2)
    ar = _generate(target, prompts, params)
    unfused = _generate(target, prompts, params, drafts=drafts, names=names, spec=spec)
    assert unfused == ar  # greedy speculative decoding is lossless

    target.fuse_for_inference(compile=False)
    for layer, own in zip(oracle.trunk, target.layers):
        assert layer is own and layer.fusion_active()
        assert layer.self_attn.q_proj.weight.data_ptr() == layer.self_attn.qkv.weight.data_ptr()
    assert _generate(target, prompts, params, drafts=drafts, names=names, spec=spec) == unfused

    for draft in drafts.values():
        fuse_for_inference(draft, compile=False)  # the draft's own adapter layers
        assert not any(layer.fusion_active() for layer in draft.adapters)  # trainable: unfused while grad is on
        draft.requires_grad_(False)  # as load_draft leaves a draft
        assert all(layer.fusion_active() for layer in draft.adapters)
    assert _generate(target, prompts, params, drafts=drafts, names=names, spec=spec) == unfused

    folder = save_draft(oracle, tmp_path / "v1", "code", "v1", dtype=torch.float32)
    loaded = load_draft(folder, target)  # the fingerprint of the fused target is unchanged
    for key, value in oracle.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key


def test_unfuse_restores_separate_parameters(hf_models):
    model = _load(hf_models, "qwen2_qkv_bias")
    tokens = _tokens(1, 12, model.args.vocab_size)
    expected = _passes(model, tokens)
    model.fuse_for_inference(compile=False).unfuse_for_inference()
    assert model.fused is None and all(layer.ops is None for layer in model.layers)
    attn = model.layers[0].self_attn
    assert attn.qkv is None and model.layers[0].mlp.gate_up is None
    assert attn.q_proj.weight.untyped_storage().data_ptr() != attn.k_proj.weight.untyped_storage().data_ptr()
    assert all(torch.equal(e, g) for e, g in zip(expected, _passes(model, tokens)))


def test_moving_the_model_refuses_and_replaced_parameters_fall_back(hf_models, caplog):
    model = _load(hf_models, "llama_untied")
    tokens = _tokens(1, 12, model.args.vocab_size)
    model.fuse_for_inference(compile=False)
    model.double()  # every parameter gets new storage: the layers fuse again over the converted ones
    assert all(layer.fusion_active() for layer in model.layers)
    assert model.layers[0].self_attn.qkv.weight.dtype == torch.float64
    assert model.layers[0].mlp.up_proj.weight.untyped_storage().data_ptr() == \
        model.layers[0].mlp.gate_up.weight.untyped_storage().data_ptr()
    reference = _load(hf_models, "llama_untied").double()
    for e, g in zip(_passes(reference, tokens), _passes(model, tokens)):
        assert (g - e).abs().max().item() <= 1e-10

    # A parameter replaced after fusing: that layer runs unfused (one warning), with the new weight.
    up = model.layers[1].mlp.up_proj
    up.weight = nn.Parameter(up.weight.detach() * 1.5, requires_grad=False)
    with torch.no_grad():
        reference.layers[1].mlp.up_proj.weight.mul_(1.5)
    with caplog.at_level(logging.WARNING, logger="engine.model"):
        got = _passes(model, tokens)
    assert sum("replaced after fuse_for_inference" in r.message for r in caplog.records) == 1
    assert not model.layers[1].fusion_active() and model.layers[0].fusion_active()
    for e, g in zip(_passes(reference, tokens), got):
        assert (g - e).abs().max().item() <= 1e-10


def test_trainable_weights_under_autograd_take_the_unfused_path(hf_models):
    """The fused weights carry no gradient to the parameters: with grad enabled and trainable weights
    the layers run unfused, so gradients reach q/k/v and gate/up as before."""
    model = _load(hf_models, "llama_untied").requires_grad_(True)
    model.fuse_for_inference(compile=False)
    assert not model.layers[0].fusion_active()
    tokens = _tokens(1, 8, model.args.vocab_size)
    model(tokens, torch.arange(8)[None]).logits.square().mean().backward()
    assert model.layers[0].self_attn.k_proj.weight.grad is not None
    assert model.layers[0].mlp.gate_proj.weight.grad is not None
    with torch.no_grad():
        assert model.layers[0].fusion_active()


def test_compile_defaults_off_on_cpu(hf_models):
    model = _load(hf_models, "llama_untied")
    model.fuse_for_inference()
    assert model.fused == "hand"


def test_compiled_kernels_are_shared_by_all_layers(hf_models):
    """Weights are arguments of the compiled functions: one graph per function and input shape, not per layer."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    model = _load(hf_models, "qwen2_qkv_bias")
    prompts = _prompts(model.args.vocab_size, (20, 25))  # prefill: > 16 tokens per row, the long-step kernels
    params = SamplingParams(max_new_tokens=10, eos_token_ids=())
    expected = _generate(model, prompts, params, batch=2)
    counter = CompileCounter()
    model.fuse_for_inference(compile=True, backend=counter)
    assert model.fused == "compiled"
    assert _generate(model, prompts, params, batch=2) == expected
    # Decode steps are (2 rows, 1 token): rms_norm (first layer), add_rms_norm, rope_qk, silu_mul; 4 layers.
    # The prefill (2 rows x 25 tokens) compiles the same four once more with the row count dynamic (dynamo may
    # trace one of them twice: a view and a fresh tensor guard apart).
    frames = counter.frame_count
    assert 8 <= frames <= 10
    assert _generate(model, prompts, params, batch=2) == expected
    assert counter.frame_count == frames
    # Prompts of other lengths: the same compiled prefill kernels, no new graph.
    _generate(model, _prompts(model.args.vocab_size, (30, 41)), params, batch=2)
    assert counter.frame_count == frames
    counts = model._fused_ops.shape_counts()
    assert all(counts[f"{name} (long steps)"] == {"compiled": 1, "eager": 0, "cap": 48}
               for name in ("rms_norm", "add_rms_norm", "rope_qk", "silu_mul")), counts


def test_compiled_shapes_are_bounded(hf_models, monkeypatch):
    """Past MAX_SHAPES distinct shapes per function, new shapes run eagerly instead of recompiling."""
    import engine.fused
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    monkeypatch.setattr(engine.fused, "MAX_SHAPES", 1)
    model = _load(hf_models, "llama_untied")
    tokens = _tokens(2, 12, model.args.vocab_size, seed=6)  # prefill 8 rows x 2 (compiled), then 1-token steps
    expected = _passes(model, tokens)
    counter = CompileCounter()
    model.fuse_for_inference(compile=True, backend=counter, max_compiled_tokens=64)
    got = _passes(model, tokens)
    assert all(torch.equal(e, g) for e, g in zip(expected, got))
    assert counter.frame_count == 4  # the first shape of each function only
    counts = model._fused_ops.shape_counts()
    short = {"rms_norm", "add_rms_norm", "rope_qk", "silu_mul"}
    assert set(counts) == short | {f"{name} (long steps)" for name in short}
    assert all(counts[n]["compiled"] == 1 and counts[n]["eager"] >= 1 and counts[n]["cap"] == 1 for n in short), counts
    assert all(counts[f"{n} (long steps)"]["compiled"] == 0 for n in short), counts  # every step is short here


def test_compile_failure_falls_back_to_eager_with_one_warning(hf_models, caplog):
    def broken(gm, example_inputs):
        raise RuntimeError("no compiler here")

    model = _load(hf_models, "llama_untied")
    prompts = _prompts(model.args.vocab_size, (4, 9))
    params = SamplingParams(max_new_tokens=8, eos_token_ids=())
    expected = _generate(model, prompts, params, batch=2)
    model.fuse_for_inference(compile=True, backend=broken)
    with caplog.at_level(logging.WARNING, logger="engine.fused"):
        got = _generate(model, prompts, params, batch=2)
    assert got == expected
    warnings = [r for r in caplog.records if "torch.compile" in r.message]
    assert len(warnings) == 1 and "no compiler here" in warnings[0].getMessage()
    assert model.fused == "hand"


@pytest.mark.slow
def test_inductor_compiled_kernels_on_cpu(hf_models):
    """The real thing on the CPU (inductor's C++ kernels): logits within fp32 rounding, tokens identical."""
    model = _load(hf_models, "qwen2_qkv_bias")
    tokens = _tokens(2, 20, model.args.vocab_size, seed=5)  # prefill 16 tokens per row: compiled too
    expected = _passes(model, tokens)
    prompts = _prompts(model.args.vocab_size, (3, 11, 1, 25))
    params = SamplingParams(max_new_tokens=12, eos_token_ids=())
    expected_tokens = _generate(model, prompts, params)
    model.fuse_for_inference(compile=True)
    got = _passes(model, tokens)
    assert model.fused == "compiled"
    for e, g in zip(expected, got):
        assert (g - e).abs().max().item() <= 1e-4
    assert _generate(model, prompts, params) == expected_tokens


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_compiled_steps_inside_cuda_graphs(hf_models, dtype):
    """Compiled kernels captured inside the engine's own CUDA graphs: fp32 tokens identical to unfused eager,
    bf16 runs (greedy agreement is reported, rounding may part ways late in a sequence)."""
    model = load_model(str(hf_models["llama_untied"][0]), device="cuda", dtype=dtype).model
    draft = DraftModel(model, DraftConfig(shared_layers=1, adapter_layers=3, head="mlp_tied"), name="d")
    draft.init_from_target()
    prompts = _prompts(model.args.vocab_size, (5, 17, 2, 30))
    params = SamplingParams(max_new_tokens=24, eos_token_ids=())
    spec = SpecConfig(5, 2)
    names = ["d"] * 4

    def run(graphs: bool, with_draft: bool):
        eng = DecodeEngine(model, None, max_batch_size=4, max_seq_len=96, spec=spec, cuda_graphs=graphs)
        eng.add_draft("d", draft)
        out = [r.token_ids for r in generate(eng, prompts, params, names if with_draft else None)]
        if graphs:
            assert len(eng.graphs) > 0
        return out

    expected = run(False, False)
    model.fuse_for_inference()  # compile defaults on for CUDA
    fuse_for_inference(draft)
    ar, sp = run(True, False), run(True, True)
    assert model.fused == "compiled"
    if dtype == torch.float32:
        assert ar == expected and sp == expected
    else:
        assert all(len(t) == 24 for t in ar + sp)

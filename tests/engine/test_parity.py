"""The engine's model against transformers' own implementations: logits and greedy generation."""

from __future__ import annotations

import pytest
import torch

from engine.generate import generate
from engine.loading import load_model
from engine.sampling import SamplingParams
from engine.scheduler import DecodeEngine

TOL = 1e-4
NAMES = ["llama_untied", "llama_tied_llama3_rope", "mistral", "qwen2_qkv_bias"]  # conftest.PARITY_MODELS


def _tokens(n: int, vocab: int, seed: int, batch: int = 1) -> torch.Tensor:
    return torch.randint(2, vocab, (batch, n), generator=torch.Generator().manual_seed(seed))


def _engine_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    pos = torch.arange(tokens.shape[1])[None].expand(tokens.shape[0], -1)
    return model(tokens, pos).logits


@pytest.mark.parametrize("name", NAMES)
def test_logits_parity_with_transformers(hf_models, name):
    path, hf = hf_models[name]
    loaded = load_model(str(path), dtype="float32")
    tokens = _tokens(48, hf.config.vocab_size, seed=1, batch=2)  # 48 > 32: past llama3 rope's original context
    with torch.no_grad():
        expected = hf(tokens).logits
        got = _engine_logits(loaded.model, tokens)
    assert expected.std() > 0.5, "logits too flat for the comparison to mean anything"
    diff = (got - expected).abs().max().item()
    assert diff <= TOL, f"{name}: max |engine - transformers| = {diff:.2e} > {TOL}"


def test_parity_model_properties_are_read(hf_models, tiny):
    """The fixtures really exercise GQA, tying, llama3 rope and q/k/v bias as read by the loader."""
    assert set(NAMES) == set(tiny.PARITY_MODELS)
    args = {name: load_model(str(path)).args for name, (path, _) in hf_models.items()}
    assert all(a.num_kv_heads == 2 and a.num_heads == 4 for a in args.values())
    assert args["llama_untied"].tie_word_embeddings is False
    assert args["llama_tied_llama3_rope"].tie_word_embeddings is True
    assert args["llama_tied_llama3_rope"].rope_scaling is not None
    assert args["llama_tied_llama3_rope"].rope_scaling.rope_type == "llama3"
    assert args["qwen2_qkv_bias"].qkv_bias is True
    assert args["mistral"].rope_theta == 50000.0
    loaded = load_model(str(hf_models["llama_tied_llama3_rope"][0]))
    assert loaded.model.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()


def test_llama3_rope_parity_has_power(hf_models, tiny):
    """The same weights without rope scaling give clearly different logits: the scaled check is not vacuous."""
    _, hf = hf_models["llama_tied_llama3_rope"]
    plain = tiny.make_hf_model("llama", seed=101, tie_word_embeddings=True)
    plain.load_state_dict(hf.state_dict())
    tokens = _tokens(48, hf.config.vocab_size, seed=1)
    with torch.no_grad():
        assert (plain(tokens).logits - hf(tokens).logits).abs().max() > 100 * TOL


def test_sharded_checkpoint_parity(hf_models, tiny, tmp_path):
    _, hf = hf_models["qwen2_qkv_bias"]
    path = tiny.save_hf(hf, tmp_path / "sharded", max_shard_size="100KB")
    assert (path / "model.safetensors.index.json").is_file()
    loaded = load_model(str(path))
    tokens = _tokens(20, hf.config.vocab_size, seed=2)
    with torch.no_grad():
        diff = (_engine_logits(loaded.model, tokens) - hf(tokens).logits).abs().max().item()
    assert diff <= TOL


@pytest.mark.parametrize("name", NAMES)
def test_layer_range_forward_parity(hf_models, name):
    """Layers [0, N) then [N, L) from the hidden states equals one full pass (what FlashSpec relies on)."""
    path, hf = hf_models[name]
    model = load_model(str(path)).model
    tokens = _tokens(16, hf.config.vocab_size, seed=3, batch=2)
    pos = torch.arange(16)[None].expand(2, -1)
    with torch.no_grad():
        full = model(tokens, pos)
        trunk = model(tokens, pos, layers=range(0, 1))
        assert trunk.logits is None and trunk.final_hidden is None
        rest = model(None, pos, layers=range(1, model.args.num_layers), hidden=trunk.hidden)
    assert torch.allclose(rest.logits, full.logits, atol=1e-6)
    with pytest.raises(ValueError, match="hidden states"):
        model(None, pos, layers=range(1, 4))


@pytest.mark.parametrize("name", NAMES)
def test_greedy_generation_parity_with_transformers(hf_models, name):
    """engine.generate greedy == transformers generate(do_sample=False), token for token, on a ragged batch."""
    path, hf = hf_models[name]
    loaded = load_model(str(path))
    engine = DecodeEngine(loaded.model, loaded.tokenizer, max_batch_size=3, max_seq_len=128)
    prompts = [_tokens(n, hf.config.vocab_size, seed=10 + n)[0].tolist() for n in (5, 17, 40)]
    results = generate(engine, prompts, SamplingParams(max_new_tokens=24))
    for prompt, result in zip(prompts, results):
        with torch.no_grad():
            expected = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, min_new_tokens=24)
        assert result.token_ids == expected[0, len(prompt):].tolist()
        assert result.finish_reason == "length"


@pytest.mark.slow
def test_default_model_parity():
    """The embedded default (SmolLM2-135M-Instruct, converted from its GGUF) against transformers on the same folder."""
    from transformers import AutoModelForCausalLM

    loaded = load_model("default", dtype="float32")
    hf = AutoModelForCausalLM.from_pretrained(str(loaded.path), dtype=torch.float32).eval()
    ids = loaded.tokenizer("The capital of France is Paris. The capital of Italy is", return_tensors="pt").input_ids
    with torch.no_grad():
        diff = (_engine_logits(loaded.model, ids) - hf(ids).logits).abs().max().item()
        expected = hf.generate(ids, max_new_tokens=16, do_sample=False, min_new_tokens=16)
    assert diff <= TOL
    engine = DecodeEngine(loaded.model, loaded.tokenizer, max_batch_size=1, max_seq_len=256)
    result = generate(engine, [ids[0].tolist()], SamplingParams(max_new_tokens=16, eos_token_ids=()))[0]
    assert result.token_ids == expected[0, ids.shape[1]:].tolist()

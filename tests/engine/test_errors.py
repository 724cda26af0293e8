"""Bad input is refused with an error that names the problem."""

from __future__ import annotations

import json

import pytest
import torch

from engine.config import ModelArgs, UnsupportedModelError
from engine.loading import ModelLoadError, load_model
from engine.requests import Request, RequestError
from engine.sampling import SamplingParams
from engine.scheduler import DecodeEngine


@pytest.fixture()
def model_dir(hf_models, tmp_path):
    """A private copy of a saved tiny model, free to damage."""
    import shutil

    src = hf_models["llama_untied"][0]
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    return dst


def _engine(tiny_target, max_seq_len=32):
    return DecodeEngine(tiny_target.model, tiny_target.tokenizer, max_batch_size=1, max_seq_len=max_seq_len)


def test_empty_prompt(tiny_target):
    with pytest.raises(RequestError, match="empty"):
        _engine(tiny_target).add_request(Request("r", [], SamplingParams()))


def test_prompt_longer_than_context(tiny_target):
    eng = _engine(tiny_target, max_seq_len=32)
    with pytest.raises(RequestError, match=r"40 tokens.*32"):
        eng.add_request(Request("r", [5] * 40, SamplingParams()))
    with pytest.raises(RequestError, match="32"):
        eng.add_request(Request("r", [5] * 32, SamplingParams()))  # no room for a new token
    eng.add_request(Request("ok", [5] * 31, SamplingParams(max_new_tokens=4)))
    outs = eng.step()
    assert outs[0].finished and outs[0].finish_reason == "length"  # the context is full after one token


def test_generation_stops_at_the_context_limit(tiny_target):
    eng = _engine(tiny_target, max_seq_len=32)
    eng.add_request(Request("r", [5] * 20, SamplingParams(max_new_tokens=100, eos_token_ids=())))
    tokens = []
    while eng.has_work():
        for out in eng.step():
            tokens += out.token_ids
    assert 20 + len(tokens) == 32


def test_token_ids_outside_the_vocabulary(tiny_target):
    with pytest.raises(RequestError, match="token ids"):
        _engine(tiny_target).add_request(Request("r", [3, tiny_target.args.vocab_size], SamplingParams()))


def test_unknown_draft_name(tiny_target):
    with pytest.raises(RequestError, match="not loaded"):
        _engine(tiny_target).add_request(Request("r", [3, 4], SamplingParams(), draft="code"))


def test_unknown_architecture(model_dir):
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (model_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        load_model(str(model_dir))


def test_unsupported_activation_and_rope_type():
    base = dict(model_type="llama", vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                num_attention_heads=2)
    with pytest.raises(UnsupportedModelError, match="gelu"):
        ModelArgs.from_hf_config({**base, "hidden_act": "gelu"})
    with pytest.raises(UnsupportedModelError, match="yarn"):
        ModelArgs.from_hf_config({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(UnsupportedModelError, match="num_key_value_heads"):
        ModelArgs.from_hf_config({**base, "num_key_value_heads": 3})


def test_sliding_window_shorter_than_the_context(tiny, tmp_path):
    model = tiny.make_hf_model("mistral", sliding_window=16)
    path = tiny.save_hf(model, tmp_path / "mistral_sw")
    with pytest.raises(UnsupportedModelError, match=r"sliding.*16.*64"):
        load_model(str(path), max_seq_len=64)
    loaded = load_model(str(path), max_seq_len=16)  # fits inside the window: fine
    with pytest.raises(UnsupportedModelError, match="sliding"):
        DecodeEngine(loaded.model, loaded.tokenizer, max_batch_size=1, max_seq_len=64)


def test_missing_weight_file(model_dir):
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        load_model(str(model_dir))


def test_truncated_safetensors(model_dir):
    weights = model_dir / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="truncated or corrupt"):
        load_model(str(model_dir))


def test_missing_shard(hf_models, tiny, tmp_path):
    path = tiny.save_hf(hf_models["llama_untied"][1], tmp_path / "sharded", max_shard_size="100KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    (path / shard).unlink()
    with pytest.raises(ModelLoadError, match=f"{shard}.*missing"):
        load_model(str(path))


def test_checkpoint_missing_tensors(model_dir):
    from safetensors.torch import load_file, save_file

    weights = model_dir / "model.safetensors"
    tensors = load_file(str(weights))
    tensors.pop("model.layers.2.mlp.up_proj.weight")
    save_file(tensors, str(weights), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="missing"):
        load_model(str(model_dir))


def test_wrong_shape_in_checkpoint(model_dir):
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (model_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="shape"):
        load_model(str(model_dir))


def test_not_a_model(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(str(tmp_path))
    with pytest.raises(ModelLoadError, match="neither"):
        load_model(str(tmp_path / "nothing-here"))
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(str(tmp_path / "model.gguf"))


def test_unknown_dtype(model_dir):
    with pytest.raises(ValueError, match="float8"):
        load_model(str(model_dir), dtype="float8")


def test_bfloat16_load(model_dir):
    loaded = load_model(str(model_dir), dtype="bfloat16")
    assert loaded.model.embed_tokens.weight.dtype == torch.bfloat16

"""Draft checkpoints: round trip, and refusal of corrupt files, another target and wrong shapes."""

from __future__ import annotations

import json

import pytest
import torch

from drafts.checkpoint import DraftLoadError, load_draft, read_manifest, save_draft, target_fingerprint
from drafts.config import DraftConfig
from drafts.model import DraftModel
from engine.config import ModelArgs
from engine.model import Transformer

ARGS = ModelArgs(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4,
                 num_kv_heads=2, head_dim=16, eos_token_ids=(1,), bos_token_id=0, max_position_embeddings=256)


def tiny_target(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(ARGS, max_seq_len=256).eval().requires_grad_(False)


def trained_like_draft(target: Transformer, config: DraftConfig | None = None) -> DraftModel:
    config = config or DraftConfig(shared_layers=1, adapter_layers=1, head="mlp_tied", feature_input="deep", head_vocab=32)
    draft = DraftModel(target, config, name="code", version="v1")
    draft.init_from_target()
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.01 * torch.randn_like(p))
    if draft.vocab_ids is not None:
        draft.set_vocab(torch.randperm(256)[:32])
    return draft


def state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_round_trip_keeps_every_tensor_and_writes_the_manifest(tmp_path):
    target = tiny_target()
    draft = trained_like_draft(target)
    folder = save_draft(draft, tmp_path / "v1", "code", "v1", training={"steps": 3}, metrics={"mean_accepted_length": 2.5},
                        dtype=torch.float32)
    manifest = read_manifest(folder)
    assert manifest["domain"] == "code" and manifest["version"] == "v1" and manifest["format_version"] == 1
    assert manifest["target_fingerprint"] == target_fingerprint(target)
    assert manifest["draft_config"] == draft.config.to_dict()
    assert manifest["metrics"]["mean_accepted_length"] == 2.5 and manifest["training"]["steps"] == 3
    assert manifest["created"].endswith("+00:00")
    assert set(manifest["tensors"]) == set(draft.state_dict()) and "vocab_ids" in manifest["tensors"]
    assert not any(k.startswith("layers.") or "embed" in k for k in manifest["tensors"])  # never the trunk

    loaded = load_draft(folder, target)
    for name, value in draft.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    assert loaded.name == "code" and loaded.version == "v1"
    x = torch.randn(1, 5, 64)
    pos = torch.arange(5)[None]
    with torch.no_grad():  # on the CPU the loaded draft's projections run oneDNN-packed: equal up to rounding
        torch.testing.assert_close(loaded.forward_train(x, x, pos)[0], draft.forward_train(x, x, pos)[0],
                                   rtol=1e-5, atol=1e-5)


def test_a_store_domain_folder_loads_its_active_version_and_a_bad_folder_says_what_a_draft_is(tmp_path):
    from bench.spec import load_bench_draft

    target = tiny_target()
    for version in ("v1", "v2"):
        save_draft(trained_like_draft(target), tmp_path / "code" / version, "code", version, dtype=torch.float32)
    (tmp_path / "code" / "ACTIVE").write_text("v1\n")
    assert load_draft(tmp_path / "code", target).version == "v1"  # the domain folder: its ACTIVE version
    assert load_bench_draft(str(tmp_path / "code" / "v2"), target).version == "v2"
    with pytest.raises(SystemExit, match=r"error: --draft .*has no manifest.json.*ACTIVE file"):
        load_bench_draft(str(tmp_path), target)  # a folder of domain folders is no draft


def test_a_draft_fusing_extra_layers_round_trips(tmp_path):
    target = tiny_target()
    config = DraftConfig(shared_layers=1, adapter_layers=1, head="mlp_tied", feature_input="deep", head_vocab=32,
                         feature_layers=(2, 3))
    draft = trained_like_draft(target, config)
    folder = save_draft(draft, tmp_path / "v1", "code", "v1", dtype=torch.float32)
    manifest = read_manifest(folder)
    assert manifest["draft_config"]["feature_layers"] == [2, 3] and "feat_proj.weight" in manifest["tensors"]
    loaded = load_draft(folder, target)
    assert loaded.feature_layers == (2, 3)
    x = torch.randn(1, 5, 64)
    with torch.no_grad():  # packed projections on the CPU: equal up to rounding
        torch.testing.assert_close(loaded.target_features(x, (x, x)), draft.target_features(x, (x, x)),
                                   rtol=1e-5, atol=1e-5)


def test_the_service_refuses_a_draft_whose_feature_projection_is_corrupt():
    from services.drafts import DraftRefused, check_draft

    target = tiny_target()
    config = DraftConfig(shared_layers=1, adapter_layers=1, head="mlp_tied", feature_input="deep", feature_layers=(2,))
    draft = trained_like_draft(target, config)
    check_draft(draft, target, "code", "v1")
    with torch.no_grad():
        draft.feat_proj.weight[0, 0] = float("nan")
    with pytest.raises(DraftRefused, match="non-finite"):
        check_draft(draft, target, "code", "v1")


def test_fp16_weights_load_in_the_targets_dtype(tmp_path):
    target = tiny_target()
    draft = trained_like_draft(target)
    save_draft(draft, tmp_path / "v1", "code", "v1")
    tensors = read_manifest(tmp_path / "v1")["tensors"]
    assert tensors["adapters.0.mlp.up_proj.weight"]["dtype"] == "float16" and tensors["vocab_ids"]["dtype"] == "int64"
    loaded = load_draft(tmp_path / "v1", target)
    assert loaded.adapters[0].mlp.up_proj.weight.dtype == torch.float32
    assert torch.allclose(loaded.adapters[0].mlp.up_proj.weight, draft.adapters[0].mlp.up_proj.weight, atol=1e-3)
    assert torch.equal(loaded.vocab_ids, draft.vocab_ids)


def test_fingerprint_is_the_same_for_fp32_and_bf16_loads_and_differs_across_models():
    target = tiny_target()
    bf16 = tiny_target().to(torch.bfloat16)
    assert target_fingerprint(target) == target_fingerprint(bf16)
    assert target_fingerprint(target) != target_fingerprint(tiny_target(seed=1))


def test_corrupt_weights_are_refused(tmp_path):
    target = tiny_target()
    save_draft(trained_like_draft(target), tmp_path / "v1", "code", "v1")
    weights = tmp_path / "v1" / "draft.safetensors"
    data = bytearray(weights.read_bytes())
    data[-10] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(DraftLoadError, match="sha256"):
        load_draft(tmp_path / "v1", target)


def test_missing_or_broken_manifest_is_refused(tmp_path):
    target = tiny_target()
    with pytest.raises(DraftLoadError, match="no manifest.json"):
        load_draft(tmp_path, target)
    save_draft(trained_like_draft(target), tmp_path / "v1", "code", "v1")
    manifest = tmp_path / "v1" / "manifest.json"
    text = manifest.read_text()
    manifest.write_text(text[: len(text) // 2])
    with pytest.raises(DraftLoadError, match="not valid JSON"):
        load_draft(tmp_path / "v1", target)
    data = json.loads(text)
    data["format_version"] = 99
    manifest.write_text(json.dumps(data))
    with pytest.raises(DraftLoadError, match="format_version 99"):
        load_draft(tmp_path / "v1", target)


def test_another_target_is_refused_and_nothing_changes(tmp_path):
    save_draft(trained_like_draft(tiny_target()), tmp_path / "v1", "code", "v1")
    other = tiny_target(seed=1)
    before = state(other)
    with pytest.raises(DraftLoadError, match="another target"):
        load_draft(tmp_path / "v1", other)
    after = state(other)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_wrong_shapes_are_refused_with_the_differences(tmp_path):
    target = tiny_target()
    save_draft(trained_like_draft(target), tmp_path / "v1", "code", "v1")
    manifest = tmp_path / "v1" / "manifest.json"
    data = json.loads(manifest.read_text())
    data["draft_config"]["head_vocab"] = 16  # the weights hold a 32-token sub-vocabulary
    data["draft_config"]["adapter_layers"] = 2
    manifest.write_text(json.dumps(data))
    before = state(target)
    with pytest.raises(DraftLoadError) as err:
        load_draft(tmp_path / "v1", target)
    assert "vocab_ids has shape (32,), expected (16,)" in str(err.value)
    assert "missing tensors" in str(err.value) and "adapters.1" in str(err.value)
    assert all(torch.equal(v, target.state_dict()[k]) for k, v in before.items())


def test_a_full_vocabulary_draft_without_features_round_trips(tmp_path):
    target = tiny_target()
    draft = trained_like_draft(target, DraftConfig(shared_layers=2, adapter_layers=1, head="mlp"))
    save_draft(draft, tmp_path / "v", "dialog", "v", dtype=torch.float32)
    loaded = load_draft(tmp_path / "v", target, name="chat")
    assert loaded.name == "chat" and loaded.vocab_ids is None and loaded.fuse is None
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in draft.state_dict().items())

"""The draft model: a trunk shared with the target (no copy), its own adapters and head."""

from __future__ import annotations

import pytest
import torch

from drafts.config import DraftConfig
from drafts.model import DraftModel


def _target_tensors(target) -> dict[int, str]:
    return {t.data_ptr(): name for name, t in target.state_dict().items()}


@pytest.mark.parametrize("config", [DraftConfig(), DraftConfig(shared_layers=2, head="mlp_tied"),
                                    DraftConfig(shared_layers=1, feature_input="deep", head_vocab=16)])
def test_trunk_is_the_targets_own_layers(tiny_target, config):
    target = tiny_target.model
    draft = DraftModel(target, config)
    n = draft.shared_layers
    assert n == (config.shared_layers if config.shared_layers is not None else round(target.args.num_layers / 4))
    assert len(draft.trunk) == n
    for i, layer in enumerate(draft.trunk):
        assert layer is target.layers[i]
        for (name, p), (_, q) in zip(layer.named_parameters(), target.layers[i].named_parameters()):
            assert p.data_ptr() == q.data_ptr(), name
    # The checkpoint holds only the draft's own tensors: none of them is (or aliases) a target tensor.
    state = draft.state_dict()
    target_ptrs = _target_tensors(target)
    assert not [k for k, v in state.items() if v.data_ptr() in target_ptrs]
    allowed = ("adapters.", "fuse.", "out_norm.", "head.", "vocab_ids")
    assert all(k.startswith(allowed) for k in state), sorted(state)
    assert not any(k.startswith(("trunk", "_target", "target", "layers.", "embed_tokens", "lm_head")) for k in state)
    own = sum(p.numel() for p in draft.trainable_parameters())
    assert own == sum(v.numel() for k, v in state.items() if k != "vocab_ids")
    assert not {id(p) for p in draft.trainable_parameters()} & {id(p) for p in target.parameters()}


def test_init_from_target_copies_rather_than_aliases(tiny_target):
    target = tiny_target.model
    draft = DraftModel(target, DraftConfig(shared_layers=1, adapter_layers=2))
    draft.init_from_target()
    for i, adapter in enumerate(draft.adapters):
        src = target.layers[1 + i]
        for (name, p), (_, q) in zip(adapter.named_parameters(), src.named_parameters()):
            assert torch.equal(p, q) and p.data_ptr() != q.data_ptr(), name
    before = target.layers[1].mlp.up_proj.weight.clone()
    with torch.no_grad():
        draft.adapters[0].mlp.up_proj.weight.add_(1.0)
    assert torch.equal(target.layers[1].mlp.up_proj.weight, before)


def _trunk_and_features(target, tokens):
    pos = torch.arange(tokens.shape[1])[None].expand(tokens.shape[0], -1)
    with torch.no_grad():
        full = target(tokens, pos)
        trunk = target(tokens, pos, layers=range(0, 1)).hidden
    features = torch.cat([torch.zeros_like(full.final_hidden[:, :1]), full.final_hidden[:, :-1]], dim=1)
    return pos, full, trunk, features


@pytest.mark.parametrize("feature_input", ["none", "deep"])
def test_oracle_draft_reproduces_the_target(tiny_target, feature_input):
    """N + A = L with the tied head, initialised from the target: the draft *is* the target."""
    target = tiny_target.model
    draft = DraftModel(target, DraftConfig(shared_layers=1, adapter_layers=target.args.num_layers - 1,
                                           head="mlp_tied", feature_input=feature_input))
    draft.init_from_target()
    tokens = torch.randint(2, target.args.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    pos, full, trunk, features = _trunk_and_features(target, tokens)
    with torch.no_grad():
        scores, out = draft.forward_train(trunk, features if feature_input == "deep" else None, pos)
    assert torch.allclose(scores, full.logits, atol=1e-4)
    assert torch.allclose(draft.proxy_feature(out), full.final_hidden, atol=1e-4)
    assert torch.allclose(draft.head_logits(out[:, -1]), scores[:, -1], atol=1e-5)


def test_head_shapes_and_sub_vocabulary(tiny_target):
    target = tiny_target.model
    vocab = target.args.vocab_size
    tokens = torch.randint(2, vocab, (2, 6), generator=torch.Generator().manual_seed(1))
    pos, _, trunk, _ = _trunk_and_features(target, tokens)
    plain = DraftModel(target, DraftConfig(shared_layers=1))
    assert plain.head.fc2.out_features == vocab and plain.head.fc1.out_features == target.args.hidden_size // 2
    assert plain.forward_train(trunk, None, pos)[0].shape == (2, 6, vocab)
    assert plain.vocab_ids is None
    sub = DraftModel(target, DraftConfig(shared_layers=1, head="mlp_tied", head_vocab=16))
    sub.init_from_target()
    ids = torch.randperm(vocab, generator=torch.Generator().manual_seed(2))[:16]
    sub.set_vocab(ids)
    assert torch.equal(sub.state_dict()["vocab_ids"], ids)
    scores, out = sub.forward_train(trunk, None, pos)
    assert scores.shape == (2, 6, 16)
    logits = sub.head_logits(out[:, -1])  # (2, V): -inf outside the sub-vocabulary
    assert logits.shape == (2, vocab)
    assert torch.isinf(logits).sum() == 2 * (vocab - 16)
    assert torch.allclose(logits[:, ids], scores[:, -1], atol=1e-5)
    # The tied sub-vocabulary head scores exactly the target's lm_head rows of those tokens.
    full = DraftModel(target, DraftConfig(shared_layers=1, head="mlp_tied"))
    full.load_state_dict({k: v for k, v in sub.state_dict().items() if k != "vocab_ids"})
    assert torch.allclose(full.head_scores(out)[..., ids], scores, atol=1e-5)
    with pytest.raises(ValueError, match="expected 16"):
        sub.set_vocab(ids[:5])


def test_deep_draft_uses_the_features(tiny_target):
    target = tiny_target.model
    draft = DraftModel(target, DraftConfig(shared_layers=1, feature_input="deep"))
    tokens = torch.randint(2, target.args.vocab_size, (1, 5), generator=torch.Generator().manual_seed(3))
    pos, _, trunk, features = _trunk_and_features(target, tokens)
    with torch.no_grad():
        a, _ = draft.forward_train(trunk, features, pos)
        b, _ = draft.forward_train(trunk, torch.zeros_like(features), pos)
    assert not torch.allclose(a, b)
    assert draft.fuse.weight.shape == (target.args.hidden_size, 2 * target.args.hidden_size)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(head="linear"), "head"),
        (dict(feature_input="shallow"), "feature_input"),
        (dict(adapter_layers=-1), "adapter_layers"),
        (dict(head_vocab=1), "head_vocab"),
        (dict(adapter_layers=0, feature_input="deep"), "adapter layer"),
        (dict(feature_layers=(2,)), "feature_input='deep'"),
        (dict(feature_input="deep", feature_layers=(3, 2)), "increasing"),
    ],
)
def test_invalid_draft_config(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DraftConfig(**kwargs)


def test_draft_config_resolve_and_round_trip():
    assert DraftConfig().resolve(30).shared_layers == 8  # round(30 / 4)
    assert DraftConfig(shared_layers=3).resolve(4).shared_layers == 3
    with pytest.raises(ValueError, match="exceeds"):
        DraftConfig(shared_layers=5).resolve(4)
    config = DraftConfig(shared_layers=2, adapter_layers=1, head="mlp_tied", feature_input="deep", head_vocab=64)
    assert DraftConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match="unknown"):
        DraftConfig.from_dict({**config.to_dict(), "dropout": 0.1})


def test_feature_layers_config_and_draft(tiny_target):
    """Extra target layers fused in: range-checked against the trunk and the target, saved only when set,
    and an initialised draft starts as the final-state-only draft (the projection picks the final state)."""
    target = tiny_target.model
    with pytest.raises(ValueError, match="strictly between"):
        DraftConfig(shared_layers=2, feature_input="deep", feature_layers=(2,)).resolve(4)
    with pytest.raises(ValueError, match="strictly between"):
        DraftConfig(shared_layers=1, feature_input="deep", feature_layers=(4,)).resolve(4)
    config = DraftConfig(shared_layers=1, adapter_layers=1, head="mlp_tied", feature_input="deep", feature_layers=[2, 3])
    assert config.feature_layers == (2, 3) and DraftConfig.from_dict(config.to_dict()) == config
    assert "feature_layers" not in DraftConfig(feature_input="deep").to_dict()  # older manifests stay as they were
    draft = DraftModel(target, config)
    draft.init_from_target()
    tokens = torch.randint(2, target.args.vocab_size, (1, 6), generator=torch.Generator().manual_seed(4))
    pos = torch.arange(6)[None]
    with torch.no_grad():
        out = target(tokens, pos, capture=(2, 3))
        assert torch.equal(draft.target_features(out.final_hidden, out.captured), out.final_hidden)
        with pytest.raises(ValueError, match="states after target layers"):
            draft.target_features(out.final_hidden, out.captured[:1])
        torch.nn.init.normal_(draft.feat_proj.weight, std=0.1)
        a = draft.target_features(out.final_hidden, out.captured)
        b = draft.target_features(out.final_hidden, (out.captured[0], torch.zeros_like(out.captured[1])))
    assert not torch.allclose(a, b)  # the captured states matter
    h = target.args.hidden_size
    assert draft.feat_proj.weight.shape == (h, 3 * h)


def test_capture_returns_the_states_after_those_layers(tiny_target):
    target = tiny_target.model
    tokens = torch.randint(2, target.args.vocab_size, (2, 5), generator=torch.Generator().manual_seed(5))
    pos = torch.arange(5).expand(2, 5)
    with torch.no_grad():
        out = target(tokens, pos, capture=(1, 3))
        plain = target(tokens, pos)
        after1 = target(tokens, pos, layers=range(0, 1)).hidden
        after3 = target(None, pos, layers=range(1, 3), hidden=after1).hidden
    assert torch.equal(out.logits, plain.logits)
    assert torch.equal(out.captured[0], after1) and torch.equal(out.captured[1], after3)
    with pytest.raises(ValueError, match="capture"):
        target(tokens, pos, capture=(0,))

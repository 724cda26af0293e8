"""Evaluation with the real decoder: report shape, losslessness, perplexity, held-out prompts."""

from __future__ import annotations

import datasets
import pytest
import torch

from drafts.config import DraftConfig
from drafts.model import DraftModel
from engine.config import ModelArgs
from engine.model import Transformer
from training.evaluate import evaluate_draft, held_out_prompts, perplexity

ARGS = ModelArgs(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4,
                 num_kv_heads=2, head_dim=16, eos_token_ids=(1,), bos_token_id=0, max_position_embeddings=256)


@pytest.fixture(scope="module")
def target() -> Transformer:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    return Transformer(ARGS, max_seq_len=256).eval().requires_grad_(False)


def prompts(n: int = 3) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(2, 256, (6 + i,), generator=gen).tolist() for i in range(n)]


@pytest.mark.parametrize("feature_input", ["deep", "none"])
def test_report_is_lossless_and_complete(target, feature_input):
    draft = DraftModel(target, DraftConfig(shared_layers=1, adapter_layers=1, head="mlp_tied", feature_input=feature_input,
                                           head_vocab=64 if feature_input == "deep" else None), name="code")
    draft.init_from_target()
    if draft.vocab_ids is not None:
        draft.set_vocab(torch.randperm(256)[:64])
    report = evaluate_draft(target, None, draft, prompts(), max_new_tokens=16, gamma=5, blocks=(2, 5))
    assert set(report["spec"]) == {"block2", "block5"}
    for entry in report["spec"].values():
        assert entry["outputs_equal_ar"] == 3  # greedy speculative decoding reproduces AR exactly
        assert entry["perplexity"] == pytest.approx(report["ar"]["perplexity"], rel=1e-6)
        assert 1 <= len(entry["acceptance_by_position"]) <= 5  # positions past every round's first rejection: absent
        assert 1.0 <= entry["mean_accepted_length"] <= 6.0 and entry["tokens_per_s"] > 0
    # Greedy: the accepted prefix does not depend on how the round is cut into verify blocks.
    assert report["spec"]["block2"]["mean_accepted_length"] == report["spec"]["block5"]["mean_accepted_length"]
    assert report["mean_accepted_length"] == report["spec"]["block5"]["mean_accepted_length"]
    assert 3 <= report["ar"]["tokens"] <= 48


def test_a_draft_that_is_the_target_accepts_everything(target):
    """All layers shared, no adapters, the plain head tied to lm_head: the draft's argmax is the target's."""
    draft = DraftModel(target, DraftConfig(shared_layers=4, adapter_layers=0, head="mlp_tied"), name="same")
    draft.init_from_target()
    report = evaluate_draft(target, None, draft, prompts(2), max_new_tokens=13, blocks=(5,), include_ar=False,
                            quality=False)
    assert report["acceptance_rate"] == 1.0 and report["acceptance_by_position"] == [1.0] * 5


def test_perplexity_matches_a_direct_computation(target):
    prompt, completion = [5, 6, 7], [8, 9]
    logits = target(torch.tensor([prompt + completion]), torch.arange(5)[None]).logits[0].float()
    logp = torch.log_softmax(logits, -1)
    expected = torch.exp(-(logp[2, 8] + logp[3, 9]) / 2)
    assert perplexity(target, [prompt], [completion]) == pytest.approx(float(expected), rel=1e-5)


class ByteTokenizer:
    def __call__(self, texts, add_special_tokens=True):
        assert add_special_tokens is False  # prompts are already chat-templated
        return {"input_ids": [list(t.encode()) for t in texts]}


def test_held_out_prompts_sample_the_split_and_skip_overlong_ones(tmp_path):
    rows = {"doc_id": ["a", "b", "c"], "source": ["s"] * 3, "license": ["MIT"] * 3, "text": ["t"] * 3,
            "messages": [[{"role": "user", "content": "x"}]] * 3, "prompt": ["short", "tiny", "x" * 100]}
    split = datasets.Dataset.from_dict(rows)
    datasets.DatasetDict({"train": split, "validation": split, "test": split}).save_to_disk(str(tmp_path / "code"))
    got = held_out_prompts("code", ByteTokenizer(), 5, "validation", max_prompt_tokens=10, data_dir=tmp_path)
    assert sorted(got) == sorted([list(b"short"), list(b"tiny")])
    with pytest.raises(ValueError, match="at most 2 tokens"):
        held_out_prompts("code", ByteTokenizer(), 5, "validation", max_prompt_tokens=2, data_dir=tmp_path)


def test_domain_matrix_measures_every_pair(target):
    from bench.domains import domain_matrix, format_table

    drafts = {}
    for name, n in (("code", 1), ("dialog", 4)):
        drafts[name] = DraftModel(target, DraftConfig(shared_layers=n, adapter_layers=4 - n, head="mlp_tied"), name=name)
        drafts[name].init_from_target()
    table = domain_matrix(target, None, drafts, {"code": prompts(1), "dialog": prompts(2)}, max_new_tokens=11)
    assert set(table) == {"code", "dialog"} and all(set(row) == {"code", "dialog"} for row in table.values())
    assert table["dialog"]["code"] == 6.0  # all 4 layers in the draft: the target itself, every draft accepted
    text = format_table(table, ["code", "dialog"])
    assert "**6.000**" in text and "matched/best-other on code" in text

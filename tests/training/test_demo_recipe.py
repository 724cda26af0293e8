"""The demo recipe's benchmark-shaped prompts: appended to the training rows, their replies merged."""

from __future__ import annotations

import pytest

from drafts.store import shipped_drafts_dir
from training.demo_recipe import DEMO, Rows, start_shape, with_shaped
from training.distill import TrainError, domain_sequences


def test_shaped_prompts_join_the_rows_and_train_on_the_targets_replies(tiny):
    tok = tiny.make_tokenizer(50)
    rows = Rows(prompt=["w2 w3", "w4 w5"], text=["w6 w7", "w8"])
    replies, sampled = {"w2 w3": [9, 10]}, [{"w2 w3": [11]}]
    shaped = {"prompt": ["w20 w21 w22", "w23"]}
    shaped_replies, shaped_sampled = {"w20 w21 w22": [30, 31], "w23": [32]}, [{"w23": [33, 34]}]
    merged, all_replies, all_sampled = with_shaped(rows, shaped, replies, sampled, shaped_replies, shaped_sampled)
    assert list(merged["prompt"]) == ["w2 w3", "w4 w5", "w20 w21 w22", "w23"] and merged.column_names == ["prompt", "text"]
    assert all_replies == {**replies, **shaped_replies} and all_sampled == [{"w2 w3": [11], "w23": [33, 34]}]
    data = domain_sequences(merged, tok, seq_len=16, responses=all_replies, extra_responses=all_sampled)
    assert [20, 21, 22, 30, 31] in data.sequences and [23, 32] in data.sequences and [23, 33, 34] in data.sequences
    assert with_shaped(rows, None, replies, sampled, {}, []) == (rows, replies, sampled)  # nothing exported


def test_init_from_a_store_fine_tunes_each_domains_active_draft_in_its_own_shape(tmp_path):
    shipped = shipped_drafts_dir()
    assert start_shape(DEMO, None, "code") is DEMO
    code = start_shape(DEMO, shipped, "code")
    active = (shipped / "code" / "ACTIVE").read_text().strip()
    assert code["init_from"] == str(shipped / "code" / active) and code["feature_layers"] == [10, 20]
    general = start_shape(DEMO, shipped, "general")  # trained before mid-layer features: none, kept so
    assert general["feature_layers"] == [] and general["head_vocab"] == 8192 and general["shared_layers"] == 3
    with pytest.raises(TrainError, match="not a draft checkpoint folder"):
        start_shape(DEMO, tmp_path, "code")

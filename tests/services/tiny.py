"""A tiny random Llama target saved as a Hugging Face folder, and the draft factory the test app loads.

The draft factory is named in the app config (`draft_source: tiny:build_draft`), so Generator
replicas build the same drafts as the test process: a version's weights are a function of
(domain, version). Versions starting with 'bad' fail to load; 'nan' ones load with corrupt weights.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import torch

from drafts.config import DraftConfig
from drafts.model import DraftModel

# Adapters start as the target's layers 1..3 and the tied head as its lm_head: version "v1" is an exact
# copy of the target's computation (every draft token accepted); other versions add seeded noise.
DRAFT_CONFIG = DraftConfig(shared_layers=1, adapter_layers=3, head="mlp_tied")


def save_tiny_target(folder: Path) -> Path:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from engine.loading import resolve_model_dir

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_dir("default")))
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, rms_norm_eps=1e-5,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # larger weights than HF's init: peaked, varied next-token choices
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3)
    model.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    return folder


def build_draft(target, domain: str, version: str) -> DraftModel:
    if version.startswith("bad"):
        raise ValueError(f"checkpoint for {domain}/{version} is truncated")
    torch.manual_seed(zlib.crc32(f"{domain}/{version}".encode()))
    draft = DraftModel(target, DRAFT_CONFIG, name=domain, version=version)
    draft.init_from_target()
    if version != "v1":
        with torch.no_grad():
            draft.head.fc2.weight.normal_(0.0, 0.5)
    if version.startswith("nan"):
        with torch.no_grad():
            draft.head.fc2.weight.fill_(float("nan"))
    return draft

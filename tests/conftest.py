"""Shared fixtures: tiny random Llama-family models, saved the way Hugging Face saves them.

Weights are re-drawn at a scale that gives logits of order 1-3 (transformers' own init gives
near-zero logits, against which any parity check would pass), norms and biases included.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)  # the test machines' cores are shared

VOCAB = 128
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=512)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32, "rope_theta": 10000.0}


def drive(engine, actions: dict, max_steps: int = 80) -> tuple[dict, dict]:
    """Step `engine` until it has no work: before step i, `actions[i](engine)` if given. Returns each request's
    tokens and the step at which it first produced one."""
    got: dict[str, list[int]] = {}
    first: dict[str, int] = {}
    for step in range(max_steps):
        if step in actions:
            actions[step](engine)
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.token_ids)
            first.setdefault(out.request_id, step)
        if not engine.has_work():
            break
    return got, first


def make_tokenizer(vocab_size: int):
    """A word-level tokenizer: id 0 = `<eos>`, 1 = `<unk>`, id i >= 2 = the word `w{i}`; decode joins with spaces."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": 0, "<unk>": 1, **{f"w{i}": i for i in range(2, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")


def randomize_(module: torch.nn.Module, seed: int, head_scale: float = 2.0) -> None:
    """Redraw every parameter: linear weights ~ N(0, 1/fan_in), embeddings ~ N(0, 1), norms ~ U(0.7, 1.3), biases ~ N(0, 0.2)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name:
                p.copy_(0.7 + 0.6 * torch.rand(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                scale = head_scale if "lm_head" in name else 1.0
                p.copy_(scale * torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)


def make_hf_model(model_type: str, vocab_size: int = VOCAB, seed: int = 0, **overrides):
    """A transformers *ForCausalLM of `model_type` (llama, mistral, qwen2) with tiny shapes and random weights."""
    from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                              Qwen2ForCausalLM)

    classes = {"llama": (LlamaConfig, LlamaForCausalLM), "mistral": (MistralConfig, MistralForCausalLM),
               "qwen2": (Qwen2Config, Qwen2ForCausalLM)}
    config_cls, model_cls = classes[model_type]
    kwargs = dict(TINY, vocab_size=vocab_size, eos_token_id=None, bos_token_id=None, pad_token_id=None,
                  tie_word_embeddings=False)
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kwargs))
    randomize_(model, seed)
    if model.config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    return model.float().eval()


def save_hf(model, path: Path, **save_kwargs) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True, **save_kwargs)
    make_tokenizer(model.config.vocab_size).save_pretrained(path)
    return path


# name -> (model_type, config overrides). GQA everywhere (4 query heads, 2 KV heads).
PARITY_MODELS = {
    "llama_untied": ("llama", {}),
    "llama_tied_llama3_rope": ("llama", {"tie_word_embeddings": True, "rope_parameters": LLAMA3_ROPE}),
    "mistral": ("mistral", {"sliding_window": None, "rope_theta": 50000.0}),
    "qwen2_qkv_bias": ("qwen2", {"tie_word_embeddings": True, "use_sliding_window": False}),
}


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory):
    """name -> (folder saved with save_pretrained, the transformers model), built once per session."""
    root = tmp_path_factory.mktemp("hf_models")
    out = {}
    for i, (name, (model_type, overrides)) in enumerate(PARITY_MODELS.items()):
        model = make_hf_model(model_type, seed=100 + i, **overrides)
        out[name] = (save_hf(model, root / name), model)
    return out


@pytest.fixture(scope="session")
def tiny_target(hf_models):
    """The engine's own Transformer for the untied Llama, loaded through load_model, plus its tokenizer."""
    from engine.loading import load_model

    loaded = load_model(str(hf_models["llama_untied"][0]), dtype="float32")
    return loaded


def tiny_vocab_target(vocab_size: int = 8, num_layers: int = 3, seed: int = 7):
    """An engine Transformer with a tiny vocabulary (distributions small enough to enumerate)."""
    from engine.config import ModelArgs
    from engine.model import Transformer

    args = ModelArgs(model_type="llama", vocab_size=vocab_size, hidden_size=32, intermediate_size=64,
                     num_layers=num_layers, num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=128)
    torch.manual_seed(seed)
    model = Transformer(args, max_seq_len=128)
    randomize_(model, seed, head_scale=1.0)
    return model.float().eval().requires_grad_(False)


@pytest.fixture(scope="session")
def tiny():
    """The helpers above, for test modules (conftest is not importable by name from every test folder)."""
    return types.SimpleNamespace(make_tokenizer=make_tokenizer, randomize_=randomize_, make_hf_model=make_hf_model,
                                 save_hf=save_hf, tiny_vocab_target=tiny_vocab_target, PARITY_MODELS=PARITY_MODELS,
                                 VOCAB=VOCAB)


_LOOP_PROBE = """
import torch, triton, triton.language as tl
@triton.jit
def k(O, N):
    acc = 0
    for i in range(0, N):
        acc += 1
    tl.store(O, acc)
o = torch.zeros(1, dtype=torch.int64)
k[(1,)](o, 3)
assert int(o) == 3
"""


@functools.lru_cache(maxsize=1)
def _interpreter_problem() -> str | None:
    """Why Triton's interpreter cannot run the kernels here (None: it can). Triton 3.6's interpreter hands a kernel
    its runtime scalars as 1-element arrays, which numpy 2.4 no longer converts to a loop bound."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", _LOOP_PROBE], env=env, capture_output=True, text=True, timeout=300)
    if done.returncode == 0:
        return None
    import numpy
    import triton

    last = (done.stderr.strip().splitlines() or ["no error output"])[-1][:160]
    return (f"Triton {triton.__version__}'s interpreter cannot loop over a runtime bound with numpy {numpy.__version__} "
            f"({last}); pip install 'numpy<2.4' runs these tests")


@pytest.fixture
def triton_interpreter():
    """run(code): the script in a fresh process under Triton's CPU interpreter (it must be switched on before
    triton is imported), from the repository root; the script prints "ok" last. Skips without triton, and
    where the interpreter cannot run the kernels (says why)."""
    from engine.triton_kernels import available

    if not available():
        pytest.skip("needs the triton package")
    problem = _interpreter_problem()
    if problem:
        pytest.skip(problem)

    def run(code: str, timeout: int = 900) -> None:
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout,
                              cwd=Path(__file__).resolve().parents[1])
        assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]

    return run

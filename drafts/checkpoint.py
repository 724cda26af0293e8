"""Draft checkpoints: the draft's own tensors (safetensors) + a manifest that ties them to one target.

A checkpoint folder holds `draft.safetensors` (adapters, fusion, output norm, head, sub-vocabulary
ids; never the trunk, which is the target's) and `manifest.json` (domain, version, target
fingerprint, draft config, training summary, eval metrics, tensor list, sha256 of the weights).
`load_draft` checks everything before it builds the draft, and returns only a fully loaded one.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from drafts.config import DraftConfig
from drafts.model import DraftModel
from engine.loading import sha256_file
from engine.model import Transformer

FORMAT_VERSION = 1
WEIGHTS = "draft.safetensors"
MANIFEST = "manifest.json"
_FINGERPRINT_SAMPLES = 256


class DraftLoadError(RuntimeError):
    """A draft checkpoint cannot be used with this target; the message says what differs and what to do."""


def target_fingerprint(model: Transformer) -> str:
    """sha256 of the target's shape and a fixed sample of its weights.

    Values are rounded to bfloat16 first, so an fp32 load on CPU and a bf16 load on GPU of the same
    checkpoint give the same fingerprint (fp32 -> bf16 rounding is deterministic).
    """
    digest = hashlib.sha256(json.dumps(model.args.to_dict(), sort_keys=True, default=str).encode())
    sampled = [
        ("embed_tokens", model.embed_tokens.weight),
        ("layers.0.q_proj", model.layers[0].self_attn.q_proj.weight),
        ("layers.-1.down_proj", model.layers[-1].mlp.down_proj.weight),
        ("norm", model.norm.weight),
    ]
    for name, weight in sampled:
        flat = weight.detach().reshape(-1)
        stride = max(1, flat.numel() // _FINGERPRINT_SAMPLES)
        values = flat[::stride][:_FINGERPRINT_SAMPLES].to(torch.bfloat16).float().cpu()
        digest.update(name.encode())
        digest.update(values.numpy().tobytes())
    return digest.hexdigest()


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()


def save_draft(
    draft: DraftModel,
    out_dir: str | Path,
    domain: str,
    version: str,
    training: dict[str, Any] | None = None,
    metrics: dict[str, Any] | None = None,
    dtype: torch.dtype = torch.float16,
) -> Path:
    """Write `draft.safetensors` + `manifest.json` into out_dir; returns out_dir.

    Floating tensors are stored as `dtype` (fp16 by default); integer buffers (vocab_ids) as they are.
    Files are written under temporary names and renamed, so a reader never sees a half-written file.
    """
    out_dir = Path(out_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OSError(f"cannot create draft folder {out_dir}: {exc}; choose a writable folder") from exc
    tensors = {
        name: (t.detach().to(dtype) if t.is_floating_point() else t.detach()).cpu().contiguous()
        for name, t in draft.state_dict().items()
    }
    weights = out_dir / WEIGHTS
    tmp_weights = out_dir / f".{WEIGHTS}.tmp-{os.getpid()}"
    save_file(tensors, str(tmp_weights), metadata={"format": "pt", "domain": domain, "version": version})
    manifest = {
        "format_version": FORMAT_VERSION,
        "domain": domain,
        "version": version,
        "created": _now(),
        "target_fingerprint": target_fingerprint(draft.target),
        "target_args": {k: v for k, v in draft.target.args.to_dict().items() if k in ("model_type", "num_layers", "hidden_size", "vocab_size")},
        "draft_config": draft.config.to_dict(),
        "training": training or {},
        "metrics": metrics or {},
        "tensors": {name: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")} for name, t in tensors.items()},
        "weights_file": WEIGHTS,
        "weights_sha256": sha256_file(tmp_weights),
    }
    tmp_manifest = out_dir / f".{MANIFEST}.tmp-{os.getpid()}"
    tmp_manifest.write_text(json.dumps(manifest, indent=2, sort_keys=True, default=str) + "\n")
    os.replace(tmp_weights, weights)
    os.replace(tmp_manifest, out_dir / MANIFEST)
    return out_dir


def version_folder(path: str | Path) -> Path:
    """A draft's version folder from a path that names it or a store's domain folder (then its ACTIVE version)."""
    folder = Path(path)
    active = folder / "ACTIVE"
    if active.is_file() and not (folder / MANIFEST).is_file():
        return folder / active.read_text().strip()
    return folder


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The manifest of a checkpoint folder; DraftLoadError if missing, unreadable or of another format."""
    folder = Path(path)
    file = folder / MANIFEST
    if not file.is_file():
        raise DraftLoadError(f"{folder} has no {MANIFEST}: not a draft checkpoint folder (expected {MANIFEST} + {WEIGHTS}, "
                             "or a store's domain folder with an ACTIVE file)")
    try:
        manifest = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DraftLoadError(f"{file} is not valid JSON ({exc}); the checkpoint is corrupt: re-publish or re-train it") from exc
    if not isinstance(manifest, dict):
        raise DraftLoadError(f"{file} is not a JSON object; the checkpoint is corrupt: re-publish or re-train it")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise DraftLoadError(
            f"{file} has format_version {version!r}; this version of FlashSpec reads format {FORMAT_VERSION}: "
            "re-train the draft or use the FlashSpec release that wrote it"
        )
    missing = [k for k in ("domain", "version", "target_fingerprint", "draft_config", "tensors", "weights_sha256") if k not in manifest]
    if missing:
        raise DraftLoadError(f"{file} lacks {', '.join(missing)}; the checkpoint is corrupt: re-publish or re-train it")
    return manifest


def load_draft(path: str | Path, target_model: Transformer, name: str | None = None) -> DraftModel:
    """Load a checkpoint folder (or a store's domain folder: its ACTIVE version) onto `target_model` (its device and
    dtype); raises DraftLoadError on any mismatch."""
    folder = version_folder(path)
    manifest = read_manifest(folder)
    weights = folder / manifest.get("weights_file", WEIGHTS)
    if not weights.is_file():
        raise DraftLoadError(f"{weights} is missing (listed in {folder / MANIFEST}); re-publish or re-train the draft")
    actual = sha256_file(weights)
    if actual != manifest["weights_sha256"]:
        raise DraftLoadError(
            f"{weights} has sha256 {actual[:16]}..., the manifest says {manifest['weights_sha256'][:16]}...: "
            "the weights file is corrupt or was replaced; re-publish or re-train the draft"
        )
    fingerprint = target_fingerprint(target_model)
    if fingerprint != manifest["target_fingerprint"]:
        trained = manifest.get("target_args", {})
        here = {k: v for k, v in target_model.args.to_dict().items() if k in trained}
        raise DraftLoadError(
            f"draft {folder} was trained for another target (fingerprint {manifest['target_fingerprint'][:12]}, "
            f"target shape {trained}); this target has fingerprint {fingerprint[:12]} ({here}). Load the target it "
            f"was trained for, or train a draft for this one: flashspec train-draft --domain {manifest['domain']} --target ..."
        )
    try:
        config = DraftConfig.from_dict(manifest["draft_config"])
        draft = DraftModel(target_model, config, name=name or manifest["domain"], version=str(manifest["version"]))
    except (TypeError, ValueError) as exc:
        raise DraftLoadError(f"{folder / MANIFEST} has a draft_config this target cannot build: {exc}") from exc
    try:
        tensors = load_file(str(weights))
    except (SafetensorError, OSError, ValueError) as exc:
        raise DraftLoadError(f"cannot read {weights}: {exc}; the file is corrupt: re-publish or re-train the draft") from exc
    expected = draft.state_dict()
    problems = _compare(expected, tensors)
    listed = {k: tuple(v["shape"]) for k, v in manifest["tensors"].items()}
    if listed != {k: tuple(v.shape) for k, v in tensors.items()}:
        problems.append("the manifest's tensor list does not match the weights file")
    if problems:
        raise DraftLoadError(
            f"draft {folder} does not fit a {config.to_dict()} draft on this target: " + "; ".join(problems[:6])
            + ("; ..." if len(problems) > 6 else "") + ". Re-train the draft for this target and config."
        )
    # Everything checked: convert to the target's device and dtype and fill the new draft.
    state = {k: tensors[k].to(device=v.device, dtype=v.dtype) for k, v in expected.items()}
    draft.load_state_dict(state, strict=True)
    draft.head._sub_weight = None
    draft.requires_grad_(False)
    from engine.cpu_linear import pack_linears

    pack_linears(draft)  # its own layers only: the trunk is the target's (packed, if at all, when it was loaded)
    return draft.eval()


def _compare(expected: dict[str, torch.Tensor], found: dict[str, torch.Tensor]) -> list[str]:
    problems = []
    missing = sorted(set(expected) - set(found))
    extra = sorted(set(found) - set(expected))
    if missing:
        problems.append(f"missing tensors {missing[:4]}")
    if extra:
        problems.append(f"unexpected tensors {extra[:4]}")
    for name in sorted(set(expected) & set(found)):
        if tuple(expected[name].shape) != tuple(found[name].shape):
            problems.append(f"{name} has shape {tuple(found[name].shape)}, expected {tuple(expected[name].shape)}")
        elif expected[name].is_floating_point() != found[name].is_floating_point():
            problems.append(f"{name} has dtype {found[name].dtype}, expected a {expected[name].dtype}-like tensor")
    return problems

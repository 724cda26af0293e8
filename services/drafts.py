"""Where the Generator's drafts come from, and how a new draft version is checked before it serves."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Callable

import torch

DraftFactory = Callable[[object, str, str], object]  # (target model, domain, version) -> draft


class DraftRefused(ValueError):
    """A draft version that cannot serve (missing, corrupt, incompatible); the old one keeps serving."""


def import_factory(path: str) -> DraftFactory:
    """'package.module:function' -> the function."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ValueError(f"draft_source {path!r} must look like 'package.module:function'")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"draft_source {path!r} cannot be imported: {exc}") from exc


def store_factory(store_root: str | None) -> DraftFactory:
    """Load versions from the draft store (user store first, then the shipped demo drafts)."""

    def load(target, domain: str, version: str):
        from drafts.checkpoint import DraftLoadError, load_draft
        from drafts.store import DraftStore, resolve_draft

        try:
            if version in ("latest", ""):
                path = resolve_draft(domain, store_root=store_root)
                if path is None:
                    raise DraftRefused(f"no draft for domain {domain!r} in the store or the demo drafts; "
                                       f"train one or remove {domain!r} from user_config.drafts")
            else:
                root = Path(store_root) if store_root else None
                store = DraftStore(root) if root is not None else DraftStore(_default_store_root())
                path = store.resolve(domain, version)
            return load_draft(path, target, name=domain)
        except DraftLoadError as exc:
            raise DraftRefused(f"draft {domain}/{version} cannot be loaded: {exc}") from exc
        except (FileNotFoundError, KeyError, LookupError) as exc:
            raise DraftRefused(f"draft {domain}/{version} is not in the store: {exc}; "
                               f"list versions with `flashspec drafts list`") from exc

    return load


def _default_store_root() -> Path:
    from engine.loading import flashspec_home

    return flashspec_home() / "store"


def check_draft(draft, target, domain: str, version: str) -> None:
    """Refuse a draft that does not fit the target or produces non-finite scores (a cheap smoke test)."""
    for attr in ("shared_layers", "adapter_layers", "feature_input", "adapters_forward", "head_logits"):
        if not hasattr(draft, attr):
            raise DraftRefused(f"draft {domain}/{version} is not a draft model (no {attr})")
    if draft.shared_layers > target.args.num_layers:
        raise DraftRefused(f"draft {domain}/{version} shares {draft.shared_layers} layers; "
                           f"the target has {target.args.num_layers}")
    if hasattr(draft, "forward_train"):
        with torch.inference_mode():
            weight = target.embed_tokens.weight
            tokens = torch.arange(4, device=weight.device)[None]  # (1, 4)
            pos = torch.arange(4, device=weight.device)[None]
            trunk = target(tokens, pos, layers=range(0, draft.shared_layers), compute_logits=False).hidden
            feats = torch.zeros_like(trunk) if draft.feature_input == "deep" else None
            scores, _ = draft.forward_train(trunk, feats, pos)
        if not torch.isfinite(scores.float()).all():
            raise DraftRefused(f"draft {domain}/{version} produces non-finite scores: its weights are corrupt")


def load_checked(factory: DraftFactory, target, domain: str, version: str):
    """The draft for (domain, version), or DraftRefused saying why not."""
    try:
        draft = factory(target, domain, version)
    except DraftRefused:
        raise
    except Exception as exc:  # any loader failure refuses the version; the old one keeps serving
        raise DraftRefused(f"draft {domain}/{version} cannot be loaded: {type(exc).__name__}: {exc}") from exc
    check_draft(draft, target, domain, version)
    if hasattr(draft, "version"):
        try:
            draft.version = version
        except AttributeError:
            pass
    return draft

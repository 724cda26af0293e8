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
    """Load versions from the draft store: the user's store first, then the shipped demo drafts.

    Version 'latest' (or 'active') means the domain's ACTIVE version there.
    """

    def load(target, domain: str, version: str):
        from drafts.checkpoint import DraftLoadError, load_draft
        from drafts.store import DraftStore, StoreError, default_store_root, resolve_draft, shipped_drafts_dir

        root = Path(store_root).expanduser() if store_root else default_store_root()
        try:
            if version in ("latest", "active"):
                path = resolve_draft(domain, store_root=root)
                if path is None:
                    raise DraftRefused(f"no active {domain!r} draft in {root} nor in the shipped demo drafts; "
                                       f"publish and activate one, or leave {domain!r} out of user_config.drafts")
            else:
                stores = [DraftStore(root, read_only=True), DraftStore(shipped_drafts_dir(), read_only=True)]
                found = [s.domain_dir(domain) / version for s in stores if version in s.versions(domain)]
                if not found:
                    known = sorted({v for s in stores for v in s.versions(domain)})
                    raise DraftRefused(f"domain {domain!r} has no version {version!r} in {root} nor in the demo "
                                       f"drafts; versions: {', '.join(known) or 'none'}")
                path = found[0]
            return load_draft(path, target, name=domain)
        except (DraftLoadError, StoreError) as exc:
            raise DraftRefused(f"draft {domain}/{version} cannot be loaded: {exc}") from exc

    return load


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
            feats = None
            if draft.feature_input == "deep":
                feats = torch.zeros_like(trunk)
                layers = getattr(draft, "feature_layers", ())
                if layers:  # through the feature projection too: its weights are checked as well
                    feats = draft.target_features(feats, [feats] * len(layers))
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
    return draft

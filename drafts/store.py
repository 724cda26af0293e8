"""The draft store: versioned checkpoints per domain, an ACTIVE pointer each, gated activation, rollback.

Layout (the shipped demo drafts use the same one, read-only):

    <root>/<domain>/<version>/manifest.json, draft.safetensors
    <root>/<domain>/ACTIVE           the active version's name (written atomically: temp file + rename)
    <root>/<domain>/history.json     previously active versions (a stack, for rollback) and a log

Every write goes under `<root>/<domain>/`: changing one domain never touches another's folder.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from drafts.checkpoint import MANIFEST, DraftLoadError, read_manifest, save_draft
from drafts.model import DraftModel

DOMAINS = ("code", "general", "dialog")
GATE_METRIC = "mean_accepted_length"
_VERSION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class StoreError(RuntimeError):
    """A store operation cannot be done; the message says why and what to do."""


@dataclasses.dataclass(frozen=True)
class Activation:
    """Outcome of `DraftStore.activate`."""

    domain: str
    version: str
    activated: bool
    previous: str | None
    message: str


def check_domain(domain: str) -> str:
    if domain not in DOMAINS:
        raise StoreError(f"unknown domain {domain!r}; valid domains: {', '.join(DOMAINS)}")
    return domain


def _utc_version() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%d-%H%M%S")


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


class DraftStore:
    def __init__(self, root: str | Path, read_only: bool = False) -> None:
        self.root = Path(root).expanduser()
        self.read_only = read_only

    def __repr__(self) -> str:
        return f"DraftStore({str(self.root)!r}{', read_only=True' if self.read_only else ''})"

    # ----- reading ------------------------------------------------------------------------
    def domain_dir(self, domain: str) -> Path:
        return self.root / check_domain(domain)

    def versions(self, domain: str) -> list[str]:
        """Published versions of a domain, oldest first (by manifest creation time, then name)."""
        folder = self.domain_dir(domain)
        if not folder.is_dir():
            return []
        found = []
        for child in folder.iterdir():
            if child.is_dir() and not child.name.startswith(".") and (child / MANIFEST).is_file():
                try:
                    created = read_manifest(child).get("created", "")
                except DraftLoadError:
                    created = ""
                found.append((created, child.name))
        return [name for _, name in sorted(found)]

    def manifest(self, domain: str, version: str) -> dict[str, Any]:
        folder = self.domain_dir(domain) / version
        if not folder.is_dir():
            raise StoreError(f"domain {domain!r} has no version {version!r} in {self.root}; versions: {', '.join(self.versions(domain)) or 'none'}")
        try:
            return read_manifest(folder)
        except DraftLoadError as exc:
            raise StoreError(str(exc)) from exc

    def active(self, domain: str) -> str | None:
        pointer = self.domain_dir(domain) / "ACTIVE"
        if not pointer.is_file():
            return None
        version = pointer.read_text().strip()
        return version or None

    def resolve(self, domain: str) -> Path | None:
        """The active version's folder, or None when the domain has no active draft."""
        version = self.active(domain)
        if version is None:
            return None
        folder = self.domain_dir(domain) / version
        if not (folder / MANIFEST).is_file():
            raise StoreError(f"{self.domain_dir(domain) / 'ACTIVE'} points to {version!r}, which is not in the store; "
                             f"activate a published version: {', '.join(self.versions(domain)) or 'none'}")
        return folder

    def history(self, domain: str) -> dict[str, list]:
        file = self.domain_dir(domain) / "history.json"
        if not file.is_file():
            return {"previous": [], "log": []}
        try:
            data = json.loads(file.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise StoreError(f"{file} is unreadable ({exc}); fix or delete it (it only holds rollback history)") from exc
        return {"previous": list(data.get("previous", [])), "log": list(data.get("log", []))}

    # ----- writing ------------------------------------------------------------------------
    def check_writable(self, domain: str) -> Path:
        folder = self.domain_dir(domain)
        if self.read_only:
            raise StoreError(f"store {self.root} is read-only (the shipped demo drafts); publish to your own store, "
                             "e.g. --store $FLASHSPEC_HOME/store")
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot create {folder}: {exc.strerror or exc}; choose a store folder you can write "
                             "(--store DIR) or fix its permissions") from exc
        if not os.access(folder, os.W_OK | os.X_OK):
            raise StoreError(f"no write permission on {folder}; choose a store folder you can write (--store DIR) "
                             "or fix its permissions")
        return folder

    def publish(self, draft: DraftModel, domain: str, version: str | None = None, training: dict | None = None,
                metrics: dict | None = None, dtype: torch.dtype = torch.float16) -> Path:
        """Write a new version (not activated); returns its folder. Auto version: UTC timestamp."""
        folder = self.check_writable(domain)
        if version is None:
            version = _utc_version()
            base, n = version, 1
            while (folder / version).exists():
                n += 1
                version = f"{base}-{n}"
        if not _VERSION_RE.match(version) or version in ("ACTIVE", "history.json"):
            raise StoreError(f"invalid version name {version!r}: use letters, digits, '.', '_' and '-' (at most 64)")
        final = folder / version
        if final.exists():
            raise StoreError(f"{domain} version {version!r} already exists in {self.root}; choose another --version")
        tmp = folder / f".tmp-{version}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            save_draft(draft, tmp, domain, version, training=training, metrics=metrics, dtype=dtype)
            os.replace(tmp, final)
        except OSError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            raise StoreError(f"cannot write {final}: {exc}; check free space and permissions of {folder}") from exc
        self._log(domain, "publish", version)
        return final

    def activate(self, domain: str, version: str, gate: bool = True, tolerance: float = 0.05, force: bool = False,
                 fallback: "DraftStore | None" = None) -> Activation:
        """Point ACTIVE at `version` if the gate passes: its mean accepted length >= the active's - tolerance.

        With no active version here, the gate compares with `fallback`'s active draft (the shipped demo
        drafts, which serve the domain until then) when it was trained for the same target.
        """
        folder = self.check_writable(domain)
        candidate = self.manifest(domain, version)
        current = self.active(domain)
        if current == version:
            return Activation(domain, version, True, current, f"{domain}: {version} is already active")
        baseline = self._baseline(domain, current, candidate, fallback)
        if gate and not force and baseline is not None:
            label, old = baseline
            new = candidate.get("metrics", {}).get(GATE_METRIC)
            if new is None:
                return Activation(domain, version, False, current,
                                  f"{domain}: refused {version}: its manifest has no {GATE_METRIC} to compare with "
                                  f"the active {label} ({old:.3f}); evaluate it first or use --force")
            if new < old - tolerance:
                return Activation(domain, version, False, current,
                                  f"{domain}: refused {version}: {GATE_METRIC} {new:.3f} < active {label} "
                                  f"{old:.3f} - tolerance {tolerance:.3f}; keep {label} (use --force to override)")
        history = self.history(domain)
        if current is not None:
            history["previous"].append(current)
        _write_atomic(folder / "ACTIVE", version + "\n")
        self._write_history(domain, history, "activate" + (" (forced)" if force else ""), version)
        new = candidate.get("metrics", {}).get(GATE_METRIC)
        shown = f" ({GATE_METRIC} {new:.3f})" if isinstance(new, (int, float)) else ""
        return Activation(domain, version, True, current, f"{domain}: activated {version}{shown}; previous: {current or 'none'}")

    def _baseline(self, domain: str, current: str | None, candidate: dict, fallback: "DraftStore | None"):
        """(label, mean accepted length) of the draft serving the domain now, or None if there is none to beat."""
        try:
            if current is not None:
                manifest, label = self.manifest(domain, current), current
            elif fallback is not None and fallback.active(domain) is not None:
                shipped = fallback.active(domain)
                manifest, label = fallback.manifest(domain, shipped), f"shipped {shipped}"
                if manifest.get("target_fingerprint") != candidate.get("target_fingerprint"):
                    return None  # made for another target: it does not serve this one
            else:
                return None
        except StoreError:
            return None  # the active version is gone or broken: anything valid beats it
        old = manifest.get("metrics", {}).get(GATE_METRIC)
        return None if old is None else (label, float(old))

    def rollback(self, domain: str) -> str:
        """Re-activate the previously active version; returns it."""
        folder = self.check_writable(domain)
        history = self.history(domain)
        available = set(self.versions(domain))
        while history["previous"]:
            version = history["previous"].pop()
            if version in available:
                _write_atomic(folder / "ACTIVE", version + "\n")
                self._write_history(domain, history, "rollback", version)
                return version
        raise StoreError(f"{domain}: nothing to roll back to in {self.root} (no earlier active version); "
                         f"activate one explicitly: {', '.join(sorted(available)) or 'none published'}")

    def _write_history(self, domain: str, history: dict, action: str, version: str) -> None:
        history["log"].append({"time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                               "action": action, "version": version})
        _write_atomic(self.domain_dir(domain) / "history.json", json.dumps(history, indent=2) + "\n")

    def _log(self, domain: str, action: str, version: str) -> None:
        self._write_history(domain, self.history(domain), action, version)


def shipped_drafts_dir() -> Path:
    """The demo drafts committed with the package: `drafts/demo/<domain>/<version>/` + ACTIVE."""
    return Path(__file__).resolve().parent / "demo"


def default_store_root() -> Path:
    from engine.loading import flashspec_home

    return flashspec_home() / "store"


def resolve_draft(domain: str, store_root: str | Path | None = None) -> Path | None:
    """The draft folder to serve for a domain: the user's store's active version, else the shipped one."""
    check_domain(domain)
    user = DraftStore(store_root if store_root is not None else default_store_root(), read_only=True)
    found = user.resolve(domain)
    if found is not None:
        return found
    return DraftStore(shipped_drafts_dir(), read_only=True).resolve(domain)

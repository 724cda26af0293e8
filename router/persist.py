"""Safe persistence of the router pipeline: skops (no pickle) with an explicit trusted-type list,
plus a JSON manifest beside it (classes, metrics, library versions, checksum)."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import zipfile
from pathlib import Path

import sklearn
import skops
import skops.io as sio
from sklearn.pipeline import Pipeline

from router.data import DOMAINS
from router.errors import RouterLoadError

FORMAT_VERSION = 1

# Types the loader accepts beyond skops' built-in safe set. Anything else in a file is refused.
TRUSTED_TYPES = (
    "router.features.CompactTfidfVectorizer",
    "router.features.ShapeFeatures",
    "router.features.text_body",
    "sklearn.calibration._CalibratedClassifier",
    "sklearn.calibration._SigmoidCalibration",
)

RETRAIN = "retrain it with `flashspec train-router --out {path}`"


def manifest_path(model_path: str | Path) -> Path:
    path = Path(model_path)
    return path.with_name(path.stem + ".manifest.json")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def save_pipeline(pipeline: Pipeline, path: str | Path, metrics: dict | None = None,
                  extra: dict | None = None) -> dict:
    """Write `path` (skops) and `<stem>.manifest.json`; returns the manifest."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sio.dump(pipeline, path, compression=zipfile.ZIP_DEFLATED, compresslevel=9)
    manifest = {
        "format_version": FORMAT_VERSION,
        "classes": [str(c) for c in pipeline.classes_],
        "metrics": metrics or {},
        "sklearn_version": sklearn.__version__,
        "skops_version": skops.__version__,
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "sha256": _sha256(path),
        **(extra or {}),
    }
    manifest_path(path).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


def _minor(version: str) -> tuple[str, ...]:
    return tuple(version.split(".")[:2])


def load_manifest(path: str | Path) -> dict:
    path = Path(path)
    mpath = manifest_path(path)
    fix = RETRAIN.format(path=path)
    if not path.is_file():
        raise RouterLoadError(f"router model {path} not found; {fix}")
    if not mpath.is_file():
        raise RouterLoadError(f"router manifest {mpath} not found next to {path.name}; {fix}")
    try:
        manifest = json.loads(mpath.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RouterLoadError(f"router manifest {mpath} is not valid JSON ({exc}); {fix}") from None
    if not isinstance(manifest, dict) or manifest.get("format_version") != FORMAT_VERSION:
        raise RouterLoadError(
            f"router manifest {mpath} has format_version "
            f"{manifest.get('format_version') if isinstance(manifest, dict) else None!r}; "
            f"this code reads version {FORMAT_VERSION}; {fix}"
        )
    return manifest


def load_pipeline(path: str | Path) -> tuple[Pipeline, dict]:
    """Load and check a router model; raises RouterLoadError naming the file and the fix."""
    path = Path(path)
    fix = RETRAIN.format(path=path)
    manifest = load_manifest(path)
    if sorted(manifest.get("classes", [])) != sorted(DOMAINS):
        raise RouterLoadError(
            f"router model {path} predicts {manifest.get('classes')}, not the domains "
            f"{list(DOMAINS)}; {fix}"
        )
    saved = str(manifest.get("sklearn_version", "?"))
    if _minor(saved) != _minor(sklearn.__version__):
        raise RouterLoadError(
            f"router model {path} was trained with scikit-learn {saved}; this environment has "
            f"{sklearn.__version__}. Install scikit-learn=={saved} or {fix}"
        )
    if manifest.get("sha256") != _sha256(path):
        raise RouterLoadError(f"router model {path} does not match the checksum in its manifest "
                              f"(corrupt or replaced file); {fix}")
    try:
        untrusted = set(sio.get_untrusted_types(file=path)) - set(TRUSTED_TYPES)
    except Exception as exc:  # zip/JSON errors of a damaged file
        raise RouterLoadError(f"router model {path} is not a readable skops file ({exc}); {fix}") from None
    if untrusted:
        raise RouterLoadError(
            f"router model {path} contains types outside the trusted list: {sorted(untrusted)}; "
            f"refusing to load it. {fix}"
        )
    try:
        pipeline = sio.load(path, trusted=list(TRUSTED_TYPES))
    except Exception as exc:
        raise RouterLoadError(f"router model {path} could not be loaded ({exc}); {fix}") from None
    if not isinstance(pipeline, Pipeline):
        raise RouterLoadError(f"router model {path} holds a {type(pipeline).__name__}, not a Pipeline; {fix}")
    return pipeline, manifest

import json
import shutil

import numpy as np
import pytest
import skops.io as sio
from sklearn.pipeline import Pipeline
from sklearn.preprocessing import FunctionTransformer

from router.classifier import DEFAULT_MODEL, DomainClassifier
from router.errors import RouterLoadError
from router.features import render
from router.persist import _sha256, load_manifest, load_pipeline, manifest_path, save_pipeline


@pytest.fixture()
def saved(small_router, tmp_path):
    classifier, metrics, _ = small_router
    path = tmp_path / "router.skops"
    save_pipeline(classifier.pipeline, path, metrics={"test": {"macro_f1": metrics["test"]["macro_f1"]}})
    return classifier, path


def _rewrite_manifest(path, **changes):
    mpath = manifest_path(path)
    manifest = json.loads(mpath.read_text())
    manifest.update(changes)
    mpath.write_text(json.dumps(manifest))


def test_round_trip(saved):
    classifier, path = saved
    loaded = DomainClassifier.load(path)
    rendered = [render("how do I sort a list in python"), render("hey what's up"), render("Explain inflation.")]
    np.testing.assert_array_equal(loaded.pipeline.predict_proba(rendered), classifier.pipeline.predict_proba(rendered))
    manifest = load_manifest(path)
    assert manifest["classes"] == sorted(manifest["classes"]) and len(manifest["classes"]) == 3
    assert {"sklearn_version", "skops_version", "created", "metrics", "sha256"} <= set(manifest)


def test_shipped_model_loads_and_is_small():
    pipeline, manifest = load_pipeline(DEFAULT_MODEL)
    assert DEFAULT_MODEL.stat().st_size < 5_000_000
    assert manifest["metrics"]["test"]["macro_f1"] >= 0.95


def test_corrupt_file_is_refused(saved):
    _, path = saved
    data = bytearray(path.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 64] = b"\x00" * 64
    path.write_bytes(bytes(data))
    with pytest.raises(RouterLoadError, match="checksum.*train-router"):
        load_pipeline(path)
    _rewrite_manifest(path, sha256=_sha256(path))  # even with a matching checksum
    path.write_bytes(b"not a zip file at all")
    _rewrite_manifest(path, sha256=_sha256(path))
    with pytest.raises(RouterLoadError, match=str(path.name)):
        load_pipeline(path)


def test_incompatible_versions_and_classes_are_refused(saved):
    _, path = saved
    _rewrite_manifest(path, sklearn_version="0.24.2")
    with pytest.raises(RouterLoadError, match=r"scikit-learn 0\.24\.2.*scikit-learn==0\.24\.2"):
        load_pipeline(path)
    _rewrite_manifest(path, classes=["a", "b"])
    with pytest.raises(RouterLoadError, match="domains"):
        load_pipeline(path)
    _rewrite_manifest(path, format_version=99)
    with pytest.raises(RouterLoadError, match="format_version"):
        load_pipeline(path)


def test_missing_files(saved, tmp_path):
    _, path = saved
    with pytest.raises(RouterLoadError, match="not found"):
        load_pipeline(tmp_path / "nope.skops")
    manifest_path(path).unlink()
    with pytest.raises(RouterLoadError, match="manifest"):
        load_pipeline(path)


def _shady(x):
    return x


def test_untrusted_types_are_refused(saved, tmp_path):
    classifier, path = saved
    shady = Pipeline([("pre", FunctionTransformer(_shady)), *classifier.pipeline.steps])
    shady.classes_  # a fitted pipeline with one extra, untrusted function
    sio.dump(shady, path)
    _rewrite_manifest(path, sha256=_sha256(path))
    with pytest.raises(RouterLoadError, match="trusted list.*_shady"):
        load_pipeline(path)


def test_copy_with_manifest_loads(saved, tmp_path):
    _, path = saved
    target = tmp_path / "copy" / "other.skops"
    target.parent.mkdir()
    shutil.copy(path, target)
    shutil.copy(manifest_path(path), manifest_path(target))
    load_pipeline(target)

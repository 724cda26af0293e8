"""The serve config embedded in k8s/ and deploy/ is services/serve_config.yaml (k8s/sync_serve_config.py)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import yaml

from deploy_manifests import ROOT, build, by_kind

SYNC = ROOT / "k8s" / "sync_serve_config.py"


@pytest.fixture()
def sync():
    spec = importlib.util.spec_from_file_location("sync_serve_config", SYNC)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rayservice_serve_config_equals_the_local_file():
    service = by_kind(build(ROOT / "k8s" / "base"), "RayService")[0]
    assert service["spec"]["serveConfigV2"] == (ROOT / "services" / "serve_config.yaml").read_text()


def test_sync_check_passes_on_the_committed_copies():
    result = subprocess.run([sys.executable, str(SYNC), "--check"], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


def test_gpu_copies_differ_only_by_the_gpu_overrides(sync):
    source = yaml.safe_load((ROOT / "services" / "serve_config.yaml").read_text())
    expected = sync.gpu_variant(source)
    compose_copy = yaml.safe_load((ROOT / "deploy" / "serve_config.gpu.yaml").read_text())
    overlay = by_kind(build(ROOT / "k8s" / "overlays" / "gpu"), "RayService")[0]
    assert compose_copy == expected == yaml.safe_load(overlay["spec"]["serveConfigV2"])
    changed = [app["args"]["device"] for app in expected["applications"]]
    assert changed == ["cuda"] * len(source["applications"])


def test_check_detects_a_stale_copy(sync, tmp_path, monkeypatch, capsys):
    edited = (ROOT / "services" / "serve_config.yaml").read_text().replace("max_queue: 64", "max_queue: 65")
    assert "max_queue: 65" in edited
    source = tmp_path / "serve_config.yaml"
    source.write_text(edited)
    monkeypatch.setattr(sync, "SOURCE", source)
    assert sync.main(["--check"]) == 1
    out = capsys.readouterr().out
    assert "k8s/base/rayservice.yaml" in out and "run python k8s/sync_serve_config.py" in out


def test_embed_replaces_only_the_block(sync):
    manifest = "spec:\n  a: 1\n  serveConfigV2: |\n    old: 1\n\n    older: 2\nstatus: {}\n"
    out = sync.embed(manifest, "# c\nnew:\n  - x\n\nb: 2\n", SYNC)
    assert out == "spec:\n  a: 1\n  serveConfigV2: |\n    # c\n    new:\n      - x\n\n    b: 2\nstatus: {}\n"
    assert yaml.safe_load(out)["spec"]["serveConfigV2"] == "# c\nnew:\n  - x\n\nb: 2\n"
    with pytest.raises(SystemExit, match="serveConfigV2"):
        sync.embed("spec: {}\n", "a: 1\n", SYNC)


def test_gpu_variant_needs_a_generator(sync):
    with pytest.raises(SystemExit, match="Generator"):
        sync.gpu_variant({"applications": [{"name": "x", "deployments": [{"name": "Ingress"}]}]})

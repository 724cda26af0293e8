"""docker-compose.yml and deploy/prometheus.yml, parsed and checked offline."""

from __future__ import annotations

import re

import pytest
import yaml

from deploy_manifests import ROOT

SERVE_CONFIG_IN_CONTAINER = "/app/config/serve_config.yaml"


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def _bytes(size: str) -> int:
    match = re.fullmatch(r"(\d+)([kmg]?)b?", str(size).lower())
    assert match, f"unreadable size {size!r}"
    return int(match.group(1)) * {"": 1, "k": 2**10, "m": 2**20, "g": 2**30}[match.group(2)]


def _mounts(service: dict) -> dict[str, str]:
    """container path -> source of each short-syntax volume."""
    out = {}
    for volume in service["volumes"]:
        source, target = volume.split(":")[:2]
        out[target] = source
    return out


def test_services_and_profiles(compose):
    services = compose["services"]
    assert set(services) == {"flashspec", "flashspec-gpu", "prometheus"}
    assert "profiles" not in services["flashspec"]  # `docker compose up` runs the CPU app
    assert services["flashspec-gpu"]["profiles"] == ["gpu"]
    assert services["prometheus"]["profiles"] == ["monitoring"]


@pytest.mark.parametrize("name,dockerfile,serve_config", [
    ("flashspec", "Dockerfile", "./services/serve_config.yaml"),
    ("flashspec-gpu", "Dockerfile.cuda", "./deploy/serve_config.gpu.yaml"),
])
def test_app_service(compose, name, dockerfile, serve_config):
    service = compose["services"][name]
    assert service["build"]["dockerfile"] == dockerfile
    assert _bytes(service["shm_size"]) >= 2 * 2**30
    assert "8000:8000" in service["ports"]
    mounts = _mounts(service)
    assert mounts["/data"] in compose["volumes"]  # a named volume for FLASHSPEC_HOME
    assert service["environment"]["FLASHSPEC_HOME"] == "/data"
    assert mounts[SERVE_CONFIG_IN_CONTAINER] == serve_config
    assert (ROOT / serve_config).is_file()
    command = " ".join(service["command"])
    assert "ray start --head" in command and f"serve run --address=auto {SERVE_CONFIG_IN_CONTAINER}" in command
    assert "/health" in " ".join(service["healthcheck"]["test"])
    # The tenant policy arrives as a compose secret, and the app is told where.
    secrets = {s["source"]: s["target"] for s in service["secrets"]}
    assert set(secrets) <= set(compose["secrets"])
    assert service["environment"]["FLASHSPEC_TENANTS_FILE"] in {f"/run/secrets/{t}" for t in secrets.values()}


def test_tenant_secret_defaults_to_the_example_file(compose):
    for secret in compose["secrets"].values():
        default = re.fullmatch(r"\$\{\w+:-(.+)\}", secret["file"])
        path = default.group(1) if default else secret["file"]
        assert (ROOT / path).is_file(), path


def test_gpu_service_reserves_an_nvidia_device(compose):
    devices = compose["services"]["flashspec-gpu"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert "deploy" not in compose["services"]["flashspec"]


def test_prometheus_scrapes_the_app_metrics(compose):
    service = compose["services"]["prometheus"]
    mounts = _mounts(service)
    assert mounts["/etc/prometheus/prometheus.yml"] == "./deploy/prometheus.yml"
    config = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    jobs = config["scrape_configs"]
    assert [job["metrics_path"] for job in jobs] == ["/metrics"]
    targets = {t for job in jobs for group in job["static_configs"] for t in group["targets"]}
    app_services = {name for name, s in compose["services"].items() if "8000:8000" in s.get("ports", [])}
    assert targets == {f"{name}:8000" for name in app_services}

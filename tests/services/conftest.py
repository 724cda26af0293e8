"""A real Ray Serve app on localhost with a tiny random target: started once per test session."""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

sys.path.insert(0, str(Path(__file__).parent))

from tiny import save_tiny_target  # noqa: E402

from router.tenants import hash_key  # noqa: E402

KEYS = {"acme": "sk-acme", "limited": "sk-limited", "nospec": "sk-nospec", "admin": "sk-admin"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory) -> Path:
    return save_tiny_target(tmp_path_factory.mktemp("target") / "tiny-llama")


@pytest.fixture(scope="session")
def tenants_file(tmp_path_factory) -> Path:
    policy = {
        "admin_api_key_sha256": [hash_key(KEYS["admin"])],
        "tenants": [
            {"name": "acme", "api_key_sha256": hash_key(KEYS["acme"]), "allow_domain_override": True},
            {"name": "limited", "api_key_sha256": hash_key(KEYS["limited"]), "allowed_domains": ["general"],
             "allow_domain_override": True, "rate_limit": {"requests_per_minute": 3}},
            {"name": "nospec", "api_key_sha256": hash_key(KEYS["nospec"]), "speculation": False},
        ],
    }
    path = tmp_path_factory.mktemp("policy") / "tenants.yaml"
    path.write_text(yaml.safe_dump(policy))
    return path


@pytest.fixture(scope="session")
def serve_port():
    """Ray (light) and the Serve HTTP proxy, once for the session."""
    import ray
    from ray import serve

    from services.run import start_ray

    tests_dir = str(Path(__file__).parent)
    # Replicas import the draft factory `tiny:build_draft` from this folder.
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (tests_dir, os.environ.get("PYTHONPATH")) if p)
    start_ray(num_cpus=4)
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield port, tests_dir
    serve.shutdown()
    ray.shutdown()


def deploy(name: str, port_info, args: dict, generator: dict) -> str:
    """Deploy an app under /<name>; returns its base URL once /health says ready."""
    from ray import serve

    from services.app import build_app
    from services.config import AppArgs

    port, _ = port_info
    deployments = {"Ingress": {"ray_actor_options": {"num_cpus": 0.1}},
                   "Router": {"ray_actor_options": {"num_cpus": 0.1}},
                   "Generator": {"ray_actor_options": {"num_cpus": 0.5}, **generator}}
    serve.run(build_app(AppArgs.model_validate(args), deployments), name=name, route_prefix=f"/{name}", blocking=False)
    base = f"http://127.0.0.1:{port}/{name}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/health", timeout=10).status_code == 200:
                return base
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"app {name} did not become healthy")


@pytest.fixture(scope="session")
def app_args(tiny_target, tenants_file) -> dict:
    return {"model": str(tiny_target), "draft_source": "tiny:build_draft", "tenants_file": str(tenants_file),
            "max_batch_size": 4, "max_queue": 2, "max_seq_len": 256, "max_tokens_cap": 200, "default_max_tokens": 16,
            "governor": False}

"""Dockerfiles and .dockerignore, checked as text (no docker daemon needed)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from deploy_manifests import ROOT

DOCKERFILES = ["Dockerfile", "Dockerfile.cuda"]
SECRET_NAME = re.compile(r"(PASSWORD|PASSWD|SECRET|TOKEN|API_?KEY|PRIVATE_KEY|CREDENTIAL)", re.IGNORECASE)


def instructions(path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    lines, current = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not current and (not line or line.startswith("#")):
            continue
        current += " " + line.rstrip("\\").strip()
        if not line.endswith("\\"):
            lines.append(current.strip())
            current = ""
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


@pytest.mark.parametrize("name", DOCKERFILES)
def test_runs_as_non_root_user(name):
    users = [args for op, args in instructions(ROOT / name) if op == "USER"]
    assert users, f"{name} has no USER"
    user = users[-1].split(":")[0]
    assert user not in {"root", "0"}


@pytest.mark.parametrize("name", DOCKERFILES)
def test_healthcheck_hits_health(name):
    checks = [args for op, args in instructions(ROOT / name) if op == "HEALTHCHECK"]
    assert len(checks) == 1 and "http://127.0.0.1:8000/health" in checks[0]


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dependencies_before_code(name):
    steps = instructions(ROOT / name)
    code = [i for i, (op, args) in enumerate(steps) if op == "COPY" and re.search(r"\s\.\s+/app$", args)]
    deps = [i for i, (op, args) in enumerate(steps) if op == "RUN" and "pip install -r" in args]
    assert len(code) == 1 and deps and max(deps) < code[0]
    # The dependency layer sees only pyproject.toml and its reader, not the code.
    for op, args in steps[: code[0]]:
        if op == "COPY":
            assert set(args.split()[:-1]) <= {"pyproject.toml", "deploy/requirements_from_pyproject.py"}


@pytest.mark.parametrize("name", DOCKERFILES)
def test_store_on_a_volume_and_app_from_the_serve_config(name):
    steps = instructions(ROOT / name)
    assert ("VOLUME", '["/data"]') in steps
    assert any(op == "ENV" and "FLASHSPEC_HOME=/data" in args for op, args in steps)
    assert steps[-1] == ("CMD", '["serve", "run", "services/serve_config.yaml"]')
    assert (ROOT / "services" / "serve_config.yaml").is_file()


@pytest.mark.parametrize("name", DOCKERFILES)
def test_no_secrets_baked_in(name):
    for op, args in instructions(ROOT / name):
        if op in {"ENV", "ARG"}:
            assert not SECRET_NAME.search(args.split("=")[0]), f"{name}: {op} {args}"
        if op in {"COPY", "ADD"}:
            assert not re.search(r"tenants|\.env\b|\.pem\b|\.key\b|id_rsa", args), f"{name}: {op} {args}"


def test_cpu_image_installs_cpu_torch_and_the_extras():
    steps = instructions(ROOT / "Dockerfile")
    assert steps[0] == ("FROM", "python:3.11-slim")
    assert any(op == "RUN" and "download.pytorch.org/whl/cpu" in args for op, args in steps)
    assert ("ARG", "EXTRAS=serve,router,default-model,train") in steps


def test_cuda_image_has_optional_gpu_kernels():
    steps = instructions(ROOT / "Dockerfile.cuda")
    assert ("ARG", "GPU_KERNELS=0") in steps
    base = [args for op, args in steps if op == "ARG" and args.startswith("BASE_IMAGE=")]
    assert base and base[0].startswith("BASE_IMAGE=pytorch/pytorch:") and "cuda" in base[0]


def test_dockerignore_keeps_secrets_and_data_out():
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()}
    assert {".git", ".env", "deploy/tenants*.yaml", "models", "store", "data", "**/*.gguf"} <= ignored
    # ...but not what the image build copies.
    assert not {"pyproject.toml", "services", "deploy", "README.md"} & ignored


def test_requirements_reader_lists_base_and_extras():
    reader = ROOT / "deploy" / "requirements_from_pyproject.py"
    run = subprocess.run([sys.executable, str(reader), str(ROOT / "pyproject.toml"), "--extras", "serve,router"],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    names = [re.split(r"[<>=\[ ;]", r)[0] for r in run.stdout.split()]
    assert "torch" in names and "ray" in names and "scikit-learn" in names and "datasets" not in names
    assert len(names) == len(set(run.stdout.split()))
    bad = subprocess.run([sys.executable, str(reader), str(ROOT / "pyproject.toml"), "--extras", "nope"],
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "known extras" in bad.stderr

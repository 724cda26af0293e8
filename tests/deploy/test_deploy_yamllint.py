"""yamllint (with the repository's .yamllint) on every deployment YAML file."""

from __future__ import annotations

import pytest
from yamllint import linter
from yamllint.config import YamlLintConfig

from deploy_manifests import ROOT

FILES = sorted(
    [ROOT / "docker-compose.yml", ROOT / ".yamllint"]
    + list((ROOT / "deploy").glob("*.y*ml"))
    + list((ROOT / "k8s").rglob("*.yaml"))
)


@pytest.fixture(scope="module")
def config() -> YamlLintConfig:
    return YamlLintConfig(file=str(ROOT / ".yamllint"))


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_yamllint_clean(config, path):
    problems = list(linter.run(path.read_text(), config, str(path.relative_to(ROOT))))
    assert not problems, "\n".join(f"{path.name}:{p.line}:{p.column} {p.rule}: {p.desc}" for p in problems)


def test_yamllint_config_catches_problems(config):
    problems = list(linter.run("a: yes\nb:  [1,2]\nc: 1   \n", config, "x.yaml"))
    assert {p.rule for p in problems} >= {"truthy", "trailing-spaces", "commas"}

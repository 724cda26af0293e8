"""Build the Ray Serve application: Ingress -> Router, Generator."""

from __future__ import annotations

from ray.serve import Application

from services.config import AppArgs, GeneratorUserConfig
from services.generator import Generator
from services.ingress import Ingress
from services.router_deployment import Router


def build_app(config: AppArgs, deployments: dict[str, dict] | None = None) -> Application:
    """The app for `config`; `deployments` maps a deployment name to `.options()` (replicas, CPUs, user_config).

    `serve run` / `serve deploy` / a RayService apply the serve config's `deployments` section
    themselves; pass it here when building the app in Python (`services.run`, tests).
    """
    deployments = deployments or {}
    args = config.model_dump()
    generator_options = dict(deployments.get("Generator", {}))
    if "user_config" in generator_options:
        GeneratorUserConfig.model_validate(generator_options["user_config"] or {})
    generator = Generator.options(**generator_options).bind(args)
    router = Router.options(**deployments.get("Router", {})).bind(args)
    return Ingress.options(**deployments.get("Ingress", {})).bind(args, router, generator)


def app_builder(args: dict) -> Application:
    """Entry point named by the serve config's `import_path` (services.app:app_builder)."""
    return build_app(AppArgs.model_validate(args or {}))

"""Start Ray (light: no dashboard, small object store, loopback) and serve the app from the serve config.

    python -m services.run [--config services/serve_config.yaml] [--host 127.0.0.1] [--port 8000]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from services.config import ServeConfig

DEFAULT_CONFIG = Path(__file__).with_name("serve_config.yaml")
OBJECT_STORE_BYTES = 150 * 1024**2


def start_ray(num_cpus: int | None = None, address: str | None = None) -> None:
    """Ray on this machine only: loopback, no dashboard, a 150 MB object store."""
    import ray

    if ray.is_initialized():
        return
    repo = str(Path(__file__).resolve().parents[1])
    pythonpath = os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH", "")) if p)
    kwargs = dict(include_dashboard=False, object_store_memory=OBJECT_STORE_BYTES, num_cpus=num_cpus or os.cpu_count(),
                  _node_ip_address="127.0.0.1", runtime_env={"env_vars": {"PYTHONPATH": pythonpath}},
                  logging_level=logging.WARNING, log_to_driver=True)
    if address:  # an existing cluster (e.g. a RayService head): join it as is
        ray.init(address=address, runtime_env={"env_vars": {"PYTHONPATH": pythonpath}})
    else:
        ray.init(**kwargs)


def serve_app(config_path: str | Path, host: str, port: int, blocking: bool = True, num_cpus: int | None = None):
    """Deploy every application of the serve config on a local Ray; returns the last app's handle."""
    from ray import serve

    from services.app import build_app

    config = ServeConfig.from_yaml(config_path)
    start_ray(num_cpus=num_cpus)
    serve.start(http_options={"host": host, "port": port})
    handle = None
    for app in config.applications:
        handle = serve.run(build_app(app.args, app.deployment_options()), name=app.name,
                           route_prefix=app.route_prefix, blocking=False)
    if blocking:
        print(f"serving {', '.join(a.name for a in config.applications)} on http://{host}:{port} "
              f"(OpenAI API under /v1; Ctrl-C stops)", flush=True)
        import time

        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            serve.shutdown()
    return handle


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="serve config YAML")
    parser.add_argument("--host", default="127.0.0.1", help="HTTP host (127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port")
    parser.add_argument("--num-cpus", type=int, default=None, help="CPUs Ray may use (default: all)")
    args = parser.parse_args(argv)
    try:
        serve_app(args.config, args.host, args.port, num_cpus=args.num_cpus)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

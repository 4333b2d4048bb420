# The llm-fleet image: server (every role), operator and CLI in one. Non-root (UID 65532, as the
# operator's pods run), read-only root filesystem friendly: caches go to /tmp (an emptyDir).
#
#   docker build -t llm-fleet:dev .                                  # CPU torch (small)
#   docker build -t llm-fleet:dev-cuda --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 .
#   kind load docker-image llm-fleet:dev                             # then spec.image: llm-fleet:dev
FROM python:3.11-slim AS build
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/llm-fleet
ENV PATH=/opt/llm-fleet/bin:$PATH
# torch first and pinned, from the chosen index: a bare `torch` would pull the default CUDA build.
RUN pip install "torch==2.13.0" --index-url "$TORCH_INDEX"
COPY pyproject.toml README.md /src/
COPY fleet /src/fleet
COPY server /src/server
COPY operator /src/operator
COPY bench /src/bench
RUN pip install /src

FROM python:3.11-slim
# A C compiler: on a CPU the server builds its decode-attention kernel for the node's own CPU at
# first start (server/runner/cpu_kernels.py); without one it runs the slower torch path.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/llm-fleet /opt/llm-fleet
ENV PATH=/opt/llm-fleet/bin:$PATH \
    HOME=/tmp \
    LLMFLEET_CACHE=/tmp/llm-fleet \
    HF_HUB_OFFLINE=1 \
    PYTHONUNBUFFERED=1
USER 65532:65532
ENTRYPOINT ["llm-fleet"]
CMD ["serve", "--host", "0.0.0.0"]

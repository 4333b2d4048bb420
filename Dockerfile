# The llm-fleet image: server (every role), operator and CLI in one. Non-root (UID 65532, as the
# operator's pods run), read-only root filesystem friendly: caches go to /tmp (an emptyDir).
# Installed by scripts/install.sh, the script scripts/setup.sh (and so CI) runs too.
#
#   docker build -t llm-fleet:dev-cpu .                              # CPU torch (small)
#   docker build -t llm-fleet:dev-cuda --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 .
#
# Releases (.github/workflows/release.yml, on a tag vX.Y.Z) push both as
# ghcr.io/<owner>/llm-fleet:X.Y.Z-cpu and :X.Y.Z-cuda.
FROM python:3.11-slim AS build
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 LLMFLEET_TORCH_INDEX=$TORCH_INDEX
RUN python -m venv /opt/llm-fleet
ENV PATH=/opt/llm-fleet/bin:$PATH
WORKDIR /src
# torch first, in a layer of its own: a source change does not download it again.
COPY scripts/install.sh scripts/
COPY constraints.txt ./
RUN bash scripts/install.sh torch
COPY pyproject.toml README.md ./
COPY fleet fleet
COPY server server
COPY operator operator
COPY bench bench
RUN bash scripts/install.sh llm-fleet

FROM python:3.11-slim
# A C compiler: on a CPU the server builds its decode-attention kernel for the node's own CPU at
# first start (server/runner/cpu_kernels.py); without one it runs the slower torch path. tcmalloc:
# `llm-fleet serve` preloads it where it is found (server/runner/host_memory.py).
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev libtcmalloc-minimal4 \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/llm-fleet /opt/llm-fleet
# Hub models (`serve --model org/name`, the operator's fetch-model init container) download into
# $HOME/.cache/huggingface unless --download-dir says otherwise.
ENV PATH=/opt/llm-fleet/bin:$PATH \
    HOME=/tmp \
    LLMFLEET_CACHE=/tmp/llm-fleet \
    PYTHONUNBUFFERED=1
USER 65532:65532
ENTRYPOINT ["llm-fleet"]
CMD ["serve", "--host", "0.0.0.0"]

# The image the manifests in infra/k8s name (ghcr.io/spotrain/spotrain:0.1.0): the Temporal
# worker, the reclaim webhook, the TrainingJob operator and the training library.
#   docker build -t ghcr.io/spotrain/spotrain:0.1.0 .                          # CPU torch
#   docker build --build-arg TORCH_VARIANT=cu128 -t ghcr.io/spotrain/spotrain:0.1.0-cu128 .
# tests/test_dockerfile.py installs the project from exactly the files this copies.
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
# cpu, or a CUDA build of the same torch: cu126, cu128
ARG TORCH_VARIANT=cpu
# PyTorch's index for that variant; empty: pip's own index (on Linux x86-64, the CUDA build)
ARG TORCH_INDEX=https://download.pytorch.org/whl/${TORCH_VARIANT}
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/spotrain
ENV PATH=/opt/spotrain/bin:$PATH
# torch first, in a layer of its own: it changes far less often than spotrain
RUN pip install "torch==${TORCH_VERSION}" ${TORCH_INDEX:+--index-url "$TORCH_INDEX"}
COPY pyproject.toml README.md /src/
COPY workflows /src/workflows
COPY activities /src/activities
COPY workers /src/workers
# (pip compiles what it installs; a `compileall` of the venv fails on torch's Python 3.12-only
# test files under 3.11, as the first real build of this file showed)
RUN pip install "/src[train]"

FROM ${PYTHON_IMAGE}
RUN useradd --uid 10001 --user-group --no-create-home --home-dir /app spotrain
COPY --from=build /opt/spotrain /opt/spotrain
COPY examples /app/examples
ENV PATH=/opt/spotrain/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
WORKDIR /app
USER 10001:10001
# The manifests give the command (`spotrain worker`, `spotrain webhook`, the operator).
CMD ["spotrain", "--help"]

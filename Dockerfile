# syntax=docker/dockerfile:1
# jaxserve for NVIDIA GPUs (CUDA 13, Hopper and newer for the Pallas attention kernel).
#
# jax[cuda13]'s wheels bring the CUDA user-space libraries; the host brings the driver (>= 580)
# through the NVIDIA container toolkit, so the slim "-base" CUDA image is enough.
#
#   docker build -t jaxserve:0.1.0 .
#   docker run --gpus 1 -p 8000:8000 -e JAXSERVE_API_KEY -v /models:/models:ro \
#       -v jaxserve-xla:/cache jaxserve:0.1.0 /models/Llama-3.1-8B-Instruct --max-model-len 8192
#
# With no model directory the image serves the demo model shipped inside the package. The
# /cache volume keeps XLA's compiled programs, so a restart skips most of the compile time.
# The base is pinned by tag and digest (refresh both together:
# `docker buildx imagetools inspect nvidia/cuda:13.0.1-base-ubuntu24.04`).
ARG CUDA_IMAGE=nvidia/cuda:13.0.1-base-ubuntu24.04@sha256:f8ef28f579ea42a44b415d2c5d46f788e6a9b395c6c83f2929416e1fc192c143

FROM ${CUDA_IMAGE} AS build
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# The base image digest pins the distribution; exact apt versions would break the build on
# every Ubuntu security update.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.12 python3.12-venv \
    && rm -rf /var/lib/apt/lists/* \
    && python3.12 -m venv /opt/jaxserve
ENV PATH=/opt/jaxserve/bin:$PATH
WORKDIR /src
COPY pyproject.toml README.md ./
COPY pallas_kernels ./pallas_kernels
COPY jaxserve ./jaxserve
RUN pip install --no-cache-dir "/src[cuda]"

FROM ${CUDA_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.12 \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 10001 --shell /usr/sbin/nologin jaxserve \
    && mkdir -p /cache \
    && chown jaxserve:jaxserve /cache
COPY --from=build /opt/jaxserve /opt/jaxserve
ENV PATH=/opt/jaxserve/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    JAXSERVE_COMPILATION_CACHE=/cache/xla
USER 10001
WORKDIR /home/jaxserve
EXPOSE 8000
# The port opens only once the model is loaded and compiled: allow a long start.
HEALTHCHECK --interval=30s --timeout=5s --start-period=900s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
ENTRYPOINT ["jaxserve", "launch"]

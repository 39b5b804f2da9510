# One image for every docker-compose service: `gradstar coordinator`, `gradstar worker` and
# `gradstar shard`.
#
#   docker build -t gradstar .                          # torch's CPU build (about 0.2 GB)
#   docker build --build-arg TORCH=cuda -t gradstar .   # PyPI's default build, with CUDA (GBs)
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cuXYZ -t gradstar .
FROM python:3.11-slim

# cpu: the CPU wheel from PyTorch's CPU index. cuda: the wheel PyPI serves for Linux, which
# bundles CUDA. TORCH_INDEX_URL, when set, is the index the wheel comes from either way (a
# mirror, or one CUDA variant: https://download.pytorch.org/whl/cu<version>).
ARG TORCH=cpu
ARG TORCH_INDEX_URL=""
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /opt/gradstar
# torch is the largest layer: installed first, so code edits do not rebuild it.
RUN case "$TORCH" in \
        cpu) index="${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}" ;; \
        cuda) index="$TORCH_INDEX_URL" ;; \
        *) echo "TORCH must be cpu or cuda, not '$TORCH'" >&2; exit 2 ;; \
    esac \
    && pip install ${index:+--index-url "$index"} "torch==2.13.0"

COPY pyproject.toml constraints.txt README.md LICENSE ./
COPY protos ./protos
COPY src ./src
COPY coordinator ./coordinator
COPY client ./client
COPY worker ./worker
RUN pip install -c constraints.txt . \
    && useradd --create-home --uid 1000 gradstar \
    && mkdir -p /var/lib/gradstar \
    && chown gradstar /var/lib/gradstar
USER gradstar

# 29400: gRPC (rendezvous, collectives, admin, health); 9400: coordinator metrics;
# 8080: a worker agent's /healthz.
EXPOSE 29400 29401 9400 8080
# The coordinator's health over the gRPC health protocol (grpc.health.v1.Health/Check must
# answer SERVING; NOT_SERVING while draining or short of shards). docker-compose.yml gives the
# worker service a check of its own.
HEALTHCHECK --interval=10s --timeout=5s --start-period=15s --retries=3 \
    CMD gradstar admin health --coordinator "127.0.0.1:${GRADSTAR_PORT:-29400}" --timeout 3
# Refuses to start without a job token (GRADSTAR_TOKEN or GRADSTAR_TOKEN_FILE): it listens on
# every interface of the container. --insecure (GRADSTAR_INSECURE=1) serves without one.
CMD ["gradstar", "coordinator"]

# One image for both docker-compose services: `gradstar coordinator` and `gradstar worker`.
FROM python:3.11-slim

# torch's CPU build is the largest layer: installed first, so code edits do not rebuild it.
# Pass the PyTorch CPU wheel index as TORCH_INDEX_URL to avoid the much larger default build.
ARG TORCH_INDEX_URL=""
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /opt/gradstar
RUN pip install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==2.13.0"

COPY pyproject.toml constraints.txt README.md ./
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
EXPOSE 29400 9400 8080
CMD ["gradstar", "coordinator"]

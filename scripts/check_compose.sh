#!/usr/bin/env bash
# Validate docker-compose.yml the way docker reads it, without a docker engine: Debian's
# `docker-compose` (apt-get install docker-compose) parses, interpolates and checks the file
# against the compose schema with `docker-compose config`. The check runs in a temporary copy
# with .env made from .env.example, so a real .env (with real tokens) is neither needed nor read.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
if ! command -v docker-compose >/dev/null; then
    echo "check_compose: docker-compose is not installed (apt-get install docker-compose)" >&2
    exit 2
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cp "$root/docker-compose.yml" "$root/Dockerfile" "$root/.env.example" "$work/"
cp "$work/.env.example" "$work/.env"
cd "$work"
docker-compose --version
docker-compose config --quiet
echo "services: $(docker-compose config --services | tr '\n' ' ')"
docker-compose config
echo "check_compose: docker-compose.yml is valid"

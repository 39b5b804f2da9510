#!/usr/bin/env bash
# Make gcc available for the emulated cluster's delay line (benchmarks/emulated_cluster/
# delay_line.c, compiled on first use by tests/cluster and the cluster benchmarks): nothing to do
# if it is on PATH; as root on Debian/Ubuntu, install the `gcc` package with apt-get. Anywhere
# else say how to install it and exit 1; a cluster with a round trip then fails saying the same.
set -euo pipefail

if command -v gcc >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "ensure_gcc: installing Debian's gcc package for the emulated cluster's delay line" >&2
    export DEBIAN_FRONTEND=noninteractive
    if apt-get update -q >/dev/null && apt-get install -y -q gcc libc6-dev >/dev/null \
            && command -v gcc >/dev/null; then
        exit 0
    fi
fi
echo "ensure_gcc: gcc is missing; install it with 'sudo apt-get install -y gcc' (Debian/Ubuntu)" \
     "so that the emulated cluster can build its delay line" >&2
exit 1

#!/usr/bin/env bash
# Make a system command that tests need available: `ensure_package.sh COMMAND "PACKAGES" WHY`.
# Nothing to do if COMMAND is on PATH; as root on Debian/Ubuntu, install PACKAGES with apt-get
# (trying without `apt-get update` first: the lists are often fresh enough). Anywhere else say
# how to install it and exit 1; the tests that need it then fail saying the same (never skip).
# Used by the Makefile for gcc (the emulated cluster's delay line, compiled on first use),
# nftables (its outbound-only hosts) and etcd (the --ha coordinator tests).
set -euo pipefail

command_name=$1 packages=$2 why=$3
if command -v "$command_name" >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "ensure_package: installing Debian's $packages for $why" >&2
    export DEBIAN_FRONTEND=noninteractive
    # shellcheck disable=SC2086  # PACKAGES is a list
    if { apt-get install -y -q $packages >/dev/null 2>&1 \
            || { apt-get update -q >/dev/null && apt-get install -y -q $packages >/dev/null; }; } \
            && command -v "$command_name" >/dev/null; then
        exit 0
    fi
fi
echo "ensure_package: $command_name is missing; install it with 'sudo apt-get install -y" \
     "$packages' (Debian/Ubuntu) for $why" >&2
exit 1

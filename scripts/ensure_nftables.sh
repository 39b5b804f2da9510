#!/usr/bin/env bash
# Make nftables' `nft` available for the emulated cluster's outbound-only hosts (hosts behind
# NAT: each namespace drops new inbound TCP on its link; tests/cluster/test_outbound_hosts.py):
# nothing to do if it is on PATH; as root on Debian/Ubuntu, install the `nftables` package with
# apt-get (a few seconds). Anywhere else say how to install it and exit 1; those tests then fail
# saying the same (they never skip).
set -euo pipefail

if command -v nft >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "ensure_nftables: installing Debian's nftables package for the outbound-only host tests" >&2
    export DEBIAN_FRONTEND=noninteractive
    if { apt-get install -y -q nftables >/dev/null 2>&1 \
            || { apt-get update -q >/dev/null && apt-get install -y -q nftables >/dev/null; }; } \
            && command -v nft >/dev/null; then
        exit 0
    fi
fi
echo "ensure_nftables: nft is missing; install it with 'sudo apt-get install -y nftables'" \
     "(Debian/Ubuntu) so that the outbound-only host tests can build their rules" >&2
exit 1

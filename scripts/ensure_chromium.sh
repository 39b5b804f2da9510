#!/usr/bin/env bash
# Make Chromium available for tests/runtime/test_status_page.py (the status page in a real
# headless browser): nothing to do if it is on PATH; as root on Debian/Ubuntu, install the
# `chromium` package with apt-get (about 2 minutes and ~480 MB on a fresh Debian 12). Anywhere
# else say how to install it and exit 1; the test then fails saying the same.
set -euo pipefail

for name in chromium chromium-browser; do
    if command -v "$name" >/dev/null 2>&1; then
        exit 0
    fi
done
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "ensure_chromium: installing Debian's chromium package for the status page test" >&2
    export DEBIAN_FRONTEND=noninteractive
    if apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null \
            && command -v chromium >/dev/null; then
        exit 0
    fi
fi
echo "ensure_chromium: Chromium is missing; install it with 'sudo apt-get install -y chromium'" \
     "(Debian/Ubuntu) so that tests/runtime/test_status_page.py can run" >&2
exit 1

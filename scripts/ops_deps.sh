#!/usr/bin/env bash
# Best effort, for the operations tests (tests/p2pnet/test_metrics.py, tests/trainer/test_dashboard_devnet.py):
# install promtool (Debian package prometheus) and a headless browser (Debian package chromium) when running
# as root and they are missing. Never fails the build: when it cannot, it says so in one line and those
# checks skip themselves with their own reason.
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    exit 0
fi
missing=()
command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
if [ ${#missing[@]} = 0 ]; then
    exit 0
fi
if apt-get update -qq >/dev/null 2>&1 \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null 2>&1; then
    exit 0
fi
echo "ops_deps: could not install ${missing[*]} (apt-get); promtool and browser checks will be skipped"
exit 0

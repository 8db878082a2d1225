#!/usr/bin/env bash
# Best effort, for the network lab (p2pnet/lab.py): install nftables, which NAT'd lab hosts need,
# when running as root and `nft` is missing. Never fails the build: when it cannot, it says so
# in one line and the NAT lab tests skip themselves with their own reason.
if command -v nft >/dev/null 2>&1 || [ "$(id -u)" != 0 ]; then
    exit 0
fi
if command -v apt-get >/dev/null 2>&1 \
    && apt-get update -qq >/dev/null 2>&1 \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nftables >/dev/null 2>&1 \
    && command -v nft >/dev/null 2>&1; then
    exit 0
fi
echo "lab_deps: could not install nftables (apt-get); lab tests with NAT'd hosts will be skipped"
exit 0

#!/usr/bin/env bash
# Installs what the multi-host test (`scenarios/tests/multihost.rs`) needs and checks that this
# machine can use it: `ip` (iproute2) for network namespaces and veth pairs, and `nft`
# (nftables) for random packet loss. Needs root. Exit 0: ready; exit 2: this machine cannot run
# the test (not root, or no network namespaces here), with the reason on stderr.
set -euo pipefail

if [ "$(id -u)" != 0 ]; then
    echo "install-netns-tools: needs root (network namespaces)" >&2
    exit 2
fi

missing=()
command -v ip >/dev/null 2>&1 || missing+=(iproute2)
command -v nft >/dev/null 2>&1 || missing+=(nftables)
if [ "${#missing[@]}" -gt 0 ]; then
    echo "install-netns-tools: installing ${missing[*]}" >&2
    # A machine that cannot install them cannot run the test: exit 2 with the reason.
    if command -v apt-get >/dev/null 2>&1; then
        { DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null &&
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null; } ||
            { echo "install-netns-tools: apt-get could not install ${missing[*]}" >&2; exit 2; }
    elif command -v dnf >/dev/null 2>&1; then
        dnf install -y -q "${missing[@]/iproute2/iproute}" ||
            { echo "install-netns-tools: dnf could not install ${missing[*]}" >&2; exit 2; }
    elif command -v apk >/dev/null 2>&1; then
        apk add --quiet "${missing[@]}" ||
            { echo "install-netns-tools: apk could not install ${missing[*]}" >&2; exit 2; }
    else
        echo "install-netns-tools: no apt-get, dnf or apk to install ${missing[*]}" >&2
        exit 2
    fi
fi

# A namespace and an nftables table in it: the kernel and the container must allow both.
probe="fedrl-probe-$$"
if ! ip netns add "$probe" 2>/dev/null; then
    echo "install-netns-tools: this machine does not allow network namespaces (ip netns add failed)" >&2
    exit 2
fi
trap 'ip netns del "$probe" 2>/dev/null || true' EXIT
if ! ip netns exec "$probe" nft add table inet fedrl_probe 2>/dev/null; then
    echo "install-netns-tools: nftables does not work in a network namespace here" >&2
    exit 2
fi
echo "install-netns-tools: ready ($(ip -V); $(nft --version))" >&2

#!/usr/bin/env bash
# Installs the system HDF5 library that the optional `hdf5` cargo feature links (`fedrl data
# import` of Minari's HDF5 storage, through hdf5-metno), and checks it is usable. The README's
# default build needs none of this. Exit 0: ready (pkg-config finds hdf5); exit 2: this machine
# cannot have it (not root and not installed, or no package manager could install it), with the
# reason on stderr.
set -euo pipefail

have() { command -v pkg-config >/dev/null 2>&1 && pkg-config --exists hdf5; }
if have; then
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    echo "install-hdf5: libhdf5 is not installed and installing it needs root (Debian: apt-get install libhdf5-dev pkg-config)" >&2
    exit 2
fi
echo "install-hdf5: installing libhdf5-dev and pkg-config" >&2
if command -v apt-get >/dev/null 2>&1; then
    { DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null &&
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libhdf5-dev pkg-config >/dev/null; } ||
        { echo "install-hdf5: apt-get could not install libhdf5-dev" >&2; exit 2; }
elif command -v dnf >/dev/null 2>&1; then
    dnf install -y -q hdf5-devel pkgconf-pkg-config ||
        { echo "install-hdf5: dnf could not install hdf5-devel" >&2; exit 2; }
elif command -v apk >/dev/null 2>&1; then
    apk add --quiet hdf5-dev pkgconf ||
        { echo "install-hdf5: apk could not install hdf5-dev" >&2; exit 2; }
else
    echo "install-hdf5: no apt-get, dnf or apk to install libhdf5" >&2
    exit 2
fi
if ! have; then
    echo "install-hdf5: installed, but pkg-config does not find hdf5" >&2
    exit 2
fi

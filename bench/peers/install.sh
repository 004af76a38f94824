#!/usr/bin/env bash
# Installs the Python peers (dp_accounting, Gymnasium, PyTorch PPO, ...) into a local virtual
# environment, bench/peers/.venv, from every requirements-*.txt beside this script.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
python3 -m venv "$here/.venv"
"$here/.venv/bin/pip" install --quiet --upgrade pip
for req in "$here"/requirements-*.txt; do
  echo "installing $(basename "$req")"
  "$here/.venv/bin/pip" install --quiet -r "$req"
done
echo "peers installed in $here/.venv"

#!/usr/bin/env bash
# Installs the Python peers into local virtual environments beside this script:
# - .venv         from every requirements-*.txt except requirements-offline.txt (dp_accounting,
#                 Gymnasium 1.4, PyTorch PPO, ...);
# - .venv-offline from requirements-offline.txt (d3rlpy 2.8.1 pins gymnasium 1.0.0, which
#                 conflicts with the other peers; minari, opacus).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"

python3 -m venv "$here/.venv"
"$here/.venv/bin/pip" install --quiet --upgrade pip
for req in "$here"/requirements-*.txt; do
  [ "$(basename "$req")" = "requirements-offline.txt" ] && continue
  echo "installing $(basename "$req") into .venv"
  "$here/.venv/bin/pip" install --quiet -r "$req"
done
echo "peers installed in $here/.venv"

python3 -m venv "$here/.venv-offline"
"$here/.venv-offline/bin/pip" install --quiet --upgrade pip
echo "installing requirements-offline.txt into .venv-offline"
"$here/.venv-offline/bin/pip" install --quiet -r "$here/requirements-offline.txt"
echo "offline peers installed in $here/.venv-offline"
